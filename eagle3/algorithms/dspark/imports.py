"""DSpark drafts trained elsewhere, as `eagle3 registry import` and `eagle3 simulate --draft` take them: SpecForge's
export (`architectures: [DSparkDraftModel]`, the head's fields nested in `dflash_config`), SGLang's layout as
published drafts ship it (`Qwen3DSparkModel`, the fields at the top level or in `dspark_config`), or this project's
own exports. The backbone's fields are read as a DFlash import reads them (eagle3.algorithms.dflash.imports); the
draft is written in SGLang's layout and validated as the export stage validates its own: a draft SGLang would serve
wrongly is refused, named (docs/algorithms.md, "DSpark")."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from eagle3.algorithms.dflash.imports import TARGET_HEAD, native_fields
from eagle3.algorithms.dspark.layout import HEAD_TYPES, validate_sglang, write_sglang
from eagle3.algorithms.dspark.model import DSparkConfig
from eagle3.contract.problems import ProblemCode, Report
from eagle3.draft.files import CONFIG_FILE, WEIGHTS_FILE
from eagle3.fsutil import atomic_directory, read_json
from eagle3.validation.external import Converted, Serving, refuse_on_errors, summary

Log = Callable[[str], None]
# SpecForge 0.2.0's objective defaults (OnlineDSparkModel), recorded on an import: its config does not say
SPECFORGE_WEIGHTS = {"ce_weight": 0.1, "l1_weight": 0.9, "confidence_weight": 1.0}


def head_fields(raw: dict, tensors: dict[str, torch.Tensor], report: Report, steps: list[str]) -> dict:
    """The heads' fields, wherever the writer put them: the top level wins (SGLang's model reads only there), then
    dspark_config, then dflash_config (SpecForge's). What the config leaves open is read off the tensors: SpecForge
    writes enable_confidence_head only when it was set (its default is no head: confidence_head_alpha 0), and its
    confidence_head_with_markov (default False) likewise; the head's presence and its input width say which."""
    nested = {**(raw.get("dflash_config") or {}), **(raw.get("dspark_config") or {})}

    def field(name, default=None):
        return raw.get(name, nested.get(name, default))

    rank, kind = field("markov_rank"), field("markov_head_type", "vanilla")
    if not isinstance(rank, int) or rank <= 0:
        report.add(ProblemCode.CONFIG_FIELD, "error", f"markov_rank is {rank}: SGLang serves no DSpark draft without a "
                   "Markov head", "import a DSpark draft that has one")
    if kind not in HEAD_TYPES:
        report.add(ProblemCode.CONFIG_FIELD, "error", f"markov_head_type {kind} is none of {', '.join(HEAD_TYPES)}",
                   "import a draft whose head SGLang builds")
    proj = tensors.get("confidence_head.proj.weight")
    enabled = field("enable_confidence_head")
    if enabled is None:
        enabled = proj is not None
        steps.append(f"no enable_confidence_head: {'a' if enabled else 'no'} confidence head, as its tensors say")
    elif enabled and proj is None:
        report.add(ProblemCode.MISSING_TENSOR, "error", "enable_confidence_head is true but there is no "
                   "confidence_head.proj.weight: SGLang's ragged verify refuses the draft", "import the draft with "
                   "its confidence head, or with enable_confidence_head false")
    with_markov = field("confidence_head_with_markov")
    if with_markov is None:
        hidden = raw.get("hidden_size")
        with_markov = bool(enabled and proj is not None and isinstance(rank, int) and isinstance(hidden, int)
                           and proj.shape[-1] == hidden + rank)
        said = f"as its head's width {proj.shape[-1]} says" if enabled and proj is not None else "SpecForge's default"
        steps.append(f"no confidence_head_with_markov: {with_markov}, {said} (the export writes it at the top level, "
                     "where SGLang, whose default is true, reads it)")
    return {"markov_rank": rank, "markov_head_type": kind, "confidence_head": bool(enabled),
            "confidence_head_with_markov": bool(with_markov)}


def convert_dspark(source: Path, dst: Path, serving: Serving, log: Log) -> Converted:
    """Validate the DSpark draft at `source` for `serving`, write it in SGLang's layout at `dst` (which appears only
    when it validates) and say what was done; raise ImportRefused on its problems."""
    raw = read_json(source / CONFIG_FILE, "missing")
    report = Report(str(source), "sglang", serving.release)
    done = Converted("sglang", [f"found a DSpark draft: architectures {raw.get('architectures')}"])
    fields = native_fields(raw, "sglang", serving, report, done.steps)
    found = load_file(source / WEIGHTS_FILE)
    tensors = {name.removeprefix("model."): t for name, t in found.items()}  # SGLang's loader strips it too
    heads = head_fields(raw, tensors, report, done.steps)
    refuse_on_errors(str(source), report)
    dropped = sorted(name for name in tensors if name in TARGET_HEAD)
    if dropped:
        done.steps.append(f"dropped {', '.join(dropped)}: the target's (SGLang's DSpark draft uses its own)")
    if not heads["confidence_head"]:
        tensors = {name: t for name, t in tensors.items() if not name.startswith("confidence_head.")}
    cfg = DSparkConfig(**fields, **heads, **SPECFORGE_WEIGHTS,
                       target_hidden_size=raw.get("target_hidden_size") or fields["hidden_size"],
                       draft_vocab_size=fields["vocab_size"], target_family=serving.family)
    done.steps.append(f"decoded the config: target layers {cfg.aux_layers} (output of decoder layer k), "
                      f"{cfg.num_hidden_layers} layer(s), gamma {cfg.block_size}, {cfg.markov_head_type} Markov head "
                      f"of rank {cfg.markov_rank}, mask token {cfg.mask_token_id}, {cfg.torch_dtype}")
    with tempfile.TemporaryDirectory() as scratch, atomic_directory(Path(dst), overwrite=True) as tmp:
        native = Path(scratch)
        save_file({name: t.contiguous() for name, t in tensors.items() if name not in dropped}, native / WEIGHTS_FILE,
                  metadata={"format": "pt"})
        (native / CONFIG_FILE).write_text(cfg.model_dump_json())
        write_sglang(native, tmp)
        served = validate_sglang(tmp, serving.release, None, serving.context_length, captured=serving.data_layers)
        refuse_on_errors(str(source), served)
    served.path = str(dst)
    done.validation = {"source": report.to_dict(), "sglang": served.to_dict()}
    done.draft = draft_section(cfg)
    done.steps.append(f"wrote SGLang's layout and validated it as the pipeline's exports are: {summary(served)}")
    for line in done.steps:
        log(f"import: {line}")
    return done


def draft_section(cfg: DSparkConfig) -> dict:
    """The draft section of a config that would have trained this draft: what its version records."""
    return {"algorithm": "dspark",
            "dspark": {"num_layers": cfg.num_hidden_layers, "block_size": cfg.block_size,
                       "mask_token_id": cfg.mask_token_id, "markov_rank": cfg.markov_rank,
                       "markov_head": cfg.markov_head_type, "confidence_head": cfg.confidence_head,
                       "confidence_head_with_markov": cfg.confidence_head_with_markov},
            **{name: getattr(cfg, name) for name in ("intermediate_size", "num_attention_heads", "num_key_value_heads",
                                                     "rms_norm_eps", "rope_theta", "max_position_embeddings",
                                                     "torch_dtype")}}
