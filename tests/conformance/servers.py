"""SGLang's own server from a published release, on this machine's CPU, under the project's launcher.

The server runs unmodified (`python -m sglang.launch_server`) with the release on its path (releases.py)
and the flags that keep it on the CPU. `env` reaches every SGLang process; EAGLE3_SGLANG_REDIRECTS there
names a set of inside/cpu_redirects.py to install at start-up (the EAGLE3 server has no CPU path of its own).
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path

import releases
from ports import free_port
from eagle3.serve.launch import Server

# The CPU build of each piece the server would otherwise take from CUDA: attention in torch, sampling in
# torch, no grammar backend, no overlap scheduler thread, no CUDA graphs, float32 like the reference server.
# And a KV pool of 4,096 tokens: sized from free host memory otherwise, ~17 M tokens of the micro target, 17 GB
# that take half a minute to allocate and leave the other test worker short of memory.
CPU_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
             "--grammar-backend", "none", "--disable-overlap-schedule", "--disable-cuda-graph", "--dtype", "float32",
             "--max-total-tokens", "4096")
START_TIMEOUT_S = 600.0


@contextmanager
def sglang_server(release: str, model_path: Path, log_dir: Path, flags=CPU_FLAGS, extra=(), env=None):
    """Yield (url, Server) for SGLang `release` serving `model_path` on 127.0.0.1; always stopped."""
    port = free_port()
    path = os.pathsep.join(str(p) for p in releases.prepare(release))
    settings = {"PYTHONPATH": path, "SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    command = ["env", *(f"{key}={value}" for key, value in settings.items()), sys.executable, "-m",
               "sglang.launch_server", "--model-path", str(model_path), "--host", "127.0.0.1", "--port", str(port),
               *flags, *extra]
    server = Server(command, "127.0.0.1", port, log_dir, log=lambda line: None, label=f"SGLang {release} on the CPU",
                    gpu_query=None, grace_s=10.0)
    with server:
        server.wait_healthy(START_TIMEOUT_S)
        yield server.url, server
