"""Draft checkpoint layouts and conversion between them.

Three layouts of the same EAGLE-3 draft (DESIGN §3):
- `native`: what our trainer writes. Tensors carry the canonical (SGLang, `midlayer.*`) names; the
  config states the architecture plus the aux layers the training data were captured at, in our
  convention (id k = output of decoder layer k).
- `sglang`: `LlamaForCausalLMEagle3`, `midlayer.*`, ids nested in `eagle_config` and encoded for the
  target's model file and SGLang release.
- `speculators` (vLLM): `layers.0.*`, top-level ids in vLLM numbering (our id + 1).

Every conversion goes through the native form and checks tensors, shapes, dtypes and the vocab map,
so nothing a loader would skip or misread is written. Exports carry an `eagle3` block in config.json
(the layers the data were captured at, target layer count, family, release) that engines ignore and
that makes round trips lossless and validation self-contained.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from eagle3.errors import ConversionError, UnreadableInput
from eagle3.formats import engines
from eagle3.formats.manifest import write_manifest
from eagle3.formats.vocab_map import VocabMap, VocabMapError, check_invariants
from eagle3.fsutil import atomic_directory, read_json

Layout = Literal["native", "sglang", "speculators"]
LAYOUTS = ("native", "sglang", "speculators")
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
NATIVE_FORMAT = "eagle3-native"
PROVENANCE_KEY = "eagle3"  # our block inside exported config.json files

# Architecture switches a draft may use beyond the plain EAGLE-3 head (speculators and SpecForge
# options). Each changes the network; an engine that does not implement one computes something else.
FLAGS = tuple(engines.FLAG_CONFIG_KEYS)

# ---------------------------------------------------------------------------------------------
# The one rename table: canonical tensor name -> name in each layout.
_LAYER_PREFIX = {"native": "midlayer", "sglang": "midlayer", "speculators": "layers.0"}
_PLAIN = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d")
# Tensors the switches add carry the same name in every layout: input_norm (norm_before_fc) is one
# RMSNorm over the concatenated aux states, fc_norm.{j} one RMSNorm per aux state.
FLAG_TENSOR_PREFIXES = tuple(prefix for prefixes in engines.FLAG_TENSOR_PREFIXES.values() for prefix in prefixes)


def tensor_names(layout: Layout, names: list[str] = ()) -> dict[str, str]:
    """canonical -> layout name for the fixed tensors, plus the switch tensors among `names`."""
    layer = {f"midlayer.{t}": f"{_LAYER_PREFIX[layout]}.{t}" for t in engines.LAYER_TENSORS}
    flagged = {name: name for name in names if name.startswith(FLAG_TENSOR_PREFIXES)}
    return {**{name: name for name in _PLAIN}, **layer, **flagged}


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

    def flags(self) -> list[str]:
        return [flag for flag in FLAGS if getattr(self, flag)]


@dataclass
class NativeDraft:
    config: DraftConfig
    tensors: dict[str, torch.Tensor]  # canonical names


@dataclass
class RawCheckpoint:
    """A checkpoint directory as found on disk, before any judgement."""

    path: Path
    layout: str  # one of LAYOUTS, "eagle" for an EAGLE-1/2 draft, "unknown" for another architecture
    config: dict
    tensors: dict[str, torch.Tensor]


def expected_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """canonical name -> shape, from the config alone."""
    return draft_shapes(
        hidden=cfg.hidden_size,
        target_hidden=cfg.target_hidden_size,
        intermediate=cfg.intermediate_size,
        q_width=cfg.num_attention_heads * cfg.head_dim,
        kv_width=cfg.num_key_value_heads * cfg.head_dim,
        num_aux=len(cfg.aux_layers),
        draft_vocab=cfg.draft_vocab_size,
        vocab=cfg.vocab_size,
        norm_before_fc=cfg.norm_before_fc,
        fc_norm=cfg.fc_norm,
    )


def draft_shapes(
    hidden: int,
    target_hidden: int,
    intermediate: int,
    q_width: int,
    kv_width: int,
    num_aux: int,
    draft_vocab: int,
    vocab: int,
    norm_before_fc: bool = False,
    fc_norm: bool = False,
) -> dict[str, tuple[int, ...]]:
    fc_in = num_aux * target_hidden  # the aux states are concatenated before fc
    shapes = {
        "fc.weight": (hidden, fc_in),
        "midlayer.input_layernorm.weight": (hidden,),
        "midlayer.hidden_norm.weight": (hidden,),
        "midlayer.post_attention_layernorm.weight": (hidden,),
        "midlayer.self_attn.q_proj.weight": (q_width, 2 * hidden),  # attention reads cat(embed, hidden)
        "midlayer.self_attn.k_proj.weight": (kv_width, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": (kv_width, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": (hidden, q_width),
        "midlayer.mlp.gate_proj.weight": (intermediate, hidden),
        "midlayer.mlp.up_proj.weight": (intermediate, hidden),
        "midlayer.mlp.down_proj.weight": (hidden, intermediate),
        "norm.weight": (hidden,),
        "lm_head.weight": (draft_vocab, hidden),
        "d2t": (draft_vocab,),
        "t2d": (vocab,),
    }
    if norm_before_fc:
        shapes["input_norm.weight"] = (fc_in,)
    if fc_norm:
        shapes.update({f"fc_norm.{j}.weight": (target_hidden,) for j in range(num_aux)})
    return shapes


# ---------------------------------------------------------------------------------------------
# Reading


def read_checkpoint(path: Path) -> RawCheckpoint:
    path = Path(path)
    if not path.is_dir():
        raise UnreadableInput(f"{path}: {'no such directory' if not path.exists() else 'not a directory'}")
    config_path = path / CONFIG_FILE
    config = read_json(config_path, "missing (a draft checkpoint needs config.json)")
    problems = config_type_problems(config)
    if problems:
        raise UnreadableInput(f"{config_path}: {'; '.join(problems)}")
    return RawCheckpoint(path=path, layout=detect_layout(config, config_path), config=config, tensors=read_tensors(path))


SIZE_FIELDS = (
    "hidden_size", "target_hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "vocab_size", "draft_vocab_size", "max_position_embeddings", "num_hidden_layers",
)


def config_type_problems(config: object) -> list[str]:
    """What in a draft config.json has the wrong JSON type, so readers can trust the types they use."""
    if not isinstance(config, dict):
        return [f"expected a JSON object, found {type(config).__name__}"]
    problems = []
    sections = {"": config, "transformer_layer_config.": config.get("transformer_layer_config")}
    for prefix, section in sections.items():
        if section is None:
            continue
        if not isinstance(section, dict):
            problems.append(f"{prefix.rstrip('.')} must be an object")
            continue
        for key in SIZE_FIELDS:
            value = section.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                problems.append(f"{prefix}{key} must be a positive integer, found {value!r}")
    nested = config.get("eagle_config")
    if nested is not None and not isinstance(nested, dict):
        problems.append("eagle_config must be an object")
    for where, ids in (("eagle_aux_hidden_state_layer_ids", config.get("eagle_aux_hidden_state_layer_ids")),
                       ("eagle_config.eagle_aux_hidden_state_layer_ids",
                        nested.get("eagle_aux_hidden_state_layer_ids") if isinstance(nested, dict) else None)):
        if ids is not None and not (isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
            problems.append(f"{where} must be a list of integers, found {ids!r}")
    if PROVENANCE_KEY in config:
        try:
            Provenance.model_validate(config[PROVENANCE_KEY])
        except ValidationError as err:
            problems.append(f"'{PROVENANCE_KEY}' record: {_first_error(err)}")
    return problems


class Provenance(BaseModel):
    """Our record inside exported config.json files."""

    model_config = ConfigDict(extra="forbid")

    aux_layers: list[int]
    target_num_hidden_layers: int = Field(gt=1)
    target_family: str | None = None
    engine_release: str | None = None


def _first_error(err: ValidationError) -> str:
    first = err.errors()[0]
    return f"{'.'.join(map(str, first['loc'])) or 'value'}: {first['msg']}"


def detect_layout(config: dict, where: Path) -> str:
    architectures = config.get("architectures") or []
    if config.get("format") == NATIVE_FORMAT:
        return "native"
    if "speculators_config" in config or config.get("speculators_model_type"):
        return "speculators"
    if "LlamaForCausalLMEagle3" in architectures:
        return "sglang"
    if "LlamaForCausalLMEagle" in architectures:
        return "eagle"
    if "hidden_size" in config:
        return "unknown"  # a draft-like config with an architecture no engine loads as EAGLE-3
    raise UnreadableInput(
        f"{where}: not an EAGLE-3 draft config (architectures {architectures}; expected "
        f"LlamaForCausalLMEagle3, a speculators config, or format '{NATIVE_FORMAT}')"
    )


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UnreadableInput(f"{path}: no weights (expected *.safetensors)")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            loaded = load_file(file)
        except (SafetensorError, OSError) as err:
            raise UnreadableInput(f"{file}: corrupt safetensors file ({err})") from None
        repeated = sorted(loaded.keys() & tensors.keys())
        if repeated:  # which copy a loader keeps depends on file order: refuse to guess
            raise UnreadableInput(f"{file}: tensors also stored in another file of {path}: {repeated[:4]}")
        tensors.update(loaded)
    return tensors


# ---------------------------------------------------------------------------------------------
# Layout -> native


def to_native(
    raw: RawCheckpoint,
    target_family: str | None = None,
    engine_release: str | None = None,
    target_num_layers: int | None = None,
) -> NativeDraft:
    if raw.layout == "unknown":
        raise ConversionError(
            f"{raw.path}: architectures {raw.config.get('architectures')} is not an EAGLE-3 draft "
            "(expected LlamaForCausalLMEagle3 or a speculators config)"
        )
    if raw.layout == "eagle":
        raise ConversionError(
            f"{raw.path}: an EAGLE (v1/v2) draft (LlamaForCausalLMEagle), not EAGLE-3; it cannot be converted"
        )
    if raw.layout == "native":
        return NativeDraft(_draft_config(raw.config, raw.path), _rename(raw, "native"))
    provenance = raw.config.get(PROVENANCE_KEY) or {}
    for given, key, label in ((target_family, "target_family", "target family"),
                              (target_num_layers, "target_num_hidden_layers", "target layer count")):
        recorded = provenance.get(key)
        if given is not None and recorded is not None and given != recorded:
            raise ConversionError(
                f"{raw.path}: the {label} given ({given}) differs from the one it was trained for ({recorded})"
            )
    family = target_family or provenance.get("target_family")
    num_layers = target_num_layers or provenance.get("target_num_hidden_layers")
    if num_layers is None:
        raise ConversionError(f"{raw.path}: the target's layer count is unknown; pass the target (--target DIR)")
    if raw.layout == "sglang":
        # Our exports record the release their ids were encoded for; others are read for the given one.
        release = provenance.get("engine_release") if provenance else engine_release
        fields = _fields_from_sglang(raw, family, release, num_layers)
    else:
        fields = _fields_from_speculators(raw)
    recorded = provenance.get("aux_layers")
    if recorded is not None and list(recorded) != fields["aux_layers"]:
        raise ConversionError(
            f"{raw.path}: its aux ids capture layers {fields['aux_layers']} but it was trained on layers "
            f"{list(recorded)} (recorded in config.json '{PROVENANCE_KEY}'); check the family and release"
        )
    fields.update(target_num_hidden_layers=num_layers, target_family=family)
    return NativeDraft(_draft_config(fields, raw.path), _rename(raw, raw.layout))


def _shared_fields(arch: dict, raw_config: dict, tensors: dict[str, torch.Tensor]) -> dict:
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


def _fields_from_sglang(raw: RawCheckpoint, family: str | None, release: str | None, num_layers: int) -> dict:
    config = raw.config
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    capture = engines.sglang_capture(ids, family, release, num_layers)
    if capture.status != "known" or capture.lost_ids:
        raise ConversionError(f"{raw.path}: cannot tell which layers its aux ids capture: {capture.explanation}")
    fields = _shared_fields(config, config, raw.tensors)
    flags = engines.enabled_flags(config)
    fields.update(aux_layers=list(capture.layers), **{flag: flag in flags for flag in FLAGS})
    return fields


def _fields_from_speculators(raw: RawCheckpoint) -> dict:
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
    fields = _shared_fields(arch, config, raw.tensors)
    enabled = engines.enabled_flags(config)
    flags = {flag: flag in enabled for flag in FLAGS}
    # vLLM reads a missing norm_before_residual as true (speculators' default); so do we.
    flags["norm_before_residual"] = bool(config.get("norm_before_residual", True))
    fields.update(aux_layers=engines.layers_from_vllm_ids(ids), **flags)
    return fields


def _draft_config(fields: dict, where: Path) -> DraftConfig:
    try:
        return DraftConfig.model_validate(fields)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        raise ConversionError(f"{where}/{CONFIG_FILE}: {problems}") from None


def _rename(raw: RawCheckpoint, layout: str) -> dict[str, torch.Tensor]:
    """Layout names -> canonical names; a tensor with no place in the layout is refused, never dropped.

    An sglang checkpoint is read the way the newest release's loader reads it (`layers.0.*` and
    `aux_norm_*` included); the written sglang layout is the one every release loads."""
    inverse = {name: canonical for canonical, name in tensor_names(layout, list(raw.tensors)).items()}
    flags = engines.enabled_flags(raw.config)
    tensors, unknown, sources = {}, [], {}
    for name, tensor in raw.tensors.items():
        if name.removeprefix("model.") == "embed_tokens.weight":
            continue  # the target's embedding; the serving engine uses its own copy
        canonical = (engines.loaded_name(name, engines.NEWEST_LOADER_RULE, flags) if layout == "sglang"
                     else inverse.get(name))
        if canonical is None:
            unknown.append(name)
        else:
            tensors[canonical] = tensor
            sources.setdefault(canonical, []).append(name)
    if unknown:
        head = " (SGLang's loader drops model.lm_head.weight: the head is named lm_head.weight)" if (
            "model.lm_head.weight" in unknown) else ""
        raise ConversionError(
            f"{raw.path}: tensors with no place in the {layout} layout (a loader would drop them): {sorted(unknown)}"
            + head
        )
    clashes = sorted(" and ".join(names) for names in sources.values() if len(names) > 1)
    if clashes:
        raise ConversionError(f"{raw.path}: several tensors name the same weight: {'; '.join(clashes)}; keep one")
    return tensors


def _declared_dtype(config: dict) -> str | None:
    return config.get("torch_dtype") or config.get("dtype")


def _dtype_name(tensors: dict[str, torch.Tensor]) -> str:
    weight = tensors.get("fc.weight")
    return str(weight.dtype).removeprefix("torch.") if weight is not None else "bfloat16"


# ---------------------------------------------------------------------------------------------
# Checks shared by every conversion


def check_native(draft: NativeDraft, where: Path) -> None:
    """Refuse a draft whose tensors disagree with its config or whose vocab map breaks the contract."""
    expected = expected_shapes(draft.config)
    missing = sorted(set(expected) - set(draft.tensors))
    extra = sorted(set(draft.tensors) - set(expected))
    if missing:
        raise ConversionError(f"{where}: missing tensors {missing}")
    if extra:
        raise ConversionError(f"{where}: tensors its config does not account for: {extra}")
    for name, shape in expected.items():
        actual = tuple(draft.tensors[name].shape)
        if actual != shape:
            raise ConversionError(f"{where}: tensor {name} has shape {list(actual)}, config implies {list(shape)}")
    for name, tensor in draft.tensors.items():
        if name not in engines.VOCAB_TENSORS and not tensor.is_floating_point():
            raise ConversionError(f"{where}: tensor {name} is {tensor.dtype}, expected a floating-point dtype")
    try:
        check_invariants(VocabMap(d2t=draft.tensors["d2t"], t2d=draft.tensors["t2d"]), source=str(where))
    except VocabMapError as err:
        raise ConversionError(str(err)) from None
    layers = draft.config.aux_layers
    n = draft.config.target_num_hidden_layers
    if layers != sorted(set(layers)) or not all(0 <= k < n - 1 for k in layers):
        raise ConversionError(
            f"{where}: aux layers {layers} must be distinct, ascending and in [0, {n - 2}] for a {n}-layer target"
        )


# ---------------------------------------------------------------------------------------------
# Native -> layout


def sglang_config(cfg: DraftConfig, family: str, release: str | None) -> dict:
    rule, note = engines.loader_rule(release)
    where = f"SGLang {release}" if release else "SGLang ≤ 0.5.11 (the strictest release; no release was given)"
    for flag in cfg.flags():
        if flag not in rule.flags:
            raise ConversionError(
                f"the draft uses {flag}, which {where} does not implement (its loader would silently ignore "
                f"it and compute a different network); "
                + ("no SGLang release read implements it" if flag == "norm_before_residual" else "pass a release that does")
            )
    if rule.fixed_num_aux is not None and len(cfg.aux_layers) != rule.fixed_num_aux:
        raise ConversionError(
            f"{where} builds fc for exactly {rule.fixed_num_aux} aux states; the draft has {len(cfg.aux_layers)}"
        )
    try:
        ids = engines.sglang_ids_for_layers(cfg.aux_layers, family, release, cfg.target_num_hidden_layers)
    except ValueError as err:
        raise ConversionError(str(err)) from None
    config = {
        **llama_layer_fields(cfg),
        "architectures": ["LlamaForCausalLMEagle3"],
        "target_hidden_size": cfg.target_hidden_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids},
        PROVENANCE_KEY: _provenance(cfg, family, release),
    }
    config.update({flag: True for flag in cfg.flags()})
    return config


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


def speculators_config(cfg: DraftConfig) -> dict:
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.1.0",
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1, "accept_tolerance": 0.0}
            ],
            "verifier": {"name_or_path": None, "architectures": []},
        },
        "transformer_layer_config": llama_layer_fields(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": engines.vllm_ids(cfg.aux_layers),
        "torch_dtype": cfg.torch_dtype,
        **{flag: getattr(cfg, flag) for flag in FLAGS},
        PROVENANCE_KEY: _provenance(cfg, cfg.target_family, None),
    }


def _provenance(cfg: DraftConfig, family: str | None, release: str | None) -> dict:
    return {
        "aux_layers": cfg.aux_layers,
        "target_num_hidden_layers": cfg.target_num_hidden_layers,
        "target_family": family,
        "engine_release": release,
    }


def native_config(cfg: DraftConfig) -> dict:
    return cfg.model_dump()


# ---------------------------------------------------------------------------------------------
# The public entry points


def load_native(
    path: Path,
    target_family: str | None = None,
    engine_release: str | None = None,
    target_num_layers: int | None = None,
) -> NativeDraft:
    """Read a draft in any layout as a checked native draft."""
    draft = to_native(read_checkpoint(path), target_family, engine_release, target_num_layers)
    check_native(draft, Path(path))
    return draft


def save_native_draft(
    draft: NativeDraft,
    dst: Path,
    to: Layout,
    target_family: str | None = None,
    engine_release: str | None = None,
    overwrite: bool = False,
    source: str | None = None,
) -> Path:
    """Write a checked draft in the given layout, atomically (nothing at `dst` unless it all worked)."""
    with atomic_directory(Path(dst), overwrite=overwrite) as tmp:
        write_draft_files(draft, tmp, to, target_family, engine_release, source)
    return Path(dst)


def write_draft_files(
    draft: NativeDraft,
    directory: Path,
    to: Layout,
    target_family: str | None = None,
    engine_release: str | None = None,
    source: str | None = None,
) -> None:
    """Check a draft and write its weights, config and manifest into an existing directory."""
    if to not in LAYOUTS:
        raise ConversionError(f"unknown layout {to!r}; choose one of {', '.join(LAYOUTS)}")
    check_native(draft, Path(source or directory))
    family = target_family or draft.config.target_family
    if to == "sglang":
        if family is None:
            raise ConversionError("the target family is unknown: pass --target-family (e.g. llama, deepseek_v2)")
        config = sglang_config(draft.config, family, engine_release)
    elif to == "speculators":
        config = speculators_config(draft.config.model_copy(update={"target_family": family}))
    else:
        config = native_config(draft.config.model_copy(update={"target_family": family}))
    names = tensor_names(to, list(draft.tensors))
    tensors = {names[canonical]: tensor.contiguous() for canonical, tensor in draft.tensors.items()}
    save_file(tensors, directory / WEIGHTS_FILE, metadata={"format": "pt"})
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    write_manifest(directory, kind=f"draft-{to}", fields={"layout": to, "source": source, "engine_release": engine_release})


def convert(
    src: Path,
    dst: Path,
    to: Layout,
    target_family: str | None = None,
    engine_release: str | None = None,
    target_num_layers: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Convert a draft between layouts. The release and family decide the aux ids SGLang needs."""
    draft = to_native(read_checkpoint(Path(src)), target_family, engine_release, target_num_layers)
    return save_native_draft(draft, dst, to, target_family, engine_release, overwrite, source=str(src))
