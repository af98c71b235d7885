"""A streamed run's capture worker on SGLang 0.5.23's own model runner, on the CPU: the train stage starts it as it
would on the node (data.feature_backend sglang: `data.sglang_python -m eagle3.stream.worker`), here with the project's
interpreter on the release's unpacked wheel (the conformance children's environment, releases.py). The worker builds
SGLangFeatures, puts each claimed sample's features into the Mooncake store, and the trainer trains on them as it
would on in-rank online features of the transformers backend, within the two engines' rounding."""

from __future__ import annotations

import json
import os
import shlex
import sys

import pytest
import torch

import releases
from helpers import run_copy
from inside.features import CPU_ENGINE_ARGS
from streaming import losses, streamed, trained

RELEASE = "0.5.23"  # the one release the sglang feature backend supports
STEPS = ["training.max_steps=6", "training.eval_every=3", "training.save_every=3", "run.cpu_threads=1",
         "training.nproc_per_node=1", "training.best_by=step_acc"]

pytestmark = pytest.mark.usefixtures("mooncake")


@pytest.fixture(scope="module")
def sglang_python(tmp_path_factory):
    """An interpreter for data.sglang_python: the project's, on SGLang 0.5.23's wheel as the conformance children run
    it (its CPU engine on, nothing fetched)."""
    try:
        paths = releases.prepare(RELEASE)
    except releases.IndexUnreachable as err:
        pytest.skip(f"sglang {RELEASE} cannot be fetched: {err}")
    script = tmp_path_factory.mktemp("sglang-env") / "python"
    variables = {"PYTHONPATH": os.pathsep.join(map(str, paths)), "SGLANG_USE_CPU_ENGINE": "1",
                 "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    exports = " ".join(f"{name}={shlex.quote(value)}" for name, value in variables.items())
    script.write_text(f"#!/bin/sh\nexport {exports}\nexec {shlex.quote(sys.executable)} \"$@\"\n")
    script.chmod(0o755)
    return script


def test_a_capture_worker_on_sglangs_runner_trains_as_in_rank_online_features(micro_data, tmp_path, sglang_python):
    online, online_dir = run_copy(micro_data, tmp_path, "online", [*STEPS, "training.features=online"])
    trained(online)
    engine = ["data.feature_backend=sglang", f"data.sglang_python={sglang_python}",
              f"data.sglang_engine_args={json.dumps(CPU_ENGINE_ARGS)}"]
    overrides, run_dir = run_copy(micro_data, tmp_path, "streamed", [*STEPS, *engine, *streamed(1)])
    lines = []
    trained(overrides, lines)
    text = "\n".join(lines)
    assert "capture capture-0-0: data.feature_backend sglang (SGLangFeatures) ready" in text, text
    torch.testing.assert_close(losses(run_dir), losses(online_dir), rtol=1e-5, atol=1e-7)  # measured 9.8e-8
