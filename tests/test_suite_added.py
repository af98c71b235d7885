"""A benchmark suite added to a finished run, as a user adds it (issue 63): the run finished with the held-out prompts
alone, every step by hand; MT-bench is added to benchmark.suites and `eagle3 data regenerate`, `eagle3 data capture`
and `eagle3 simulate` run again. Only the suite's continuations, their features and the replay are made: the training
replies, the training data set and the held-out features, the vocabulary, the draft and its export keep their keys and
their files, and the replay measures the run's own draft on both suites."""

import hashlib
import json

import pytest

from eagle3.cli import main
from eagle3.resolve import load_config
from eagle3.config.suites import MTBENCH
from eagle3.data.capture import HELDOUT_DIR
from eagle3.data.continuations import suites_dir
from eagle3.records.manifest import read_manifest
from eagle3.stages.keys import recorded_key
from eagle3.stages.table import STAGES, StageRun, output_of, record_path
from helpers import TINY, micro_overrides, write_heldout

pytestmark = pytest.mark.usefixtures("one_thread")

KEPT = ("regenerate", "capture", "vocab", "train", "export")  # the stages a suite must not run again
SMALL = ["data.num_samples=8", "training.max_steps=2", "training.batch_size=4", "training.seq_len=96",
         "training.warmup_steps=1", "training.eval_every=2", "training.save_every=2", "training.ttt_steps=2",
         "benchmark.num_prompts=2", "benchmark.max_new_tokens=8", "sweep.points=[]", "serving.context_length=512"]
WITH_MTBENCH = f"benchmark.suites=[heldout, {{name: {MTBENCH}, num_prompts: 2}}]"


def step(overrides: list[str], *command: str) -> int:
    return main([*command, "--config", str(TINY), *[f"--set={o}" for o in overrides]])


def files_of(config, stage: str) -> dict[str, tuple[str, int]]:
    """{file: (sha256, mtime)} of what a stage made (the capture stage's held-out features too) and its marker."""
    places = [output_of(config, stage)] + ([config.stage_dir("data") / HELDOUT_DIR] if stage == "capture" else [])
    found = {}
    for place in places:
        for path in sorted(place.rglob("*")) if place.is_dir() else [place]:
            if path.is_file():
                found[str(path)] = (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns)
    return found


@pytest.fixture(scope="module")
def finished(micro_target, tmp_path_factory):
    """A micro run finished by hand with benchmark.suites at its default, the held-out prompts alone."""
    root = tmp_path_factory.mktemp("suite-added")
    overrides = micro_overrides(root / "run", micro_target) + SMALL + [
        f"registry.path={root / 'registry'}", f"production.state_dir={root / 'production'}",
        f"serving.log_dir={root / 'logs'}"]
    for command in (("data", "regenerate"), ("data", "capture"), ("vocab", "build"), ("train",), ("export",),
                    ("simulate",)):
        assert step(overrides, *command) == 0, command
    return overrides


def test_a_suite_added_to_a_finished_run_measures_its_own_draft_without_retraining(finished, capsys):
    config = load_config(TINY, finished)
    before = {stage: (recorded_key(config, stage), files_of(config, stage)) for stage in KEPT}
    simulated = json.loads(record_path(config, "simulated").read_text())
    assert list(simulated["suites"]) == ["heldout"]
    capsys.readouterr()

    added = [*finished, WITH_MTBENCH]
    # simulate first: the suite's continuations are not made yet, and the step says which steps make them
    assert step(added, "simulate") == 2
    refused = capsys.readouterr().err
    assert "(the suites stage's output) was made for other inputs (config.suites: [] -> " in refused
    assert refused.strip().endswith("run `eagle3 data regenerate`, then `eagle3 data capture` with these settings "
                                    "first, or `eagle3 run`")
    assert json.loads(record_path(config, "simulated").read_text()) == simulated  # left as it was
    for command in (("data", "regenerate"), ("data", "capture")):
        assert step(added, *command) == 0, command
    out = capsys.readouterr().out
    for stage in ("regenerate", "capture"):
        assert f"{stage}: {output_of(config, stage)} was finished under this very key" in out
    assert step(added, "simulate") == 0
    assert f"simulate: {output_of(config, 'simulate')} was finished" not in capsys.readouterr().out

    config = load_config(TINY, added)
    after = {stage: (recorded_key(config, stage), files_of(config, stage)) for stage in KEPT}
    assert after == before  # no stage made again: the same keys, the same files, never rewritten
    remeasured = json.loads(record_path(config, "simulated").read_text())
    assert remeasured["checkpoint"] == str(output_of(config, "export"))  # the run's own draft
    assert list(remeasured["suites"]) == ["heldout", MTBENCH]
    assert remeasured["suites"][MTBENCH]["requests"] == 4  # two MT-bench questions, two turns each
    # the held-out suite replayed over the same sequences by the same draft: the same figures as before
    assert remeasured["suites"]["heldout"] == simulated["suites"]["heldout"]
    assert {stage for stage in STAGES if stage not in KEPT} == {"suites", "suite_features", "simulate"}


def test_the_suites_stage_starts_no_server_when_its_continuations_are_current(tmp_path, micro_target):
    """Made again after the training replies changed (its upstream), the suites stage finds its continuations made
    for the same questions and lengths: it starts none of data.nodes' servers (here, one that could not start)."""
    overrides = micro_overrides(tmp_path / "run", micro_target) + ["benchmark.num_prompts=2",
                                                                   "benchmark.max_new_tokens=8", WITH_MTBENCH]
    write_heldout(load_config(TINY, overrides))  # every suite's continuations, by the local engine
    nodes = load_config(TINY, overrides + ["data.generator=sglang", "data.nodes=[127.0.0.1:1]"])
    lines = []
    STAGES["suites"].runner(StageRun(nodes, nodes.run.dir / "config.resolved.yaml", lines.append))
    assert read_manifest(suites_dir(nodes.run))["greedy"]["suites"] == {MTBENCH: 4}
    assert lines == []
