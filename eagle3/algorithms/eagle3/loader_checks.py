"""What SGLang's draft loader makes of a checkpoint before any shape is compared: the tensor names it
keeps, the config.json fields it reads, and the tensors' dtypes (part of `eagle3.algorithms.eagle3.validate`)."""

from __future__ import annotations

import torch

import eagle3.algorithms.eagle3.contract as loader
from eagle3.algorithms.eagle3.checkpoint import RawCheckpoint
from eagle3.contract.problems import CONVERT_HINT, ProblemCode, Report


def check_names(
    raw: RawCheckpoint, rule: loader.DraftLoaderRule, note: str, where: str, report: Report
) -> dict[str, torch.Tensor]:
    """Return the tensors the loader keeps (canonical names); report those it would drop."""
    flags = loader.enabled_flags(raw.config)
    check_flags(flags, rule, where, report)
    loaded, skipped, sources = {}, [], {}
    for name, tensor in raw.tensors.items():
        canonical = loader.loaded_name(name, rule, flags)
        if canonical is None:
            skipped.append(name)
        else:
            loaded[canonical] = tensor
            sources.setdefault(canonical, []).append(name)
    clashes = {canonical: names for canonical, names in sources.items() if len(names) > 1}
    if clashes:
        report.add(
            ProblemCode.DUPLICATE_TENSOR,
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
            ProblemCode.SKIPPED_TENSOR,
            "error",
            f"{where} would skip {len(skipped)} tensor(s) without a word: {sample_names(skipped)}"
            + (f" ({note})" if note else ""),
            fix,
        )
    return loaded


def check_flags(flags: set[str], rule: loader.DraftLoaderRule, where: str, report: Report) -> None:
    """Report the architecture switches a draft uses that the release's loader does not implement."""
    for flag in sorted(flags - rule.flags):
        never = flag == "norm_before_residual"
        report.add(
            ProblemCode.UNSUPPORTED_FLAG,
            "error",
            f"config sets {flag}, which {where} does not implement: it would serve a different network than the "
            f"one trained" + (" (no SGLang release read implements it)" if never else ""),
            "retrain without it" if never else "serve with a release that implements it and pass that release",
        )


def check_config_fields(raw: RawCheckpoint, report: Report, architecture: str) -> None:
    """The config.json fields SGLang builds the draft from, for a draft of `architecture` (one of
    loader.DRAFT_ARCHITECTURES)."""
    config = raw.config
    for sentence in loader.misplaced_flags(config):
        report.add(
            ProblemCode.FLAG_MISPLACED,
            "error",
            f"{sentence}: the draft would be served with a different architecture than the config says, and the "
            "tensors of the switch that is off would be dropped",
            "write each switch once, at the top level of config.json (fc_norm, use_aux_norm, norm_output, "
            "norm_before_fc), and remove it from eagle_config",
        )
    architectures = config.get("architectures") or []
    if raw.layout == "speculators" or architecture not in architectures:
        report.add(
            ProblemCode.CONFIG_ARCHITECTURE,
            "error",
            f"architectures is {architectures}; SGLang's EAGLE3 worker loads {architecture}",
            CONVERT_HINT,
        )
    # transformers' AutoConfig reads the draft's config: 'llama' for the Llama form; the MLA form's sizes are kept by
    # any config class (its MLA fields are read as attributes)
    if architecture == loader.DRAFT_ARCHITECTURES["mha"] and config.get("model_type") != "llama":
        report.add(
            ProblemCode.CONFIG_MODEL_TYPE,
            "error",
            f"model_type is {config.get('model_type')!r}; transformers' AutoConfig needs 'llama' to read this draft",
            'set "model_type": "llama"',
        )
    if config.get("num_hidden_layers") != 1 and raw.layout != "speculators":
        report.add(
            ProblemCode.CONFIG_NUM_LAYERS,
            "error",
            f"num_hidden_layers is {config.get('num_hidden_layers')!r}; an EAGLE-3 draft has exactly 1 (SGLang builds "
            "the extra layers with random weights; transformers defaults a missing value to 32)",
            'set "num_hidden_layers": 1',
        )
    if config.get("tie_word_embeddings"):
        report.add(
            ProblemCode.CONFIG_TIE_EMBEDDINGS,
            "error",
            "tie_word_embeddings is true: SGLang would make lm_head the (target's) embedding and ignore the trained head",
            'set "tie_word_embeddings": false',
        )
    if "torch_dtype" not in config and "dtype" not in config:
        report.add(
            ProblemCode.CONFIG_TORCH_DTYPE, "warning", "torch_dtype is not set; the engine picks a dtype on its own",
            'set "torch_dtype"',
        )
    if config.get("eagle_aux_hidden_state_layer_ids") is not None and not (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    ):
        report.add(
            ProblemCode.AUX_IDS_TOP_LEVEL,
            "error",
            "eagle_aux_hidden_state_layer_ids is given only at the top level; SGLang reads only "
            "eagle_config.eagle_aux_hidden_state_layer_ids and silently captures its default layers",
            "move the ids into eagle_config (re-encoded for the release: " + CONVERT_HINT + ")",
        )


def check_dtypes(loaded: dict[str, torch.Tensor], config: dict, report: Report) -> None:
    for name, want in (("d2t", torch.int64), ("t2d", torch.bool)):
        if name in loaded and loaded[name].dtype != want:
            report.add(ProblemCode.DTYPE, "error", f"{name} is {loaded[name].dtype}, expected {want}",
                       f"save {name} as {want}")
    weights = {n: t for n, t in loaded.items() if n not in loader.VOCAB_TENSORS}
    not_float = sorted(n for n, t in weights.items() if not t.is_floating_point())
    if not_float:
        report.add(ProblemCode.DTYPE, "error", f"weights that are not floating point: {sample_names(not_float)}",
                   "re-export the weights")
    declared = config.get("torch_dtype") or config.get("dtype")
    others = sorted({str(t.dtype).removeprefix("torch.") for t in weights.values()} - {declared})
    if declared and others and not not_float:
        report.add(
            ProblemCode.DTYPE,
            "warning",
            f"config declares torch_dtype {declared} but tensors are {', '.join(others)}",
            "make torch_dtype match the stored tensors",
        )


def sample_names(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")
