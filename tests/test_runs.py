"""Retention of retrain run directories (run.keep_runs): the newest runs stay, and so do the run that built
production, runs in progress (their lock, which a crash releases), other registries' runs and anything that is
not a retrain run; what is removed is returned, logged and shown in the decision report."""

import fcntl
import subprocess
import sys

import pytest

from eagle3.registry.samples import SampleStore
from eagle3.registry.store import LocalStore
from eagle3.config import RESOLVED_FILE
from eagle3.resolve import load_config
from eagle3.data.storage import human_bytes
from eagle3.deployment.promotion import prune_after_promotion
from eagle3.report import decision_report
from eagle3.runs import (
    LOCK_FILE,
    RunDirBeingRemoved,
    is_retrain_dir,
    prune_runs,
    retrain_dir,
    retrain_runs,
    run_in_use,
    runs_base,
)
from helpers import TINY, make_run


@pytest.fixture
def registry(tmp_path):
    return str((tmp_path / "registry").resolve())


def test_retrain_directories_are_named_by_utc_time_and_sit_under_the_base(tmp_path):
    run = retrain_dir(tmp_path, when=1704067200)
    assert run == tmp_path / "retrain-20240101T000000Z" and is_retrain_dir(run)
    assert runs_base(run) == tmp_path and runs_base(tmp_path) == tmp_path  # a full run is the base itself
    assert not is_retrain_dir(tmp_path / "retrain-latest")


def test_the_newest_keep_runs_stay_and_the_older_are_removed_and_logged(tmp_path, registry):
    runs = [make_run(tmp_path, day, registry, size=1000 + day) for day in range(5)]
    sizes = [1000 + day + (run / RESOLVED_FILE).stat().st_size for day, run in enumerate(runs)]
    lines = []
    removed = prune_runs(tmp_path, 3, registry, protected=[], log=lines.append)
    assert removed == [{"path": str(runs[0]), "bytes": sizes[0]}, {"path": str(runs[1]), "bytes": sizes[1]}]
    assert retrain_runs(tmp_path) == runs[2:]
    assert sorted(p.name for p in tmp_path.iterdir()) == [r.name for r in runs[2:]]  # no hidden remains
    assert any(f"removing {runs[0]} ({human_bytes(sizes[0])})" in line for line in lines), lines
    assert prune_runs(tmp_path, 3, registry, protected=[], log=lines.append) == []


def test_the_run_that_built_production_and_this_run_are_never_removed(tmp_path, registry):
    runs = [make_run(tmp_path, day, registry) for day in range(4)]
    removed = prune_runs(tmp_path, 1, registry, protected=[runs[0], runs[3]], log=print)
    assert [r["path"] for r in removed] == [str(runs[1]), str(runs[2])]
    assert retrain_runs(tmp_path) == [runs[0], runs[3]]


def test_a_run_in_progress_is_never_removed_even_by_this_process(tmp_path, registry):
    old, middle, _ = [make_run(tmp_path, day, registry) for day in range(3)]
    lines = []
    with run_in_use(old):  # flock conflicts between two opens of the file, also within one process
        assert [r["path"] for r in prune_runs(tmp_path, 1, registry, protected=[], log=lines.append)] == [str(middle)]
    assert old.is_dir() and any(f"keeping {old}: a run is using it" in line for line in lines), lines
    assert [r["path"] for r in prune_runs(tmp_path, 1, registry, protected=[], log=print)] == [str(old)]


def test_a_crashed_run_leaves_no_stale_mark(tmp_path, registry):
    old, _ = [make_run(tmp_path, day, registry) for day in range(2)]
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_SH); "
         "print('held', flush=True); time.sleep(120)", str(old / LOCK_FILE)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert prune_runs(tmp_path, 1, registry, protected=[], log=print) == []
    finally:
        holder.kill()  # a crash: no clean-up code runs, the kernel drops the lock
        holder.wait()
    assert [r["path"] for r in prune_runs(tmp_path, 1, registry, protected=[], log=print)] == [str(old)]


def test_a_run_cannot_start_in_a_directory_being_removed(tmp_path):
    run = tmp_path / "retrain-20240101T000000Z"
    run.mkdir()
    with open(run / LOCK_FILE, "a") as pruner:
        fcntl.flock(pruner, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(RunDirBeingRemoved, match="run.keep_runs.*choose another run.dir"):
            with run_in_use(run):
                pass


def test_only_this_registrys_retrain_runs_are_candidates(tmp_path, registry):
    ours = [make_run(tmp_path, day, registry) for day in (0, 5)]
    other = make_run(tmp_path, 1, tmp_path / "other-registry")
    unresolved = make_run(tmp_path, 2, None)  # stopped before its config was resolved, or another tool's
    (tmp_path / "retrain-latest").mkdir()
    (tmp_path / "retrain-20230101T000000Z").write_text("a file, not a run")
    (tmp_path / "retrain-20230102T000000Z").symlink_to(other, target_is_directory=True)
    (tmp_path / "registry").mkdir()
    lines = []
    removed = prune_runs(tmp_path, 1, registry, protected=[], log=lines.append)
    assert [r["path"] for r in removed] == [str(ours[0])]
    assert other.is_dir() and unresolved.is_dir() and (tmp_path / "retrain-latest").is_dir()
    assert (tmp_path / "retrain-20230101T000000Z").is_file() and (tmp_path / "registry").is_dir()
    assert any("leaving 2 retrain run(s)" in line for line in lines), lines


def test_the_remains_of_an_interrupted_prune_are_deleted(tmp_path, registry):
    remains = tmp_path / ".retrain-20240101T000000Z.removing"
    (remains / "data").mkdir(parents=True)
    lines = []
    assert prune_runs(tmp_path, 3, registry, protected=[], log=lines.append) == []
    assert not remains.exists() and any("interrupted prune" in line for line in lines)


class FakeRegistry:
    """Production's version and manifest as given; the store is a real one, where the sample store lives."""

    def __init__(self, production, manifest, store=None):
        self.production, self.manifest_, self.store = production, manifest, store

    def production_version(self):
        return self.production

    def manifest(self, version):
        assert version == self.production
        return self.manifest_


def test_after_a_promotion_the_base_of_this_retrain_is_pruned_sparing_productions_builder(tmp_path):
    config = load_config(TINY, [f"run.dir={tmp_path}", f"registry.path={tmp_path / 'registry'}", "run.keep_runs=1"])
    registry = str((tmp_path / "registry").resolve())
    runs = [make_run(tmp_path, day, registry) for day in range(4)]
    this = config.model_copy(update={"run": config.run.model_copy(update={"dir": runs[3]})})
    store = LocalStore(tmp_path / "registry")
    for run in runs:  # each run published its replies; the third's were also taken by the fourth
        SampleStore(store, "a" * 32).publish([{"id": run.name}], str(run.resolve()))
    list(SampleStore(store, "a" * 32).take([runs[2].name], str(runs[3].resolve())))
    built = FakeRegistry("v1", {"config": {"run": {"dir": str(runs[0])}}}, store)
    removed = prune_after_promotion(this.run, this.registry, built, print)
    assert [r["path"] for r in removed] == [str(runs[1]), str(runs[2])]
    assert retrain_runs(tmp_path) == [runs[0], runs[3]]
    index, _ = SampleStore(store, "a" * 32).index()  # only the second run's replies went with it
    assert sorted(index["entries"]) == sorted(run.name for run in (runs[0], runs[2], runs[3]))


def test_a_production_manifest_without_its_run_directory_removes_nothing(tmp_path):
    config = load_config(TINY, [f"run.dir={tmp_path}", f"registry.path={tmp_path / 'registry'}", "run.keep_runs=1"])
    runs = [make_run(tmp_path, day, (tmp_path / "registry").resolve()) for day in range(3)]
    lines = []
    assert prune_after_promotion(config.run, config.registry, FakeRegistry("v1", {"metrics": {}}), lines.append) == []
    assert retrain_runs(tmp_path) == runs and "names no run directory" in lines[0]


def test_the_decision_report_lists_the_removed_runs():
    args = ("promoted", "v2", [], None, "/reg", "v1", "v2", None, None)
    text = decision_report(*args, [{"path": "/runs/retrain-20240101T000000Z", "bytes": 2_500_000}], 3)
    assert "## Run directories removed (run.keep_runs 3)\n\n- `/runs/retrain-20240101T000000Z` (2.5 MB)" in text
    assert decision_report(*args, [], 3).endswith("## Run directories removed (run.keep_runs 3)\n\nnone")
    assert "Run directories removed" not in decision_report(*args)  # a rollback: the retention did not run
