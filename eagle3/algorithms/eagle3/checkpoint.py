"""Reading, checking and converting EAGLE-3 draft checkpoints.

Three layouts of the same draft (docs/contracts.md), each an adapter in eagle3/algorithms/eagle3/layouts/ that owns its tensor
names and its config.json both ways: `native` (what our trainer writes), `sglang` and `speculators`.
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
from pydantic import ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from eagle3.errors import ConversionError, UnreadableInput
from eagle3.contract import engines
import eagle3.algorithms.eagle3.contract as loader
from eagle3.algorithms.eagle3.layouts import LAYOUTS, LayoutAdapter
from eagle3.algorithms.eagle3.layouts.shared import DraftConfig, Log, NATIVE_FORMAT, PROVENANCE_KEY, Provenance, RawCheckpoint
from eagle3.draft.files import CONFIG_FILE, WEIGHTS_FILE, Verifier
from eagle3.records.manifest import write_manifest
from eagle3.draft.vocab_map import VocabMap, VocabMapError, check_invariants
from eagle3.fsutil import atomic_directory, read_json
from eagle3.shape import DEFAULT_NUM_STEPS

Layout = Literal["native", "sglang", "speculators"]


@dataclass
class NativeDraft:
    config: DraftConfig
    tensors: dict[str, torch.Tensor]  # canonical names


def expected_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """canonical name -> shape, from the config alone."""
    if cfg.attention == "mla":
        attention = mla_attention_shapes(cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank,
                                         cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim)
    else:
        attention = mha_attention_shapes(cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim,
                                         cfg.num_key_value_heads * cfg.head_dim)
    return draft_shapes(
        hidden=cfg.hidden_size,
        target_hidden=cfg.target_hidden_size,
        intermediate=cfg.intermediate_size,
        attention=attention,
        num_aux=len(cfg.aux_layers),
        draft_vocab=cfg.draft_vocab_size,
        vocab=cfg.vocab_size,
        norm_before_fc=cfg.norm_before_fc,
        fc_norm=cfg.fc_norm,
    )


def mha_attention_shapes(hidden: int, q_width: int, kv_width: int) -> dict[str, tuple[int, ...]]:
    """A Llama layer's attention, which reads cat(embed, hidden) [2H]."""
    return {
        "self_attn.q_proj.weight": (q_width, 2 * hidden),
        "self_attn.k_proj.weight": (kv_width, 2 * hidden),
        "self_attn.v_proj.weight": (kv_width, 2 * hidden),
        "self_attn.o_proj.weight": (hidden, q_width),
    }


def mla_attention_shapes(hidden: int, heads: int, q_lora_rank: int, kv_lora_rank: int, nope: int, rope: int,
                         v_dim: int) -> dict[str, tuple[int, ...]]:
    """DeepSeek-V2 multi-latent attention reading cat(embed, hidden) [2H]: SGLang fuses the two down projections
    into one of 2H inputs."""
    return {
        "self_attn.q_a_proj.weight": (q_lora_rank, 2 * hidden),
        "self_attn.q_a_layernorm.weight": (q_lora_rank,),
        "self_attn.q_b_proj.weight": (heads * (nope + rope), q_lora_rank),
        "self_attn.kv_a_proj_with_mqa.weight": (kv_lora_rank + rope, 2 * hidden),
        "self_attn.kv_a_layernorm.weight": (kv_lora_rank,),
        "self_attn.kv_b_proj.weight": (heads * (nope + v_dim), kv_lora_rank),
        "self_attn.o_proj.weight": (hidden, heads * v_dim),
    }


def draft_shapes(
    hidden: int,
    target_hidden: int,
    intermediate: int,
    attention: dict[str, tuple[int, ...]],
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
        **{f"midlayer.{name}": shape for name, shape in attention.items()},
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



def _first_error(err: ValidationError) -> str:
    first = err.errors()[0]
    return f"{'.'.join(map(str, first['loc'])) or 'value'}: {first['msg']}"


# A config that speaks for several layouts is read as the first: our native marker, then speculators' own
# keys, then the sglang architecture.
DETECTION_ORDER = ("native", "speculators", "sglang")


def detect_layout(config: dict, where: Path) -> str:
    detected = next((name for name in DETECTION_ORDER if LAYOUTS[name].detects(config)), None)
    if detected is not None:
        return detected
    architectures = config.get("architectures") or []
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
    release: str | None = None,
    target_num_layers: int | None = None,
    log: Log = print,
) -> NativeDraft:
    """The checkpoint as a native draft: its config decoded, its tensors renamed (not yet checked together)."""
    return NativeDraft(draft_config(raw, target_family, release, target_num_layers, log), native_tensors(raw))


def draft_config(
    raw: RawCheckpoint,
    target_family: str | None = None,
    release: str | None = None,
    target_num_layers: int | None = None,
    log: Log = print,
) -> DraftConfig:
    """The checkpoint's config as the native one. An export of ours records its target and release: a target the
    caller gives must agree with it, and the recorded release decides what its aux ids mean (logged when the
    caller's differs)."""
    fields = layout_of(raw).decode_config(raw, target_family, release, target_num_layers, log)
    try:
        return DraftConfig.model_validate(fields)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        raise ConversionError(f"{raw.path}/{CONFIG_FILE}: {problems}") from None


def native_tensors(raw: RawCheckpoint) -> dict[str, torch.Tensor]:
    """Layout names -> canonical names; a tensor with no place in the layout is refused, never dropped."""
    adapter = layout_of(raw)
    tensors, unknown, sources = {}, [], {}
    for name, tensor in raw.tensors.items():
        if name.removeprefix("model.") == "embed_tokens.weight":
            continue  # the target's embedding; the serving engine uses its own copy
        canonical = adapter.canonical_name(name, raw.config)
        if canonical is None:
            unknown.append(name)
        else:
            tensors[canonical] = tensor
            sources.setdefault(canonical, []).append(name)
    if unknown:
        head = " (SGLang's loader drops model.lm_head.weight: the head is named lm_head.weight)" if (
            "model.lm_head.weight" in unknown) else ""
        raise ConversionError(
            f"{raw.path}: tensors with no place in the {raw.layout} layout (a loader would drop them): {sorted(unknown)}"
            + head
        )
    clashes = sorted(" and ".join(names) for names in sources.values() if len(names) > 1)
    if clashes:
        raise ConversionError(f"{raw.path}: several tensors name the same weight: {'; '.join(clashes)}; keep one")
    return tensors


def layout_of(raw: RawCheckpoint) -> LayoutAdapter:
    """The adapter that reads the checkpoint; drafts no engine loads as EAGLE-3 are refused by name."""
    if raw.layout == "unknown":
        raise ConversionError(
            f"{raw.path}: architectures {raw.config.get('architectures')} is not an EAGLE-3 draft "
            "(expected LlamaForCausalLMEagle3 or a speculators config)"
        )
    if raw.layout == "eagle":
        raise ConversionError(
            f"{raw.path}: an EAGLE (v1/v2) draft (LlamaForCausalLMEagle), not EAGLE-3; it cannot be converted"
        )
    return LAYOUTS[raw.layout]


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
        if name not in loader.VOCAB_TENSORS and not tensor.is_floating_point():
            raise ConversionError(f"{where}: tensor {name} is {tensor.dtype}, expected a floating-point dtype")
    try:
        check_invariants(VocabMap(d2t=draft.tensors["d2t"], t2d=draft.tensors["t2d"]), source=str(where))
    except VocabMapError as err:
        raise ConversionError(str(err)) from None
    n = draft.config.target_num_hidden_layers
    if problem := engines.aux_layers_problem(draft.config.aux_layers, n):
        raise ConversionError(f"{where}: aux layers {problem} (a {n}-layer target)")


# ---------------------------------------------------------------------------------------------
# The public entry points


def load_native(
    path: Path,
    target_family: str | None = None,
    release: str | None = None,
    target_num_layers: int | None = None,
) -> NativeDraft:
    """Read a draft in any layout as a checked native draft."""
    draft = to_native(read_checkpoint(path), target_family, release, target_num_layers)
    check_native(draft, Path(path))
    return draft



def save_native_draft(
    draft: NativeDraft,
    dst: Path,
    to: Layout,
    target_family: str | None = None,
    release: str | None = None,
    overwrite: bool = False,
    source: str | None = None,
    num_steps: int = DEFAULT_NUM_STEPS,
    verifier: Verifier | None = None,
) -> Path:
    """Write a checked draft in the given layout, atomically (nothing at `dst` unless it all worked)."""
    with atomic_directory(Path(dst), overwrite=overwrite) as tmp:
        write_draft_files(draft, tmp, to, target_family, release, source, num_steps, verifier)
    return Path(dst)


def write_draft_files(
    draft: NativeDraft,
    directory: Path,
    to: Layout,
    target_family: str | None = None,
    release: str | None = None,
    source: str | None = None,
    num_steps: int = DEFAULT_NUM_STEPS,
    verifier: Verifier | None = None,
    manifest_fields: dict | None = None,
) -> None:
    """Check a draft and write its weights, config and manifest into an existing directory. `num_steps` is the
    drafting steps per verify step it is served with, and `verifier` the target it is for (the speculators layout
    records both, and ships the target's embedding); `manifest_fields` are recorded in the manifest too."""
    adapter = LAYOUTS.get(to)
    if adapter is None:
        raise ConversionError(f"unknown layout {to!r}; choose one of {', '.join(LAYOUTS)}")
    check_native(draft, Path(source or directory))
    config = draft.config.model_copy(update={"target_family": target_family or draft.config.target_family})
    encoded = adapter.encode_config(config, release, num_steps, verifier)
    names = adapter.tensor_names(list(draft.tensors))
    tensors = {names[canonical]: tensor.contiguous() for canonical, tensor in draft.tensors.items()}
    if verifier is not None:
        tensors.update(adapter.verifier_tensors(config, verifier))
    save_file(tensors, directory / WEIGHTS_FILE, metadata={"format": "pt"})
    (directory / CONFIG_FILE).write_text(json.dumps(encoded, indent=2) + "\n")
    write_manifest(directory, kind=f"draft-{to}",
                   fields={"layout": to, "source": source, "engine_release": release, **(manifest_fields or {})})


def convert(
    src: Path,
    dst: Path,
    to: Layout,
    target_family: str | None = None,
    release: str | None = None,
    target_num_layers: int | None = None,
    overwrite: bool = False,
    num_steps: int = DEFAULT_NUM_STEPS,
    log: Log = print,
    verifier: Verifier | None = None,
) -> Path:
    """Convert a draft between layouts. The release and family decide the aux ids SGLang needs; a source our
    export wrote is read for the release it records. The speculators layout needs the `verifier`."""
    draft = to_native(read_checkpoint(Path(src)), target_family, release, target_num_layers, log)
    return save_native_draft(draft, dst, to, target_family, release, overwrite, source=str(src), num_steps=num_steps,
                             verifier=verifier)
