"""What every layout adapter shares: the native config (DraftConfig), a checkpoint as read from disk, the target an
export names (Verifier), our provenance record inside exported config.json files, the one rename table, and the
config fields that the sglang config and speculators' transformer_layer_config both spell as a Llama decoder layer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from eagle3.errors import ConversionError
import eagle3.algorithms.eagle3.contract as loader
from eagle3.config.draft import MLA_SIZES

Log = Callable[[str], None]
NATIVE_FORMAT = "eagle3-native"
PROVENANCE_KEY = "eagle3"  # our block inside exported config.json files

# Architecture switches a draft may use beyond the plain EAGLE-3 head (speculators and SpecForge
# options). Each changes the network; an engine that does not implement one computes something else.
FLAGS = tuple(loader.FLAG_CONFIG_KEYS)


class DraftConfig(BaseModel):
    """The native config: everything needed to rebuild the draft and to serve it correctly."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["eagle3-native"] = NATIVE_FORMAT
    format_version: Literal[1] = 1
    hidden_size: int = Field(gt=0)
    target_hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    rms_norm_eps: float = Field(gt=0)
    rope_theta: float = Field(gt=0)
    rope_scaling: dict | None = None
    max_position_embeddings: int = Field(gt=0)
    hidden_act: Literal["silu"] = "silu"
    vocab_size: int = Field(gt=0, description="the target's vocabulary")
    draft_vocab_size: int = Field(gt=0)
    torch_dtype: Literal["bfloat16", "float16", "float32"]
    aux_layers: list[int] = Field(min_length=1, description="our convention: id k = output of decoder layer k")
    target_num_hidden_layers: int = Field(gt=1)
    target_family: str | None = None
    fc_norm: bool = False
    norm_before_fc: bool = False
    norm_before_residual: bool = False
    norm_output: bool = False
    # The attention form: mha (a Llama layer's, grouped heads of head_dim) or mla (DeepSeek-V2's multi-latent
    # attention, whose sizes are the fields below; num_key_value_heads and head_dim are then unused)
    attention: Literal["mha", "mla"] = "mha"
    q_lora_rank: int | None = Field(default=None, gt=0)
    kv_lora_rank: int | None = Field(default=None, gt=0)
    qk_nope_head_dim: int | None = Field(default=None, gt=0)
    qk_rope_head_dim: int | None = Field(default=None, gt=0)
    v_head_dim: int | None = Field(default=None, gt=0)
    rope_interleave: bool = True  # mla: RoPE on interleaved pairs (DeepSeek's), else on halves

    @model_validator(mode="after")
    def _mla_is_complete(self) -> DraftConfig:
        if self.attention == "mla" and (missing := [name for name in MLA_SIZES if getattr(self, name) is None]):
            raise ValueError(f"an MLA draft needs {', '.join(missing)}")
        return self

    def flags(self) -> list[str]:
        return [flag for flag in FLAGS if getattr(self, flag)]


class Provenance(BaseModel):
    """Our record inside exported config.json files."""

    model_config = ConfigDict(extra="forbid")

    aux_layers: list[int]
    target_num_hidden_layers: int = Field(gt=1)
    target_family: str | None = None
    engine_release: str | None = None


@dataclass
class RawCheckpoint:
    """A checkpoint directory as found on disk, before any judgement."""

    path: Path
    layout: str  # a key of LAYOUTS, "eagle" for an EAGLE-1/2 draft, "unknown" for another architecture
    config: dict
    tensors: dict[str, torch.Tensor]


# ---------------------------------------------------------------------------------------------
# The one rename table: canonical tensor name -> name in a layout, which differ only in where the
# decoder layer lives.
PLAIN_TENSORS = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d")
# Tensors the switches add carry the same name in every layout: input_norm (norm_before_fc) is one
# RMSNorm over the concatenated aux states, fc_norm.{j} one RMSNorm per aux state.
FLAG_TENSOR_PREFIXES = tuple(prefix for prefixes in loader.FLAG_TENSOR_PREFIXES.values() for prefix in prefixes)


LAYER_NAMES = (*loader.LAYER_TENSORS, *loader.MLA_LAYER_TENSORS)  # either attention form's, under the layer


def names_with_layer_at(layer_prefix: str, names: list[str] = ()) -> dict[str, str]:
    """canonical -> layout name for the fixed tensors, the layer's tensors among `names` (a Llama layer's when none
    are), plus the switch tensors among `names`."""
    canonical = loader.CANONICAL_LAYER_PREFIX
    given = [t for t in LAYER_NAMES if f"{canonical}.{t}" in names] or loader.LAYER_TENSORS
    layer = {f"{canonical}.{t}": f"{layer_prefix}.{t}" for t in given}
    flagged = {name: name for name in names if name.startswith(FLAG_TENSOR_PREFIXES)}
    return {**{name: name for name in PLAIN_TENSORS}, **layer, **flagged}


def canonical_with_layer_at(layer_prefix: str, name: str) -> str | None:
    """The canonical name of a tensor in a layout whose decoder layer lives at `layer_prefix`; None if it has no
    place there."""
    every_layer_tensor = [f"{loader.CANONICAL_LAYER_PREFIX}.{t}" for t in LAYER_NAMES]
    mapping = names_with_layer_at(layer_prefix, [*every_layer_tensor, name])
    return {layout_name: canonical for canonical, layout_name in mapping.items()}.get(name)


# ---------------------------------------------------------------------------------------------
# Decoding the config of an exported layout (sglang, speculators)


def target_for(raw: RawCheckpoint, family: str | None, num_layers: int | None) -> tuple[str | None, int]:
    """The target family and layer count a checkpoint is read for: the caller's, which must agree with the ones
    our export recorded; the recorded ones when the caller gives none."""
    provenance = raw.config.get(PROVENANCE_KEY) or {}
    for given, key, label in ((family, "target_family", "target family"),
                              (num_layers, "target_num_hidden_layers", "target layer count")):
        recorded = provenance.get(key)
        if given is not None and recorded is not None and given != recorded:
            raise ConversionError(
                f"{raw.path}: the {label} given ({given}) differs from the one it was trained for ({recorded})"
            )
    family = family or provenance.get("target_family")
    num_layers = num_layers or provenance.get("target_num_hidden_layers")
    if num_layers is None:
        raise ConversionError(f"{raw.path}: the target's layer count is unknown; pass the target (--target DIR)")
    return family, num_layers


def trained_fields(raw: RawCheckpoint, fields: dict, family: str | None, num_layers: int) -> dict:
    """The decoded fields with the target, once the aux layers they decode to agree with the recorded ones."""
    recorded = (raw.config.get(PROVENANCE_KEY) or {}).get("aux_layers")
    if recorded is not None and list(recorded) != fields["aux_layers"]:
        raise ConversionError(
            f"{raw.path}: its aux ids capture layers {fields['aux_layers']} but it was trained on layers "
            f"{list(recorded)} (recorded in config.json '{PROVENANCE_KEY}'); check the family and release"
        )
    return fields | {"target_num_hidden_layers": num_layers, "target_family": family}


def architecture_fields(arch: dict, raw_config: dict, tensors: dict[str, torch.Tensor]) -> dict:
    """Architecture fields common to the sglang config and speculators' transformer_layer_config."""
    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "max_position_embeddings") if k not in arch]
    if missing:
        raise ConversionError(f"the draft's config lacks {', '.join(missing)}")
    hidden = arch["hidden_size"]
    heads = arch["num_attention_heads"]
    rope = dict(arch.get("rope_parameters") or {})  # transformers 5 folds rope_theta/scaling in here
    rope_theta = arch.get("rope_theta") or rope.pop("rope_theta", 10000.0)
    rope_scaling = arch.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    return {
        "hidden_size": hidden,
        "target_hidden_size": raw_config.get("target_hidden_size") or hidden,
        "intermediate_size": arch["intermediate_size"],
        "num_attention_heads": heads,
        "num_key_value_heads": arch.get("num_key_value_heads") or heads,
        "head_dim": arch.get("head_dim") or hidden // heads,
        "rms_norm_eps": arch.get("rms_norm_eps", 1e-6),
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": arch["max_position_embeddings"],
        "hidden_act": arch.get("hidden_act", "silu"),
        "vocab_size": arch.get("vocab_size") or raw_config.get("vocab_size"),
        "draft_vocab_size": raw_config.get("draft_vocab_size") or arch.get("draft_vocab_size"),
        "torch_dtype": _declared_dtype(raw_config) or _declared_dtype(arch) or _dtype_name(tensors),
    }


def _declared_dtype(config: dict) -> str | None:
    return config.get("torch_dtype") or config.get("dtype")


def _dtype_name(tensors: dict[str, torch.Tensor]) -> str:
    weight = tensors.get("fc.weight")
    return str(weight.dtype).removeprefix("torch.") if weight is not None else "bfloat16"


# ---------------------------------------------------------------------------------------------
# Encoding the config of an exported layout


def llama_layer_fields(cfg: DraftConfig) -> dict:
    """The one decoder layer as a Llama config: shared by the sglang config and speculators'
    transformer_layer_config."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "torch_dtype": cfg.torch_dtype,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": cfg.hidden_act,
        "vocab_size": cfg.vocab_size,
    }


def provenance(cfg: DraftConfig, release: str | None) -> dict:
    """Our record for config.json: what makes a round trip lossless and validation self-contained."""
    return {
        "aux_layers": cfg.aux_layers,
        "target_num_hidden_layers": cfg.target_num_hidden_layers,
        "target_family": cfg.target_family,
        "engine_release": release,
    }
