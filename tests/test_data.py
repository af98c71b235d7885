"""Regeneration, capture and the vocab map on the micro target, end to end on the CPU."""

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle3.cli import main
from eagle3.resolve import load_config
from eagle3.data.capture import capture, check_dataset
from eagle3.data.regenerate import greedy_length, read_regenerated, read_samples, regenerate, training_ids
from eagle3.data.shards import read_dataset
from eagle3.data.storage import StorageError, check_storage
from eagle3.data.vocab import build_vocab, count_loss_tokens
from eagle3.data.conversation import prompt_ids
from eagle3.runtime.generators import LocalGenerator, make_generator, target_greedy
from eagle3.runtime.targets import DataMismatch
from eagle3.records.manifest import read_data_capture, read_manifest
from eagle3.draft.vocab_map import load_vocab_map, read_stats
from eagle3.stages.keys import begin, finish
from helpers import KIMI, TINY, micro_overrides


@pytest.fixture(scope="module")
def micro_run(tmp_path_factory, micro_target):
    """One regenerated + captured micro dataset shared by the tests of this module."""
    run_dir = tmp_path_factory.mktemp("micro-run")
    config = load_config(TINY, micro_overrides(run_dir, micro_target))
    lines = []
    regenerate(config, log=lines.append)
    capture(config.run, config.data, config.target, config.training, log=lines.append)
    return config, lines


def test_regenerated_samples_mask_exactly_the_assistant_tokens(micro_run):
    config, _ = micro_run
    tokenizer = AutoTokenizer.from_pretrained(config.target.path)
    records = list(read_samples(config.stage_dir("data") / "regen"))
    assert len(records) == 24
    for record in records:
        user = record["conversation"][0]
        prompt = tokenizer.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ids, mask = record["input_ids"], record["loss_mask"]
        assert ids[: len(prompt_ids)] == prompt_ids and not any(mask[: len(prompt_ids)])
        assert all(mask[len(prompt_ids) :]) and len(ids) > len(prompt_ids)  # everything after is the target's
        reply = tokenizer.decode(ids[len(prompt_ids) :], skip_special_tokens=True)
        assert record["conversation"][1] == {"role": "assistant", "content": reply}


def test_regeneration_is_the_targets_greedy_continuation(micro_run):
    config, _ = micro_run
    model = AutoModelForCausalLM.from_pretrained(config.target.path).eval()
    record = next(read_samples(config.stage_dir("data") / "regen"))
    start = record["loss_mask"].index(1)
    prompt = torch.tensor([record["input_ids"][:start]])
    out = model.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=model.generation_config.eos_token_id)
    expected = out[0, start:].tolist()
    stored = record["input_ids"][start:]
    assert expected[: len(stored)] == stored


def test_captured_states_equal_a_direct_forward_pass(micro_run):
    config, _ = micro_run
    model = AutoModelForCausalLM.from_pretrained(config.target.path).eval()
    samples = list(read_dataset(config.stage_dir("data") / "hidden"))
    assert len(samples) == 24
    for sample in samples[:3] + samples[-2:]:
        ids = sample.input_ids.long().unsqueeze(0)
        with torch.no_grad():
            out = model(input_ids=ids, output_hidden_states=True)
        aux = torch.cat([out.hidden_states[k + 1] for k in config.data.aux_layers], dim=-1)[0]  # our convention
        assert sample.aux_hidden.dtype == torch.bfloat16 and sample.aux_hidden.shape == (ids.shape[1], 3 * 64)
        torch.testing.assert_close(sample.aux_hidden.float(), aux, atol=2e-2, rtol=2e-2)
        # post-norm last state: the target's logits come straight from lm_head
        logits = model.lm_head(sample.last_hidden.float())
        torch.testing.assert_close(logits, out.logits[0], atol=0.15, rtol=0.05)
        assert torch.equal(sample.loss_mask.bool().any(), torch.tensor(True))


def test_manifest_records_what_later_stages_check(micro_run):
    config, lines = micro_run
    manifest = read_manifest(config.stage_dir("data") / "hidden")
    assert manifest["capture"] == {"aux_layers": [0, 1, 2], "last_hidden": "post_norm", "dtype": "bfloat16",
                                   "engine": "local", "engine_release": None}
    assert manifest["samples"] == 24 and manifest["bytes_per_token"] == 4 * 64 * 2 + 5
    assert len(manifest["files"]) == 3 and all(len(f["sha256"]) == 64 for f in manifest["files"].values())
    assert manifest["target"]["tokenizer_sha256"] and manifest["chat_template_sha256"]
    assert read_data_capture(config.stage_dir("data") / "hidden")["aux_layers"] == [0, 1, 2]
    assert any("bytes per token" in line for line in lines) and any("samples/s" in line for line in lines)


def test_capture_resumes_by_shard(micro_run):
    config, _ = micro_run
    hidden = config.stage_dir("data") / "hidden"
    before = {p.name: p.stat().st_mtime_ns for p in hidden.glob("shard-*")}
    (hidden / "shard-00001.safetensors").unlink()
    capture(config.run, config.data, config.target, config.training, log=lambda line: None)
    after = {p.name: p.stat().st_mtime_ns for p in hidden.glob("shard-*")}
    assert after["shard-00000.safetensors"] == before["shard-00000.safetensors"]  # untouched
    assert set(after) == set(before)


@pytest.mark.parametrize(
    ("override", "names"),
    [("data.thinking=true", "thinking: data has False, config gives True"), ("target.family=qwen2", "family")],
)
def test_data_made_under_other_settings_is_refused(micro_run, override, names):
    config, _ = micro_run
    other = load_config(TINY, micro_overrides(config.run.dir, config.target.path) + [override])
    with pytest.raises(DataMismatch, match=names):
        capture(other.run, other.data, other.target, other.training, log=lambda line: None)


def test_dataset_with_other_layers_is_refused(micro_run):
    config, _ = micro_run
    manifest = read_manifest(config.stage_dir("data") / "hidden")
    other = load_config(TINY, micro_overrides(config.run.dir, config.target.path) + ["data.aux_layers=[0, 2]"])
    with pytest.raises(DataMismatch, match=r"aux_layers: data has \[0, 1, 2\], config gives \[0, 2\]"):
        check_dataset(other.run, other.data, other.target, other.training, manifest)
    check_dataset(config.run, config.data, config.target, config.training, manifest)


def test_vocab_map_from_loss_masked_tokens(micro_run):
    config, _ = micro_run
    lines = []
    out = build_vocab(config.run, config.data, config.target, config.vocab, log=lines.append)
    vocab_map = load_vocab_map(out)
    stats = read_stats(out)
    counts = count_loss_tokens(read_samples(config.stage_dir("data") / "regen"), 512)
    assert stats.counted_tokens == int(counts.sum()) == read_manifest(config.stage_dir("data") / "regen")["loss_tokens"]
    assert vocab_map.draft_vocab_size == 128 and stats.coverage > 0.5
    assert set(torch.nonzero(counts).flatten().tolist()) <= set(vocab_map.target_ids().tolist()) or stats.distinct_ids_seen > 128
    assert any("cover" in line for line in lines)


def test_storage_projection_refuses_a_disk_that_is_too_small(tmp_path):
    kimi = load_config(KIMI, [f"run.dir={tmp_path}"])
    lines = []
    tokens = kimi.data.num_samples * kimi.data.max_length  # 200k samples x 4096 tokens
    with pytest.raises(StorageError, match=r"needs 47.0 TB \(819,200,000 tokens x 57,349 bytes\)") as err:
        check_storage(kimi.data, kimi.target, tokens, tmp_path / "data" / "hidden", lines.append)
    assert "free at" in str(err.value)
    assert "57,349 bytes per token (3 aux + 1 last state x 7168 x bf16)" in lines[0]


def test_cli_commands_run_the_stages(micro_run, tmp_path, capsys):
    config, _ = micro_run
    args = ["--config", str(TINY)] + [f"--set={o}" for o in micro_overrides(config.run.dir, config.target.path)]
    assert main(["vocab", "build", *args]) == 0
    assert "vocab: 128 draft ids cover" in capsys.readouterr().out
    assert main(["data", "capture", *args, "--set=data.thinking=true"]) == 2
    assert "thinking" in capsys.readouterr().err


def test_capture_recomputes_what_no_longer_matches(micro_run, tmp_path):
    config, _ = micro_run
    hidden = config.stage_dir("data") / "hidden"
    other = load_config(TINY, micro_overrides(config.run.dir, config.target.path) + ["data.aux_layers=[0, 2]"])
    capture(other.run, other.data, other.target, other.training, log=lambda line: None)
    sample = next(read_dataset(hidden))
    assert sample.aux_hidden.shape[1] == 2 * 64  # recaptured at the new layers, not reused
    lines = []
    capture(config.run, config.data, config.target, config.training, log=lines.append)  # back to [0, 1, 2]: recaptured again, then reusable
    assert next(read_dataset(hidden)).aux_hidden.shape[1] == 3 * 64
    capture(config.run, config.data, config.target, config.training, log=lines.append)
    assert "(3 reused)" in lines[-1]


def test_a_changed_split_never_leaks_into_later_stages(micro_target, tmp_path):
    overrides = micro_overrides(tmp_path / "run", micro_target)
    regenerate(load_config(TINY, overrides), log=lambda line: None)
    smaller = load_config(TINY, overrides + ["data.num_samples=10", "data.heldout_fraction=0.5"])
    lines = []
    regenerate(smaller, log=lines.append)
    heldout = {json.loads(line)["id"] for line in (tmp_path / "run" / "data" / "heldout.jsonl").read_text().splitlines()}
    current = list(read_regenerated(smaller.stage_dir("data") / "regen"))
    assert len(current) == 10 and not {r["id"] for r in current} & heldout
    assert any("ignoring" in line for line in lines)
    assert read_manifest(smaller.stage_dir("data") / "regen")["samples"] == 10
    capture(smaller.run, smaller.data, smaller.target, smaller.training, log=lambda line: None)
    assert {s.id for s in read_dataset(smaller.stage_dir("data") / "hidden")} == {r["id"] for r in current}


class CountingGenerator:
    """The real local generator, counting the prompts it is asked to answer."""

    def __init__(self, inner):
        self.inner, self.release, self.prompts, self.continued = inner, inner.release, 0, 0

    def generate(self, prompts):
        self.prompts += len(prompts)
        return self.inner.generate(prompts)

    def continue_greedy(self, prompts, length):
        self.continued += len(prompts)
        return self.inner.continue_greedy(prompts, length)


def test_more_samples_generate_and_capture_only_the_new_ones_and_fewer_take_a_prefix(micro_target, tmp_path):
    overrides = micro_overrides(tmp_path / "run", micro_target) + ["data.shard_samples=4"]
    sized = lambda n: load_config(TINY, overrides + [f"data.num_samples={n}"])  # noqa: E731
    regen = tmp_path / "run" / "data" / "regen"
    eight = sized(8)
    regenerate(eight, log=lambda line: None)
    capture(eight.run, eight.data, eight.target, eight.training, log=lambda line: None)
    first = {record["id"]: record for record in read_regenerated(regen)}
    twelve = sized(12)
    generator = CountingGenerator(make_generator(twelve.data, twelve.target, twelve.training.seed))
    regenerate(twelve, log=lambda line: None, generator=generator)
    grown = list(read_regenerated(regen))
    assert generator.prompts == 4 and len(grown) == 12  # only the 4 new samples were generated
    assert all(record == first[record["id"]] for record in grown if record["id"] in first) and len(first) == 8
    lines = []
    capture(twelve.run, twelve.data, twelve.target, twelve.training, log=lines.append)
    assert "12 samples in 3 shard(s)" in lines[-1] and "(2 reused)" in lines[-1]  # the 8 first samples' shards kept
    four = sized(4)
    regenerate(four, log=lambda line: None, generator=generator)
    assert generator.prompts == 4  # nothing generated: a prefix of the same split
    assert [r["id"] for r in read_regenerated(regen)] == training_ids(regen)[:4] == [*first][:4]
    capture(four.run, four.data, four.target, four.training, log=lines.append)
    assert "4 samples in 1 shard(s)" in lines[-1] and "(1 reused)" in lines[-1]


QUESTIONS = ("What is a list?", "How do I open a file for reading in binary mode?", "Explain the with statement.",
             "Why?", "What does the yield keyword do inside a function that is called from a loop?")


def questions_ids(target) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    return [prompt_ids(tokenizer, [{"role": "user", "content": q}], False) for q in QUESTIONS]


def test_held_out_continuations_have_the_asked_length_on_a_target_that_ends_its_turns(micro_target, tmp_path):
    """The micro target never ends a turn; made to end it at the first token it answers with, it stops at once in
    regeneration, and its greedy continuations still run the whole length (EOS ignored)."""
    target = tmp_path / "target"
    shutil.copytree(micro_target, target)
    prompts = questions_ids(target)
    first = LocalGenerator(str(target), 8, 0.0).continue_greedy(prompts[:1], 1)[0][0]
    generation = json.loads((target / "generation_config.json").read_text())
    (target / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [first]}))
    ends = LocalGenerator(str(target), 8, 0.0)
    assert ends.generate(prompts[:1])[0].finish_reason == "stop"  # it does end its turn there
    assert [len(c) for c in ends.continue_greedy(prompts, 40)] == [40] * len(prompts)
    assert len(target_greedy(ends.model, prompts[0], 40)) == 40  # the simulator's single continuation too


def test_batched_continuations_equal_the_one_at_a_time_ones(micro_target):
    """Left padding and the attention mask leave each greedy continuation exactly what it is alone (float32)."""
    generator = LocalGenerator(str(micro_target), 8, 0.0)
    prompts = questions_ids(micro_target)
    assert len(set(map(len, prompts))) > 1  # the batch is padded
    assert generator.continue_greedy(prompts, 30) == [target_greedy(generator.model, ids, 30) for ids in prompts]


def test_other_benchmark_prompts_redo_only_the_held_out_continuations(micro_target, tmp_path):
    """benchmark.num_prompts and max_new_tokens refine regeneration: the training shards are kept as they are."""
    overrides = micro_overrides(tmp_path / "run", micro_target) + ["data.num_samples=8", "benchmark.max_new_tokens=8"]
    first = load_config(TINY, overrides + ["benchmark.num_prompts=2"])
    begin("regenerate", first, [], print)
    regenerate(first, log=lambda line: None)
    finish("regenerate", first, [])
    regen = first.stage_dir("data") / "regen"
    shards = {path: (path.read_bytes(), path.stat().st_mtime_ns) for path in regen.glob("samples-*.jsonl")}
    for changed in (["benchmark.num_prompts=4"], ["benchmark.num_prompts=4", "benchmark.max_new_tokens=12"]):
        config = load_config(TINY, overrides + changed)
        lines, generator = [], CountingGenerator(make_generator(config.data, config.target, config.training.seed))
        begin("regenerate", config, [], lines.append)
        regenerate(config, log=lines.append, generator=generator)
        finish("regenerate", config, [])
        assert generator.prompts == 0 and generator.continued == 4  # no sample made again; every continuation
        assert {path: (path.read_bytes(), path.stat().st_mtime_ns) for path in regen.glob("samples-*.jsonl")} == shards
        assert "regenerate: resuming, 8 samples already written" in lines
        assert any(line.startswith("held-out continuations: 4/4 requests") and "tokens/s" in line for line in lines)
        assert read_manifest(regen)["heldout_greedy"] == {"prompts": 4, "length": greedy_length(config), "requests": 4,
                                                          "suites": {"heldout": 4}}


def test_held_out_prompts_longer_than_training_takes_are_left_out_of_the_benchmark(micro_target, tmp_path):
    """Training sends no prompt of data.max_length tokens or more; the benchmark's held-out prompts follow the same rule
    (a ShareGPT conversation of 2,800 tokens would measure the draft far past the positions it was trained on)."""
    from eagle3.data.prompts import load_prompts, split_heldout

    words = "the object of the statement is evaluated once"
    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"{words} " * (40 if i % 2 else 1)}]}
            for i in range(24)]
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = load_config(TINY, micro_overrides(tmp_path / "run", micro_target) + [
        f"data.prompts={source}", "data.num_samples=2", "data.heldout_fraction=0.5", "benchmark.num_prompts=2"])
    lines = []
    regenerate(config, log=lines.append)
    _, heldout = split_heldout(load_prompts(str(source)).prompts, 0.5)
    long_ones = {p.id for p in heldout if len(p.turns[-1]["content"]) > 100}
    kept = [json.loads(line) for line in (tmp_path / "run" / "data" / "heldout.jsonl").read_text().splitlines()]
    assert long_ones and kept and not long_ones & {row["id"] for row in kept}
    assert all(len(row["messages"][-1]["content"]) < 100 for row in kept)
    tokenizer = AutoTokenizer.from_pretrained(str(micro_target))
    assert all(len(prompt_ids(tokenizer, row["messages"], False)) < 96 for row in kept)
    assert any(f"{len(long_ones)} of {len(heldout)} held-out prompts are data.max_length (96)" in line for line in lines)
