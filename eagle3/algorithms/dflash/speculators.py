"""A DFlash draft in speculators' layout (speculators 0.9 `DFlashDraftModel`, which vLLM's qwen3_dflash.py serves),
and what would go wrong with one before it is loaded (docs/algorithms.md, "DFlash").

config.json: `speculators_model_type: dflash`, the draft's layers as a nested Qwen3 `transformer_layer_config`
(num_hidden_layers = the draft's layers, vocab_size = the target's), `draft_vocab_size` = the target's vocabulary (the
draft drafts over the target's whole head, so no `lm_head`, `d2t` or `t2d` is stored: speculators and vLLM take the
verifier's head), `block_size`, `mask_token_id`, and `aux_hidden_state_layer_ids`: speculators' id k is the input of
decoder layer k (HF's hidden_states[k]), so this project's id k (the output of layer k) is k + 1 there; vLLM captures
layer k - 1's output for it and gives SGLang's reader k - 1. `speculators_config` names the target as the verifier
(its embedding and head are loaded from there) and the served chain as the greedy proposal's speculative tokens
(vLLM drafts that many a step). Tensors: the same as SGLang's layout (`fc`, `hidden_norm`, `layers.N.*`, `norm`).
"""

from __future__ import annotations

from pathlib import Path

from eagle3.algorithms.dflash.layout import check_tensors, write_export
from eagle3.algorithms.dflash.model import DFlashConfig
from eagle3.contract.problems import ProblemCode, Report
from eagle3.draft.files import CONFIG_FILE, Verifier
from eagle3.contract.releases import SPECULATORS_RELEASE
from eagle3.fsutil import read_json
from eagle3.records.manifest import read_data_capture

MODEL_TYPE = "dflash"  # speculators_model_type
SPECULATORS_ARCHITECTURE = "DFlashDraftModel"  # the class speculators saves and registers


def speculators_ids(aux_layers: list[int]) -> list[int]:
    """This project's layer ids (output of layer k) in speculators' numbering (input of layer k)."""
    return [k + 1 for k in aux_layers]


def speculators_config(cfg: DFlashConfig, verifier: Verifier, num_steps: int) -> dict:
    layers = {
        "model_type": "qwen3", "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
        "hidden_act": cfg.hidden_act, "attention_bias": False, "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * cfg.num_hidden_layers,
    }
    return {
        "architectures": [SPECULATORS_ARCHITECTURE], "speculators_model_type": MODEL_TYPE,
        "speculators_version": SPECULATORS_RELEASE, "transformer_layer_config": layers,
        "draft_vocab_size": cfg.vocab_size, "block_size": cfg.block_size, "target_hidden_size": cfg.target_hidden_size,
        "aux_hidden_state_layer_ids": speculators_ids(cfg.aux_layers), "mask_token_id": cfg.mask_token_id,
        "sample_from_anchor": False,  # the block's first entry is the verified token, as trained
        # vLLM 0.32 reads `causal = not sliding_window_non_causal` for every draft layer (speculators, for sliding
        # ones only): false would serve a block trained to see all of itself through a causal mask
        "sliding_window_non_causal": True,
        "dtype": cfg.torch_dtype, "tie_word_embeddings": False,
        "speculators_config": {
            "algorithm": MODEL_TYPE, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_steps, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier.name_or_path, "architectures": verifier.architectures},
        },
        "eagle3": {"native": cfg.model_dump()},  # our record: the native config, for reading the export back
    }


def write_speculators(source: Path, directory: Path, verifier: Verifier, num_steps: int) -> Path:
    """The native draft at `source` in speculators' layout in `directory`, replaced if there."""
    return write_export(source, directory, "speculators", lambda cfg: speculators_config(cfg, verifier, num_steps))


def validate_speculators(directory: Path, data_manifest: Path | None) -> Report:
    """What speculators' loader or vLLM would do wrongly with the export at `directory`: each problem named, with its
    fix."""
    report = Report(str(directory), "speculators", SPECULATORS_RELEASE)
    raw = read_json(directory / CONFIG_FILE, "missing")
    layers = raw.get("transformer_layer_config") or {}
    if raw.get("speculators_model_type") != MODEL_TYPE or not layers:
        report.add(ProblemCode.SPECULATORS_CONFIG, "error", f"speculators_model_type is "
                   f"{raw.get('speculators_model_type')!r}{'' if layers else ', no transformer_layer_config'}: "
                   "speculators reads a DFlash draft from both", "re-export with export.layouts speculators")
    ids = raw.get("aux_hidden_state_layer_ids")
    captured = read_data_capture(data_manifest)["aux_layers"] if data_manifest is not None else None
    if ids is None:
        report.add(ProblemCode.AUX_IDS_MISSING, "error", "no aux_hidden_state_layer_ids: speculators cannot build fc "
                   "and vLLM refuses the draft", "set aux_hidden_state_layer_ids (speculators' numbering: layer + 1)")
    elif captured is not None and list(ids) != speculators_ids(captured):
        report.add(ProblemCode.CAPTURED_LAYERS_MISMATCH, "error", f"aux_hidden_state_layer_ids {list(ids)} are the "
                   f"inputs of those layers (the outputs of {[k - 1 for k in ids]}), but the draft was trained on the "
                   f"outputs of {captured}", f"set aux_hidden_state_layer_ids to {speculators_ids(captured)}")
    vocab, mask = layers.get("vocab_size"), raw.get("mask_token_id")
    if raw.get("draft_vocab_size") != vocab:
        report.add(ProblemCode.DRAFT_VOCAB_SIZE, "error", f"draft_vocab_size {raw.get('draft_vocab_size')} is not the "
                   f"target's {vocab}: speculators would look for a reduced head (lm_head, d2t, t2d) the draft never "
                   "had", f"set draft_vocab_size to {vocab}")
    if not isinstance(mask, int) or not isinstance(vocab, int) or not 0 <= mask < vocab:
        report.add(ProblemCode.VOCAB_SIZE, "error", f"mask_token_id {mask} is not an id of the target's {vocab}",
                   "set mask_token_id to the id it was trained with")
    if raw.get("sliding_window_non_causal") is not True:
        report.add(ProblemCode.SPECULATORS_CONFIG, "error", "sliding_window_non_causal is not true: vLLM then masks "
                   "every draft layer causally, and a block trained to see all of itself is served blind to its "
                   "later entries", "set sliding_window_non_causal to true")
    spec = raw.get("speculators_config") or {}
    steps = [m.get("speculative_tokens") for m in spec.get("proposal_methods") or []]
    block = raw.get("block_size")
    if not steps or not isinstance(block, int) or not 0 < steps[0] < block:
        report.add(ProblemCode.SPECULATORS_CONFIG, "error", f"speculative_tokens {steps[:1]} with block_size {block}: "
                   "vLLM verifies 1 + speculative_tokens a step, which must fit the trained block",
                   "set speculative_tokens to at most block_size - 1")
    if not (spec.get("verifier") or {}).get("name_or_path"):
        report.add(ProblemCode.VERIFIER, "error", "speculators_config.verifier.name_or_path is not set: speculators "
                   "leaves the embedding unset and vLLM has no target to serve", "set export.verifier or re-export "
                   "where the target is")
    check_tensors(report, directory, (raw.get("eagle3") or {}).get("native"), raw.get("dtype"), "speculators")
    return report

