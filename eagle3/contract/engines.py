"""What each SGLang release's target model files capture as aux hidden states (`set_eagle3_layers_to_capture`), as
data: one table for the config, validation and export of every kind of draft. Read from SGLang's published wheels
(`pip download --no-deps sglang==X`). Numbering: inside this project aux id k means "the output of decoder layer k"
(HF hidden_states[k + 1]); SGLang's capture loop records "the input of layer i" (hidden_states + residual, before layer
i runs). SGLang's EAGLE-3 draft loader is the EAGLE-3 algorithm's (eagle3/algorithms/eagle3/contract.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle3.contract.releases import Release, ReleaseRange, parse_release


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
            "(data.feature_backend: sglang) on the release you serve")


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
