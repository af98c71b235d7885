"""DSpark drafts trained elsewhere, as `eagle3 registry import` and `eagle3 simulate --draft` take them: SpecForge's
export (`architectures: [DSparkDraftModel]`, the head's fields nested in `dflash_config`), SGLang's layout as
published drafts ship it (`Qwen3DSparkModel`, the fields at the top level or in `dspark_config`), or this project's
own exports. The backbone's fields are read as a DFlash import reads them (eagle3.algorithms.dflash.imports); the
draft is written in SGLang's layout and validated as the export stage validates its own: a draft SGLang would serve
wrongly is refused, named (docs/algorithms.md, "DSpark")."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from safetensors.torch import load_file

from eagle3.algorithms.dflash.imports import TARGET_HEAD, native_fields, publish
from eagle3.algorithms.dspark.layout import HEAD_TYPES, validate_sglang, write_sglang
from eagle3.algorithms.dspark.model import DSparkConfig
from eagle3.contract.problems import ProblemCode, Report
from eagle3.draft.files import CONFIG_FILE, WEIGHTS_FILE
from eagle3.fsutil import read_json
from eagle3.validation.external import Converted, Serving, refuse_on_errors

Log = Callable[[str], None]
# SpecForge 0.2.0's objective defaults (OnlineDSparkModel), recorded on an import: its config does not say
SPECFORGE_WEIGHTS = {"ce_weight": 0.1, "l1_weight": 0.9, "confidence_weight": 1.0}


def head_fields(raw: dict, tensors: dict, report: Report, steps: list[str]) -> dict:
    """The heads' fields, wherever the writer put them: the top level wins (SGLang's model reads only there), then
    dspark_config, then dflash_config (SpecForge's). A confidence head the config does not mention is the one the
    tensors hold (SpecForge builds it only when asked and saves what it built), and its width, where the config leaves
    it open, is its weight's: the stream alone, or the stream and the Markov row."""
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
    weight = tensors.get("confidence_head.proj.weight")
    enabled = field("enable_confidence_head")
    if enabled is None:
        enabled = weight is not None
        steps.append(f"no enable_confidence_head: the confidence head is {'on' if enabled else 'off'}, as its "
                     f"tensors are {'present' if enabled else 'absent'} (SpecForge saves the head it built)")
    with_markov = field("confidence_head_with_markov")
    if with_markov is None:
        width = None if weight is None else weight.shape[-1]
        with_markov = isinstance(rank, int) and width == (raw.get("hidden_size") or 0) + rank
        steps.append(f"no confidence_head_with_markov: {str(with_markov).lower()}, "
                     f"{'SpecForge default' if width is None else f'confidence_head.proj.weight is {width} wide'} "
                     "(SGLang would assume the Markov row; the export names it)")
    return {"markov_rank": rank, "markov_head_type": kind, "confidence_head": bool(enabled),
            "confidence_head_with_markov": bool(with_markov)}


def convert_dspark(source: Path, dst: Path, serving: Serving, log: Log) -> Converted:
    """Validate the DSpark draft at `source` for `serving`, write it in SGLang's layout at `dst` (which appears only
    when it validates) and say what was done; raise ImportRefused on its problems."""
    raw = read_json(source / CONFIG_FILE, "missing")
    report = Report(str(source), "sglang", serving.release)
    done = Converted("sglang", [f"found a DSpark draft: architectures {raw.get('architectures')}"])
    found = load_file(source / WEIGHTS_FILE)
    tensors = {name.removeprefix("model."): t for name, t in found.items()}  # SGLang's loader strips it too
    if renamed := [name for name in found if name.startswith("model.")]:
        done.steps.append(f"renamed {len(renamed)} tensor(s) without their model. prefix, as SGLang's loader reads "
                          "them")
    spark = raw.get("dspark_config") or {}
    # SGLang's DSpark worker takes its mask token from dspark_config before the top level and dflash_config
    backbone = {**raw, "mask_token_id": spark["mask_token_id"]} if "mask_token_id" in spark else raw
    fields = native_fields(backbone, "sglang", serving, report, done.steps)
    heads = head_fields(raw, tensors, report, done.steps)
    refuse_on_errors(str(source), report)
    dropped = sorted(name for name in tensors if name in TARGET_HEAD)
    if dropped:
        done.steps.append(f"dropped {', '.join(dropped)}: the target's (SGLang's DSpark draft uses its own)")
    if not heads["confidence_head"] and (unread := sorted(n for n in tensors if n.startswith("confidence_head."))):
        done.steps.append(f"dropped {', '.join(unread)}: enable_confidence_head is false, so no server reads them")
        tensors = {name: t for name, t in tensors.items() if name not in unread}
    cfg = DSparkConfig(**fields, **heads, **SPECFORGE_WEIGHTS,
                       target_hidden_size=raw.get("target_hidden_size") or fields["hidden_size"],
                       draft_vocab_size=fields["vocab_size"], target_family=serving.family)
    done.steps.append(f"decoded the config: target layers {cfg.aux_layers} (output of decoder layer k), "
                      f"{cfg.num_hidden_layers} layer(s), gamma {cfg.block_size}, {cfg.markov_head_type} Markov head "
                      f"of rank {cfg.markov_rank}, mask token {cfg.mask_token_id}, {cfg.torch_dtype}")
    kept = {name: t for name, t in tensors.items() if name not in dropped}
    return publish(source, dst, serving, cfg, kept, report, done, (write_sglang, validate_sglang, draft_section), log)


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
