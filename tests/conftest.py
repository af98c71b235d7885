import json
import os
import sys
from pathlib import Path

# Wherever Prefect starts (docs/pipeline.md): its first start migrates a fresh database; no network for telemetry.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, temporary_settings  # noqa: E402
from prefect.testing.utilities import prefect_test_harness  # noqa: E402
from xdist.scheduler import LoadFileScheduling  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))

from drafts import TARGET_LAYERS, TARGET_VOCAB, write_draft  # noqa: E402
from eagle3.resolve import load_config  # noqa: E402
from eagle3.config.deployment import RegistrySection  # noqa: E402
from eagle3.algorithms.eagle3.checkpoint import NativeDraft, save_native_draft  # noqa: E402
from eagle3.registry.registry import open_registry  # noqa: E402
# micro_target and kimi_target: registered here so the session builds each once
from fixtures_tiny import micro_target, one_torch_thread  # noqa: E402,F401
from helpers import (  # noqa: E402
    CONFIG, MICRO_DRAFT, PREFIX, RELEASE, TINY, build_micro_data, lens_draft, micro_of, micro_overrides,
    rewrite,
    write_heldout,
)
from kimi_target import kimi_target  # noqa: E402,F401
from ports import free_port  # noqa: E402
from s3_server import new_bucket, serve_moto_s3  # noqa: E402
from sshd import sshd  # noqa: E402,F401  (registered here: one sshd per session for every test file)


# pytest-xdist (`--dist loadfile`, the Makefile's sessions) hands each unit of tests whole to one worker, in
# collection order: the longest units start first, so no worker ends the session alone on one of them. A unit is a
# test file (its module fixtures built once), except that the files of SGLang's release children are one unit: the
# children are session fixtures, started once per worker that asks (~15 s each, nine releases). That unit goes second:
# the first worker builds the micro target (~45 s, tests/fixtures_tiny.py) and the second, which needs no target
# there, would otherwise wait for it.
# The loader probe builds a child's process groups once, at its first load: the files that load drafts run one after
# the other (test_loader, test_mla_draft, test_dflash_loader, test_dspark_loader), after the probes that publish other
# server args.
RELEASE_CHILD_FILES = ("conformance/test_aux_ids.py", "conformance/test_counting.py", "conformance/test_dflash.py",
                       "conformance/test_families.py", "conformance/test_features.py", "conformance/test_loader.py",
                       "conformance/test_mla_draft.py", "conformance/test_dflash_loader.py",
                       "conformance/test_dspark_loader.py", "conformance/test_server_args.py",
                       "conformance/test_telemetry.py")
LONGEST_FILES = ("conformance/test_eagle3_server.py", *RELEASE_CHILD_FILES, "test_deployment_e2e.py",
                 "conformance/test_vllm_server.py", "conformance/test_plain_server.py", "test_flow.py", "test_streamed.py",
                 "test_stop.py", "test_train_launch.py", "test_train.py", "test_launch.py")
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
    return build_micro_data(tmp_path_factory.mktemp("train-data"), micro_target)


@pytest.fixture(scope="session")
def mooncake():
    """Mooncake's store (training.features streamed), or skip (fail where EAGLE3_REQUIRE_MOONCAKE is set: .ci/run)
    naming what is missing; a module asks with `pytestmark = pytest.mark.usefixtures("mooncake")`."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as err:
        reason = (f"Mooncake cannot load ({err}): pip install 'eagle3[stream]' and apt-get install libibverbs1 "
                  "librdmacm1 libnuma1 (.ci/run installs them)")
        if os.environ.get("EAGLE3_REQUIRE_MOONCAKE"):
            pytest.fail(reason)
        pytest.skip(reason)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny forwards: a second OpenMP thread only waits when the cores are shared (a module marks itself
    `pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    with one_torch_thread():
        yield


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    """One throwaway Prefect server for the session; task results (the cache) kept in a temporary directory."""
    with temporary_settings({PREFECT_LOCAL_STORAGE_PATH: tmp_path_factory.mktemp("prefect-results")}):
        with prefect_test_harness(server_startup_timeout=120):
            yield


@pytest.fixture
def production_config(tmp_path, micro_target):
    """A managed production on the micro target that keeps serving; registry version v1 holds a good draft."""
    def config(*overrides):
        return load_config(TINY, micro_overrides(tmp_path / "run", micro_target) + [
            f"registry.path={tmp_path / 'registry'}", f"production.port={free_port()}",
            f"production.state_dir={tmp_path / 'production'}", "production.keep_serving=true",
            f"serving.log_dir={tmp_path / 'logs'}", "serving.context_length=512", "benchmark.num_prompts=2",
            "benchmark.max_new_tokens=8", "benchmark.concurrency=2", *overrides])

    write_heldout(config())
    draft = write_draft(tmp_path / "export" / "sglang", layout="sglang", release=RELEASE, **MICRO_DRAFT)
    open_registry(config().registry, log=lambda line: None).publish("v1", {"sglang": draft}, {})
    return config


@pytest.fixture(scope="module")
def drafts(micro, tmp_path_factory):
    """The lens draft with its feature path scaled by 1e-3: the final norm undoes the scale, so it drafts
    like the lens when its layer loads, while the random init of a skipped layer (std 0.02) outweighs
    it. Exported as SGLang 0.5.13 would read it; plus the same with absolute d2t and with layers.0.* names."""
    root = tmp_path_factory.mktemp("drafts")
    draft = lens_draft(micro)
    with torch.no_grad():
        draft.fc.weight.mul_(1e-3)
    good = save_native_draft(NativeDraft(CONFIG, draft.export_state()), root / "good", to="sglang", release=RELEASE)
    absolute = rewrite(good, root / "absolute", lambda t: {**t, "d2t": t["d2t"] + torch.arange(t["d2t"].numel())})
    renamed = rewrite(good, root / "renamed", lambda t: {k.replace("midlayer.", "layers.0."): v for k, v in t.items()})
    return {"good": good, "absolute": absolute, "renamed": renamed}


@pytest.fixture
def moto_s3(monkeypatch, tmp_path):
    yield from serve_moto_s3(monkeypatch, tmp_path)


@pytest.fixture(params=["local", "s3"])
def section(request, tmp_path) -> RegistrySection:
    if request.param == "local":
        return RegistrySection(backend="local", path=tmp_path / "registry")
    server = request.getfixturevalue("moto_s3")
    return RegistrySection(backend="s3", bucket=new_bucket(server.url), prefix=PREFIX, endpoint_url=server.url)


@pytest.fixture(scope="module")
def micro(micro_target):
    return micro_of(micro_target)
