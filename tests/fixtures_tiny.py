"""The MICRO tiny target, built once per test session (~15 s)."""

import contextlib
import fcntl
import os
import shutil
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

from eagle3.engines.tiny import MICRO, build_tiny_target


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Train test models on one thread: they gain nothing from two, and when other processes share the two
    cores, two OpenMP threads wait on each other (measured: 91 s instead of 15 s for the same MICRO steps)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def once_per_session(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]) -> Path:
    """`build(directory)` once per test session, by whichever pytest-xdist worker asks first: the others wait on a lock
    and share the directory, which tests only read (a target is ~15-30 s of training on one core)."""
    root = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        root = root.parent  # the session's directory, above each worker's own
    out, built = root / name, root / f"{name}.built"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not built.exists():
            shutil.rmtree(out, ignore_errors=True)  # a worker that failed half-way
            with one_torch_thread():
                build(out)
            built.touch()
    return out


@pytest.fixture(scope="session")
def micro_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return once_per_session(tmp_path_factory, "micro-target",
                            lambda out: build_tiny_target(out, MICRO, progress=lambda line: None))
