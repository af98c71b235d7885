"""A DSpark draft in the layout SGLang's Qwen3DSparkModel loads (srt/models/dspark.py, 0.5.16-0.5.23), and what would go
wrong with one before a server starts (docs/algorithms.md, "DSpark").

config.json: DFlash's SGLang config (eagle3.algorithms.dflash.layout: Qwen3's fields, `dflash_config: {target_layer_ids,
mask_token_id}`) with `architectures: [Qwen3DSparkModel]` (the one entry class of every release; DSparkDraftModel came
in 0.5.17), `block_size` gamma, and the head's fields where each reader looks: top level (the model's
build_markov_head and build_confidence_head read only there; vLLM too) and in `dspark_config` and `dflash_config`
(the spec parser's, and SpecForge's). `sample_from_anchor: true`: every entry drafts, the only form before 0.5.20.
Tensors: DFlash's under SGLang's names, then `markov_head.*` and `confidence_head.proj.*`; no embedding and no head.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file

from eagle3.algorithms.dflash.layout import check_layer_ids, check_tensors, native_config, sglang_config, write_export
from eagle3.algorithms.dspark.contract import ARCHITECTURE, dspark_family_problem, dspark_release_problem
from eagle3.algorithms.dspark.model import DSparkConfig, DSparkDraft
from eagle3.contract.problems import Problem, ProblemCode, Report
from eagle3.draft.files import CONFIG_FILE, WEIGHTS_FILE
from eagle3.fsutil import read_json
from eagle3.records.manifest import read_data_capture

HEAD_TYPES = ("vanilla", "gated", "rnn")  # SGLang's SUPPORTED_DSPARK_MARKOV_HEAD_TYPES


def head_fields(cfg: DSparkConfig) -> dict:
    """The head's fields as SGLang's and vLLM's readers name them."""
    return {"markov_rank": cfg.markov_rank, "markov_head_type": cfg.markov_head_type,
            "enable_confidence_head": cfg.confidence_head,
            "confidence_head_with_markov": cfg.confidence_head_with_markov, "sample_from_anchor": True}


def dspark_sglang_config(cfg: DSparkConfig) -> dict:
    config = sglang_config(cfg)
    nested = {**config["dflash_config"], **head_fields(cfg), "block_size": cfg.block_size}
    return {**config, "architectures": [ARCHITECTURE], **head_fields(cfg), "dspark_config": nested,
            "dflash_config": nested}


def write_sglang(source: Path, directory: Path) -> Path:
    """The native draft at `source` as SGLang's layout in `directory`."""
    return write_export(source, directory, "sglang", dspark_sglang_config, DSparkConfig)


def read_sglang(directory: Path) -> tuple[DSparkConfig, dict[str, torch.Tensor]]:
    """An export `write_sglang` wrote: the native config it records and its tensors."""
    return native_config(directory, DSparkConfig), load_file(directory / WEIGHTS_FILE)


def validate_sglang(directory: Path, release: str | None, data_manifest: Path | None,
                    context_length: int | None, captured: list[int] | None = None) -> Report:
    """What SGLang `release` would do wrongly with the DSpark export at `directory`: each problem named, with its fix
    (its ids against the layers of the data at `data_manifest`, or `captured`, when given)."""
    report = Report(str(directory), "sglang", release)
    raw = read_json(directory / CONFIG_FILE, "missing")
    native = (raw.get("eagle3") or {}).get("native") or {}
    if problem := dspark_release_problem(release):
        report.add(ProblemCode.UNSUPPORTED_FLAG, "error", problem, "serve with SGLang >= 0.5.16")
    if raw.get("architectures") != [ARCHITECTURE]:
        report.add(ProblemCode.CONFIG_ARCHITECTURE, "error", f"architectures is {raw.get('architectures')}; every "
                   f"SGLang release with DSPARK serves it as {ARCHITECTURE}", f"set architectures to [{ARCHITECTURE}]")
    if problem := dspark_family_problem(native.get("target_family") or "unknown"):
        report.add(ProblemCode.CAPTURED_LAYERS, "error", problem, "serve a DSpark draft of another target family")
    if data_manifest is not None:
        captured = read_data_capture(data_manifest)["aux_layers"]
    check_layer_ids(report, (raw.get("dflash_config") or {}).get("target_layer_ids"), captured)
    check_head(report, raw, native)
    if context_length is not None and (raw.get("max_position_embeddings") or 0) < context_length:
        report.add(ProblemCode.CONTEXT_LENGTH, "error", f"max_position_embeddings {raw.get('max_position_embeddings')} "
                   f"is below serving.context_length {context_length}", "raise draft.max_position_embeddings")
    checked = len(report.problems)
    check_tensors(report, directory, native or None, raw.get("torch_dtype"), "SGLang", DSparkDraft)
    report.problems[checked:] = [head_tensor_problem(problem) for problem in report.problems[checked:]]
    return report


def placed(raw: dict, name: str) -> dict[str, object]:
    """Each value of `name` the config holds, by where: the top level (SGLang's model and vLLM read it), dflash_config
    and dspark_config (SGLang's spec parser reads these first: gamma from dflash_config.block_size, the worker's
    mask token and Markov rank from dspark_config, merged over dflash_config from 0.5.23)."""
    found = {name: raw[name]} if name in raw else {}
    for nest in ("dflash_config", "dspark_config"):
        if name in (raw.get(nest) or {}):
            found[f"{nest}.{name}"] = raw[nest][name]
    return found


def listed(values: dict) -> str:
    return ", ".join(f"{where} {value}" for where, value in values.items())


def differing(raw: dict, name: str, native: dict) -> dict:
    """The places whose `name` is not the trained one (none where the export records no native config)."""
    return {where: value for where, value in placed(raw, name).items() if native and value != native.get(name)}


def head_tensor_problem(problem: Problem) -> Problem:
    """DFlash's tensor check says what SGLang's DFlash loader does with a tensor no parameter takes (skips it) or a
    parameter no tensor fills (left at its initialisation); its DSpark loader routes the heads' tensors itself
    (load_weights, 0.5.16-0.5.23): it refuses an unknown markov_head.* tensor, and reads confidence_head.* only where
    it builds that head (any SGLANG_RAGGED_VERIFY_MODE but the default static), refusing one missing or unknown
    there. A missing Markov tensor it loads silently, as the check says."""
    name = problem.message.split(" ", 1)[0]  # check_tensors' messages start with the tensor's name
    if problem.code == ProblemCode.SKIPPED_TENSOR and name.startswith("markov_head."):
        return replace(problem, message=f"{name} is no parameter of the draft's Markov head: SGLang's DSpark loader "
                       "refuses it (DSpark unexpected markov weight) and the server does not start")
    if problem.code in (ProblemCode.SKIPPED_TENSOR, ProblemCode.MISSING_TENSOR) and name.startswith("confidence_head."):
        fault = "is missing" if problem.code == ProblemCode.MISSING_TENSOR else "is no confidence head parameter"
        return replace(problem, message=f"{name} {fault}: SGLang refuses the draft wherever it builds the confidence "
                       "head (SGLANG_RAGGED_VERIFY_MODE other than static); its default static verify builds none")
    return problem


def check_head(report: Report, raw: dict, native: dict) -> None:
    """The fields SGLang builds the head and the block from, against what the draft was trained with, wherever a
    reader looks (`placed`): the Markov rank and head type (the model reads the top level, the spec parser the nested
    configs first), the mask token, gamma."""
    rank, kind = raw.get("markov_rank"), raw.get("markov_head_type")
    if not isinstance(rank, int) or rank <= 0:
        report.add(ProblemCode.CONFIG_FIELD, "error", f"markov_rank is {rank}: SGLang refuses a DSpark draft without "
                   "a Markov head (markov_rank > 0, read at the config's top level)",
                   f"set markov_rank to {native.get('markov_rank', 'the trained rank')}")
    elif wrong := differing(raw, "markov_rank", native):
        report.add(ProblemCode.SHAPE_MISMATCH, "error", f"{listed(wrong)}, but the draft was trained with "
                   f"{native.get('markov_rank')}: SGLang builds markov_w1/markov_w2 of that rank and refuses the "
                   "tensors", f"set markov_rank to {native.get('markov_rank')} everywhere")
    if kind not in HEAD_TYPES:
        report.add(ProblemCode.CONFIG_FIELD, "error", f"markov_head_type is {kind}: SGLang refuses a Markov rank "
                   f"without one of {', '.join(HEAD_TYPES)}", f"set markov_head_type to "
                   f"{native.get('markov_head_type', 'the trained head')}")
    elif wrong := differing(raw, "markov_head_type", native):
        report.add(ProblemCode.CONFIG_FIELD, "error", f"{listed(wrong)}, but the draft was trained with a "
                   f"{native.get('markov_head_type')} head: SGLang builds the other head and refuses its tensors",
                   f"set markov_head_type to {native.get('markov_head_type')} everywhere")
    masks, vocab = placed(raw, "mask_token_id"), raw.get("vocab_size")
    outside = {where: mask for where, mask in masks.items()
               if not isinstance(mask, int) or not isinstance(vocab, int) or not 0 <= mask < vocab}
    if not masks or outside:
        report.add(ProblemCode.VOCAB_SIZE, "error", f"{listed(outside) or 'no dflash_config.mask_token_id'}: not an "
                   f"id of the target's {vocab} (vocab_size): SGLang's DSpark refuses it", "set it to the id the "
                   "draft was trained with")
    elif wrong := differing(raw, "mask_token_id", native):
        report.add(ProblemCode.CONFIG_FIELD, "error", f"{listed(wrong)}, but the draft was trained with "
                   f"{native.get('mask_token_id')} at its blocks' unknown entries",
                   f"set it to {native.get('mask_token_id')} everywhere")
    gammas = placed(raw, "block_size")
    if not gammas:
        report.add(ProblemCode.CONFIG_FIELD, "error", "no block_size: SGLang's DSpark takes gamma from the server's "
                   "--speculative-num-draft-tokens alone, unchecked against the block the draft was trained on",
                   "set block_size to draft.dspark.block_size")
    elif wrong := differing(raw, "block_size", native):
        report.add(ProblemCode.CONFIG_FIELD, "error", f"{listed(wrong)}, but the draft's gamma is "
                   f"{native.get('block_size')}: SGLang takes gamma from dflash_config.block_size (else the top "
                   f"level) and refuses --speculative-num-draft-tokens {native.get('block_size', 0) + 1}",
                   f"set block_size to {native.get('block_size')} everywhere")
    if native.get("confidence_head") is False:
        report.add(ProblemCode.CONFIG_FIELD, "warning", "no confidence head: SGLang builds one whenever "
                   "SGLANG_RAGGED_VERIFY_MODE is not static (it never reads enable_confidence_head) and then refuses "
                   "this draft for the head's missing tensors; it serves it in the default static verify only",
                   "serve with SGLANG_RAGGED_VERIFY_MODE=static (the default), or train with "
                   "draft.dspark.confidence_head true")
    if raw.get("confidence_head_with_markov") is None and native.get("confidence_head"):
        report.add(ProblemCode.CONFIG_FIELD, "error", "no confidence_head_with_markov: SGLang then builds the head "
                   "over the Markov row too, vLLM without it; one of them reads the weights at the wrong width",
                   f"set confidence_head_with_markov to {native.get('confidence_head_with_markov')}")
    elif native.get("confidence_head") and (wrong := differing(raw, "confidence_head_with_markov", native)):
        report.add(ProblemCode.SHAPE_MISMATCH, "error", f"{listed(wrong)}, but the draft's confidence head was "
                   f"trained {'with' if native.get('confidence_head_with_markov') else 'without'} the Markov row: "
                   "the servers build confidence_head.proj of the other width and refuse its weight",
                   f"set confidence_head_with_markov to {native.get('confidence_head_with_markov')} everywhere")
