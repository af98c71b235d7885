"""`eagle3 data import`: token rows and conversations made outside the pipeline, with the split they name, through
capture and training on the micro target; and every kind of bad row refused by file, line and field."""

import json

import pytest
from pydoc_data.topics import topics
from transformers import AutoTokenizer

from eagle3.cli import main
from eagle3.config import check_local_inputs
from eagle3.resolve import load_config
from eagle3.data.capture import dataset_dir
from eagle3.data.importer import import_rows
from eagle3.data.regenerate import read_regenerated
from eagle3.errors import ConfigError
from eagle3.records.manifest import read_manifest
from eagle3.report import data_report
from eagle3.stages.keys import stage_key
from eagle3.train.data import TrainingData
from eagle3.train.trainer import Trainer
from helpers import TINY, micro_overrides

MAX_LENGTH = 160
TRAINING = [f"data.max_length={MAX_LENGTH}", "training.batch_size=4", f"training.seq_len={MAX_LENGTH}", "training.max_steps=6", "training.eval_every=3",
            "training.save_every=100", "training.ttt_steps=2", "training.warmup_steps=0", "benchmark.num_prompts=4"]


def paragraphs(count):
    """Text the outside tool 'answered' with: paragraphs of the corpus the micro target learned."""
    found = []
    for key in sorted(topics):
        for paragraph in topics[key].split("\n\n"):
            words = paragraph.split()
            if len(words) >= 30:
                found.append((" ".join(words[:6]), " ".join(words[6:20])))
            if len(found) == count:
                return found
    raise AssertionError("the corpus has fewer paragraphs than asked for")


def outside_rows(tokenizer, count=24):
    """What another tool would write: token rows it tokenized itself (prompt through the template, mask 1 on the
    answer) and OpenAI-messages conversations, alternating; every fourth row named eval."""
    rows = []
    for n, (question, answer) in enumerate(paragraphs(count)):
        user = {"role": "user", "content": question}
        if n % 2:
            row = {"messages": [user, {"role": "assistant", "content": answer}]}
        else:
            prompt = tokenizer.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
            prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            answer_ids = tokenizer(answer + "<|end|>\n", add_special_tokens=False)["input_ids"]
            row = {"input_ids": prompt_ids + answer_ids, "loss_mask": [0] * len(prompt_ids) + [1] * len(answer_ids)}
        rows.append({"id": f"row-{n}", **row, "split": "eval" if n % 4 == 3 else "train"})
    return rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def cli_args(overrides):
    return ["--config", str(TINY), *[f"--set={o}" for o in overrides]]


@pytest.fixture(scope="module")
def imported(tmp_path_factory, micro_target):
    """Rows made in the test, imported, captured and vocab-mapped through the CLI, then trained a few steps."""
    root = tmp_path_factory.mktemp("import")
    tokenizer = AutoTokenizer.from_pretrained(micro_target)
    rows = outside_rows(tokenizer)
    source = write_jsonl(root / "rows.jsonl", rows)
    overrides = micro_overrides(root / "run", micro_target) + TRAINING + [f"data.import_path={source}"]
    for command in (["data", "import"], ["data", "capture"], ["vocab", "build"]):
        assert main([*command, *cli_args(overrides)]) == 0, command
    config = load_config(TINY, overrides)
    Trainer(config, log=lambda line: None).run()
    return config, rows, tokenizer


def test_imported_rows_are_stored_as_regeneration_stores_them(imported):
    config, rows, tokenizer = imported
    records = {r["id"]: r for r in read_regenerated(config.stage_dir("data") / "regen")}
    assert list(records) == [row["id"] for row in rows]
    for row in rows:
        record = records[row["id"]]
        assert record["split"] == row["split"]
        if "input_ids" in row:  # token rows as given, each run of mask 1 a reply
            assert (record["input_ids"], record["loss_mask"]) == (row["input_ids"], row["loss_mask"])
            assert [r[:2] for r in record["replies"]] == [[row["loss_mask"].index(1), len(row["loss_mask"])]]
        else:  # the template's text (mask 0), then the assistant turn as the template renders it (mask 1)
            text = tokenizer.apply_chat_template(row["messages"], tokenize=False)
            assert tokenizer.decode(record["input_ids"]) == text
            start = record["loss_mask"].index(1)
            assert tokenizer.decode(record["input_ids"][start:]) == row["messages"][1]["content"] + "<|end|>\n"
            assert set(record["loss_mask"][start:]) == {1}
    manifest = read_manifest(config.stage_dir("data") / "regen")
    assert manifest["imported"]["split"] == {"train": 18, "eval": 6}
    assert manifest["imported"]["formats"] == {"tokens": 12, "conversations": 12}
    assert manifest["samples"] == 24 and manifest["heldout_greedy"]["prompts"] == 4
    report = data_report(manifest, read_manifest(dataset_dir(config.run, config.training)))
    assert "24 rows imported from" in report and "split as named (18 train, 6 eval)" in report


def test_training_evaluates_on_exactly_the_named_eval_rows(imported):
    config, rows, _ = imported
    named = {row["id"] for row in rows if row["split"] == "eval"}
    data = TrainingData(dataset_dir(config.run, config.training), config.training.seq_len, config.training.eval_fraction)
    assert {ref.id for ref in data.eval} == named
    assert {ref.id for ref in data.train} == {row["id"] for row in rows} - named
    assert read_manifest(dataset_dir(config.run, config.training))["named_eval_samples"] == 6
    metrics = [json.loads(line) for line in (config.run.dir / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == list(range(1, 7))
    assert [m["step"] for m in metrics if "eval_loss" in m] == [3, 6]


def test_without_a_named_split_the_hash_of_the_id_splits(imported, tmp_path):
    config, rows, _ = imported
    unnamed = [{k: v for k, v in row.items() if k != "split"} for row in rows]
    source = write_jsonl(tmp_path / "unnamed.jsonl", unnamed)
    overrides = micro_overrides(tmp_path / "run", config.target.path) + TRAINING + [
        "training.eval_fraction=0.5", f"data.import_path={source}"]
    other = load_config(TINY, overrides)
    assert main(["data", "regenerate", *cli_args(overrides)]) == 0  # data.import_path is set: it imports
    assert main(["data", "capture", *cli_args(overrides)]) == 0
    assert not (dataset_dir(other.run, other.training) / "split.json").exists()
    assert read_manifest(dataset_dir(other.run, other.training))["named_eval_samples"] is None
    data = TrainingData(dataset_dir(other.run, other.training), MAX_LENGTH, 0.5)
    assert 0 < len(data.eval) < 24 and {ref.id for ref in data.eval} != {r["id"] for r in rows if r["split"] == "eval"}


def test_the_data_stage_key_follows_the_imported_files_content(imported, tmp_path):
    config, rows, _ = imported
    source = write_jsonl(tmp_path / "rows.jsonl", rows)
    overrides = micro_overrides(config.run.dir, config.target.path) + [f"data.import_path={source}"]
    before = stage_key("regenerate", load_config(TINY, overrides), [])
    write_jsonl(source, rows[:-1])
    assert stage_key("regenerate", load_config(TINY, overrides), []) != before


def bad_rows(tokenizer):
    good = outside_rows(tokenizer, count=2)[0]
    return {
        "vocab": ({**good, "input_ids": [*good["input_ids"][:-1], 512]}, "field input_ids: token id 512 is outside the "
                  "target's vocabulary (target.vocab_size 512)"),
        "length": ({**good, "input_ids": [1] * (MAX_LENGTH + 1), "loss_mask": [1] * (MAX_LENGTH + 1)},
                   f"field input_ids: {MAX_LENGTH + 1} tokens, longer than data.max_length {MAX_LENGTH}"),
        "missing": ({k: v for k, v in good.items() if k != "loss_mask"}, "field loss_mask: missing"),
        "ill-typed": ({**good, "input_ids": [*good["input_ids"][:-1], "7"]}, "field input_ids: holds a value that "
                      "is not a token id: '7'"),
        "mask-values": ({**good, "loss_mask": [2] * len(good["input_ids"])}, "field loss_mask: not a list of 0 and 1"),
        "mask-length": ({**good, "loss_mask": good["loss_mask"][:-1]}, "field loss_mask: "
                        f"{len(good['input_ids']) - 1} values for {len(good['input_ids'])} input_ids"),
        "split": ({**good, "split": "test"}, "field split: 'test' is neither 'train' nor 'eval'"),
        "no-split": ({k: v for k, v in good.items() if k != "split"}, "field split: missing, but the first row names "
                     "a split"),
        "duplicate": (good, "field id: 'row-0' is also the id of line 1"),
        "no-reply": ({"id": "q", "messages": [{"role": "user", "content": "hi"}], "split": "train"},
                     "field messages: no assistant turn"),
    }


@pytest.mark.parametrize("case", ["vocab", "length", "missing", "ill-typed", "mask-values", "mask-length", "split",
                                  "no-split", "duplicate", "no-reply"])
def test_a_bad_row_is_refused_by_file_line_and_field_and_nothing_is_written(case, micro_target, tmp_path, capsys):
    tokenizer = AutoTokenizer.from_pretrained(micro_target)
    row, message = bad_rows(tokenizer)[case]
    first = outside_rows(tokenizer, count=2)[0]
    source = write_jsonl(tmp_path / "rows.jsonl", [first, row])
    overrides = micro_overrides(tmp_path / "run", micro_target) + TRAINING
    assert main(["data", "import", *cli_args(overrides), str(source)]) == 2
    assert f"{source}, line 2, {message}" in capsys.readouterr().err
    assert not (tmp_path / "run" / "data" / "regen").exists()
    assert not [p for p in (tmp_path / "run" / "data").glob("*") if p.name.startswith(".regen")]


def test_an_empty_file_is_refused(micro_target, tmp_path, capsys):
    source = tmp_path / "rows.jsonl"
    source.write_text("\n")
    assert main(["data", "import", *cli_args(micro_overrides(tmp_path / "run", micro_target)), str(source)]) == 2
    assert f"{source}: no rows (the file is empty)" in capsys.readouterr().err
    assert not (tmp_path / "run" / "data" / "regen").exists()


def test_a_missing_import_file_is_a_config_error(micro_target, tmp_path):
    config = load_config(TINY, micro_overrides(tmp_path / "run", micro_target) + [f"data.import_path={tmp_path}/no"])
    with pytest.raises(ConfigError, match="data.import_path .*/no: no such file"):
        check_local_inputs(config)


def test_an_import_over_a_regenerated_set_leaves_it_when_a_row_is_bad(imported, tmp_path):
    config, rows, _ = imported
    regen = config.stage_dir("data") / "regen"
    manifest = (regen / "manifest.json").read_text()
    with pytest.raises(Exception, match="line 1, field loss_mask"):
        import_rows(config, write_jsonl(tmp_path / "bad.jsonl", [{**rows[0], "loss_mask": []}]), log=lambda line: None)
    assert (regen / "manifest.json").read_text() == manifest


def test_the_regenerate_step_of_a_run_that_imports_imports_and_says_so(micro_target, tmp_path, capsys):
    source = write_jsonl(tmp_path / "rows.jsonl", outside_rows(AutoTokenizer.from_pretrained(micro_target), count=2))
    overrides = micro_overrides(tmp_path / "run", micro_target) + TRAINING + [f"data.import_path={source}"]
    assert main(["data", "regenerate", *cli_args(overrides)]) == 0  # the stage `eagle3 run` runs: it imports
    assert f"data.import_path is set: importing {source}" in capsys.readouterr().out
    assert read_manifest(tmp_path / "run" / "data" / "regen")["imported"]["path"] == str(source)
