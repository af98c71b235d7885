"""Stage cache keys: what changes them and what does not, and the marks that keep the cache from handing on an
output that no longer is what its key describes."""

import json
import shutil
import typing
from dataclasses import replace

from pydantic import BaseModel

from drafts import write_draft
from eagle3.cli import main
from eagle3.config import PipelineConfig
from eagle3.resolve import load_config
from eagle3.records.manifest import MANIFEST_FILE, fingerprint, write_manifest
from eagle3.registry.registry import Registry
from eagle3.registry.store import LocalStore
from eagle3.stages.keys import IN_PROGRESS, begin, cache_key, done, finish, marker, recorded_key, stage_key
from eagle3.config.run import RUN_DIRS
from eagle3.stages.table import OPERATIONAL, RECORDS, STAGES, output_of, record_path, under_run
from helpers import TINY, TOY

D = {"dataset": "d"}  # the fingerprints of the outputs a stage consumes, by parameter name


def config(tmp_path, *overrides):
    return load_config(TINY, [f"run.dir={tmp_path / 'run'}", f"target.path={tmp_path / 'target'}", *overrides])


def test_keys_follow_what_a_stage_reads_and_nothing_else(tmp_path):
    base = config(tmp_path)
    key = stage_key("train", base, D)
    assert key == stage_key("train", config(tmp_path, "serving.port=1234", "training.nproc_per_node=8"), D)
    assert key != stage_key("train", config(tmp_path, "training.learning_rate=1e-3"), D)
    assert key != stage_key("train", base, {"dataset": "other data"})
    assert key != stage_key("train", config(tmp_path, "serving.num_steps=5"), D)
    assert stage_key("regenerate", base, {}) == stage_key("regenerate", config(tmp_path, "data.concurrency=3"), {})


def test_a_suite_besides_the_held_out_prompts_is_in_the_suites_stages_key_alone(tmp_path):
    """Only the replays read the other suites' continuations: adding MT-bench re-keys the suites stage, not the
    training replies (and so nothing training reads); the held-out suite's own count re-keys regeneration."""
    base, added = config(tmp_path), config(tmp_path, "benchmark.suites=[heldout, mtbench]")
    regenerated = {"regenerated": "r"}
    assert stage_key("regenerate", added, {}) == stage_key("regenerate", base, {})
    assert stage_key("suites", added, regenerated) != stage_key("suites", base, regenerated)
    assert stage_key("suites", config(tmp_path, "benchmark.suites=[heldout, mtbench]", "benchmark.num_prompts=7"),
                     regenerated) == stage_key("suites", added, regenerated)  # no traffic suite takes that count
    fewer = config(tmp_path, "benchmark.suites=[{name: heldout, num_prompts: 1}, mtbench]")
    assert stage_key("regenerate", fewer, {}) != stage_key("regenerate", added, {})
    assert stage_key("suites", fewer, regenerated) == stage_key("suites", added, regenerated)


def test_a_prompt_file_is_keyed_by_its_content(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"messages": [{"role": "user", "content": "a"}]}\n')
    first = stage_key("regenerate", config(tmp_path, f"data.prompts={prompts}"), [])
    prompts.write_text('{"messages": [{"role": "user", "content": "b"}]}\n')
    assert stage_key("regenerate", config(tmp_path, f"data.prompts={prompts}"), []) != first


def test_the_cache_is_offered_a_key_only_for_an_output_finished_under_it(tmp_path):
    good, other = config(tmp_path), config(tmp_path, "training.learning_rate=1e-3")
    assert cache_key("train", good, D) is not None  # never ran here
    begin("train", good, D, print)
    (tmp_path / "run" / "train" / "best").mkdir(parents=True)
    assert cache_key("train", good, D) is None  # in progress: a failed run's half output is no result
    finish("train", good, D)
    assert cache_key("train", good, D) == stage_key("train", good, D)
    begin("train", other, D, print)  # another config's run overwrites it, and fails
    assert cache_key("train", good, D) is None


def test_changed_inputs_start_a_resuming_stage_afresh_and_a_crash_resumes(tmp_path):
    good, other = config(tmp_path), config(tmp_path, "training.learning_rate=1e-3")
    checkpoint = tmp_path / "run" / "train" / "checkpoints" / "step-100"
    checkpoint.mkdir(parents=True)
    begin("train", good, D, print)  # crashed: still in progress under the same key
    begin("train", good, D, print)
    assert checkpoint.is_dir()  # the re-run resumes
    lines = []
    begin("train", other, D, lines.append)
    assert not checkpoint.exists() and "its inputs changed" in lines[0]
    assert "(config.training.learning_rate: 0.003 -> 0.001)" in lines[0]  # the one input that changed, named
    assert recorded_key(other, "train") == IN_PROGRESS + stage_key("train", other, D)


def test_more_samples_other_thresholds_or_benchmark_prompts_keep_the_regenerated_samples_and_other_prompts_do_not(tmp_path):
    """data.num_samples, data.quality and the benchmark's held-out set change regeneration's cache key, not what it
    resumes from."""
    written = tmp_path / "run" / "data" / "regen" / "samples-00000.jsonl"
    written.parent.mkdir(parents=True)
    written.write_text("{}\n")
    begin("regenerate", config(tmp_path), [], print)
    finish("regenerate", config(tmp_path), [])
    for overrides in (["data.num_samples=5000"], ["data.num_samples=3", "data.quality.max_empty_share=0.5"],
                      ["benchmark.num_prompts=7"], ["benchmark.max_new_tokens=9"]):
        refined = config(tmp_path, *overrides)
        assert cache_key("regenerate", refined, []) is None  # not the same output: the stage runs
        begin("regenerate", refined, [], print)
        assert written.is_file()  # ... and resumes from the samples already written
    begin("regenerate", config(tmp_path, "data.temperature=0.7"), [], print)
    assert not written.exists()


def test_a_finished_output_is_done_by_its_marker_alone_and_the_log_names_a_changed_upstream(tmp_path):
    """No orchestrator state: the marker beside the output says whether it is done for these inputs."""
    good = config(tmp_path)
    (tmp_path / "run" / "train" / "best").mkdir(parents=True)
    begin("train", good, D, print)
    assert not done("train", good, D)  # in progress
    finish("train", good, D)
    assert done("train", good, D) and not done("train", good, {"dataset": "other"})
    lines = []
    begin("train", good, {"dataset": "e" * 64}, lines.append)
    assert '(upstream.dataset: "d" -> "eeeeeeeeeeeeeee...): starting it afresh' in lines[0], lines


def test_a_fingerprint_hashes_what_an_output_holds_not_when_it_was_written(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "samples.jsonl").write_text("{}\n")
    write_manifest(out, kind="regenerated", fields={"samples": 1})
    first = fingerprint(out)
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    (out / MANIFEST_FILE).write_text(json.dumps({**manifest, "created": "2031-01-01T00:00:00+00:00"}))
    assert fingerprint(out) == first  # made again with the same content: downstream keys unchanged
    (out / "samples.jsonl").write_text("{}\n{}\n")
    write_manifest(out, kind="regenerated", fields={"samples": 1})
    assert fingerprint(out) != first


def test_the_init_draft_is_keyed_by_its_content_not_its_path_or_version_id(tmp_path):
    """training.init_from: another draft at the same path runs training again; the same draft elsewhere, or published
    as a registry version, does not."""
    draft = write_draft(tmp_path / "draft", layout="sglang", release="0.5.13")
    key = stage_key("train", config(tmp_path, f"training.init_from={draft}"), D)
    assert key != stage_key("train", config(tmp_path), D)  # from scratch
    moved = shutil.copytree(draft, tmp_path / "elsewhere")
    (moved / "notes.txt").write_text("a file no checkpoint reader reads\n")
    assert stage_key("train", config(tmp_path, f"training.init_from={moved}"), D) == key
    Registry(LocalStore(tmp_path / "registry")).publish("imported-1", {"sglang": draft}, {})
    by_version = config(tmp_path, "training.init_from=imported-1", f"registry.path={tmp_path / 'registry'}")
    assert stage_key("train", by_version, D) == key
    shutil.rmtree(draft)
    write_draft(draft, layout="sglang", release="0.5.13", seed=1)  # other weights at the same path
    assert stage_key("train", config(tmp_path, f"training.init_from={draft}"), D) != key


def config_fields(model, prefix: str = "") -> list[str]:
    """Every leaf field of a config model, dotted; a section (a model, or an optional one) is walked into."""
    fields = []
    for name, info in model.model_fields.items():
        sections = [t for t in (info.annotation, *typing.get_args(info.annotation))
                    if isinstance(t, type) and issubclass(t, BaseModel)]
        fields += config_fields(sections[0], f"{prefix}{name}.") if sections else [prefix + name]
    return fields


def uncovered(model) -> list[str]:
    """Config fields in no stage's key and not listed as operational."""
    covering = [field for stage in STAGES.values() for field in stage.key_fields()] + list(OPERATIONAL)
    return [field for field in config_fields(model)
            if not any(field == name or field.startswith(name + ".") for name in covering)]


def test_every_config_field_is_in_a_stage_key_or_operational_with_a_reason():
    assert uncovered(PipelineConfig) == []
    leaves = config_fields(PipelineConfig)
    named = lambda name: any(leaf == name or leaf.startswith(name + ".") for leaf in leaves)  # noqa: E731
    keyed = {field for stage in STAGES.values() for field in stage.key_fields()}
    assert [name for name in keyed | set(OPERATIONAL) if not named(name)] == []  # no stale names
    assert sorted(keyed & set(OPERATIONAL)) == []
    assert all(reason.strip() for reason in OPERATIONAL.values())


def test_each_run_directory_part_holds_some_stage_output_or_record_and_nothing_lies_outside_them(tmp_path):
    """The run directory's parts (RUN_DIRS, what `stage_dir` takes) and the table's outputs, resume points and records
    name the same places: none of them outside a part, no part that nothing makes."""
    for features in ("offline", "online"):
        run = config(tmp_path, f"training.features={features}")
        paths = [output_of(run, name) for name in STAGES] + [record_path(run, record) for record in RECORDS]
        paths += [under_run(run, resumed) for stage in STAGES.values() for resumed in stage.resumes]
        parts = [path.relative_to(run.run.dir).parts[0] for path in paths]
        assert set(parts) == set(RUN_DIRS), parts
        assert output_of(run, "capture").name == ("tokens" if features == "online" else "hidden")


def test_a_new_setting_left_out_of_every_key_is_named(monkeypatch):
    class Training(PipelineConfig.model_fields["training"].annotation):
        lr_floor_2: float = 0.0

    class Config(PipelineConfig):
        training: Training

    assert uncovered(Config) == ["training.lr_floor_2"]
    monkeypatch.setitem(STAGES, "train", replace(STAGES["train"], key=STAGES["train"].key + ("training.lr_floor_2",)))
    assert uncovered(Config) == []


def test_a_new_stage_is_one_table_entry_and_its_runner(tmp_path, monkeypatch, capsys):
    """A toy stage (tests/helpers.py) added to the table: the CLI has its step, and its key and marker follow its fields and
    its upstream's content (the flow's task for it: tests/test_flow.py)."""
    monkeypatch.setitem(STAGES, "toy", TOY)
    base = config(tmp_path)
    vocab = output_of(base, "vocab")
    vocab.mkdir(parents=True)
    write_manifest(vocab, "vocab", {"coverage": 0.5})  # the upstream output the toy reads, on disk

    def toy(*sets: str) -> str:
        assert main(["toy", "--config", str(TINY), *[a for s in (f"run.dir={tmp_path / 'run'}",
                     f"target.path={tmp_path / 'target'}", *sets) for a in ("--set", s)]]) == 0
        return capsys.readouterr().out

    assert "toy: wrote" in toy()
    assert output_of(base, "toy").read_text() == f"{base.training.seed} {base.vocab.draft_vocab_size}\n"
    assert done("toy", base, {"vocab": fingerprint(vocab)})
    assert "kept, not made again" in toy()
    assert "toy: wrote" in toy("training.seed=7")  # a field of its key
    assert output_of(base, "toy").read_text().startswith("7 ")
    assert "kept, not made again" in toy("training.seed=7", "serving.port=1234")  # in no key of its
    write_manifest(vocab, "vocab", {"coverage": 0.75})
    assert "toy: wrote" in toy("training.seed=7")  # its upstream's content


def test_a_step_by_hand_refuses_an_upstream_output_left_unfinished_or_made_for_other_settings(tmp_path, monkeypatch,
                                                                                              capsys):
    """The toy step reads the vocab map, which reads the regenerated samples: a vocab map marked in progress, or
    finished for another draft vocabulary than the step's settings give, is refused, naming the steps to run."""
    monkeypatch.setitem(STAGES, "toy", TOY)
    base = config(tmp_path)
    for stage in ("regenerate", "vocab"):
        output_of(base, stage).mkdir(parents=True)
        write_manifest(output_of(base, stage), stage, {})
    upstream = {"regenerated": fingerprint(output_of(base, "regenerate"))}
    begin("vocab", base, upstream, print)

    def toy(*sets: str) -> int:
        return main(["toy", "--config", str(TINY), *[a for s in (f"run.dir={tmp_path / 'run'}",
                     f"target.path={tmp_path / 'target'}", *sets) for a in ("--set", s)]])

    assert toy() == 2
    assert (f"toy: {output_of(base, 'vocab')} (the vocab stage's output) was left unfinished (marked in progress in "
            f"{marker(base, 'vocab')}): run `eagle3 vocab build` with these settings first") in capsys.readouterr().err
    finish("vocab", base, upstream)
    assert toy() == 0 and "toy: wrote" in capsys.readouterr().out
    assert toy("vocab.draft_vocab_size=512") == 2
    assert ("(the vocab stage's output) was made for other inputs (config.vocab.draft_vocab_size: 1024 -> 512): run "
            "`eagle3 vocab build` with these settings first") in capsys.readouterr().err
