"""What each SGLang release does with an EAGLE-3 draft, as data: one table for validation, conversion
and the reference server, so they can never disagree.

Everything here was read from SGLang's published wheels (`pip download --no-deps sglang==X`), files
`srt/models/llama_eagle3.py` (the draft loader) and the target model files' `set_eagle3_layers_to_capture`.
Numbering: inside this project aux id k means "the output of decoder layer k" (HF hidden_states[k + 1]);
SGLang's capture loop records "the input of layer i" (hidden_states + residual, before layer i runs).
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle3.contract.releases import Release, ReleaseRange, parse_release

# ---------------------------------------------------------------------------------------------
# The draft loader (llama_eagle3.py `load_weights`). A checkpoint name is looked up as-is or with a
# `model.` prefix; a name that matches no parameter is dropped without a word. Every rule here is
# proven against the releases' own loader by tests/conformance/test_loader.py.

# Tensors of the one decoder layer, under the layer prefix.
LAYER_TENSORS = (
    "input_layernorm.weight",
    "hidden_norm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
# Tensors of the draft's inner `model` module, outside the layer. embed_tokens is optional: SGLang
# replaces it with the target's.
MODEL_TENSORS = ("fc.weight", "norm.weight", "embed_tokens.weight")
HEAD_TENSOR = "lm_head.weight"  # outside `model`: `model.lm_head.weight` matches no parameter and is dropped
TOP_TENSORS = (*MODEL_TENSORS, HEAD_TENSOR)
VOCAB_TENSORS = ("d2t", "t2d")  # d2t becomes hot_token_id = d2t + arange; t2d is read and ignored
CANONICAL_LAYER_PREFIX = "midlayer"

# Optional architecture switches of llama_eagle3.py, with the config keys that turn them on and the
# tensors they add. `norm_before_residual` (a speculators option) is implemented by no release read.
FLAG_CONFIG_KEYS = {
    "fc_norm": ("fc_norm", "use_aux_norm"),
    "norm_output": ("norm_output",),
    "norm_before_fc": ("norm_before_fc",),
    "norm_before_residual": ("norm_before_residual",),
}
FLAG_TENSOR_PREFIXES = {"fc_norm": ("fc_norm.",), "norm_before_fc": ("input_norm.",)}
# SpecForge's older names for the per-aux norms, renamed by the loader from 0.5.12 on.
LEGACY_FC_NORM_NAMES = {"aux_norm_low.": "fc_norm.0.", "aux_norm_mid.": "fc_norm.1.", "aux_norm_high.": "fc_norm.2."}


@dataclass(frozen=True)
class DraftLoaderRule:
    releases: ReleaseRange
    layer_prefixes: tuple[str, ...]  # spellings of the decoder layer the loader accepts
    flags: frozenset[str]  # architecture switches this release implements
    fixed_num_aux: int | None  # fc input width hard-coded as fixed_num_aux x target_hidden
    legacy_names: bool = False  # aux_norm_{low,mid,high} load as fc_norm.{0,1,2}
    layer_tensors: tuple[str, ...] = LAYER_TENSORS
    model_prefix: bool = True  # `model.<name>` loads as <name> (llama_eagle3's second lookup)


SGLANG_LOADER_RULES = (
    # 0.5.10/0.5.11: module `midlayer`; fc width hard-coded to 3 aux states; no switches.
    DraftLoaderRule(ReleaseRange("0.0.0", "0.5.11"), ("midlayer",), frozenset(), 3),
    # 0.5.12: module `layers`, legacy map midlayer -> layers.0; fc_norm, norm_output, num_aux_hidden_states.
    DraftLoaderRule(
        ReleaseRange("0.5.12", "0.5.16"), ("midlayer", "layers.0"), frozenset({"fc_norm", "norm_output"}), None, True
    ),
    # 0.5.17: adds input_norm (norm_before_fc).
    DraftLoaderRule(
        ReleaseRange("0.5.17", "0.5.23"),
        ("midlayer", "layers.0"),
        frozenset({"fc_norm", "norm_output", "norm_before_fc"}),
        None,
        True,
    ),
)
STRICTEST_LOADER_RULE = SGLANG_LOADER_RULES[0]
NEWEST_LOADER_RULE = SGLANG_LOADER_RULES[-1]


def loader_rule(release: str | None) -> tuple[DraftLoaderRule, str]:
    """The loader rule for a release, and a note on how it was chosen (empty when exact)."""
    if release is None:
        return STRICTEST_LOADER_RULE, "no release given: checked against the strictest loader (≤ 0.5.11)"
    parsed = parse_release(release)
    for rule in SGLANG_LOADER_RULES:
        if parsed in rule.releases:
            return rule, ""
    return STRICTEST_LOADER_RULE, f"release {release} is not in the table: checked against the strictest loader (≤ 0.5.11)"


# SGLang's second EAGLE-3 draft architecture: one DeepSeek-V2 (MLA) decoder layer, for Kimi-K2.5 and
# DeepSeek targets (models/kimi_k25_eagle3.py, from 0.5.12 on). Its loader maps `layers.0.` to `midlayer.`
# (either spelling loads), fuses q_a_proj with kv_a_proj_with_mqa (both must be there, else neither loads),
# splits kv_b_proj after loading, and drops `model.`-prefixed names, input_norm and t2d without a word.
MLA_DRAFT_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"
MLA_LAYER_TENSORS = (
    "input_layernorm.weight",
    "hidden_norm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_a_proj.weight",  # [q_lora_rank, 2H]
    "self_attn.q_a_layernorm.weight",
    "self_attn.q_b_proj.weight",  # [heads * (nope + rope), q_lora_rank]
    "self_attn.kv_a_proj_with_mqa.weight",  # [kv_lora_rank + rope, 2H]
    "self_attn.kv_a_layernorm.weight",
    "self_attn.kv_b_proj.weight",  # [heads * (nope + v), kv_lora_rank]
    "self_attn.o_proj.weight",  # [H, heads * v]
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
MLA_FUSED_PAIR = ("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight")
MLA_LOADER_RULES = (  # 0.5.12: no switches; 0.5.13: fc_norm (or use_aux_norm) and norm_output
    DraftLoaderRule(ReleaseRange("0.5.12", "0.5.12"), ("layers.0", "midlayer"), frozenset(), None,
                    layer_tensors=MLA_LAYER_TENSORS, model_prefix=False),
    DraftLoaderRule(ReleaseRange("0.5.13", "0.5.23"), ("layers.0", "midlayer"), frozenset({"fc_norm", "norm_output"}),
                    None, layer_tensors=MLA_LAYER_TENSORS, model_prefix=False),
)
DRAFT_LOADERS = {"mha": SGLANG_LOADER_RULES, "mla": MLA_LOADER_RULES}
DRAFT_ARCHITECTURES = {"mha": "LlamaForCausalLMEagle3", "mla": MLA_DRAFT_ARCHITECTURE}


def draft_loader_rule(attention: str, release: str | None) -> DraftLoaderRule | None:
    """The loader of a draft form in a release (mha: the strictest one for a release not in the table; mla: None for a
    release without the form or not in the table)."""
    if attention == "mha":
        return loader_rule(release)[0]
    if release is None:
        return None
    return next((rule for rule in MLA_LOADER_RULES if parse_release(release) in rule.releases), None)


def served_draft_problem(attention: str, flags: list[str], release: str | None) -> str | None:
    """Why SGLang `release` (None: the strictest) would not serve a draft of this form with these switches as trained,
    as a sentence; None when it would."""
    rule, name = draft_loader_rule(attention, release), DRAFT_ARCHITECTURES[attention]
    where = f"SGLang {release}" if release else "SGLang ≤ 0.5.11 (the strictest release; no release was given)"
    if rule is None:
        read = ", ".join(str(r.releases) for r in MLA_LOADER_RULES)
        return f"{where} is not among the releases read that have {name} ({read}): name one in serving.release"
    reasons = [f"{flag}, which {where} does not implement ("
               + next((f"served from {r.releases.first}" for r in DRAFT_LOADERS[attention] if flag in r.flags),
                      "no SGLang release read implements it") + ")" for flag in flags if flag not in rule.flags]
    if reasons:
        return (f"the draft uses {'; '.join(reasons)}: {name}'s loader would skip its weights and serve another "
                "network; name a release that does")
    return None


# Where SGLang reads each switch: fc_norm / use_aux_norm and norm_output from the top level of the
# config only; norm_before_fc from eagle_config when it is given there (it wins), else the top level.
TOP_LEVEL_ONLY_KEYS = ("fc_norm", "use_aux_norm", "norm_output", "norm_before_residual")
NESTED_FIRST_KEYS = ("norm_before_fc",)


def flag_setting(config: dict, key: str):
    """A switch's value as SGLang reads it."""
    nested = config.get("eagle_config") or {}
    if key in NESTED_FIRST_KEYS and key in nested:
        return nested[key]
    return config.get(key)


def enabled_flags(config: dict) -> set[str]:
    """Architecture switches a draft config turns on, read where SGLang reads them."""
    return {flag for flag, keys in FLAG_CONFIG_KEYS.items() if any(flag_setting(config, key) for key in keys)}


def misplaced_flags(config: dict) -> list[str]:
    """Switch settings SGLang does not read the way a writer of the config meant them, as sentences."""
    nested = config.get("eagle_config") or {}
    found = [
        f"eagle_config.{key} is {nested[key]!r} but SGLang reads {key} only at the top level (where it is "
        f"{config.get(key)!r})"
        for key in TOP_LEVEL_ONLY_KEYS
        if key in nested and bool(nested[key]) != bool(config.get(key))
    ]
    found += [
        f"eagle_config.{key} is {nested[key]!r} and overrides the top-level {key} ({config[key]!r}) in SGLang"
        for key in NESTED_FIRST_KEYS
        if key in nested and key in config and bool(nested[key]) != bool(config[key])
    ]
    return found


def loaded_name(name: str, rule: DraftLoaderRule, flags: set[str]) -> str | None:
    """The canonical (midlayer.*) name a checkpoint tensor loads as, or None if the loader drops it."""
    if name.startswith("model."):
        if not rule.model_prefix:
            return None
        # The loader also tries `model.` + name, so the prefix is optional inside the draft's `model`
        # module; the head lives outside it.
        name = name.removeprefix("model.")
        if name == HEAD_TENSOR:
            return None
    if name in TOP_TENSORS or name in VOCAB_TENSORS:
        return name
    for prefix in rule.layer_prefixes:
        rest = name.removeprefix(prefix + ".")
        if rest != name and rest in rule.layer_tensors:
            return f"{CANONICAL_LAYER_PREFIX}.{rest}"
    if rule.legacy_names:
        for legacy, new in LEGACY_FC_NORM_NAMES.items():
            if name.startswith(legacy):
                name = new + name.removeprefix(legacy)
    for flag, prefixes in FLAG_TENSOR_PREFIXES.items():
        if flag in rule.flags and flag in flags and name.startswith(prefixes):
            return name
    return None


# ---------------------------------------------------------------------------------------------
# Aux hidden-state capture on the target. SGLang reads the ids only from the nested
# `eagle_config.eagle_aux_hidden_state_layer_ids`; without them it captures the inputs of
# [2, n//2, n-3]. What it does with explicit ids depends on the model file and the release:
#   always          - captures the input of id + 1 (our id)
#   if_first_is_one - +1 only when the first id is 1, otherwise the input of the id itself
#   unless_max_is_n - ids unchanged when max(ids) == n (id n = the last layer's output), else +1


# What the capture loop records at a boundary. The data stage trains on transformers' hidden_states, the residual
# stream; a loop that records something else hands the served draft other features than it was trained on.
RESIDUAL_STREAM = "the residual stream (hidden_states + residual, what transformers' hidden_states hold)"
BRANCH_ONLY = ("the previous layer's feed-forward branch alone (its hidden_states, without the residual it returns "
               "beside them)")


@dataclass(frozen=True)
class AuxIdRule:
    families: frozenset[str]
    releases: ReleaseRange
    shift: str  # "always" | "if_first_is_one" | "unless_max_is_n"
    captures_last_output: bool = False  # id n captures the last layer's output (before the final norm)
    records: str = RESIDUAL_STREAM


_DEEPSEEK = frozenset({"deepseek_v2", "kimi_k25", "glm4_moe_lite"})  # kimi_k25 delegates to DeepseekV3
_QWEN = frozenset({"qwen2", "qwen3", "qwen3_moe"})  # qwen3_moe's loop is Qwen2-MoE's
# One row per (families, releases) whose rule or record differs; tests/conformance/test_aux_ids.py runs each release's
# own model files against every row (docs/contracts.md: adding a family).
AUX_ID_RULES = (
    AuxIdRule(frozenset({"llama"}), ReleaseRange("0.5.10", "0.5.23"), "always"),
    AuxIdRule(_QWEN, ReleaseRange("0.5.11", "0.5.23"), "always"),
    AuxIdRule(_DEEPSEEK, ReleaseRange("0.5.10", "0.5.12"), "always"),
    AuxIdRule(_DEEPSEEK, ReleaseRange("0.5.13", "0.5.23"), "if_first_is_one"),
    AuxIdRule(frozenset({"gpt_oss"}), ReleaseRange("0.5.10", "0.5.16"), "always"),
    AuxIdRule(frozenset({"gpt_oss"}), ReleaseRange("0.5.17", "0.5.23"), "unless_max_is_n", captures_last_output=True),
    # Gemma 3: no EAGLE-3 capture before 0.5.12. From 0.5.17 its decoder layer returns (branch, residual) apart and
    # the loop appends only the branch.
    AuxIdRule(frozenset({"gemma3"}), ReleaseRange("0.5.12", "0.5.16"), "always", captures_last_output=True),
    AuxIdRule(frozenset({"gemma3"}), ReleaseRange("0.5.17", "0.5.23"), "always", captures_last_output=True,
              records=BRANCH_ONLY),
)
KNOWN_FAMILIES = frozenset().union(*(rule.families for rule in AUX_ID_RULES))

# Target config `architectures` -> the SGLang model file that serves it.
ARCHITECTURE_FAMILY = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma3ForCausalLM": "gemma3",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v2",
    "KimiK25ForConditionalGeneration": "kimi_k25",
    "Glm4MoeLiteForCausalLM": "glm4_moe_lite",
    "GptOssForCausalLM": "gpt_oss",
}
# A model file that runs another's model code: naming either family describes the same served model (the shipped
# Kimi-K2.5 config names deepseek_v2).
FAMILY_DELEGATES_TO = {"kimi_k25": "deepseek_v2"}


@dataclass(frozen=True)
class Capture:
    """What the target engine captures for a draft: `layers` in our convention, in concatenation order."""

    status: str  # "known", "unknown" (family/release not in the table) or "ambiguous" (differs by release)
    layers: tuple[int, ...] | None
    explanation: str
    lost_ids: tuple[int, ...] = ()  # ids the capture loop never reaches (fewer states than the fc expects)


def aux_id_rule(family: str, release: Release) -> AuxIdRule | None:
    for rule in AUX_ID_RULES:
        if family in rule.families and release in rule.releases:
            return rule
    return None


def sglang_default_inputs(num_layers: int) -> list[int]:
    """The layers whose input SGLang captures when the draft names no ids (every file, every release)."""
    return [2, num_layers // 2, num_layers - 3]


def captured_inputs(ids: list[int] | None, rule: AuxIdRule, num_layers: int) -> list[int]:
    """Engine numbering: the layer indices whose input is recorded (n = the last layer's output)."""
    if ids is None:
        return sglang_default_inputs(num_layers)
    if rule.shift == "always":
        return [i + 1 for i in ids]
    if rule.shift == "if_first_is_one":
        return [i + 1 for i in ids] if ids and ids[0] == 1 else list(ids)
    if rule.shift == "unless_max_is_n":
        return list(ids) if ids and max(ids) == num_layers else [i + 1 for i in ids]
    raise ValueError(f"unknown shift rule {rule.shift!r}")


# With two-batch overlap (`--enable-two-batch-overlap`) these model files run only the layers below
# `first_k_dense_replace` in the loop that captures aux states and hand the rest to the overlap
# executor, which captures nothing: every release read (0.5.11-0.5.23; tests/conformance runs it).
TWO_BATCH_OVERLAP_LOSES_CAPTURE = _DEEPSEEK


def _capture_under(ids: list[int] | None, rule: AuxIdRule, num_layers: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    reachable = num_layers if rule.captures_last_output else num_layers - 1
    inputs = captured_inputs(ids, rule, num_layers)
    # The loop appends in layer order, so the concatenation is sorted whatever order the ids have.
    captured = tuple(sorted({i - 1 for i in inputs if 0 <= i <= reachable}))
    lost = tuple(i for i in inputs if not 0 <= i <= reachable)
    return captured, lost


def sglang_capture(ids: list[int] | None, family: str | None, release: str | None, num_layers: int) -> Capture:
    """The layers (our convention) SGLang captures for these nested ids on this family and release.

    With no release, the answer is known only if every release in the table agrees.
    """
    if family is None:
        return Capture("unknown", None, "target family unknown: pass the target (or its family)")
    rules = [r for r in AUX_ID_RULES if family in r.families]
    if not rules:
        return Capture(
            "unknown", None, f"model file '{family}' is not in the aux-id table (known: {', '.join(sorted(KNOWN_FAMILIES))})"
        )
    if release is not None:
        rule = aux_id_rule(family, parse_release(release))
        if rule is None:
            return Capture("unknown", None, f"'{family}' on SGLang {release} is not in the aux-id table")
        rules = [rule]
    outcomes = {str(rule.releases): _capture_under(ids, rule, num_layers) for rule in rules}
    distinct = set(outcomes.values())
    if len(distinct) > 1:
        detail = "; ".join(f"{r}: {list(layers)}" for r, (layers, _) in outcomes.items())
        return Capture("ambiguous", None, f"ambiguous across releases ({detail}): pass the release")
    layers, lost = distinct.pop()
    where = f"SGLang {release}" if release else f"every release in the table ({', '.join(outcomes)})"
    ids_text = "no ids (the default)" if ids is None else f"ids {ids}"
    explanation = f"{family} on {where} captures the outputs of layers {list(layers)} for {ids_text}"
    if lost:
        explanation += (f"; input index(es) {list(lost)} are never reached by the capture loop (the draft gets fewer "
                        "states than its fc expects; DeepSeek files from 0.5.17 fail at the first forward instead)")
    inputs = captured_inputs(ids, rules[0], num_layers)
    if len(set(inputs)) < len(inputs):
        explanation += f"; the loop captures a repeated layer once (inputs {inputs})"
    return Capture("known", layers, explanation, lost)


def served_features_problem(family: str, release: str | None) -> str | None:
    """Why SGLang `release` (None: any release in the table) would hand a draft of `family` other aux states than the
    residual stream the transformers features hold; None when it hands the same, or the pair is not in the table
    (sglang_capture reports that)."""
    rows = [rule for rule in AUX_ID_RULES if family in rule.families]
    if release is not None:
        rows = [rule for rule in rows if parse_release(release) in rule.releases]
    differing = [rule for rule in rows if rule.records != RESIDUAL_STREAM]
    if not differing:
        return None
    faithful = [str(rule.releases) for rule in AUX_ID_RULES if family in rule.families and rule.records == RESIDUAL_STREAM]
    where = f"SGLang {release}" if release else f"SGLang {', '.join(str(rule.releases) for rule in differing)}"
    return (f"{family} on {where} captures {differing[0].records} as each aux state, while drafts are trained on "
            f"{RESIDUAL_STREAM}: serve with SGLang {' or '.join(faithful) or '(no release)'}"
            f"{'' if release else ' and name it in serving.release'}, or capture the features through SGLang "
            "(data.capture_engine: sglang) on the release you serve")


def aux_layers_problem(layers: list[int], num_layers: int) -> str | None:
    """Why `layers` (our numbering) cannot be a draft's aux layers on a `num_layers`-layer target; None when they
    can. The one statement of the rule: the config, the checkpoint checks and the id translation all ask here."""
    layers = list(layers)
    if len(set(layers)) != len(layers):
        return f"{layers} repeats a layer; set distinct ids, e.g. {list(range(min(3, num_layers - 1)))}"
    if layers != sorted(layers):
        return (f"{layers} must be ascending: SGLang concatenates captured states in layer order, so another order "
                f"would scramble the draft's fc input; write {sorted(layers)}")
    if any(not 0 <= k < num_layers - 1 for k in layers):
        return (f"{layers}: every id must be in [0, {num_layers - 2}] (id k = output of decoder layer k; SGLang "
                "cannot capture the last layer's output)")
    return None


def sglang_ids_for_layers(layers: list[int], family: str, release: str | None, num_layers: int) -> list[int]:
    """Nested ids that make SGLang capture exactly `layers` (our convention); with no release, ids that
    mean the same on every release in the table. Raises ValueError when no ids can express them."""
    if problem := aux_layers_problem(layers, num_layers):
        raise ValueError(f"aux layers {problem}")
    candidates = (list(layers), [k + 1 for k in layers])
    tried = []
    for ids in candidates:
        capture = sglang_capture(ids, family, release, num_layers)
        if capture.status == "unknown":
            raise ValueError(capture.explanation)
        if capture.status == "known" and list(capture.layers) == list(layers) and not capture.lost_ids:
            return ids
        tried.append(f"{ids} -> {capture.explanation}")
    raise ValueError(
        f"no ascending aux ids make {family} on SGLang {release or '(any release)'} capture layers {list(layers)}: "
        + " | ".join(tried)
    )


# vLLM and speculators number explicit ids as "the input of layer i" (HF hidden_states[i]), on every
# release: a speculators id is our id + 1.
def vllm_ids(layers: list[int]) -> list[int]:
    return [k + 1 for k in layers]


def layers_from_vllm_ids(ids: list[int]) -> list[int]:
    return [i - 1 for i in ids]
