"""Probe: eagle3.runtime.sglang_features.SGLangFeatures, run on this release's own model runner on the CPU (DeepSeek
targets through the release's absorbed-MLA attention path: see _mla_prefill_on_torch_native).

job = {"target": directory of the target, "family", "num_hidden_layers", "aux_layers", "rows": token rows (lists of
ints), "slices": {label: [start, stop] | null (all rows)}, "out": path to write the tensors to}.

The module is built as a trainer rank builds it: torch.distributed initialised first (here one gloo rank), tp_size 1,
then SGLangFeatures on top of that group. The features go through a file (torch.save of {label: {"aux", "last"}}),
never through JSON. Answer: {"release", "shapes": {label: {"aux", "last"}}, "build_seconds", "features_seconds",
"free_kv_before", "free_kv_after"}.
"""

from __future__ import annotations

import socket
import time

import torch

# Small pools: a few short rows per batch. float32 and torch-native attention like the CPU server (servers.py).
CPU_ENGINE_ARGS = {"device": "cpu", "attention_backend": "torch_native", "sampling_backend": "pytorch",
                   "grammar_backend": "none", "dtype": "float32", "max_total_tokens": 1024,
                   "max_running_requests": 8, "context_length": 256, "mem_fraction_static": 0.3}


def _gloo_group() -> None:
    """One gloo rank, as torchrun + init_process_group would leave it (kept when an earlier probe made one)."""
    if torch.distributed.is_initialized():
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0)


def _fresh_parallel_state() -> None:
    """Another probe in this child (loader.py) may have built SGLang's model-parallel groups: a process builds them
    once, so drop them first (their WORLD stays and is reused)."""
    from sglang.srt.distributed.parallel_state import destroy_model_parallel, model_parallel_is_initialized
    from sglang.srt.eplb.expert_location import set_global_expert_location_metadata

    if model_parallel_is_initialized():
        destroy_model_parallel()
    set_global_expert_location_metadata(None, allow_overwrite=True)  # left by an MoE runner that failed to start


def _mla_prefill_on_torch_native() -> None:
    """0.5.23 registers no DeepSeek attention handler for torch_native, so the DeepSeek file falls back to Triton's,
    which sends a fresh prefill down the MHA path; torch_native then reads the MLA latent cache as the keys (a shape
    error at the first layer). Registered instead: the release's own MLA dispatch (`_dispatch_mla_subtype`, the
    absorbed path every backend takes for decode), the same attention in the latent space."""
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry, _dispatch_mla_subtype,
    )

    AttentionBackendRegistry.register("torch_native", _dispatch_mla_subtype)


def run(job: dict) -> dict:
    from eagle3.runtime.features import pad_rows
    from eagle3.runtime.sglang_features import SGLangFeatures

    _mla_prefill_on_torch_native()  # read by the DeepSeek-style files only
    _gloo_group()
    _fresh_parallel_state()
    started = time.perf_counter()
    backend = SGLangFeatures(job["target"], job["family"], job["num_hidden_layers"], job["aux_layers"], "post_norm",
                             0, 1, torch.device("cpu"), CPU_ENGINE_ARGS)
    built = time.perf_counter()
    try:
        free_before = backend.runner.token_to_kv_pool_allocator.available_size()
        batch = pad_rows(job["rows"], [f"row{i}" for i in range(len(job["rows"]))])
        results = {}
        for label, bounds in job["slices"].items():
            rows = slice(None) if bounds is None else slice(*bounds)
            features = backend.features(batch, rows)
            results[label] = {"aux": features.aux, "last": features.last}
        free_after = backend.runner.token_to_kv_pool_allocator.available_size()
        release = backend.release
    finally:
        backend.close()
    torch.save(results, job["out"])
    return {
        "release": release,
        "shapes": {label: {k: list(v.shape) for k, v in r.items()} for label, r in results.items()},
        "build_seconds": round(built - started, 3),
        "features_seconds": round(time.perf_counter() - built, 3),
        "free_kv_before": free_before,
        "free_kv_after": free_after,
    }
