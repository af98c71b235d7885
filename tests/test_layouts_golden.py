"""Golden exports: a deterministic tiny draft written in every layout through the functions the pipeline uses
(the trainer's save, the export stage's convert, and convert back to native), compared with files checked in
under tests/golden/layouts/: per tensor its name, shape, dtype and the sha256 of its bytes, and config.json
exactly. A change to any exported byte fails here.

To regenerate after a deliberate change of the output: EAGLE3_UPDATE_GOLDEN=1 pytest tests/test_layouts_golden.py,
then commit the files separately, saying what changed and why."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3.algorithms.eagle3.checkpoint import DraftConfig, NativeDraft, convert, expected_shapes, save_native_draft
from eagle3.draft.files import Verifier

GOLDEN = Path(__file__).parent / "golden" / "layouts"
UPDATE = os.environ.get("EAGLE3_UPDATE_GOLDEN") == "1"
FLAGS = dict(fc_norm=True, norm_before_fc=True, norm_output=True)
ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256}


def golden_config(**overrides) -> DraftConfig:
    fields = dict(
        hidden_size=16, target_hidden_size=24, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
        head_dim=8, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=1024, vocab_size=128,
        draft_vocab_size=32, torch_dtype="bfloat16", aux_layers=[0, 1, 2], target_num_hidden_layers=4,
        target_family="llama",
    )
    return DraftConfig(**(fields | overrides))


def golden_draft(**overrides) -> NativeDraft:
    """Weights from arange (no random generator, so the bytes never depend on the torch release) and a vocab map
    of every fourth target id, as offsets."""
    config = golden_config(**overrides)
    dtype = getattr(torch, config.torch_dtype)
    tensors = {}
    for position, (name, shape) in enumerate(expected_shapes(config).items()):
        count = torch.Size(shape).numel()
        values = (torch.arange(count, dtype=torch.float32) * 7 + position) % 61 - 30
        tensors[name] = (values / 32).reshape(shape).to(dtype)
    ids = torch.arange(config.draft_vocab_size, dtype=torch.int64) * 4
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    tensors.update(d2t=ids - torch.arange(config.draft_vocab_size), t2d=t2d)
    return NativeDraft(config, tensors)


def golden_verifier(config: DraftConfig) -> Verifier:
    """The target the speculators layout names, with an embedding from arange like the weights."""
    values = (torch.arange(config.vocab_size * config.hidden_size, dtype=torch.float32) * 5) % 53 - 26
    return Verifier("golden-target", ["LlamaForCausalLM"], (values / 16).reshape(config.vocab_size, config.hidden_size))


KIMI = dict(target_family="kimi_k25", aux_layers=[2, 3, 5], target_num_hidden_layers=8, torch_dtype="float16")
FLAGGED = dict(FLAGS, rope_scaling=ROPE_SCALING)

# case -> (the draft, [(layout, release) conversions in order, each from the previous output], num_steps)
CASES = {
    "native": ({}, [], 3),
    "sglang-llama-0.5.11": ({}, [("sglang", "0.5.11")], 3),
    "sglang-llama-any-release": ({}, [("sglang", None)], 3),
    "sglang-kimi_k25-0.5.12": (KIMI, [("sglang", "0.5.12")], 3),
    "sglang-kimi_k25-0.5.13": (KIMI, [("sglang", "0.5.13")], 3),
    "sglang-llama-0.5.17-flags": (FLAGGED, [("sglang", "0.5.17")], 3),
    "speculators-llama": ({}, [("speculators", None)], 3),
    "speculators-llama-flags": (FLAGGED, [("speculators", None)], 3),
    "speculators-llama-5-steps": ({}, [("speculators", None)], 5),
    "native-from-sglang-kimi_k25-0.5.13": (KIMI, [("sglang", "0.5.13"), ("native", None)], 3),
    "native-from-speculators-flags": (FLAGGED, [("speculators", None), ("native", None)], 3),
}


def export(tmp_path: Path, overrides: dict, conversions: list[tuple[str, str | None]], num_steps: int) -> Path:
    draft = golden_draft(**overrides)
    current = save_native_draft(draft, tmp_path / "native", to="native")  # as the trainer writes it
    for step, (layout, release) in enumerate(conversions):
        current = convert(current, tmp_path / f"{step}-{layout}", to=layout, target_family=draft.config.target_family,
                          release=release, target_num_layers=draft.config.target_num_hidden_layers,
                          num_steps=num_steps, verifier=golden_verifier(draft.config))
    return current


def fingerprint(directory: Path) -> dict:
    tensors = load_file(directory / "model.safetensors")
    return {
        "config": json.loads((directory / "config.json").read_text()),
        "tensors": [
            {"name": name, "shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
             "sha256": hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()}
            for name, tensor in sorted(tensors.items())
        ],
    }


@pytest.mark.parametrize("case", sorted(CASES))
def test_exports_match_the_golden_files(tmp_path, case):
    out = export(tmp_path, *CASES[case])
    found = fingerprint(out)
    golden = GOLDEN / f"{case}.json"
    if UPDATE:
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(json.dumps(found, indent=2) + "\n")
    expected = json.loads(golden.read_text())
    assert found["tensors"] == expected["tensors"]
    # config.json byte for byte, as the writer formats it
    assert (out / "config.json").read_text() == json.dumps(expected["config"], indent=2) + "\n"

