"""The MICRO tiny target, built once per test session (~15 s)."""

import contextlib
from pathlib import Path
from typing import Iterator

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


@pytest.fixture(scope="session")
def micro_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    with one_torch_thread():
        return build_tiny_target(tmp_path_factory.mktemp("micro-target"), MICRO, progress=lambda line: None)
