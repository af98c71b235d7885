"""Contenders (docs/algorithms.md, "Contenders"): other drafts a run trains on its own data. The config derives each
one and refuses what would not train on the run's data; the gate's pick is the fastest draft it passes; and a micro
run with a DFlash contender trains both on one data set, measures both, promotes the pick and reports both."""

import json

import pytest

from eagle3.resolve import contender_configs, draft_configs, load_config
from eagle3.config.contenders import SHAPE_FIELDS, SHARED_TRAINING
from eagle3.data.regenerate import greedy_length
from eagle3.deployment.contenders import Contender, contenders_record, contenders_text, pick, write_contenders
from eagle3.deployment.promotion import Candidate
from eagle3.deployment.sweep import with_shape
from eagle3.errors import ConfigError
from eagle3.registry.gate import Decision, Reason
from eagle3.registry.registry import open_registry, version_algorithm
from eagle3.shape import DraftShape
from eagle3.stages.keys import stage_key
from eagle3.stages.table import STAGES, output_of
from flows.eagle3 import eagle3
from flows.summary import stage_rows, summary
from family_targets import CONTENDERS_CONFIG, THREE_KINDS_CONFIG
from helpers import ROOT, TINY, micro_run_overrides

KIMI_CONTENDERS = ROOT / "configs" / "kimi-k25-contenders-8xh200.yaml"

PAD = 5  # the tiny tokenizers' <|pad|>: never generated
DFLASH = {"draft": {"algorithm": "dflash", "dflash": {"num_layers": 1, "block_size": 4, "mask_token_id": PAD}},
          "sweep": {"points": [[1, 1, 2]]}}


def with_contenders(contenders: dict, *overrides: str):
    return load_config(TINY, [f"contenders={json.dumps(contenders)}", *overrides])


def test_a_contender_is_the_runs_config_with_its_fields_over_it_reading_the_runs_data():
    config = with_contenders({"dflash": DFLASH | {"training": {"learning_rate": 1e-3}}},
                             "training.init_from=runs/some-eagle3-draft")
    run, dflash = draft_configs(config).values()
    assert run is config and dflash.draft.algorithm == "dflash" and dflash.contenders is None
    assert dflash.run.dir == config.run.dir / "contenders" / "dflash" and dflash.run.data_from == config.run.dir
    # the shared stages' outputs are the run's; its own are under its directory
    for stage in ("regenerate", "capture", "vocab"):
        assert output_of(dflash, stage) == output_of(config, stage)
    for stage in ("train", "export", "simulate"):
        assert output_of(dflash, stage).is_relative_to(dflash.run.dir)
    assert dflash.training.learning_rate == 1e-3 and dflash.draft.intermediate_size == config.draft.intermediate_size
    # the run's warm start is an EAGLE-3 draft: a contender of another kind trains from scratch
    assert dflash.training.init_from is None and config.training.init_from == "runs/some-eagle3-draft"
    # a contender's own shape: what it leaves out takes the defaults, not the run's resolved values
    shorter = contender_configs(with_contenders({"dflash": DFLASH | {"serving": {"num_steps": 2}}}))["dflash"]
    assert (shorter.serving.num_steps, shorter.serving.num_draft_tokens) == (2, 3) and config.serving.num_steps == 3


def test_the_shared_stages_keys_are_the_same_for_the_run_and_its_contender(tmp_path):
    config = with_contenders({"dflash": DFLASH}, f"run.dir={tmp_path}", "target.path=runs/targets/absent")
    dflash = contender_configs(config)["dflash"]
    upstream = {"regenerated": "f" * 64}
    assert stage_key("vocab", dflash, upstream) == stage_key("vocab", config, upstream)  # one token, one data set
    assert stage_key("train", dflash, {"dataset": "a", "vocab": "b"}) != stage_key("train", config,
                                                                                  {"dataset": "a", "vocab": "b"})


def test_a_contender_may_change_nothing_the_shared_stages_read_but_its_shape():
    """SHARED_TRAINING is what the shared stages' keys hold of the sections a contender sets, its shape aside."""
    settable = ("draft", "training.", *(f"serving.{name}" for name in SHAPE_FIELDS), "sweep.")
    read = {name for stage in STAGES.values() if not stage.per_draft for name in stage.key_fields()
            if name.startswith(settable)}
    shape = {f"serving.{name}" for name in SHAPE_FIELDS} | {"sweep.points"}
    assert read - shape == {f"training.{name}" for name in SHARED_TRAINING}


def test_the_three_kinds_config_trains_each_kind_on_the_runs_data_and_serves_dspark_as_its_gamma():
    """configs/tiny-three-kinds-cpu.yaml (measured in docs/algorithms.md, "Contenders"): the run's EAGLE-3 draft, the
    DFlash contender in its blocks, the DSpark contender only as the chain of its gamma; one release that serves all
    three, one data set."""
    config = load_config(THREE_KINDS_CONFIG)
    contenders = contender_configs(config)
    assert [config.draft.algorithm, *(c.draft.algorithm for c in contenders.values())] == ["eagle3", "dflash", "dspark"]
    spark = contenders["dspark"]
    assert spark.serving.shape == DraftShape(spark.draft.dspark.block_size, 1, spark.draft.dspark.block_size + 1)
    assert spark.sweep.points == [] and {c.serving.release for c in contenders.values()} == {"0.5.23"}
    assert {c.data.aux_layers == config.data.aux_layers for c in contenders.values()} == {True}


def test_the_runs_draft_is_served_in_any_of_its_shapes_whatever_its_contenders_take():
    config = load_config(CONTENDERS_CONFIG)
    tree = with_shape(config, DraftShape(3, 4, 8))  # a tree: the DFlash contender could not be served so
    assert tree.serving.shape == DraftShape(3, 4, 8) and tree.contenders is None


def test_the_held_out_continuations_run_as_deep_as_any_drafts_deepest_shape():
    alone = load_config(TINY)
    deeper = with_contenders({"dflash": {**DFLASH, "draft": {**DFLASH["draft"], "dflash": {
        **DFLASH["draft"]["dflash"], "block_size": 8}}, "sweep": {"points": [[7, 1, 8]]}}})
    assert greedy_length(deeper) == greedy_length(alone) + 4  # 7 steps against the run's deepest 3


def test_the_plan_gives_a_contenders_hours_beside_the_runs_without_a_second_baseline(capsys):
    from eagle3 import cli

    assert cli.main(["plan", str(KIMI_CONTENDERS), "--json"]) == 0
    hours = json.loads(capsys.readouterr().out)["hours"]
    stages = {stage["name"]: stage for stage in hours["stages"]}
    assert list(stages) == ["regenerate", "capture", "train", "serve", "sweep", "train dflash", "serve dflash",
                            "sweep dflash", "deploy"]  # one data set, two drafts
    assert "1 server start(s) (candidate): 0.17 h" in [f"{k}: {v:.2f} h" for k, v in
                                                        stages["serve dflash"]["parts"].items()]
    assert 10 < stages["train dflash"]["hours"] < stages["train"]["hours"]  # one forward a block, not 7 TTT steps
    assert hours["total_h"] == pytest.approx(sum(stage["hours"] for stage in stages.values()), abs=0.02)


@pytest.mark.parametrize("contenders, message", [
    ({"dflash": DFLASH | {"training": {"features": "online"}}},
     "contenders.dflash: training.features differ(s) from the run's: a contender trains on the run's data"),
    ({"big": {"serving": {"release": "0.5.23"}}}, "contenders.big.serving: release: a contender is served as the run"),
    ({"eagle3": {}}, "contenders.eagle3: the run's own draft is called eagle3"),
    ({"dflash": {"draft": {"algorithm": "dflash"}}}, "contenders.dflash: draft.algorithm dflash needs "
     "draft.dflash.mask_token_id"),
    ({"dflash": {"draft": DFLASH["draft"]}}, "contenders.dflash: draft.algorithm dflash, sweep.points"),
    ({"x": {"data": {}}}, "contenders.x.data: unknown field; allowed here: draft, serving, sweep, training"),
])
def test_a_contender_that_would_not_train_on_the_runs_data_or_serve_is_refused_by_name(contenders, message):
    with pytest.raises(ConfigError, match="tiny-cpu.yaml: " + message.replace("(", r"\(").replace(")", r"\)")):
        with_contenders(contenders)


def draft(label: str, speedup: float | None, algorithm: str = "eagle3") -> Contender:
    config = load_config(TINY) if algorithm == "eagle3" else contender_configs(with_contenders({"dflash": DFLASH}))[
        "dflash"]
    chosen = {"shape": {"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4}, "speedup": speedup,
              "output_tokens_per_s": None if speedup is None else 100 * speedup,
              "suites": {"heldout": {"accept_length": 2.0 + (speedup or 0)}}}
    return Contender(label, config, Candidate(config.run.dir, "f" * 64, {"accept_length": 2.0},
                                              {"accept_length": 2.0}, chosen))


PASS, FAIL = Decision(True), Decision(False, [Reason("suite-regression", "mtbench fell")])


def test_the_pick_is_the_fastest_draft_the_gate_passes_else_the_fastest_of_all():
    drafts = [draft("eagle3", 1.3), draft("dflash", 1.6, "dflash")]
    assert pick(drafts, [PASS, PASS]) == 1
    assert pick(drafts, [PASS, FAIL]) == 0  # faster, but the per-suite rule rejects it
    assert pick(drafts, [FAIL, FAIL]) == 1  # the gate then rejects the fastest, naming why
    assert pick([draft("eagle3", 1.5), draft("dflash", 1.5, "dflash")], [PASS, PASS]) == 0  # equals: the run's own
    assert pick([draft("eagle3", None), draft("dflash", 0.9, "dflash")], [PASS, PASS]) == 1  # none measured: slowest


def test_the_record_shows_every_draft_side_by_side_and_a_run_without_contenders_clears_it(tmp_path):
    drafts = [draft("eagle3", 1.3), draft("dflash", 1.6, "dflash")]
    record = contenders_record(drafts, [PASS, FAIL], 0)
    assert record["chosen"] == "eagle3" and [row["algorithm"] for row in record["drafts"]] == ["eagle3", "dflash"]
    lines = contenders_text(record)
    assert "eagle3 (eagle3): served accept length 2.000, 3/1/4 at 1.30x" in lines[1] and "<- production" in lines[1]
    assert "dflash (dflash)" in lines[2] and "reject: suite-regression: mtbench fell" in lines[2]
    assert len(lines) == 3 and [c["name"] for c in record["columns"]] == ["eagle3 3/1/4 served", "dflash 3/1/4 served"]
    out = write_contenders(record, tmp_path / "contenders.json")
    assert json.loads(out.read_text())["chosen"] == "eagle3"
    write_contenders(None, out)
    assert not out.exists()


def test_a_run_with_a_dflash_contender_trains_both_on_one_data_set_and_promotes_the_pick(prefect_api,
                                                                                       tmp_path_factory, micro_target):
    """configs/tiny-contenders-cpu.yaml on the micro target: EAGLE-3 and the DFlash contender (2 layers, block 4)."""
    run_dir = tmp_path_factory.mktemp("contenders")
    overrides = micro_run_overrides(run_dir, micro_target) + ["sweep.enabled=true"]  # each draft swept in its shapes
    config = load_config(CONTENDERS_CONFIG, overrides)
    state = eagle3(str(CONTENDERS_CONFIG), overrides, return_state=True)
    assert state.is_completed() and state.name == "Completed", state.message
    record = json.loads((config.stage_dir("bench") / "contenders.json").read_text())
    assert [row["label"] for row in record["drafts"]] == ["eagle3", "dflash"]
    assert all(row["served_accept_length"] > 1 and row["speedup"] > 0 for row in record["drafts"])
    # one no-draft baseline for both: the speedups share their denominator
    assert len({row["baseline_output_tokens_per_s"] for row in record["drafts"]}) == 1
    chosen = next(row for row in record["drafts"] if row["label"] == record["chosen"])
    assert chosen["speedup"] == max(row["speedup"] for row in record["drafts"])  # gate.min_speedup 0: both pass
    version = state.result()
    assert version_algorithm(open_registry(config.registry).manifest(version)) == chosen["algorithm"]
    # one data set: the shared stages ran once, each draft's stages in its own directory
    tasks = [name for name, _, _ in stage_rows(state.state_details.flow_run_id)]
    assert [tasks.count(name) for name in STAGES] == [2 if stage.per_draft else 1 for stage in STAGES.values()], tasks
    dflash = contender_configs(config)["dflash"]
    assert (dflash.run.dir / "train").is_dir() and not (dflash.run.dir / "data").exists()
    lines = summary(state, config, "full", private_api=True).splitlines()
    assert any(line.startswith("  dflash (dflash): served accept length") for line in lines)
    assert any(line.startswith("  eagle3 (eagle3): served accept length") for line in lines)
    assert lines[-1] == f"decision: promoted {version}"
