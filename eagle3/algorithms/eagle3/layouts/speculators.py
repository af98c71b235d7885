"""The speculators layout (speculators and vLLM): the decoder layer under `layers.0.*`, its own config
(`speculators_config`, top-level ids in vLLM numbering - our id + 1 on every release - and the layer as
`transformer_layer_config`), written so that speculators' own `from_pretrained` loads it as is
(tests/conformance/test_speculators.py runs SPECULATORS_RELEASE's loader on it):
- `speculators_config.verifier` names the target: the loader reads its config (AutoConfig.from_pretrained of
  the name; None fails) and its head and final norm (the training-time teacher).
- the target's embedding is shipped as `embed_tokens.weight`. The loader copies the verifier's only into an
  embedding that is NaN, and under transformers 5 a tensor missing from the checkpoint is left uninitialised
  (measured with speculators 0.9.0 and transformers 5.19: in ten loads of an export without it, three to five held
  garbage, not the target's). speculators' own save writes it too, and vLLM compares it with the target's and
  shares the target's when equal. At Kimi-K2.5 it is 163840 x 7168 bf16 = 2.35 GB beside the 1.92 GB draft.
"""

from __future__ import annotations

import torch

from eagle3.errors import ConversionError
from eagle3.contract import engines
import eagle3.algorithms.eagle3.contract as loader
from eagle3.algorithms.eagle3.layouts.shared import (
    DraftConfig, FLAGS, Log, PROVENANCE_KEY, RawCheckpoint, architecture_fields, canonical_with_layer_at,
    llama_layer_fields, names_with_layer_at, provenance, target_for, trained_fields,
)
from eagle3.contract.releases import SPECULATORS_RELEASE
from eagle3.draft.files import Verifier

LAYER_PREFIX = "layers.0"
ARCHITECTURE = "Eagle3DraftModel"  # the class that release registers for eagle3, and writes when it saves one
EMBED_TOKENS = "embed_tokens.weight"
# speculators' speculative_tokens is the drafting steps per verify step: SGLang's --speculative-num-steps, our
# serving.num_steps (eagle3.shape.DEFAULT_NUM_STEPS when a conversion is told no serving shape).


def detects(config: dict) -> bool:
    return "speculators_config" in config or bool(config.get("speculators_model_type"))


def tensor_names(names: list[str] = ()) -> dict[str, str]:
    return names_with_layer_at(LAYER_PREFIX, names)


def canonical_name(name: str, config: dict) -> str | None:
    return canonical_with_layer_at(LAYER_PREFIX, name)


def decode_config(raw: RawCheckpoint, family: str | None, release: str | None, num_layers: int | None,
                  log: Log) -> dict:
    """The native fields; vLLM numbering needs no release, so the caller's is not used."""
    family, num_layers = target_for(raw, family, num_layers)
    config = raw.config
    arch = config.get("transformer_layer_config")
    if not isinstance(arch, dict):
        raise ConversionError(f"{raw.path}: speculators config lacks transformer_layer_config")
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        raise ConversionError(
            f"{raw.path}: speculators config has no eagle_aux_hidden_state_layer_ids; the layers the draft "
            f"was trained on cannot be recovered"
        )
    sliding = arch.get("use_sliding_window") or "sliding_attention" in (arch.get("layer_types") or [])
    if sliding:
        raise ConversionError(
            f"{raw.path}: the draft was trained with sliding-window attention (window {arch.get('sliding_window')}); "
            "SGLang's LlamaForCausalLMEagle3 attends over the whole context, so it would compute something else "
            "on long prompts; retrain with full attention"
        )
    fields = architecture_fields(arch, config, raw.tensors)
    enabled = loader.enabled_flags(config)
    flags = {flag: flag in enabled for flag in FLAGS}
    # vLLM reads a missing norm_before_residual as true (speculators' default); so do we.
    flags["norm_before_residual"] = bool(config.get("norm_before_residual", True))
    fields.update(aux_layers=engines.layers_from_vllm_ids(ids), **flags)
    return trained_fields(raw, fields, family, num_layers)


def encode_config(cfg: DraftConfig, release: str | None, num_steps: int, verifier: Verifier | None) -> dict:
    """speculators' config, naming the verifier; `num_steps` becomes its speculative_tokens. Its ids mean the same
    on every release, so none is recorded."""
    if verifier is None:
        raise ConversionError(
            "the speculators layout names its verifier (speculators' from_pretrained reads the target's config and "
            "head from it) and ships the target's embedding: pass the target (`eagle3 convert ... --target DIR`)"
        )
    if num_steps < 1:
        raise ConversionError(f"num_steps is {num_steps}: speculators' speculative_tokens must be at least 1")
    if cfg.attention != "mha":
        raise ConversionError(
            f"the draft's attention is {cfg.attention}: speculators' layout holds a Llama decoder layer (its reader and "
            "vLLM's build LlamaDecoderLayer from transformer_layer_config), so an MLA draft has no form there; serve "
            "it with SGLang (serving.engine sglang), or train draft.attention mha")
    return {
        "architectures": [ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_RELEASE,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": num_steps, "verifier_accept_k": 1,
                 "accept_tolerance": 0.0}
            ],
            "verifier": {"name_or_path": verifier.name_or_path, "architectures": list(verifier.architectures)},
        },
        "transformer_layer_config": llama_layer_fields(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": engines.vllm_ids(cfg.aux_layers),
        "torch_dtype": cfg.torch_dtype,
        **{flag: getattr(cfg, flag) for flag in FLAGS},
        PROVENANCE_KEY: provenance(cfg, None),
    }


def verifier_tensors(cfg: DraftConfig, verifier: Verifier) -> dict[str, torch.Tensor]:
    """The target's embedding, in the draft's dtype (see the module's docstring for why it is shipped)."""
    expected = (cfg.vocab_size, cfg.hidden_size)
    if tuple(verifier.embed_tokens.shape) != expected:
        raise ConversionError(
            f"the target's embedding ({verifier.name_or_path}) is {list(verifier.embed_tokens.shape)}, the draft "
            f"needs {list(expected)} (vocab_size x hidden_size): is it the target the draft was trained for?"
        )
    return {EMBED_TOKENS: verifier.embed_tokens.to(getattr(torch, cfg.torch_dtype)).contiguous()}
