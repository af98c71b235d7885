"""What the pipeline needs to know about a target model, read from its config.json alone."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagle3.errors import UnreadableInput
from eagle3.contract.engines import ARCHITECTURE_FAMILY
from eagle3.fsutil import read_json


@dataclass(frozen=True)
class TargetInfo:
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    family: str | None  # the SGLang model file, None when the architecture is not in our table
    architecture: str | None
    rms_norm_eps: float
    tie_word_embeddings: bool  # the head is the input embedding (absent: untied, every served architecture's default)
    dtype: str | None  # the precision the weights were saved in (torch_dtype, or transformers 5's dtype)


def read_target_info(path: Path) -> TargetInfo:
    """Read a target directory's (or file's) config.json; multimodal configs nest it in text_config."""
    path = Path(path)
    config_path = path / "config.json" if path.is_dir() else path
    config = read_json(config_path, "no such file (expected the target's config.json)")
    if not isinstance(config, dict) or not isinstance(config.get("text_config", {}), dict):
        raise UnreadableInput(f"{config_path}: expected a JSON object (with an optional text_config object)")
    architectures = config.get("architectures") or [None]
    text = config.get("text_config") or config
    missing = [key for key in ("num_hidden_layers", "hidden_size", "vocab_size") if key not in text]
    if missing:
        raise UnreadableInput(f"{config_path}: target config lacks {', '.join(missing)}")
    return TargetInfo(
        num_hidden_layers=int(text["num_hidden_layers"]),
        hidden_size=int(text["hidden_size"]),
        vocab_size=int(text["vocab_size"]),
        family=ARCHITECTURE_FAMILY.get(architectures[0]),
        architecture=architectures[0],
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
        dtype=text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or config.get("dtype"),
    )


@dataclass(frozen=True)
class TargetSize:
    """What the target takes on GPUs: its weights, and its KV cache per token (every layer, one copy)."""

    weight_bytes: int
    weights_from: str  # "safetensors files" (exact) or how the estimate was made
    kv_bytes_per_token: int
    kv_split_by_tp: bool  # GQA/MHA heads are split over tensor-parallel ranks; MLA's latent is not
    num_parameters: int | None  # None when the weights come from the files


DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}
KV_CACHE_BYTES = 2  # bf16 KV cache, SGLang's default for a bf16 model


def read_target_size(path: Path) -> TargetSize:
    """Weights from the checkpoint's safetensors files when they are there (exact), else estimated from
    config.json (parameters by architecture, dtype and quantization)."""
    path = Path(path)
    config_path, config, text = read_target_config(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    kv, split = kv_cache_per_token(text)
    if files:
        return TargetSize(sum(f.stat().st_size for f in files), "safetensors files", kv, split, None)
    parameters, weight_bytes, how = estimate_weights(text, config.get("quantization_config") or text.get("quantization_config"))
    return TargetSize(weight_bytes, f"estimated from {config_path} ({how})", kv, split, parameters)


def read_target_config(path: Path) -> tuple[Path, dict, dict]:
    """(config.json's path, its contents, its text model's part) for a model directory or a config file."""
    config_path = path / "config.json" if path.is_dir() else path
    config = read_json(config_path, "no such file (expected the target's config.json)")
    return config_path, config, config.get("text_config") or config


def active_parameters(text: dict) -> tuple[int, int]:
    """(parameters a token's forward multiplies by, all parameters): the experts it is routed to, never the others,
    and not the input embedding (a lookup); the output head counts."""
    routed, rest = parameter_counts(text)
    experts = int(text.get("n_routed_experts") or text.get("num_experts") or 0)
    per_token = int(text.get("num_experts_per_tok") or 0)
    lookup = 0 if text.get("tie_word_embeddings") else int(text["vocab_size"]) * int(text["hidden_size"])
    active = rest - lookup + (routed * per_token // experts if experts else 0)
    return active, routed + rest


def kv_cache_per_token(text: dict) -> tuple[int, bool]:
    layers = int(text["num_hidden_layers"])
    if "kv_lora_rank" in text:  # MLA: one compressed latent plus the rope key per layer
        return (int(text["kv_lora_rank"]) + int(text["qk_rope_head_dim"])) * layers * KV_CACHE_BYTES, False
    heads = int(text.get("num_attention_heads", 1))
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    return 2 * kv_heads * head_dim * layers * KV_CACHE_BYTES, True


def estimate_weights(text: dict, quantization: dict | None) -> tuple[int, int, str]:
    """(parameters, bytes, how): Llama-style or DeepSeek-V3-style (MLA, MoE) decoders."""
    dtype_bytes = DTYPE_BYTES.get(str(text.get("torch_dtype") or text.get("dtype") or "bfloat16"), 2)
    routed, rest = parameter_counts(text)
    if not routed:
        return rest, rest * dtype_bytes, f"dense, {dtype_bytes}-byte weights"
    expert_bytes, scheme = quantized_bytes_per_parameter(quantization, dtype_bytes)
    total = routed * expert_bytes + rest * dtype_bytes
    return routed + rest, int(total), f"MoE, routed experts {scheme}, the rest {dtype_bytes}-byte"


def parameter_counts(text: dict) -> tuple[int, int]:
    """(routed-expert parameters, every other parameter); 0 routed for a dense model."""
    hidden, vocab, layers = int(text["hidden_size"]), int(text["vocab_size"]), int(text["num_hidden_layers"])
    embeddings = vocab * hidden * (1 if text.get("tie_word_embeddings") else 2)
    attention = layers * attention_parameters(text)
    dense_mlp = 3 * hidden * int(text.get("intermediate_size", 4 * hidden))
    experts = int(text.get("n_routed_experts") or text.get("num_experts") or 0)
    if not experts:
        return 0, embeddings + attention + layers * dense_mlp
    dense_layers = int(text.get("first_k_dense_replace", 0))
    expert_size = 3 * hidden * int(text["moe_intermediate_size"])
    routed = (layers - dense_layers) * experts * expert_size
    shared = (layers - dense_layers) * (int(text.get("n_shared_experts", 0)) * expert_size + experts * hidden)
    return routed, embeddings + attention + dense_layers * dense_mlp + shared


def attention_parameters(text: dict) -> int:
    hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
    if "kv_lora_rank" in text:  # MLA
        q_rank, kv_rank = int(text.get("q_lora_rank") or 0), int(text["kv_lora_rank"])
        qk = int(text["qk_nope_head_dim"]) + int(text["qk_rope_head_dim"])
        q = hidden * q_rank + q_rank * heads * qk if q_rank else hidden * heads * qk
        kv = hidden * (kv_rank + int(text["qk_rope_head_dim"])) + kv_rank * heads * (int(text["qk_nope_head_dim"]) + int(text["v_head_dim"]))
        return q + kv + heads * int(text["v_head_dim"]) * hidden
    head_dim = int(text.get("head_dim") or hidden // heads)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    return 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim


def quantized_bytes_per_parameter(quantization: dict | None, dtype_bytes: int) -> tuple[float, str]:
    """Bytes per routed-expert weight: compressed-tensors int-N with a bf16 scale per group (Kimi-K2's
    INT4 experts), block FP8 (DeepSeek-V3), or unquantized."""
    if not quantization:
        return dtype_bytes, f"{dtype_bytes}-byte"
    if quantization.get("quant_method") == "fp8":
        return 1.0, "fp8"
    for group in (quantization.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        if weights.get("num_bits"):
            bits, size = int(weights["num_bits"]), int(weights.get("group_size") or 128)
            return bits / 8 + 2 / size, f"int{bits} in groups of {size}"
    return dtype_bytes, f"{dtype_bytes}-byte ({quantization.get('quant_method')} not modelled)"
