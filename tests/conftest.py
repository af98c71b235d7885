import json
import os
import sys
from pathlib import Path

# Wherever Prefect starts (docs/pipeline.md): its first start migrates a fresh database; no network for telemetry.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

import pytest
from xdist.scheduler import LoadFileScheduling

sys.path.insert(0, str(Path(__file__).parent))

from drafts import TARGET_LAYERS, TARGET_VOCAB, write_draft  # noqa: E402
from fixtures_tiny import micro_target  # noqa: E402,F401  (registered here so the session builds it once)
from kimi_target import kimi_target  # noqa: E402,F401


# pytest-xdist (`--dist loadfile`, the Makefile's sessions) hands each unit of tests whole to one worker, in
# collection order: the longest units start first, so no worker ends the session alone on one of them. A unit is a
# test file (its module fixtures built once), except that the files of SGLang's release children are one unit: the
# children are session fixtures, started once per worker that asks (~15 s each, nine releases). That unit goes second:
# the first worker builds the micro target (~45 s, tests/fixtures_tiny.py) and the second, which needs no target
# there, would otherwise wait for it.
RELEASE_CHILD_FILES = ("conformance/test_aux_ids.py", "conformance/test_counting.py", "conformance/test_families.py",
                       "conformance/test_features.py", "conformance/test_loader.py", "conformance/test_mla_draft.py",
                       "conformance/test_server_args.py",
                       "conformance/test_telemetry.py")
LONGEST_FILES = ("conformance/test_eagle3_server.py", *RELEASE_CHILD_FILES, "test_deployment_e2e.py",
                 "conformance/test_plain_server.py", "test_flow.py", "test_stop.py", "test_train_launch.py",
                 "test_train.py", "test_launch.py")
HERE = Path(__file__).parent


def tests_path(item) -> str:
    return Path(item.fspath).relative_to(HERE).as_posix()


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(tests_path(item), len(rank)))  # stable
    strays = sorted({tests_path(item) for item in items
                     if "run_sglang" in item.fixturenames and tests_path(item) not in RELEASE_CHILD_FILES})
    if strays:
        raise pytest.UsageError(f"{', '.join(strays)} use SGLang's release children (run_sglang): add them to "
                                "RELEASE_CHILD_FILES in tests/conftest.py, so that one worker starts the children")


class FilesSharingChildren(LoadFileScheduling):
    """--dist loadfile with the release children's files as one unit (xdist's loadgroup cannot: pytest 9.2 no
    longer reads the group xdist writes into a test's id)."""

    def _split_scope(self, nodeid: str) -> str:
        path = (self.config.rootpath / super()._split_scope(nodeid)).relative_to(HERE).as_posix()
        return "SGLang's release children" if path in RELEASE_CHILD_FILES else path


def pytest_xdist_make_scheduler(config, log):
    return FilesSharingChildren(config, log) if config.getvalue("dist") == "loadfile" else None


def write_target(path: Path, layers: int = TARGET_LAYERS, hidden: int = 32, vocab: int = TARGET_VOCAB,
                 architecture: str = "LlamaForCausalLM") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": [architecture], "num_hidden_layers": layers, "hidden_size": hidden, "vocab_size": vocab}
    (path / "config.json").write_text(json.dumps(config))
    return path


def write_data_manifest(path: Path, aux_layers: list[int], layers: int = TARGET_LAYERS, family: str = "llama",
                        engine: str = "local", engine_release: str | None = None) -> Path:
    manifest = {
        "kind": "dataset",
        "target": {"family": family, "num_hidden_layers": layers, "hidden_size": 32, "vocab_size": TARGET_VOCAB},
        "capture": {"aux_layers": aux_layers, "last_hidden": "post_norm", "engine": engine,
                    "engine_release": engine_release},
    }
    path.write_text(json.dumps(manifest))
    return path


@pytest.fixture
def target_dir(tmp_path: Path) -> Path:
    return write_target(tmp_path / "target")


@pytest.fixture
def native_draft(tmp_path: Path) -> Path:
    return write_draft(tmp_path / "native")


@pytest.fixture
def sglang_draft(tmp_path: Path) -> Path:
    return write_draft(tmp_path / "sglang", layout="sglang", release="0.5.13")


@pytest.fixture(scope="session")
def micro_data(tmp_path_factory, micro_target):
    """The trainer tests' micro data set, built once per session; tests train in copies (test_train.run_copy)."""
    from test_train import build_micro_data

    return build_micro_data(tmp_path_factory.mktemp("train-data"), micro_target)
