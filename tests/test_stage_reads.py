"""Each stage's key covers every run-directory file it reads: the table's stages run by hand on the micro target, each
runner's file opens recorded (tests/read_audit.py: audit events, safetensors' Rust opens through wrappers, and the
trainer's own process through a sitecustomize), and every file a stage reads outside what it makes itself must be
pinned by the fingerprint of an upstream output its key names - its manifest, or a file whose sha256 that manifest
records. A key holds its upstreams' fingerprints, not their keys: a read two stages up counts only where an output
records the fingerprint it was made from (`keyed_files` follows such chains: the vocab map's manifest records the
regenerated data's, which pins the held-out continuations the trainer's acceptance replay reads; the other suites'
continuations are the suites stage's, which only the replays read).

Dropping any edge of the table makes the audit name the stage and the file (the parametrised test), and the bug that
asked for this - `eagle3 simulate` keeping its result after `eagle3 data regenerate` made other continuations - ends
in a refusal that names the steps to run."""

import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from eagle3.config import RESOLVED_FILE, resolved_config_file
from eagle3.data.continuations import suites_dir
from eagle3.resolve import load_config
from eagle3.data.regenerate import GREEDY_FILE, regen_dir
from eagle3.stages.keys import done, stage_fingerprint
from eagle3.stages.run import StaleUpstream, run_by_hand
from eagle3.stages.table import STAGES, under_run
from helpers import TINY, micro_overrides
from read_audit import (LOG_ENV, READ, ROOT_ENV, WRITE, Recording, audit, child_events, child_site, foreign_reads,
                        keyed_files, recording, safetensors_patches)

pytestmark = pytest.mark.usefixtures("one_thread")

EDGES = [(stage.name, source) for stage in STAGES.values() for source in stage.upstream.values()]
QUESTION = '{"prompt": "What does the len() function return?"}\n'


def quiet(line: str) -> None:
    """Stage logs are not what these tests look at."""


def tiny_run(run_dir: Path, target: Path, elsewhere: Path) -> list[str]:
    """The micro target's smallest whole run: a few samples, two training steps with the acceptance replay (so the
    trainer reads the held-out continuations), serving's shape alone, a suite of our own besides the held-out prompts
    (its file outside run.dir, as the registry and the servers' places)."""
    suite = elsewhere / "mine.jsonl"
    suite.write_text(QUESTION)
    return micro_overrides(run_dir, target) + [
        "data.num_samples=8", "training.max_steps=2", "training.batch_size=4", "training.seq_len=96",
        "training.warmup_steps=1", "training.eval_every=2", "training.save_every=2", "training.ttt_steps=2",
        "benchmark.num_prompts=2", "benchmark.max_new_tokens=8", "sweep.points=[]",
        f"benchmark.suites=[heldout, {{name: mine, path: {suite}}}]", f"registry.path={elsewhere / 'registry'}",
        f"production.state_dir={elsewhere / 'production'}", f"serving.log_dir={elsewhere / 'logs'}"]


def recorded(runner, into: Recording):
    """The stage's runner, recording while it runs (its key, marker and upstream fingerprints are the machinery's)."""
    def run(stage_run) -> None:
        with recording(into):
            runner(stage_run)
    return run


@pytest.fixture(scope="module")
def audited(micro_target, tmp_path_factory):
    """Every stage of the table run by hand, in order, in a fresh run directory, with its runner's reads and writes
    recorded (the trainer's process too); then the files each stage's fingerprint pins."""
    root = tmp_path_factory.mktemp("stage-reads")
    run_dir, child_log = root / "run", root / "child-events.tsv"
    overrides = tiny_run(run_dir, micro_target, root)
    config = load_config(TINY, overrides)
    resolved = resolved_config_file(config)
    events = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(LOG_ENV, str(child_log))
        patch.setenv(ROOT_ENV, str(run_dir))
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (str(child_site(root / "site")),
                                                                 os.environ.get("PYTHONPATH")))))
        for module, name, wrapper in safetensors_patches():
            patch.setattr(module, name, wrapper)
        for name, stage in list(STAGES.items()):
            made = Recording(run_dir)
            patch.setitem(STAGES, name, replace(stage, runner=recorded(stage.runner, made)))
            child_log.unlink(missing_ok=True)
            run_by_hand(name, config, resolved, quiet)
            events[name] = made.events + child_events(child_log)
        pinned = {}
        for name in STAGES:
            with recording(Recording(run_dir)) as made:
                stage_fingerprint(config, name)
            pinned[name] = keyed_files([Path(path) for kind, path in made.events if kind == READ], run_dir)
    writers = {Path(path): name for name, made in events.items() for kind, path in made if kind == WRITE}
    # the run's resolved config is the config itself: the trainer reads it, and every field of it is in some stage's
    # key or listed as operational (test_stages.py)
    reads = {name: [path for path in foreign_reads(made, own_places(config, name)) if path != run_dir / RESOLVED_FILE]
             for name, made in events.items()}
    return dict(config=config, overrides=overrides, run_dir=run_dir, events=events, reads=reads, pinned=pinned,
                writers=writers, suite=root / "mine.jsonl")


def own_places(config, name: str) -> list[Path]:
    stage = STAGES[name]
    return [under_run(config, place) for place in (stage.output, *stage.resumes)]


def problems(audited) -> list[str]:
    return audit(STAGES, audited["reads"], audited["pinned"], audited["writers"], audited["run_dir"])


def test_every_run_directory_file_a_stage_reads_is_pinned_by_its_key(audited):
    assert problems(audited) == []
    run_dir, events = audited["run_dir"], audited["events"]
    # the recording sees what it must: the trainer's process, safetensors' Rust opens, the continuations simulate reads
    assert any(kind == READ and path.endswith(".safetensors") and "/data/hidden/" in path
               for kind, path in events["train"]), events["train"]
    greedy = regen_dir(audited["config"].run) / GREEDY_FILE
    assert (READ, str(greedy)) in events["simulate"] and (READ, str(greedy)) in events["train"]
    assert greedy in audited["pinned"]["vocab"]  # the train stage's key reaches it through the vocab map's manifest
    # our suite's continuations: read by its features' capture and the replay, never by training
    suite = suites_dir(audited["config"].run) / GREEDY_FILE
    assert (READ, str(suite)) in events["simulate"] and (READ, str(suite)) in events["suite_features"]
    assert not any(suite in audited["pinned"][name] for name in ("regenerate", "capture", "vocab", "train", "export"))
    assert not any(path == str(suite) for name in ("capture", "vocab", "train", "export") for _, path in events[name])
    assert {name for name, reads in audited["reads"].items() if reads} == {stage for stage, _ in EDGES}, \
        {name: [str(path.relative_to(run_dir)) for path in reads] for name, reads in audited["reads"].items()}


@pytest.mark.parametrize(("stage", "source"), EDGES, ids=[f"{stage}-{source}" for stage, source in EDGES])
def test_an_upstream_left_out_of_the_table_is_named_with_the_file_read(audited, monkeypatch, stage, source):
    """Each edge is needed: without it the stage reads a file of that upstream that its key no longer pins."""
    kept = {name: upstream for name, upstream in STAGES[stage].upstream.items() if upstream != source}
    monkeypatch.setitem(STAGES, stage, replace(STAGES[stage], upstream=kept))
    found = problems(audited)
    assert found and all(problem.startswith(f"{stage} reads ") for problem in found), found
    assert any(f"(written by {source})" in problem for problem in found), found


def test_a_step_by_hand_after_new_continuations_is_refused_naming_the_steps_to_run(audited, tmp_path):
    """The bug: `eagle3 data regenerate` made other continuations (here: our suite's file holds another question,
    at the same path, so no setting in simulate's key changed), and `eagle3 simulate` kept its result. Now simulate's
    key holds the suites stage's output, and the step refuses the outputs made from the old continuations, naming the
    step to run - and only that one: the training data, the vocabulary, the draft and its export stay as they are.
    (This test is the suite file's last reader: it rewrites it.)"""
    run_dir = shutil.copytree(audited["run_dir"], tmp_path / "run", symlinks=True)
    config = load_config(TINY, [*audited["overrides"], f"run.dir={run_dir}"])

    def is_done(stage: str) -> bool:
        upstream = {name: stage_fingerprint(config, source) for name, source in STAGES[stage].upstream.items()}
        return done(stage, config, upstream)

    assert is_done("simulate")  # the copy is the same run: finished, kept
    audited["suite"].write_text(QUESTION.replace("len()", "sorted()"))
    assert not is_done("suites")
    run_by_hand("suites", config, resolved_config_file(config), quiet)
    assert not is_done("simulate")  # its key follows the continuations
    assert all(is_done(stage) for stage in ("regenerate", "capture", "vocab", "train", "export"))
    with pytest.raises(StaleUpstream) as refused:
        run_by_hand("simulate", config, resolved_config_file(config), quiet)
    assert str(refused.value).startswith(f"simulate: {run_dir / 'data' / 'suite-features'} (the suite_features "
                                         "stage's output) was made for other inputs (upstream.suites: ")
    assert str(refused.value).endswith("run `eagle3 data capture` with these settings first, or `eagle3 run`")
