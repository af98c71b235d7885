"""DFlash drafts trained elsewhere, as `eagle3 registry import` and `eagle3 simulate --draft` take them: SGLang's layout
as z-lab's and SpecForge's drafts ship it (`DFlashDraftModel`, `dflash_config`), speculators' (`speculators_model_type:
dflash`, its nested `transformer_layer_config`, which SGLang cannot read), or this project's own exports. Each is
decoded into the native config (speculators' ids, the input of layer k, become this project's k - 1; ids a config
leaves out are SGLang's default spread), written in SGLang's layout, and validated as the export stage validates its
own, against the layers the pipeline's data are captured at: a draft SGLang would serve wrongly is refused, named
(docs/algorithms.md, "DFlash")."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

from safetensors.torch import load_file, save_file

from eagle3.algorithms.dflash.layout import validate_sglang, write_sglang
from eagle3.algorithms.dflash.model import DFlashConfig
from eagle3.algorithms.dflash.speculators import MODEL_TYPE
from eagle3.algorithms.dflash.contract import dflash_default_layer_ids
from eagle3.contract.problems import ProblemCode, Report
from eagle3.draft.files import CONFIG_FILE, WEIGHTS_FILE
from eagle3.fsutil import atomic_directory, read_json
from eagle3.validation.external import Converted, Serving, refuse_on_errors, summary

Log = Callable[[str], None]
QWEN3_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "rms_norm_eps", "max_position_embeddings", "vocab_size")
TARGET_HEAD = ("embed_tokens.weight", "lm_head.weight")  # the target's, which SGLang's DFlashDraftModel takes itself


def convert_dflash(source: Path, dst: Path, serving: Serving, log: Log) -> Converted:
    """Validate the DFlash draft at `source` for `serving`, write it in SGLang's layout at `dst` (which appears only
    when it validates) and say what was done; raise ImportRefused on its problems."""
    raw = read_json(source / CONFIG_FILE, "missing")
    layout = "speculators" if raw.get("speculators_model_type") == MODEL_TYPE else "sglang"
    report = Report(str(source), layout, serving.release)
    done = Converted(layout, [f"found a DFlash draft in {layout}'s layout: architectures {raw.get('architectures')}"])
    fields = native_fields(raw, layout, serving, report, done.steps)
    refuse_on_errors(str(source), report)
    found = load_file(source / WEIGHTS_FILE)
    tensors = {name.removeprefix("model."): t for name, t in found.items()}  # SGLang's loader strips it too
    if renamed := [name for name in found if name.startswith("model.")]:
        done.steps.append(f"renamed {len(renamed)} tensor(s) without their model. prefix, as SGLang's loader reads them")
    dropped = sorted(name for name in tensors if name in TARGET_HEAD)
    if dropped:
        done.steps.append(f"dropped {', '.join(dropped)}: the target's (SGLang's DFlashDraftModel uses its own)")
    cfg = DFlashConfig(**fields, target_hidden_size=raw.get("target_hidden_size") or fields["hidden_size"],
                       draft_vocab_size=fields["vocab_size"], target_family=serving.family)
    done.steps.append(f"decoded the config: target layers {cfg.aux_layers} (output of decoder layer k), "
                      f"{cfg.num_hidden_layers} layer(s), block {cfg.block_size}, mask token {cfg.mask_token_id}, "
                      f"{cfg.torch_dtype}")
    kept = {name: t for name, t in tensors.items() if name not in dropped}
    return publish(source, dst, serving, cfg, kept, report, done, (write_sglang, validate_sglang, draft_section), log)


def publish(source: Path, dst: Path, serving: Serving, cfg: DFlashConfig, tensors: dict, report: Report,
            done: Converted, kind: tuple[Callable, Callable, Callable], log: Log) -> Converted:
    """The decoded draft (`cfg`, `tensors`; DFlash's or a kind built on its backbone, whose `kind` gives its SGLang
    writer, validation and draft section) written in SGLang's layout at `dst`, which appears only when it validates
    for `serving` as the pipeline's exports are validated; the steps logged."""
    write, validate, section = kind
    with tempfile.TemporaryDirectory() as scratch, atomic_directory(Path(dst), overwrite=True) as tmp:
        native = Path(scratch)
        save_file({name: t.contiguous() for name, t in tensors.items()}, native / WEIGHTS_FILE,
                  metadata={"format": "pt"})
        (native / CONFIG_FILE).write_text(cfg.model_dump_json())
        write(native, tmp)
        served = validate(tmp, serving.release, None, serving.context_length, captured=serving.data_layers)
        refuse_on_errors(str(source), served)
    served.path = str(dst)
    done.validation = {"source": report.to_dict(), "sglang": served.to_dict()}
    done.draft = section(cfg)
    done.steps.append(f"wrote SGLang's layout and validated it as the pipeline's exports are: {summary(served)}")
    for line in done.steps:
        log(f"import: {line}")
    return done


def native_fields(raw: dict, layout: str, serving: Serving, report: Report, steps: list[str]) -> dict:
    """The native config's fields a DFlash config gives, in this project's numbering; a field it lacks that cannot be
    told otherwise is a problem in `report`."""
    layers = (raw.get("transformer_layer_config") or {}) if layout == "speculators" else raw
    fields = {name: layers.get(name) for name in QWEN3_FIELDS}
    if missing := [name for name, value in fields.items() if value is None]:
        report.add(ProblemCode.CONFIG_FIELD, "error", f"no {', '.join(missing)}: the draft's layers cannot be built",
                   "write the draft's Qwen3 fields into its config")
        return {}
    fields.update(head_dim=layers.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"],
                  rope_theta=(layers.get("rope_parameters") or {}).get("rope_theta") or layers.get("rope_theta")
                  or 1_000_000.0,  # Qwen3's default, as SGLang's transformers takes it
                  torch_dtype=raw.get("torch_dtype") or raw.get("dtype") or layers.get("torch_dtype") or "bfloat16",
                  target_num_hidden_layers=raw.get("num_target_layers") or serving.num_layers)
    if fields["vocab_size"] != serving.vocab_size:
        report.add(ProblemCode.VOCAB_SIZE, "error", f"vocab_size {fields['vocab_size']} is not the target's "
                   f"{serving.vocab_size}: the draft was trained for another target", "import a draft of this target")
    if "sliding_attention" in (layers.get("layer_types") or []):
        report.add(ProblemCode.UNSUPPORTED_FLAG, "error", "sliding-window draft layers: this project's DFlash draft "
                   "has full attention only", "import a draft whose layers all attend fully")
    dflash = raw.get("dflash_config") or {}
    block, mask = raw.get("block_size"), raw.get("mask_token_id", dflash.get("mask_token_id"))
    if not isinstance(block, int):
        report.add(ProblemCode.CONFIG_FIELD, "error", "no block_size: SGLang takes 16 or the server's "
                   "--speculative-num-draft-tokens, which may not be the block the draft was trained on",
                   "set block_size to the block the draft was trained on")
    if not isinstance(mask, int) or not 0 <= mask < fields["vocab_size"]:
        report.add(ProblemCode.VOCAB_SIZE, "error", f"mask_token_id {mask} is not an id of the target's "
                   f"{fields['vocab_size']}", "set the mask token id the draft was trained with")
    fields.update(block_size=block, mask_token_id=mask, aux_layers=layer_ids(raw, layout, fields, report, steps))
    if layout == "speculators" and raw.get("draft_vocab_size") not in (None, fields["vocab_size"]):
        report.add(ProblemCode.DRAFT_VOCAB_SIZE, "error", f"draft_vocab_size {raw['draft_vocab_size']} of "
                   f"{fields['vocab_size']}: a reduced head of its own (lm_head, d2t), which SGLang's DFlashDraftModel "
                   "never reads (it drafts over the target's head)", "import a full-vocabulary DFlash draft")
    return fields


def layer_ids(raw: dict, layout: str, fields: dict, report: Report, steps: list[str]) -> list[int] | None:
    """The target layers the draft reads, in this project's numbering (id k = the output of layer k)."""
    if layout == "speculators":
        ids = raw.get("aux_hidden_state_layer_ids")
        if ids is None:
            report.add(ProblemCode.AUX_IDS_MISSING, "error", "no aux_hidden_state_layer_ids: the layers the draft was "
                       "trained on are unknown", "set them as speculators trained it")
            return None
        if 0 in ids:
            report.add(ProblemCode.AUX_IDS_INVALID, "error", f"aux_hidden_state_layer_ids {ids} hold 0, the "
                       "embedding's output: SGLang captures decoder layers' outputs only", "retrain without id 0")
            return None
        steps.append(f"speculators' aux_hidden_state_layer_ids {ids} (the input of layer k) are layers "
                     f"{[k - 1 for k in ids]} (the output of layer k)")
        return [k - 1 for k in ids]
    ids = (raw.get("dflash_config") or {}).get("target_layer_ids")
    if ids is None:
        ids = dflash_default_layer_ids(fields["target_num_hidden_layers"], fields["num_hidden_layers"])
        steps.append(f"no dflash_config.target_layer_ids: SGLang spreads {ids} over the target's "
                     f"{fields['target_num_hidden_layers']} layers (build_target_layer_ids)")
    return list(ids)


def draft_section(cfg: DFlashConfig) -> dict:
    """The draft section of a config that would have trained this draft: what its version records."""
    return {"algorithm": "dflash", "dflash": {"num_layers": cfg.num_hidden_layers, "block_size": cfg.block_size,
                                              "mask_token_id": cfg.mask_token_id},
            **{name: getattr(cfg, name) for name in ("intermediate_size", "num_attention_heads", "num_key_value_heads",
                                                     "rms_norm_eps", "rope_theta", "max_position_embeddings",
                                                     "torch_dtype")}}
