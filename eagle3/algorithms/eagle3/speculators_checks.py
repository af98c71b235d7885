"""What speculators' loader (`SpeculatorModel.from_pretrained` of SPECULATORS_RELEASE, read from its wheel and run
on our exports in tests/conformance/test_speculators.py) makes of a checkpoint: the config it validates, the
verifier it reads, the tensors it keeps and the shapes it builds, and the layers vLLM captures for the ids (part
of `eagle3.algorithms.eagle3.validate`, which adds the vocab map and the context length)."""

from __future__ import annotations

from pathlib import Path

import torch

from eagle3.errors import UnreadableInput
from eagle3.contract import engines
import eagle3.algorithms.eagle3.contract as loader
from eagle3.algorithms.eagle3.checkpoint import RawCheckpoint, draft_shapes, mha_attention_shapes
from eagle3.algorithms.eagle3.layouts import speculators
from eagle3.algorithms.eagle3.loader_checks import check_dtypes, sample_names
from eagle3.contract.problems import ProblemCode, Report
from eagle3.target.info import read_target_info

WHERE = f"speculators {speculators.SPECULATORS_RELEASE}"
REEXPORT = "re-export with `eagle3 convert SRC DST --to speculators --target DIR`"
LAYER_TYPES = ("llama", "qwen3")  # transformer_layer_config.model_type it builds an EAGLE-3 layer for
DEFAULT_NUM_AUX = 3  # fc's width without explicit ids (and the ids it then uses: [2, n // 2, n - 3])


def check_speculators(raw: RawCheckpoint, ctx, report: Report) -> dict[str, torch.Tensor]:
    """Report what the loader refuses or leaves uninitialised; return the tensors it loads (canonical names).
    `ctx` is validate's Context (the target and data facts known); a local verifier fills in the target's."""
    config = raw.config
    layer = config.get("transformer_layer_config")
    layer = layer if isinstance(layer, dict) else {}
    _check_config(config, layer, report)
    _check_verifier(config, layer, ctx, report)
    loaded = _check_tensors(raw, layer, report)
    _check_target(layer, ctx, report)
    _check_aux_ids(config.get("eagle_aux_hidden_state_layer_ids"), ctx, report)
    return loaded


def _config_problems(config: dict, layer: dict) -> list[str]:
    """What makes the loader fail on config.json, or build another network than the one stored."""
    problems = []
    if config.get("speculators_model_type") != "eagle3":
        problems.append(f"speculators_model_type is {config.get('speculators_model_type')!r}, not 'eagle3' (it picks "
                        "the model class from it)")
    spec = config.get("speculators_config")
    if not isinstance(spec, dict) or not all(key in spec for key in ("algorithm", "proposal_methods",
                                                                      "default_proposal_method", "verifier")):
        problems.append("speculators_config lacks algorithm, proposal_methods, default_proposal_method or verifier")
    else:
        methods = spec["proposal_methods"] if isinstance(spec["proposal_methods"], list) else []
        steps = [m.get("speculative_tokens") for m in methods if isinstance(m, dict)]
        if not methods or any(not isinstance(s, int) or s < 1 for s in steps if s is not None):
            problems.append(f"proposal_methods {spec['proposal_methods']!r}: each needs speculative_tokens >= 1")
        if spec["default_proposal_method"] not in [m.get("proposal_type") for m in methods if isinstance(m, dict)]:
            problems.append(f"default_proposal_method {spec['default_proposal_method']!r} is none of the "
                            "proposal_methods' proposal_type")
    if not layer:
        problems.append("transformer_layer_config is missing")
    elif layer.get("model_type") not in LAYER_TYPES:
        problems.append(f"transformer_layer_config.model_type is {layer.get('model_type')!r}: it builds an EAGLE-3 "
                        f"layer for {', '.join(LAYER_TYPES)} only (none given: a Qwen3 layer, with q/k norms)")
    if config.get("norm_before_fc") and config.get("fc_norm"):
        problems.append("norm_before_fc and fc_norm are both set; its config refuses them together")
    return problems


def _check_config(config: dict, layer: dict, report: Report) -> None:
    for problem in _config_problems(config, layer):
        report.add(ProblemCode.SPECULATORS_CONFIG, "error", f"{WHERE} cannot load it: {problem}", REEXPORT)
    if layer and layer.get("num_hidden_layers") != 1:
        report.add(
            ProblemCode.CONFIG_NUM_LAYERS, "error",
            f"transformer_layer_config.num_hidden_layers is {layer.get('num_hidden_layers')!r}; {WHERE} builds that "
            "many decoder layers (32 when it is missing) and leaves all but layers.0 uninitialised",
            'set "num_hidden_layers": 1 in transformer_layer_config')


def _check_verifier(config: dict, layer: dict, ctx, report: Report) -> None:
    spec = config.get("speculators_config")
    verifier = spec.get("verifier") if isinstance(spec, dict) else None
    name = verifier.get("name_or_path") if isinstance(verifier, dict) else None
    if not name:
        report.add(ProblemCode.VERIFIER, "error",
                   f"speculators_config.verifier names no model: {WHERE} loads the verifier's config through AutoConfig "
                   "from the name None and fails", REEXPORT)
        return
    path = Path(name).expanduser()
    if not path.is_dir():
        if path.is_absolute() or name.startswith((".", "~")):
            report.add(ProblemCode.VERIFIER, "warning",
                       f"the verifier {name} is no directory on this machine: from_pretrained fails here, and loads "
                       "only where that path holds the target", "load it where the target is, or re-export there")
        else:
            report.add(ProblemCode.VERIFIER, "unknown",
                       f"the verifier {name} is not a local directory (a hub id?): not checked offline",
                       "pass --target DIR to compare the draft with the target")
        return
    try:
        info = read_target_info(path)
    except UnreadableInput as err:
        report.add(ProblemCode.VERIFIER, "error", f"the verifier cannot be read: {err}", REEXPORT)
        return
    if info.hidden_size != layer.get("hidden_size"):
        report.add(ProblemCode.VERIFIER, "error",
                   f"the verifier {name} has hidden size {info.hidden_size}, the draft {layer.get('hidden_size')}: "
                   f"{WHERE} refuses the pair", "name the target the draft was trained for")
    ctx.num_layers = ctx.num_layers or info.num_hidden_layers
    ctx.hidden_size = ctx.hidden_size or info.hidden_size
    ctx.vocab_size = ctx.vocab_size or info.vocab_size


def expected_tensors(config: dict, layer: dict) -> dict[str, tuple[int, ...]]:
    """Layout name -> shape of every tensor the loader fills from the checkpoint. It sizes fc from hidden_size
    (target_hidden_size is not read) and keeps no vocab map when the draft's vocabulary is the target's."""
    hidden, heads = layer["hidden_size"], layer["num_attention_heads"]
    head_dim = layer.get("head_dim") or hidden // heads
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    vocab, draft_vocab = layer["vocab_size"], config.get("draft_vocab_size", 32000)
    attention = mha_attention_shapes(hidden, heads * head_dim, (layer.get("num_key_value_heads") or heads) * head_dim)
    shapes = draft_shapes(
        hidden=hidden, target_hidden=hidden, intermediate=layer["intermediate_size"], attention=attention,
        num_aux=len(ids) if ids else DEFAULT_NUM_AUX,
        draft_vocab=draft_vocab, vocab=vocab, norm_before_fc=bool(config.get("norm_before_fc")),
        fc_norm=bool(config.get("fc_norm")))
    if draft_vocab == vocab:
        shapes = {name: shape for name, shape in shapes.items() if name not in loader.VOCAB_TENSORS}
    names = speculators.tensor_names(list(shapes))
    return {**{names[name]: shape for name, shape in shapes.items()}, speculators.EMBED_TOKENS: (vocab, hidden)}


def _check_tensors(raw: RawCheckpoint, layer: dict, report: Report) -> dict[str, torch.Tensor]:
    needed = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
    if any(key not in layer for key in needed):
        report.add(ProblemCode.CONFIG_FIELD, "error", f"transformer_layer_config lacks one of {', '.join(needed)}",
                   REEXPORT)
        return {}
    expected = expected_tensors(raw.config, layer)
    ignored = set(loader.VOCAB_TENSORS) - set(expected)  # an identity map it accepts and ignores
    skipped = sorted(set(raw.tensors) - set(expected) - ignored)
    if skipped:
        fix = "rename midlayer.* to layers.0.*" if any(n.startswith("midlayer.") for n in skipped) else REEXPORT
        report.add(ProblemCode.SKIPPED_TENSOR, "error",
                   f"{WHERE} has no parameter for {len(skipped)} tensor(s), which transformers drops: "
                   f"{sample_names(skipped)}", fix)
    missing = sorted(set(expected) - set(raw.tensors))
    if missing:
        embed = (f" ({speculators.EMBED_TOKENS}: it copies the verifier's only into a NaN tensor, and transformers 5 "
                 "leaves a missing one uninitialised: another embedding on every load)"
                 if speculators.EMBED_TOKENS in missing else "")
        report.add(ProblemCode.MISSING_TENSOR, "error",
                   f"{WHERE} would load no value for {len(missing)} tensor(s): {sample_names(missing)}; they keep "
                   f"whatever memory they were given{embed}", REEXPORT)
    present = {name: tuple(raw.tensors[name].shape) for name in expected if name in raw.tensors}
    mismatched = [f"{name} {list(present[name])} (config implies {list(shape)})"
                  for name, shape in expected.items() if name in present and present[name] != shape]
    if mismatched:
        report.add(ProblemCode.SHAPE_MISMATCH, "error", f"{WHERE} fails on the sizes (it builds fc for "
                   "hidden_size, not target_hidden_size): " + "; ".join(mismatched),
                   "fix config.json to describe the tensors (or re-export)")
    loaded = {name: raw.tensors[name] for name in expected if name in raw.tensors}
    check_dtypes(loaded, raw.config, report)
    canonical = {speculators.canonical_name(name, raw.config): tensor for name, tensor in loaded.items()}
    canonical.pop(None, None)  # the embedding has no canonical name
    return canonical | {name: raw.tensors[name] for name in ignored if name in raw.tensors}


def _check_target(layer: dict, ctx, report: Report) -> None:
    if ctx.hidden_size is not None and layer.get("hidden_size") not in (None, ctx.hidden_size):
        report.add(ProblemCode.HIDDEN_SIZE, "error",
                   f"hidden_size is {layer['hidden_size']} but the target's is {ctx.hidden_size}",
                   "train the draft for this target")
    if ctx.vocab_size is not None and layer.get("vocab_size") not in (None, ctx.vocab_size):
        report.add(ProblemCode.VOCAB_SIZE, "error",
                   f"vocab_size is {layer['vocab_size']} but the target's vocabulary is {ctx.vocab_size}",
                   "build the vocab map with the target's tokenizer")


def _check_aux_ids(ids: list[int] | None, ctx, report: Report) -> None:
    """The loader resolves the ids against the verifier (distinct, within [0, n]; none: [2, n // 2, n - 3], with a
    warning); vLLM captures HF hidden_states[i] for id i, our layer i - 1."""
    n = ctx.num_layers
    if ids is not None and (not ids or len(set(ids)) != len(ids) or min(ids) < 0 or (n and max(ids) > n)):
        report.add(ProblemCode.AUX_IDS_INVALID, "error",
                   f"eagle_aux_hidden_state_layer_ids {ids} must be distinct and within [0, {n or 'n'}]: {WHERE} "
                   "refuses them", REEXPORT)
        return
    if n is None:
        report.add(ProblemCode.CAPTURED_LAYERS, "unknown", "which layers vLLM captures is unknown without the "
                   "target's layer count", "pass --target DIR or --data-manifest FILE")
        return
    layers = engines.layers_from_vllm_ids(ids if ids else [2, n // 2, n - 3])
    said = f"ids {ids} capture layers {layers}" if ids else f"no ids: its default captures layers {layers}"
    if ctx.data_layers is None:
        report.add(ProblemCode.CAPTURED_LAYERS, "unknown", f"{said}; the layers the data were captured at are "
                   "unknown", "pass --data-manifest FILE")
    elif layers != list(ctx.data_layers):
        report.add(ProblemCode.AUX_IDS_MISSING if not ids else ProblemCode.CAPTURED_LAYERS_MISMATCH, "error",
                   f"{said}, but the training data were captured at layers {ctx.data_layers} "
                   f"({ctx.data_layers_source})", REEXPORT)
    elif not ids:
        report.add(ProblemCode.AUX_IDS_MISSING, "warning", f"{said}, the data's, by default",
                   "write the ids explicitly so the draft does not depend on a default")
