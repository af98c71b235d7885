"""The conformance suites: SGLang's own code, speculators' (marker `speculators`) and SpecForge's (marker
`specforge`), from their published releases, run against ours.

Selected with `make conformance` (`pytest -m "sglang or sglang_server or speculators or specforge"
tests/conformance`); the default `pytest` run leaves them out (they fetch ~1.8 GB once into the cache, see
releases.py). Each release's probe runs once per test module, in that release's child process; tests compare its
answers with the project's code.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import releases  # noqa: E402


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        others = {"sglang_server", "speculators", "specforge", "vllm"} & set(item.keywords)
        if Path(item.fspath).is_relative_to(here) and not others:
            item.add_marker(pytest.mark.sglang)


def release_runner(package: str):
    """run(release, probe, job) -> the probe's answer, from one child process per release of `package`; skips
    when the package index is unreachable. A generator: the children close when the session ends."""
    children: dict[str, releases.ReleaseProcess] = {}
    answers: dict = {}

    def run(release: str, probe: str, job: dict) -> dict:
        key = (release, probe, repr(job))
        if key not in answers:
            if release not in children:
                try:
                    children[release] = releases.ReleaseProcess(release, package=package)
                except releases.IndexUnreachable as err:
                    pytest.skip(f"{package} {release} cannot be fetched: {err}")
            answers[key] = children[release].run(probe, job)
        return answers[key]

    yield run
    for child in children.values():
        child.close()


@pytest.fixture(scope="session")
def run_sglang():
    yield from release_runner("sglang")


@pytest.fixture(scope="session")
def run_speculators():
    yield from release_runner("speculators")


@pytest.fixture(scope="session")
def run_specforge():
    yield from release_runner("specforge")
