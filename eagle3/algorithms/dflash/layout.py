"""A DFlash draft in the layout SGLang's DFlashDraftModel loads (srt/models/dflash.py, 0.5.11-0.5.23), and what would
go wrong with one before a server starts (docs/algorithms.md, "DFlash").

config.json: `architectures: [DFlashDraftModel]` with Qwen3's fields (model_type qwen3, head_dim, rms_norm_eps,
rope_theta and rope_parameters, hidden_act silu, no attention bias), `block_size`, `num_target_layers` and `dflash_config: {target_layer_ids,
mask_token_id}`; target_layer_ids are this project's numbering (id k = the output of layer k), which every release
records for them on the families it captures for (tests/conformance/test_dflash.py). Tensors: the draft's own under
SGLang's names (`fc`, `hidden_norm`, `layers.N.*` with q/k/v and gate/up apart, which its loader stacks, `norm`); no
embedding and no head, which it takes from the target.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from pydantic import ValidationError
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle3.algorithms.dflash.model import DFlashConfig, DFlashDraft
from eagle3.algorithms.dflash.contract import FIXED_ROPE_THETA, dflash_family_problem, dflash_rope_problem
from eagle3.contract.problems import ProblemCode, Report
from eagle3.draft.files import CONFIG_FILE, WEIGHTS_FILE
from eagle3.errors import UnreadableInput
from eagle3.fsutil import read_json
from eagle3.records.manifest import read_data_capture, write_manifest

ARCHITECTURE = "DFlashDraftModel"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def sglang_config(cfg: DFlashConfig) -> dict:
    return {
        "architectures": [ARCHITECTURE], "model_type": "qwen3", "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        # transformers 5 (the pin of SGLang 0.5.11 on) reads Qwen3's RoPE base only from here: with rope_theta alone
        # the server rotates with Qwen3's default 1,000,000 (tests/conformance/test_dflash_loader.py)
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
        "hidden_act": cfg.hidden_act, "attention_bias": False, "tie_word_embeddings": False,
        "torch_dtype": cfg.torch_dtype, "block_size": cfg.block_size, "num_target_layers": cfg.target_num_hidden_layers,
        "dflash_config": {"target_layer_ids": list(cfg.aux_layers), "mask_token_id": cfg.mask_token_id},
        "eagle3": {"native": cfg.model_dump()},  # our record: the native config, for reading the export back
    }


def write_sglang(source: Path, directory: Path) -> Path:
    """The native draft at `source` (config.json + model.safetensors) as SGLang's layout in `directory`."""
    return write_export(source, directory, "sglang", sglang_config)


def write_export(source: Path, directory: Path, layout: str, config_of: Callable[[DFlashConfig], dict],
                 config_type: type[DFlashConfig] = DFlashConfig) -> Path:
    """The native draft at `source` (of `config_type`: DFlash's, or a kind built on its backbone) in `layout` in
    `directory`, replaced if there: the tensors in the config's dtype, config.json as `config_of` writes it, written
    beside and moved in whole."""
    cfg = native_config(source, config_type)
    dtype = DTYPES[cfg.torch_dtype]
    tensors = {name: t.to(dtype).contiguous() for name, t in load_file(source / WEIGHTS_FILE).items()}
    partial = directory.with_name(directory.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file(tensors, partial / WEIGHTS_FILE, metadata={"format": "pt"})
    (partial / CONFIG_FILE).write_text(json.dumps(config_of(cfg), indent=2) + "\n")
    write_manifest(partial, kind=f"draft-{cfg.format.removesuffix('-native')}-{layout}",
                   fields={"layout": layout, "source": str(source)})
    shutil.rmtree(directory, ignore_errors=True)
    partial.rename(directory)
    return directory


def native_config(directory: Path, config_type: type[DFlashConfig] = DFlashConfig) -> DFlashConfig:
    """The native config (of `config_type`) of the draft at `directory`: a trained draft's, or the one an export
    records."""
    raw = read_json(directory / CONFIG_FILE, "missing")
    try:
        return config_type.model_validate((raw.get("eagle3") or {}).get("native") or raw)
    except ValidationError as err:
        kind = config_type.model_fields["format"].default.removesuffix("-native")
        raise UnreadableInput(f"{directory / CONFIG_FILE}: not a {kind} draft this project wrote "
                              f"({err.errors()[0]['loc']}: {err.errors()[0]['msg']}); import a draft from elsewhere "
                              "with `eagle3 registry import`") from None


def read_sglang(directory: Path) -> tuple[DFlashConfig, dict[str, torch.Tensor]]:
    """An export `write_sglang` wrote: the native config it records and its tensors."""
    return native_config(directory), load_file(directory / WEIGHTS_FILE)


def validate_sglang(directory: Path, release: str | None, data_manifest: Path | None,
                    context_length: int | None, captured: list[int] | None = None) -> Report:
    """What SGLang `release` would do wrongly with the export at `directory` (its ids against the layers of the data at
    `data_manifest`, or the `captured` layers, when given): each problem named, with its fix. The
    releases' loaders and capture agree (tests/conformance/test_dflash*.py); their RoPE base does not
    (eagle3.algorithms.dflash.contract)."""
    report = Report(str(directory), "sglang", release)
    raw = read_json(directory / CONFIG_FILE, "missing")
    family = ((raw.get("eagle3") or {}).get("native") or {}).get("target_family") or "unknown"
    if raw.get("architectures") != [ARCHITECTURE]:
        report.add(ProblemCode.CONFIG_ARCHITECTURE, "error", f"architectures is {raw.get('architectures')}; SGLang "
                   f"serves DFlash as {ARCHITECTURE}", f"set architectures to [{ARCHITECTURE}]")
    if problem := dflash_family_problem(family):
        report.add(ProblemCode.CAPTURED_LAYERS, "error", problem, "serve a DFlash draft of another target family")
    dflash = raw.get("dflash_config") or {}
    if data_manifest is not None:
        captured = read_data_capture(data_manifest)["aux_layers"]
    check_layer_ids(report, dflash.get("target_layer_ids"), captured)
    mask, vocab = dflash.get("mask_token_id"), raw.get("vocab_size")
    if not isinstance(mask, int) or not isinstance(vocab, int) or not 0 <= mask < vocab:
        report.add(ProblemCode.VOCAB_SIZE, "error", f"dflash_config.mask_token_id {mask} is not an id of the target's "
                   f"{vocab} (vocab_size): SGLang refuses it, or resolves a mask token from the tokenizer that the "
                   "draft never saw", "set dflash_config.mask_token_id to the id it was trained with")
    if not isinstance(raw.get("block_size"), int):
        report.add(ProblemCode.CONFIG_FIELD, "error", "no block_size: SGLang takes 16 or the server's "
                   "--speculative-num-draft-tokens, which may not be the block the draft was trained on",
                   "set block_size to draft.dflash.block_size")
    rope = (raw.get("rope_parameters") or {}).get("rope_theta")
    if rope != raw.get("rope_theta"):
        report.add(ProblemCode.CONFIG_FIELD, "error", f"rope_parameters.rope_theta is {rope}, rope_theta "
                   f"{raw.get('rope_theta')}: SGLang's transformers reads a Qwen3 config's RoPE base from "
                   "rope_parameters (Qwen3's default 1,000,000 when absent), so the served draft rotates otherwise",
                   "set rope_parameters to {\"rope_type\": \"default\", \"rope_theta\": <the trained base>}")
    if problem := dflash_rope_problem(release, float(raw.get("rope_theta") or 0)):
        report.add(ProblemCode.UNSUPPORTED_FLAG, "error", problem, "serve with SGLang >= 0.5.13, or retrain with "
                   f"draft.rope_theta {FIXED_ROPE_THETA:.0f}")
    if context_length is not None and (raw.get("max_position_embeddings") or 0) < context_length:
        report.add(ProblemCode.CONTEXT_LENGTH, "error", f"max_position_embeddings {raw.get('max_position_embeddings')} "
                   f"is below serving.context_length {context_length}", "raise draft.max_position_embeddings")
    check_tensors(report, directory, (raw.get("eagle3") or {}).get("native"), raw.get("torch_dtype"), "SGLang")
    return report


def check_layer_ids(report: Report, ids, captured: list[int] | None) -> None:
    """The ids SGLang captures for the draft must be the layers its training data came from (None: not known here):
    one off is a draft served its neighbour layer's states."""
    if ids is None:
        report.add(ProblemCode.AUX_IDS_MISSING, "error", "no dflash_config.target_layer_ids: SGLang spreads its own "
                   "default over the target's layers", "set dflash_config.target_layer_ids to the layers the draft "
                   f"was trained on{f' ({captured})' if captured is not None else ''}")
    elif captured is None:
        report.add(ProblemCode.CAPTURED_LAYERS_MISMATCH, "unknown", f"dflash_config.target_layer_ids {list(ids)}: "
                   "the layers the draft was trained on are not known here (no data manifest)",
                   "validate with the run's data (eagle3 validate --data-manifest)")
    elif list(ids) != list(captured):
        report.add(ProblemCode.CAPTURED_LAYERS_MISMATCH, "error", f"dflash_config.target_layer_ids {list(ids)} make "
                   f"SGLang capture the outputs of layers {list(ids)}, but the draft was trained on layers {captured}",
                   f"set dflash_config.target_layer_ids to {captured}")


def check_tensors(report: Report, directory: Path, native: dict | None, dtype: str | None, engine: str,
                  model_type: type[DFlashDraft] = DFlashDraft) -> None:
    """Every parameter `engine`'s draft model has, under its name, shape and the declared `dtype`; nothing it would
    skip. The expected set is our `model_type`'s (DFlash's, or a kind built on its backbone), built on the meta device
    from the `native` config the export records."""
    if native is None:
        report.add(ProblemCode.CONFIG_FIELD, "error", "no eagle3.native record: the tensors cannot be checked against "
                   "the draft's own architecture", "export the draft with this project")
        return
    cfg = model_type.config_type.model_validate(native)
    with torch.device("meta"):
        model = model_type(cfg, torch.empty(cfg.vocab_size, cfg.hidden_size))
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items() if not name.startswith("embed_tokens")}
    with safe_open(directory / WEIGHTS_FILE, "pt") as weights:
        found = {name: (tuple(weights.get_slice(name).get_shape()), weights.get_slice(name).get_dtype())
                 for name in weights.keys()}
    for name in sorted(set(expected) - set(found)):
        report.add(ProblemCode.MISSING_TENSOR, "error", f"{name} is missing: {engine} leaves it at its "
                   "initialisation", "re-export the draft")
    for name in sorted(set(found) - set(expected)):
        report.add(ProblemCode.SKIPPED_TENSOR, "error", f"{name} is no {model_type.served_name} parameter: {engine} "
                   "skips it without a word", "re-export the draft")
    declared = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(dtype)
    for name in sorted(set(expected) & set(found)):
        shape, found_dtype = found[name]
        if shape != expected[name]:
            report.add(ProblemCode.SHAPE_MISMATCH, "error", f"{name} is {list(shape)}, the config makes it "
                       f"{list(expected[name])}", "re-export the draft")
        if found_dtype != declared:
            report.add(ProblemCode.DTYPE, "error", f"{name} is {found_dtype}, the config declares {dtype}",
                       "re-export the draft")
