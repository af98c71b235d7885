"""What each SGLang release's EAGLE-3 draft loader (`srt/models/llama_eagle3.py`, `kimi_k25_eagle3.py`) does with a
draft, as data: one table for validation, conversion and the reference server, so they can never disagree. Read from
SGLang's published wheels (`pip download --no-deps sglang==X`); what the target captures is
eagle3/contract/engines.py's (every kind's)."""

from __future__ import annotations

from dataclasses import dataclass

from eagle3.contract.releases import ReleaseRange, parse_release

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
