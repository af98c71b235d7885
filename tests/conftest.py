import json
import os
import sys
from pathlib import Path

# Wherever Prefect starts (DESIGN §6): its first start migrates a fresh database; no network for telemetry.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from drafts import TARGET_LAYERS, TARGET_VOCAB, write_draft  # noqa: E402
from fixtures_tiny import micro_target  # noqa: E402,F401  (registered here so the session builds it once)
from kimi_target import kimi_target  # noqa: E402,F401


# pytest-xdist (`--dist loadfile`, the Makefile's sessions) hands whole files to its workers in collection order: the
# longest start first, so no worker ends the session alone on one of them while the others idle.
LONGEST_FILES = ("conformance/test_eagle3_server.py", "test_deployment_e2e.py", "conformance/test_plain_server.py",
                 "test_flow.py", "test_stop.py", "test_train_launch.py", "test_train.py", "test_launch.py")


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(Path(item.fspath).relative_to(here).as_posix(), len(rank)))  # stable


def write_target(path: Path, layers: int = TARGET_LAYERS, hidden: int = 32, vocab: int = TARGET_VOCAB,
                 architecture: str = "LlamaForCausalLM") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": [architecture], "num_hidden_layers": layers, "hidden_size": hidden, "vocab_size": vocab}
    (path / "config.json").write_text(json.dumps(config))
    return path


def write_data_manifest(path: Path, aux_layers: list[int], layers: int = TARGET_LAYERS, family: str = "llama") -> Path:
    manifest = {
        "kind": "dataset",
        "target": {"family": family, "num_hidden_layers": layers, "hidden_size": 32, "vocab_size": TARGET_VOCAB},
        "capture": {"aux_layers": aux_layers, "last_hidden": "post_norm"},
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
