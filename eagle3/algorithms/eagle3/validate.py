"""Validate a draft checkpoint against what a serving engine will actually do with it.

Each problem has a code (eagle3.contract.problems), a severity and a fix. A check whose inputs are missing
(no target, no data manifest, no release where the answer depends on it) is reported with severity
"unknown": it was not passed, it was not checked. The engine is SGLang (LlamaForCausalLMEagle3), or speculators'
own loader (`--engine speculators`, checked in eagle3.algorithms.eagle3.speculators_checks). For SGLang the tensor names,
config fields and dtypes are checked in eagle3.algorithms.eagle3.loader_checks; the shapes, the vocab map, the aux ids and
the context length here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3.contract import engines
import eagle3.algorithms.eagle3.contract as loader
from eagle3.contract.releases import parse_release
from eagle3.algorithms.eagle3.checkpoint import (
    PROVENANCE_KEY, RawCheckpoint, draft_shapes, mha_attention_shapes, mla_attention_shapes, read_checkpoint,
)
from eagle3.algorithms.eagle3.layouts import sglang
from eagle3.config.draft import MLA_SIZES
from eagle3.contract.releases import SPECULATORS_RELEASE
from eagle3.algorithms.eagle3.loader_checks import check_config_fields, check_dtypes, check_flags, check_names, sample_names
from eagle3.records.manifest import read_data_capture
from eagle3.contract.problems import CONVERT_HINT, ProblemCode, Report
from eagle3.validation.external import sglang_where
from eagle3.algorithms.eagle3.speculators_checks import check_speculators
from eagle3.target.info import read_target_info
from eagle3.draft.vocab_map import analyze_d2t

ENGINES = ("sglang", "speculators")


@dataclass
class Context:
    """What is known about the target and the data, and where each fact came from."""

    num_layers: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    family: str | None = None
    data_layers: list[int] | None = None
    data_layers_source: str = ""
    feature_backend: str | None = None  # the backend that computed the data's features, "local" or "sglang"
    feature_backend_release: str | None = None


def validate(
    path: Path,
    engine: str = "sglang",
    release: str | None = None,
    target: Path | None = None,
    data_manifest: Path | None = None,
    context_length: int | None = None,
    target_family: str | None = None,
    data_layers: list[int] | None = None,
) -> Report:
    """`data_layers`: the layers the training data were captured at, when no data manifest says (the pipeline
    config's data.aux_layers, for a draft trained elsewhere)."""
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r} is not supported; choose one of {', '.join(ENGINES)}")
    if engine == "speculators":
        if release not in (None, SPECULATORS_RELEASE):
            raise ValueError(f"speculators {release}: only the loader of speculators {SPECULATORS_RELEASE} was read")
        release = SPECULATORS_RELEASE
    elif release is not None:
        parse_release(release)
    raw = read_checkpoint(Path(path))
    report = Report(path=str(path), engine=engine, engine_release=release)
    if raw.layout == "eagle" or _eagle_shaped(raw):
        report.add(
            ProblemCode.EAGLE_NOT_EAGLE3,
            "error",
            "this is an EAGLE (v1/v2) draft: fc takes cat(embed, hidden) and there is no hidden_norm; SGLang's "
            "EAGLE3 algorithm cannot serve it",
            "train an EAGLE-3 draft (or serve this one with --speculative-algorithm EAGLE)",
        )
        return report
    ctx = _context(raw, target, data_manifest, target_family, data_layers)
    if engine == "speculators":
        _check_vocab(raw, check_speculators(raw, ctx, report), ctx, report)
        layer = raw.config.get("transformer_layer_config")
        _check_context(layer.get("max_position_embeddings") if isinstance(layer, dict) else None, context_length,
                       report)
        return report
    attention = sglang.attention_of(raw.config)
    if attention == "mla":
        rule, rule_note = _mla_loader_rule(release, report)
        if rule is None:
            return report
    else:
        rule, rule_note = loader.loader_rule(release)
    where = sglang_where(release)
    loaded = check_names(raw, rule, rule_note, where, report)
    check_config_fields(raw, report, loader.DRAFT_ARCHITECTURES[attention])
    if attention == "mla":
        _check_mla_fields(raw, loaded, report)
    num_aux = _check_shapes(raw, loaded, ctx, rule, where, report)
    _check_vocab(raw, loaded, ctx, report)
    _check_aux_ids(raw, ctx, release, num_aux, report)
    _check_context(raw.config.get("max_position_embeddings"), context_length, report)
    return report


def validate_for_conversion(raw: RawCheckpoint, flags: list[str], release: str | None,
                            vocab_size: int | None) -> Report:
    """What converting a native or speculators draft (`flags`: the switches its config decodes to) to the sglang
    layout for SGLang `release` would carry over for SGLang to misread: switches the release does not implement and
    the vocab map. Everything else is checked on the converted export, by `validate`."""
    report = Report(path=str(raw.path), engine="sglang", engine_release=release)
    check_flags(set(flags), loader.loader_rule(release)[0], sglang_where(release), report)
    vocab = {name: raw.tensors[name] for name in loader.VOCAB_TENSORS if name in raw.tensors}
    _check_vocab(raw, vocab, Context(vocab_size=vocab_size), report)
    return report


def _mla_loader_rule(release: str | None, report: Report) -> tuple[loader.DraftLoaderRule | None, str]:
    """The MLA draft's loader for a release: the oldest one read when none is given; None (reported) for a release
    without the architecture."""
    name = loader.MLA_DRAFT_ARCHITECTURE
    if release is None:
        return loader.MLA_LOADER_RULES[0], f"no release given: checked against the oldest {name} loader (0.5.12)"
    rule = loader.draft_loader_rule("mla", release)
    if rule is None:
        report.add(ProblemCode.CONFIG_ARCHITECTURE, "error",
                   f"architectures is [{name}]; SGLang {release} does not have it (it ships from 0.5.12, "
                   "models/kimi_k25_eagle3.py)", "serve with SGLang >= 0.5.12")
    return rule, ""


def _check_mla_fields(raw: RawCheckpoint, loaded: dict[str, torch.Tensor], report: Report) -> None:
    """What SGLang's MLA draft needs beyond the names: every MLA size (it refuses a config without q_lora_rank), and
    both halves of the down projection it fuses on load (with one missing, neither loads)."""
    missing = [name for name in MLA_SIZES if raw.config.get(name) is None]
    if missing:
        report.add(ProblemCode.CONFIG_FIELD, "error", f"config.json lacks {', '.join(missing)} (an "
                   f"{loader.MLA_DRAFT_ARCHITECTURE} draft is built from them; without q_lora_rank SGLang refuses it)",
                   "write the MLA sizes the tensors were trained with")
    halves = [f"{loader.CANONICAL_LAYER_PREFIX}.{name}" for name in loader.MLA_FUSED_PAIR]
    present = [name for name in halves if name in loaded]
    if len(present) == 1:
        report.add(ProblemCode.MISSING_TENSOR, "error",
                   f"only {present[0]} of the pair SGLang fuses into fused_qkv_a_proj_with_mqa is here: it loads "
                   "neither, and both keep their random initialisation", "ship q_a_proj and kv_a_proj_with_mqa")


def _eagle_shaped(raw: RawCheckpoint) -> bool:
    fc = raw.tensors.get("fc.weight")
    hidden = raw.config.get("hidden_size")
    has_hidden_norm = any(name.endswith("hidden_norm.weight") for name in raw.tensors)
    return fc is not None and hidden is not None and tuple(fc.shape) == (hidden, 2 * hidden) and not has_hidden_norm


def _context(raw: RawCheckpoint, target: Path | None, data_manifest: Path | None, family: str | None,
             data_layers: list[int] | None) -> Context:
    ctx = Context(family=family)
    provenance = raw.config.get(PROVENANCE_KEY) or {}
    if target is not None:
        info = read_target_info(target)
        ctx.num_layers, ctx.hidden_size, ctx.vocab_size = info.num_hidden_layers, info.hidden_size, info.vocab_size
        ctx.family = ctx.family or info.family
    if data_manifest is not None:
        capture = read_data_capture(data_manifest)
        ctx.data_layers, ctx.data_layers_source = capture["aux_layers"], f"data manifest {data_manifest}"
        ctx.num_layers = ctx.num_layers or capture.get("num_hidden_layers")
        ctx.hidden_size = ctx.hidden_size or capture.get("hidden_size")
        ctx.family = ctx.family or capture.get("family")
        ctx.feature_backend, ctx.feature_backend_release = capture["engine"], capture["engine_release"]
    elif data_layers is not None:
        ctx.data_layers = list(data_layers)
        ctx.data_layers_source = "the layers the pipeline captures (data.aux_layers)"
    elif provenance.get("aux_layers") is not None:
        ctx.data_layers = provenance["aux_layers"]
        ctx.data_layers_source = f"the checkpoint's own '{PROVENANCE_KEY}' record"
    ctx.num_layers = ctx.num_layers or provenance.get("target_num_hidden_layers")
    ctx.family = ctx.family or provenance.get("target_family")
    return ctx


def _check_shapes(
    raw: RawCheckpoint,
    loaded: dict[str, torch.Tensor],
    ctx: Context,
    rule: loader.DraftLoaderRule,
    where: str,
    report: Report,
) -> int | None:
    """Compare every loaded tensor with the shape the config implies; return the number of aux states."""
    config = raw.config
    needed = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
    missing_fields = [key for key in needed if key not in config]
    if missing_fields:
        report.add(ProblemCode.CONFIG_FIELD, "error", f"config.json lacks {', '.join(missing_fields)}",
                   "write the draft's full config")
        return None
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    if sglang.attention_of(config) == "mla":
        if any(config.get(name) is None for name in MLA_SIZES):
            return None  # reported by _check_mla_fields
        attention = mla_attention_shapes(hidden, heads, *(config[name] for name in MLA_SIZES))
    else:
        attention = mha_attention_shapes(hidden, heads * head_dim, (config.get("num_key_value_heads") or heads) * head_dim)
    target_hidden = config.get("target_hidden_size") or hidden
    draft_vocab = config.get("draft_vocab_size")
    ids = _nested_ids(config)
    num_aux = rule.fixed_num_aux or (config.get("num_aux_hidden_states") or (len(ids) if ids else 3))
    if rule.fixed_num_aux and ids is not None and len(ids) != rule.fixed_num_aux:
        report.add(
            ProblemCode.AUX_COUNT,
            "error",
            f"{where} builds fc for exactly {rule.fixed_num_aux} aux states; eagle_config names {len(ids)}",
            "train with 3 aux layers or serve with SGLang ≥ 0.5.12",
        )
    if draft_vocab is None:
        _report_draft_vocab_size(raw, loaded, report)
        draft_vocab = config["vocab_size"]
    served_flags = loader.enabled_flags(config) & rule.flags
    expected = draft_shapes(
        hidden=hidden,
        target_hidden=target_hidden,
        intermediate=config["intermediate_size"],
        attention=attention,
        num_aux=num_aux,
        draft_vocab=draft_vocab,
        vocab=config["vocab_size"],
        norm_before_fc="norm_before_fc" in served_flags,
        fc_norm="fc_norm" in served_flags,
    )
    missing = sorted(set(expected) - set(loaded) - {"t2d"})  # SGLang never reads t2d
    if missing:
        report.add(
            ProblemCode.MISSING_TENSOR,
            "error",
            f"{where} would load no value for {len(missing)} required tensor(s): {sample_names(missing)}; "
            "they would keep their random initialisation",
            CONVERT_HINT,
        )
    mismatched = [
        f"{name} {list(loaded[name].shape)} (config implies {list(shape)})"
        for name, shape in expected.items()
        if name in loaded and tuple(loaded[name].shape) != shape
    ]
    if mismatched:
        report.add(ProblemCode.SHAPE_MISMATCH, "error", "tensor shapes disagree with config.json: " + "; ".join(mismatched),
                   "fix config.json to describe the tensors (or re-export)")
    check_dtypes(loaded, config, report)
    if ctx.hidden_size is None:
        report.add(ProblemCode.HIDDEN_SIZE, "unknown", "hidden_size not compared with the target's",
                   "pass --target DIR")
    else:
        for key, value in (("hidden_size", hidden), ("target_hidden_size", target_hidden)):
            if value != ctx.hidden_size:
                report.add(
                    ProblemCode.HIDDEN_SIZE,
                    "error",
                    f"{key} is {value} but the target's hidden size is {ctx.hidden_size} (SGLang swaps in the "
                    "target's embedding and feeds the target's hidden states)",
                    "train the draft for this target",
                )
    if ctx.vocab_size is not None and config["vocab_size"] != ctx.vocab_size:
        report.add(
            ProblemCode.VOCAB_SIZE,
            "error",
            f"vocab_size is {config['vocab_size']} but the target's vocabulary is {ctx.vocab_size}",
            "build the vocab map with the target's tokenizer",
        )
    return num_aux


def _report_draft_vocab_size(raw: RawCheckpoint, loaded: dict[str, torch.Tensor], report: Report) -> None:
    """What SGLang does without a draft_vocab_size (LlamaForCausalLMEagle3, every release read)."""
    vocab, head = raw.config["vocab_size"], loaded.get("lm_head.weight")
    rows = head.shape[0] if head is not None else None
    if "draft_vocab_size" not in raw.config:
        consequence = "SGLang fails while building the draft (AttributeError: the config has no draft_vocab_size)"
    elif rows is not None and rows != vocab:
        consequence = (f"draft_vocab_size is null: SGLang sizes lm_head for the target's whole vocabulary ({vocab} rows) "
                       f"and its loader fails an assertion on this {rows}-row head")
    else:
        consequence = (f"draft_vocab_size is null: SGLang serves a {vocab}-row head over the whole vocabulary and still "
                       "maps its rows through d2t (hot_token_id = d2t + arange)")
    size = raw.tensors["d2t"].numel() if "d2t" in raw.tensors else "<rows of lm_head>"
    report.add(ProblemCode.DRAFT_VOCAB_SIZE, "error", consequence, f'set "draft_vocab_size": {size}')


def _check_vocab(raw: RawCheckpoint, loaded: dict[str, torch.Tensor], ctx: Context, report: Report) -> None:
    d2t, t2d = loaded.get("d2t"), loaded.get("t2d")
    if d2t is None:
        return  # reported as a missing tensor
    config = raw.config
    if config.get("draft_vocab_size") is not None and d2t.numel() != config["draft_vocab_size"]:
        report.add(
            ProblemCode.DRAFT_VOCAB_SIZE,
            "error",
            f"draft_vocab_size is {config['draft_vocab_size']} but d2t has {d2t.numel()} entries",
            "make draft_vocab_size equal the rows of lm_head and d2t",
        )
    analysis = analyze_d2t(d2t, t2d, ctx.vocab_size or config.get("vocab_size"))
    evidence = "; ".join(analysis.evidence)
    if analysis.encoding == "absolute":
        report.add(
            ProblemCode.D2T_ABSOLUTE,
            "error",
            f"d2t holds absolute target ids, but SGLang reads offsets (hot_token_id = d2t + arange): {evidence}",
            "store d2t[i] = target_id[i] - i (`eagle3 convert` re-encodes and checks it)",
        )
    elif analysis.encoding == "invalid":
        out_of_range = analysis.offsets_in_range is False
        report.add(
            ProblemCode.D2T_OUT_OF_RANGE if out_of_range else ProblemCode.D2T_T2D_DISAGREE,
            "error",
            f"{analysis.verdict}: {evidence}",
            "rebuild the vocab map (`eagle3 vocab build`) and re-export",
        )
    elif analysis.encoding == "unknown":
        report.add(ProblemCode.D2T_ENCODING, "unknown", f"{analysis.verdict}: {evidence}", "store t2d beside d2t")
    elif not analysis.offsets_sorted:
        report.add(
            ProblemCode.D2T_UNSORTED,
            "warning",
            "d2t is consistent but its target ids are not ascending (still served correctly: row i predicts i + d2t[i])",
            "sort the draft vocabulary when building the map",
        )
    if t2d is not None and "vocab_size" in config and t2d.numel() != config["vocab_size"]:
        report.add(
            ProblemCode.VOCAB_SIZE, "error",
            f"t2d has {t2d.numel()} entries but vocab_size is {config.get('vocab_size')}",
            "t2d must span the target vocabulary",
        )


def _check_served_states(ctx: Context, release: str | None, report: Report) -> None:
    """Data whose features SGLang computed on the served release hold what that release captures; any other features
    (transformers', or an unknown backend's) are the residual stream."""
    problem = engines.served_features_problem(ctx.family, release)
    if problem is None or (ctx.feature_backend == "sglang" and release is not None and ctx.feature_backend_release is not None
                           and parse_release(ctx.feature_backend_release) == parse_release(release)):
        return
    made_by = {"local": "transformers", "sglang": f"SGLang {ctx.feature_backend_release}"}.get(ctx.feature_backend, "an unknown backend")
    report.add(ProblemCode.AUX_STATES_DIFFER, "error", f"{problem} (the data's features: {made_by})",
               "serve with a release that captures the residual stream, or capture the data through SGLang on the "
               "release you serve")


def _check_aux_ids(raw: RawCheckpoint, ctx: Context, release: str | None, num_aux: int | None, report: Report) -> None:
    ids = _nested_ids(raw.config)
    if ids is not None and len(set(ids)) != len(ids):
        report.add(ProblemCode.AUX_IDS_INVALID, "error", f"aux ids {ids} repeat a layer", "capture distinct layers")
    if ctx.num_layers is None:
        report.add(
            ProblemCode.CAPTURED_LAYERS, "unknown",
            "which layers SGLang captures is unknown without the target's layer count",
            "pass --target DIR or --data-manifest FILE",
        )
        return
    capture = engines.sglang_capture(ids, ctx.family, release, ctx.num_layers)
    if capture.status == "ambiguous":
        report.add(
            ProblemCode.AUX_IDS_AMBIGUOUS, "error", f"aux ids {ids}: {capture.explanation}",
            "pass --release (the release you serve with)",
        )
        return
    if capture.status == "unknown":
        report.add(ProblemCode.CAPTURED_LAYERS, "unknown", capture.explanation,
                   "pass --target DIR (or its family) and the release")
        return
    _check_served_states(ctx, release, report)
    if capture.lost_ids:
        report.add(
            ProblemCode.AUX_IDS_INVALID,
            "error",
            f"aux ids {ids}: {capture.explanation}; the draft would receive fewer aux states than its fc expects",
            f"aux layers must be below {ctx.num_layers - 1} for a {ctx.num_layers}-layer target",
        )
    if -1 in capture.layers:
        report.add(
            ProblemCode.AUX_IDS_INVALID, "error",
            f"aux ids {ids}: SGLang would capture the input of layer 0, the embeddings (0.5.13's DeepSeek/Kimi and "
            "0.5.13-0.5.17's glm4_moe_lite files fail at the first forward instead)",
            CONVERT_HINT,
        )
    if num_aux is not None and len(capture.layers) != num_aux:
        report.add(
            ProblemCode.AUX_COUNT, "error",
            f"SGLang captures {len(capture.layers)} aux states but fc expects {num_aux}",
            "make the aux ids match the fc input width",
        )
    if ctx.data_layers is None:
        report.add(
            ProblemCode.CAPTURED_LAYERS, "unknown",
            f"{capture.explanation}; the layers the data were captured at are unknown",
            "pass --data-manifest FILE",
        )
        return
    if list(capture.layers) != list(ctx.data_layers):
        report.add(
            ProblemCode.AUX_IDS_MISSING if ids is None else ProblemCode.CAPTURED_LAYERS_MISMATCH,
            "error",
            f"{capture.explanation}, but the training data were captured at layers {ctx.data_layers} "
            f"({ctx.data_layers_source})",
            CONVERT_HINT,
        )
    elif ids is None:
        report.add(
            ProblemCode.AUX_IDS_MISSING,
            "warning",
            f"no eagle_config ids: SGLang's default happens to capture the data's layers {ctx.data_layers}",
            "write the ids explicitly so the draft does not depend on a default",
        )


def _check_context(max_positions: int | None, context_length: int | None, report: Report) -> None:
    if context_length is None:
        report.add(ProblemCode.CONTEXT_LENGTH, "unknown", "serving context length not compared",
                   "pass --context-length N")
    elif max_positions is None or max_positions < context_length:
        report.add(
            ProblemCode.CONTEXT_LENGTH,
            "error",
            f"max_position_embeddings is {max_positions} but the server's context is {context_length}",
            f"set max_position_embeddings >= {context_length} (and check the RoPE settings)",
        )


def _nested_ids(config: dict) -> list[int] | None:
    return (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")

