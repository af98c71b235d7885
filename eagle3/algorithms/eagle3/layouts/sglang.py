"""The sglang layout: `LlamaForCausalLMEagle3`, or `Eagle3DeepseekV2ForCausalLM` for an MLA draft, with the decoder
layer under `midlayer.*` (the names every release loads, for both forms), and the aux ids nested in `eagle_config`,
encoded for the target's model file and the SGLang release."""

from __future__ import annotations

from eagle3.errors import ConversionError
from eagle3.contract import engines
import eagle3.algorithms.eagle3.contract as loader
from eagle3.algorithms.eagle3.layouts.shared import (
    DraftConfig, FLAGS, Log, PROVENANCE_KEY, RawCheckpoint, architecture_fields, llama_layer_fields,
    names_with_layer_at, provenance, target_for, trained_fields,
)
from eagle3.config.draft import MLA_SIZES
from eagle3.draft.files import Verifier

ARCHITECTURE = loader.DRAFT_ARCHITECTURES["mha"]
MLA_MODEL_TYPE = "deepseek_v3"  # transformers' config class for it keeps the MLA sizes SGLang reads


def detects(config: dict) -> bool:
    return bool(set(loader.DRAFT_ARCHITECTURES.values()) & set(config.get("architectures") or []))


def attention_of(config: dict) -> str:
    """The draft form a config.json names: mla for SGLang's MLA draft architecture, else mha."""
    return "mla" if loader.MLA_DRAFT_ARCHITECTURE in (config.get("architectures") or []) else "mha"


def tensor_names(names: list[str] = ()) -> dict[str, str]:
    return names_with_layer_at(loader.CANONICAL_LAYER_PREFIX, names)


def canonical_name(name: str, config: dict) -> str | None:
    """Read the way the newest release's loader of its form reads it (`layers.0.*` and `aux_norm_*` included)."""
    newest = loader.DRAFT_LOADERS[attention_of(config)][-1]
    return loader.loaded_name(name, newest, loader.enabled_flags(config))


def encoded_release(raw: RawCheckpoint, given: str | None, log: Log) -> str | None:
    """The release the nested ids were encoded for. Our exports record it (None: ids that mean the same on every
    release), and the record wins: the caller's release is the one it serves on or converts for, which may
    rightly differ (a re-export after an upgrade, a simulated mismatch). Other checkpoints are read for the
    caller's release."""
    record = raw.config.get(PROVENANCE_KEY)
    if not record:
        return given
    recorded = record.get("engine_release")
    if given is not None and recorded is not None and given != recorded:
        log(f"{raw.path}: reading its aux ids as encoded for SGLang {recorded} (recorded in config.json "
            f"'{PROVENANCE_KEY}'), not for {given}, the release given")
    return recorded


def decode_config(raw: RawCheckpoint, family: str | None, release: str | None, num_layers: int | None,
                  log: Log) -> dict:
    """The native fields, with the aux layers SGLang captures for the nested ids on the family and release."""
    family, num_layers = target_for(raw, family, num_layers)
    config = raw.config
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    capture = engines.sglang_capture(ids, family, encoded_release(raw, release, log), num_layers)
    if capture.status != "known" or capture.lost_ids:
        raise ConversionError(f"{raw.path}: cannot tell which layers its aux ids capture: {capture.explanation}")
    fields = architecture_fields(config, config, raw.tensors)
    flags = loader.enabled_flags(config)
    fields.update(aux_layers=list(capture.layers), **{flag: flag in flags for flag in FLAGS})
    if attention_of(config) == "mla":  # DraftConfig refuses a missing MLA size; head_dim is not an MLA draft's
        fields.update(attention="mla", **{name: config.get(name) for name in MLA_SIZES},
                      rope_interleave=bool(config.get("rope_interleave", True)),
                      num_key_value_heads=fields["num_attention_heads"])
    return trained_fields(raw, fields, family, num_layers)


def encode_config(cfg: DraftConfig, release: str | None, num_steps: int, verifier: Verifier | None) -> dict:
    """The config SGLang `release` (None: every release in the table) reads as this draft; refused when that
    release would build another network or capture other layers."""
    family = cfg.target_family
    if family is None:
        raise ConversionError("the target family is unknown: pass --target-family (e.g. llama, deepseek_v2)")
    if problem := loader.served_draft_problem(cfg.attention, cfg.flags(), release):
        raise ConversionError(problem)
    rule = loader.draft_loader_rule(cfg.attention, release)
    where = f"SGLang {release}" if release else "SGLang ≤ 0.5.11 (the strictest release; no release was given)"
    if rule.fixed_num_aux is not None and len(cfg.aux_layers) != rule.fixed_num_aux:
        raise ConversionError(
            f"{where} builds fc for exactly {rule.fixed_num_aux} aux states; the draft has {len(cfg.aux_layers)}"
        )
    try:
        ids = engines.sglang_ids_for_layers(cfg.aux_layers, family, release, cfg.target_num_hidden_layers)
    except ValueError as err:
        raise ConversionError(str(err)) from None
    config = {
        **llama_layer_fields(cfg),
        "architectures": [ARCHITECTURE],
        "target_hidden_size": cfg.target_hidden_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids},
        PROVENANCE_KEY: provenance(cfg, release),
    }
    config.update({flag: True for flag in cfg.flags()})
    if cfg.attention == "mla":
        config.update(architectures=[loader.MLA_DRAFT_ARCHITECTURE], model_type=MLA_MODEL_TYPE,
                      rope_interleave=cfg.rope_interleave, **{name: getattr(cfg, name) for name in MLA_SIZES})
    return config


def verifier_tensors(cfg: DraftConfig, verifier: Verifier) -> dict:
    return {}  # SGLang swaps in the target's embedding
