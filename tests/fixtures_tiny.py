"""The MICRO tiny target: built once per machine for the code and libraries that make it (~45 s on one core), kept
in a cache, and copied into each test session."""

import contextlib
import fcntl
import hashlib
import os
import shutil
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest
import tokenizers
import torch
import transformers

import eagle3.runtime.tiny
import eagle3.records.manifest
from eagle3.runtime.tiny import MICRO, TinyRecipe, build_tiny_target, of_family

# Test targets are pure functions of the builder's code, its recipe and the library versions (test_tiny_target
# builds MICRO again and compares it bit for bit with the session's copy); EAGLE3_TEST_TARGETS moves the cache.
TARGET_CACHE = Path(os.environ.get("EAGLE3_TEST_TARGETS", Path.home() / ".cache" / "eagle3" / "test-targets"))


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


def build_key(recipe: str, *modules) -> str:
    """What a test target depends on: its recipe, the sources of the modules that build and describe it, and the
    versions of Python, torch, transformers and tokenizers."""
    digest = hashlib.sha256(recipe.encode())
    for module in modules:
        digest.update(Path(module.__file__).read_bytes())
    for version in (sys.version, torch.__version__, transformers.__version__, tokenizers.__version__):
        digest.update(version.encode())
    return digest.hexdigest()[:16]


def cached_build(out: Path, key: str, build: Callable[[Path], object]) -> None:
    """Copy the cached build for `key` to `out`, or build it there and cache it (a whole directory, or nothing)."""
    cached = TARGET_CACHE / key
    if not cached.is_dir():
        shutil.rmtree(out, ignore_errors=True)  # a worker that failed half-way
        with one_torch_thread():
            build(out)
        partial = TARGET_CACHE / f".{key}.{os.getpid()}"
        shutil.copytree(out, partial)
        with contextlib.suppress(OSError):  # another session cached the same build meanwhile
            partial.rename(cached)
        shutil.rmtree(partial, ignore_errors=True)
        return
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(cached, out)


def once_per_session(tmp_path_factory: pytest.TempPathFactory, name: str, key: str,
                     build: Callable[[Path], object]) -> Path:
    """The target `name` for this test session, by whichever pytest-xdist worker asks first (the others wait on a
    lock and share the directory, which tests only read): from the cache, or `build(directory)` (a target is ~15-45 s
    of training on one core) once per `key` (build_key)."""
    root = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        root = root.parent  # the session's directory, above each worker's own
    out, built = root / name, root / f"{name}.built"
    TARGET_CACHE.mkdir(parents=True, exist_ok=True)
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not built.exists():
            cached_build(out, f"{name}-{key}", build)
            built.touch()
    return out


def micro_target_of(tmp_path_factory: pytest.TempPathFactory, family: str) -> Path:
    """The MICRO recipe as `family`'s architecture (~35 s to build on one core), once per machine."""
    recipe = of_family(MICRO, family)
    return recipe_target(tmp_path_factory, recipe, "micro-target" if family == MICRO.family else f"{recipe.name}-target")


def recipe_target(tmp_path_factory: pytest.TempPathFactory, recipe: TinyRecipe, name: str | None = None) -> Path:
    """The target `recipe` builds, once per machine."""
    key = build_key(repr(recipe), eagle3.runtime.tiny, eagle3.records.manifest)
    return once_per_session(tmp_path_factory, name or f"{recipe.name}-target", key,
                            lambda out: build_tiny_target(out, recipe, progress=lambda line: None))


@pytest.fixture(scope="session")
def micro_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return micro_target_of(tmp_path_factory, MICRO.family)
