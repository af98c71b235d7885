"""Run directories: where retrain runs live, the mark of a run in progress, and the retention policy that removes
old retrain runs (`run.keep_runs`) after a promotion.

A retrain runs in `<run.dir>/retrain-<UTC timestamp>`; the configured run.dir is their base. A run in progress
holds a shared flock on `<run dir>/.run-lock` for as long as it runs. The pruner removes a directory only while it
holds the exclusive lock, so a running run is never removed, and a crashed run leaves no stale mark: the kernel
drops the locks of a process that ends. A removed run is first renamed to a hidden name, so a half-removed run
never looks like a run; the next prune finishes what an interrupted one left.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import yaml
from pydantic import ValidationError

from eagle3.config import RESOLVED_FILE
from eagle3.config.deployment import RegistrySection
from eagle3.data.storage import human_bytes
from eagle3.errors import Eagle3Error
from eagle3.registry.registry import registry_location

Log = Callable[[str], None]
RETRAIN_NAME = re.compile(r"retrain-\d{8}T\d{6}Z")
LOCK_FILE = ".run-lock"
TRASH_SUFFIX = ".removing"


class RunDirBeingRemoved(Eagle3Error):
    """A run started in a directory that the retention policy is removing at that moment."""


def retrain_dir(base: Path, when: float | None = None) -> Path:
    """A new retrain run's directory under `base`, named after the UTC time (now by default): names sort by age."""
    return Path(base) / time.strftime("retrain-%Y%m%dT%H%M%SZ", time.gmtime(when))


def is_retrain_dir(path: Path) -> bool:
    return RETRAIN_NAME.fullmatch(Path(path).name) is not None


def runs_base(run_dir: Path) -> Path:
    """The directory holding the retrain runs: a retrain's parent, else the run directory itself (a full run of
    the configured run.dir, whose retrains are its children)."""
    run_dir = Path(run_dir)
    return run_dir.parent if is_retrain_dir(run_dir) else run_dir


@contextlib.contextmanager
def run_in_use(run_dir: Path, log: Log = print) -> Iterator[None]:
    """Mark `run_dir` in use for the block: a shared lock, so several processes may use one directory, and only
    the pruner's exclusive lock conflicts with it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / LOCK_FILE, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirBeingRemoved(f"{run_dir}: the retention of old retrain runs (run.keep_runs) is removing this "
                                     "directory; choose another run.dir") from None
        except OSError as err:  # a file system without flock (ENOLCK, EOPNOTSUPP): the run goes on unmarked
            log(f"{run_dir}: cannot be marked in use ({err}); retention removes no run directory it cannot lock, "
                "so none on this file system")
        yield  # closing the file releases the lock


def retrain_runs(base: Path) -> list[Path]:
    """The retrain run directories under `base`, oldest first (the UTC timestamp in the name orders them)."""
    base = Path(base)
    if not base.is_dir():
        return []
    return sorted(p for p in base.iterdir() if is_retrain_dir(p) and p.is_dir() and not p.is_symlink())


def registry_of(run_dir: Path) -> str | None:
    """The registry location a run was made for, from its resolved config; None when it has none (it stopped
    before its config was resolved) or the file cannot be read as one."""
    try:
        raw = yaml.safe_load((Path(run_dir) / RESOLVED_FILE).read_text())
        return registry_location(RegistrySection.model_validate(raw["registry"]))
    except (OSError, yaml.YAMLError, TypeError, KeyError, ValidationError):
        return None


def prune_runs(base: Path, keep: int, registry: str, protected: Iterable[Path], log: Log = print) -> list[dict]:
    """Remove the retrain runs of `registry` under `base` older than its newest `keep`, except the `protected`
    directories and any run in progress. Runs of another registry, and runs without a resolved config, are
    left alone: their own registry's retention decides. Returns the removed runs, oldest first, as
    {"path", "bytes"}."""
    finish_interrupted(base, log)
    protected = {Path(p).resolve() for p in protected}
    runs = retrain_runs(base)
    ours = [run for run in runs if registry_of(run) == registry]
    if len(ours) < len(runs):
        log(f"retention: leaving {len(runs) - len(ours)} retrain run(s) under {base} alone: another registry's, or "
            "without a resolved config")
    removed = []
    for run in ours[:max(len(ours) - keep, 0)]:
        if run.resolve() in protected:
            log(f"retention: keeping {run}: it built production, or it is this run")
            continue
        entry = remove_run(run, log)
        if entry is not None:
            removed.append(entry)
    log(f"retention: {len(removed)} run director{'y' if len(removed) == 1 else 'ies'} removed under {base} "
        f"(run.keep_runs {keep})")
    return removed


def remove_run(run: Path, log: Log) -> dict | None:
    """Remove `run` unless a process holds its lock; None when it is kept."""
    trash = run.with_name(f".{run.name}{TRASH_SUFFIX}")
    try:
        with open(run / LOCK_FILE, "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            size = tree_bytes(run)
            os.rename(run, trash)  # under the lock: no run can start in it between the check and the move
    except BlockingIOError:
        log(f"retention: keeping {run}: a run is using it (it holds {run / LOCK_FILE})")
        return None
    except OSError as err:  # cannot lock (a file system without flock) or move it: keeping it is the safe side
        log(f"retention: keeping {run}: {err}")
        return None
    log(f"retention: removing {run} ({human_bytes(size)})")
    delete_tree(trash, log)
    return {"path": str(run), "bytes": size}


def finish_interrupted(base: Path, log: Log) -> None:
    """Delete what an interrupted prune left behind (hidden, renamed runs)."""
    for trash in sorted(Path(base).glob(f".retrain-*{TRASH_SUFFIX}")):
        log(f"retention: finishing the removal of {trash}, left by an interrupted prune")
        delete_tree(trash, log)


def delete_tree(trash: Path, log: Log) -> None:
    try:
        shutil.rmtree(trash)
    except OSError as err:  # the run is already out of sight; its hidden remains wait for the next prune
        log(f"retention: {trash} only partly deleted ({err}); the next prune tries again")


def tree_bytes(path: Path) -> int:
    """The size of the files under `path` (symbolic links not followed)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            total += os.lstat(os.path.join(root, name)).st_size
    return total
