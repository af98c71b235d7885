"""Validate a draft checkpoint against what a serving engine will actually do with it.

Each problem has a code, a severity and a fix. A check whose inputs are missing (no target, no data
manifest, no release where the answer depends on it) is reported with severity "unknown": it was not
passed, it was not checked.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from eagle3.formats import engines
from eagle3.formats.checkpoint import PROVENANCE_KEY, RawCheckpoint, draft_shapes, read_checkpoint
from eagle3.formats.manifest import read_data_capture
from eagle3.formats.target import read_target_info
from eagle3.formats.vocab_map import analyze_d2t

CONVERT_HINT = "re-export with `eagle3 convert SRC DST --to sglang --engine-version RELEASE`"


@dataclass(frozen=True)
class Problem:
    code: str
    severity: str  # "error", "warning" or "unknown"
    message: str
    fix: str


@dataclass
class Report:
    path: str
    engine: str
    engine_release: str | None
    problems: list[Problem] = field(default_factory=list)

    def add(self, code: str, severity: str, message: str, fix: str) -> None:
        self.problems.append(Problem(code, severity, message, fix))

    def of(self, severity: str) -> list[Problem]:
        return [p for p in self.problems if p.severity == severity]

    def errors(self, waived: list[str] = ()) -> list[Problem]:
        """The errors, less those whose codes are waived on purpose (`export.waive`)."""
        return [p for p in self.of("error") if p.code not in waived]

    @property
    def ok(self) -> bool:
        return not self.of("error")

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


@dataclass
class Context:
    """What is known about the target and the data, and where each fact came from."""

    num_layers: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    family: str | None = None
    data_layers: list[int] | None = None
    data_layers_source: str = ""


def validate(
    path: Path,
    engine: str = "sglang",
    engine_release: str | None = None,
    target: Path | None = None,
    data_manifest: Path | None = None,
    context_length: int | None = None,
    target_family: str | None = None,
) -> Report:
    if engine != "sglang":
        raise ValueError(f"engine {engine!r} is not supported; only 'sglang' is validated")
    if engine_release is not None:
        engines.parse_release(engine_release)
    raw = read_checkpoint(Path(path))
    report = Report(path=str(path), engine=engine, engine_release=engine_release)
    if raw.layout == "eagle" or _eagle_shaped(raw):
        report.add(
            "eagle-not-eagle3",
            "error",
            "this is an EAGLE (v1/v2) draft: fc takes cat(embed, hidden) and there is no hidden_norm; SGLang's "
            "EAGLE3 algorithm cannot serve it",
            "train an EAGLE-3 draft (or serve this one with --speculative-algorithm EAGLE)",
        )
        return report
    ctx = _context(raw, target, data_manifest, target_family)
    if engines.MLA_DRAFT_ARCHITECTURE in (raw.config.get("architectures") or []):
        _report_mla_draft(raw, ctx, engine_release, context_length, report)
        return report
    rule, rule_note = engines.loader_rule(engine_release)
    where = f"SGLang {engine_release}" if engine_release else "SGLang ≤ 0.5.11 (strictest; no release given)"
    loaded = _check_names(raw, rule, rule_note, where, report)
    _check_config_fields(raw, report)
    num_aux = _check_shapes(raw, loaded, ctx, rule, where, report)
    _check_vocab(raw, loaded, ctx, report)
    _check_aux_ids(raw, ctx, engine_release, num_aux, report)
    _check_context(raw, context_length, report)
    return report


def _report_mla_draft(raw: RawCheckpoint, ctx: Context, release: str | None, context_length: int | None,
                      report: Report) -> None:
    """SGLang's MLA draft: what does not depend on the draft's layer is checked; its tensors are not."""
    name = engines.MLA_DRAFT_ARCHITECTURE
    if release is not None and engines.parse_release(release) < engines.MLA_DRAFT_FROM:
        report.add("config-architecture", "error", f"architectures is [{name}]; SGLang {release} does not have it "
                   "(it ships from 0.5.12, models/kimi_k25_eagle3.py)", "serve with SGLang >= 0.5.12")
    report.add("architecture-unchecked", "unknown",
               f"{name} (one DeepSeek-V2 MLA decoder layer, SGLang >= 0.5.12) is served by SGLang, but this project "
               "checks the tensor names and shapes of LlamaForCausalLMEagle3 drafts only: they were not checked",
               "check its tensors by hand against models/kimi_k25_eagle3.py of the release you serve")
    _check_vocab(raw, {n: t for n, t in raw.tensors.items() if n in engines.VOCAB_TENSORS}, ctx, report)
    ids = _nested_ids(raw.config) or raw.config.get("eagle_aux_hidden_state_layer_ids")
    num_aux = len(ids) if ids else 3  # how models/kimi_k25_eagle3.py sizes its fc
    _check_aux_ids(raw, ctx, release, num_aux, report)
    _check_context(raw, context_length, report)


def _eagle_shaped(raw: RawCheckpoint) -> bool:
    fc = raw.tensors.get("fc.weight")
    hidden = raw.config.get("hidden_size")
    has_hidden_norm = any(name.endswith("hidden_norm.weight") for name in raw.tensors)
    return fc is not None and hidden is not None and tuple(fc.shape) == (hidden, 2 * hidden) and not has_hidden_norm


def _context(raw: RawCheckpoint, target: Path | None, data_manifest: Path | None, family: str | None) -> Context:
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
    elif provenance.get("aux_layers") is not None:
        ctx.data_layers = provenance["aux_layers"]
        ctx.data_layers_source = f"the checkpoint's own '{PROVENANCE_KEY}' record"
    ctx.num_layers = ctx.num_layers or provenance.get("target_num_hidden_layers")
    ctx.family = ctx.family or provenance.get("target_family")
    return ctx


def _check_names(
    raw: RawCheckpoint, rule: engines.DraftLoaderRule, note: str, where: str, report: Report
) -> dict[str, torch.Tensor]:
    """Return the tensors the loader keeps (canonical names); report those it would drop."""
    flags = engines.enabled_flags(raw.config)
    for flag in sorted(flags - rule.flags):
        never = flag == "norm_before_residual"
        report.add(
            "unsupported-flag",
            "error",
            f"config sets {flag}, which {where} does not implement: it would serve a different network than the "
            f"one trained" + (" (no SGLang release read implements it)" if never else ""),
            "retrain without it" if never else "serve with a release that implements it and pass that release",
        )
    loaded, skipped, sources = {}, [], {}
    for name, tensor in raw.tensors.items():
        canonical = engines.loaded_name(name, rule, flags)
        if canonical is None:
            skipped.append(name)
        else:
            loaded[canonical] = tensor
            sources.setdefault(canonical, []).append(name)
    clashes = {canonical: names for canonical, names in sources.items() if len(names) > 1}
    if clashes:
        report.add(
            "duplicate-tensor",
            "error",
            "several tensors load into the same parameter (which one wins depends on file order): "
            + "; ".join(f"{' and '.join(sorted(names))} -> {canonical}" for canonical, names in sorted(clashes.items())),
            "keep one spelling of each tensor",
        )
    if skipped:
        if "model.lm_head.weight" in skipped:
            fix = "rename model.lm_head.weight to lm_head.weight (the head is outside the draft's `model` module)"
        elif any(n.startswith("layers.0.") for n in skipped):
            fix = f"rename layers.0.* to midlayer.* ({CONVERT_HINT})"
        else:
            fix = "remove them, or serve with a release whose loader uses them"
        report.add(
            "skipped-tensor",
            "error",
            f"{where} would skip {len(skipped)} tensor(s) without a word: {_sample(skipped)}"
            + (f" ({note})" if note else ""),
            fix,
        )
    return loaded


def _check_config_fields(raw: RawCheckpoint, report: Report) -> None:
    config = raw.config
    for sentence in engines.misplaced_flags(config):
        report.add(
            "flag-misplaced",
            "error",
            f"{sentence}: the draft would be served with a different architecture than the config says, and the "
            "tensors of the switch that is off would be dropped",
            "write each switch once, at the top level of config.json (fc_norm, use_aux_norm, norm_output, "
            "norm_before_fc), and remove it from eagle_config",
        )
    architectures = config.get("architectures") or []
    if raw.layout == "speculators" or "LlamaForCausalLMEagle3" not in architectures:
        report.add(
            "config-architecture",
            "error",
            f"architectures is {architectures}; SGLang's EAGLE3 worker loads LlamaForCausalLMEagle3",
            CONVERT_HINT,
        )
    if config.get("model_type") != "llama":
        report.add(
            "config-model-type",
            "error",
            f"model_type is {config.get('model_type')!r}; transformers' AutoConfig needs 'llama' to read this draft",
            'set "model_type": "llama"',
        )
    if config.get("num_hidden_layers") != 1 and raw.layout != "speculators":
        report.add(
            "config-num-layers",
            "error",
            f"num_hidden_layers is {config.get('num_hidden_layers')!r}; an EAGLE-3 draft has exactly 1 (SGLang builds "
            "the extra layers with random weights; transformers defaults a missing value to 32)",
            'set "num_hidden_layers": 1',
        )
    if config.get("tie_word_embeddings"):
        report.add(
            "config-tie-embeddings",
            "error",
            "tie_word_embeddings is true: SGLang would make lm_head the (target's) embedding and ignore the trained head",
            'set "tie_word_embeddings": false',
        )
    if "torch_dtype" not in config and "dtype" not in config:
        report.add(
            "config-torch-dtype", "warning", "torch_dtype is not set; the engine picks a dtype on its own", 'set "torch_dtype"'
        )
    if config.get("eagle_aux_hidden_state_layer_ids") is not None and not (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    ):
        report.add(
            "aux-ids-top-level",
            "error",
            "eagle_aux_hidden_state_layer_ids is given only at the top level; SGLang reads only "
            "eagle_config.eagle_aux_hidden_state_layer_ids and silently captures its default layers",
            "move the ids into eagle_config (re-encoded for the release: " + CONVERT_HINT + ")",
        )


def _check_shapes(
    raw: RawCheckpoint,
    loaded: dict[str, torch.Tensor],
    ctx: Context,
    rule: engines.DraftLoaderRule,
    where: str,
    report: Report,
) -> int | None:
    """Compare every loaded tensor with the shape the config implies; return the number of aux states."""
    config = raw.config
    needed = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
    missing_fields = [key for key in needed if key not in config]
    if missing_fields:
        report.add("config-field", "error", f"config.json lacks {', '.join(missing_fields)}", "write the draft's full config")
        return None
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    target_hidden = config.get("target_hidden_size") or hidden
    draft_vocab = config.get("draft_vocab_size")
    ids = _nested_ids(config)
    num_aux = rule.fixed_num_aux or (config.get("num_aux_hidden_states") or (len(ids) if ids else 3))
    if rule.fixed_num_aux and ids is not None and len(ids) != rule.fixed_num_aux:
        report.add(
            "aux-count",
            "error",
            f"{where} builds fc for exactly {rule.fixed_num_aux} aux states; eagle_config names {len(ids)}",
            "train with 3 aux layers or serve with SGLang ≥ 0.5.12",
        )
    if draft_vocab is None:
        _report_draft_vocab_size(raw, loaded, report)
        draft_vocab = config["vocab_size"]
    served_flags = engines.enabled_flags(config) & rule.flags
    expected = draft_shapes(
        hidden=hidden,
        target_hidden=target_hidden,
        intermediate=config["intermediate_size"],
        q_width=heads * head_dim,
        kv_width=(config.get("num_key_value_heads") or heads) * head_dim,
        num_aux=num_aux,
        draft_vocab=draft_vocab,
        vocab=config["vocab_size"],
        norm_before_fc="norm_before_fc" in served_flags,
        fc_norm="fc_norm" in served_flags,
    )
    missing = sorted(set(expected) - set(loaded) - {"t2d"})  # SGLang never reads t2d
    if missing:
        report.add(
            "missing-tensor",
            "error",
            f"{where} would load no value for {len(missing)} required tensor(s): {_sample(missing)}; "
            "they would keep their random initialisation",
            CONVERT_HINT,
        )
    mismatched = [
        f"{name} {list(loaded[name].shape)} (config implies {list(shape)})"
        for name, shape in expected.items()
        if name in loaded and tuple(loaded[name].shape) != shape
    ]
    if mismatched:
        report.add("shape-mismatch", "error", "tensor shapes disagree with config.json: " + "; ".join(mismatched),
                   "fix config.json to describe the tensors (or re-export)")
    _check_dtypes(loaded, config, report)
    if ctx.hidden_size is None:
        report.add("hidden-size", "unknown", "hidden_size not compared with the target's", "pass --target DIR")
    else:
        for key, value in (("hidden_size", hidden), ("target_hidden_size", target_hidden)):
            if value != ctx.hidden_size:
                report.add(
                    "hidden-size",
                    "error",
                    f"{key} is {value} but the target's hidden size is {ctx.hidden_size} (SGLang swaps in the "
                    "target's embedding and feeds the target's hidden states)",
                    "train the draft for this target",
                )
    if ctx.vocab_size is not None and config["vocab_size"] != ctx.vocab_size:
        report.add(
            "vocab-size",
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
    report.add("draft-vocab-size", "error", consequence, f'set "draft_vocab_size": {size}')


def _check_dtypes(loaded: dict[str, torch.Tensor], config: dict, report: Report) -> None:
    for name, want in (("d2t", torch.int64), ("t2d", torch.bool)):
        if name in loaded and loaded[name].dtype != want:
            report.add("dtype", "error", f"{name} is {loaded[name].dtype}, expected {want}", f"save {name} as {want}")
    weights = {n: t for n, t in loaded.items() if n not in engines.VOCAB_TENSORS}
    not_float = sorted(n for n, t in weights.items() if not t.is_floating_point())
    if not_float:
        report.add("dtype", "error", f"weights that are not floating point: {_sample(not_float)}", "re-export the weights")
    declared = config.get("torch_dtype") or config.get("dtype")
    others = sorted({str(t.dtype).removeprefix("torch.") for t in weights.values()} - {declared})
    if declared and others and not not_float:
        report.add(
            "dtype",
            "warning",
            f"config declares torch_dtype {declared} but tensors are {', '.join(others)}",
            "make torch_dtype match the stored tensors",
        )


def _check_vocab(raw: RawCheckpoint, loaded: dict[str, torch.Tensor], ctx: Context, report: Report) -> None:
    d2t, t2d = loaded.get("d2t"), loaded.get("t2d")
    if d2t is None:
        return  # reported as a missing tensor
    config = raw.config
    if config.get("draft_vocab_size") is not None and d2t.numel() != config["draft_vocab_size"]:
        report.add(
            "draft-vocab-size",
            "error",
            f"draft_vocab_size is {config['draft_vocab_size']} but d2t has {d2t.numel()} entries",
            "make draft_vocab_size equal the rows of lm_head and d2t",
        )
    analysis = analyze_d2t(d2t, t2d, ctx.vocab_size or config.get("vocab_size"))
    evidence = "; ".join(analysis.evidence)
    if analysis.encoding == "absolute":
        report.add(
            "d2t-absolute",
            "error",
            f"d2t holds absolute target ids, but SGLang reads offsets (hot_token_id = d2t + arange): {evidence}",
            "store d2t[i] = target_id[i] - i (`eagle3 convert` re-encodes and checks it)",
        )
    elif analysis.encoding == "invalid":
        out_of_range = analysis.offsets_in_range is False
        report.add(
            "d2t-out-of-range" if out_of_range else "d2t-t2d-disagree",
            "error",
            f"{analysis.verdict}: {evidence}",
            "rebuild the vocab map (`eagle3 vocab build`) and re-export",
        )
    elif analysis.encoding == "unknown":
        report.add("d2t-encoding", "unknown", f"{analysis.verdict}: {evidence}", "store t2d beside d2t")
    elif not analysis.offsets_sorted:
        report.add(
            "d2t-unsorted",
            "warning",
            "d2t is consistent but its target ids are not ascending (still served correctly: row i predicts i + d2t[i])",
            "sort the draft vocabulary when building the map",
        )
    if t2d is not None and "vocab_size" in config and t2d.numel() != config["vocab_size"]:
        report.add(
            "vocab-size", "error", f"t2d has {t2d.numel()} entries but vocab_size is {config.get('vocab_size')}",
            "t2d must span the target vocabulary",
        )


def _check_aux_ids(raw: RawCheckpoint, ctx: Context, release: str | None, num_aux: int | None, report: Report) -> None:
    ids = _nested_ids(raw.config)
    if ids is not None and len(set(ids)) != len(ids):
        report.add("aux-ids-invalid", "error", f"aux ids {ids} repeat a layer", "capture distinct layers")
    if ctx.num_layers is None:
        report.add(
            "captured-layers", "unknown", "which layers SGLang captures is unknown without the target's layer count",
            "pass --target DIR or --data-manifest FILE",
        )
        return
    capture = engines.sglang_capture(ids, ctx.family, release, ctx.num_layers)
    if capture.status == "ambiguous":
        report.add(
            "aux-ids-ambiguous", "error", f"aux ids {ids}: {capture.explanation}",
            "pass --engine-version (the release you serve with)",
        )
        return
    if capture.status == "unknown":
        report.add("captured-layers", "unknown", capture.explanation, "pass --target DIR (or its family) and the release")
        return
    if capture.lost_ids:
        report.add(
            "aux-ids-invalid",
            "error",
            f"aux ids {ids}: {capture.explanation}; the draft would receive fewer aux states than its fc expects",
            f"aux layers must be below {ctx.num_layers - 1} for a {ctx.num_layers}-layer target",
        )
    if -1 in capture.layers:
        report.add(
            "aux-ids-invalid", "error",
            f"aux ids {ids}: SGLang would capture the input of layer 0, the embeddings (0.5.13's DeepSeek/Kimi and "
            "0.5.13-0.5.17's glm4_moe_lite files fail at the first forward instead)",
            CONVERT_HINT,
        )
    if num_aux is not None and len(capture.layers) != num_aux:
        report.add(
            "aux-count", "error", f"SGLang captures {len(capture.layers)} aux states but fc expects {num_aux}",
            "make the aux ids match the fc input width",
        )
    if ctx.data_layers is None:
        report.add(
            "captured-layers", "unknown", f"{capture.explanation}; the layers the data were captured at are unknown",
            "pass --data-manifest FILE",
        )
        return
    if list(capture.layers) != list(ctx.data_layers):
        report.add(
            "aux-ids-missing" if ids is None else "captured-layers-mismatch",
            "error",
            f"{capture.explanation}, but the training data were captured at layers {ctx.data_layers} "
            f"({ctx.data_layers_source})",
            CONVERT_HINT,
        )
    elif ids is None:
        report.add(
            "aux-ids-missing",
            "warning",
            f"no eagle_config ids: SGLang's default happens to capture the data's layers {ctx.data_layers}",
            "write the ids explicitly so the draft does not depend on a default",
        )


def _check_context(raw: RawCheckpoint, context_length: int | None, report: Report) -> None:
    max_positions = raw.config.get("max_position_embeddings")
    if context_length is None:
        report.add("context-length", "unknown", "serving context length not compared", "pass --context-length N")
    elif max_positions is None or max_positions < context_length:
        report.add(
            "context-length",
            "error",
            f"max_position_embeddings is {max_positions} but the server's context is {context_length}",
            f"set max_position_embeddings >= {context_length} (and check the RoPE settings)",
        )


def _nested_ids(config: dict) -> list[int] | None:
    return (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")


def _sample(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")
