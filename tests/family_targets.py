"""Tiny random targets of the families SGLang serves beside Llama, built with the tiny target's own family table
(eagle3/runtime/tiny.py) in ~1 s each: five decoder layers, so three aux layers [1, 2, 3] stay below the last one on
every family's rule."""

from __future__ import annotations

from pathlib import Path

import torch

from eagle3.runtime.tiny import FAMILY_ARCHITECTURES, family_model

FAMILIES = sorted(set(FAMILY_ARCHITECTURES) - {"llama"})  # Llama: the micro target (conformance/test_features.py)
# The shipped CPU config of each family: configs/tiny-cpu.yaml on that family's tiny target
FAMILY_CONFIGS = {family: Path(__file__).parent.parent / "configs" / f"tiny-{family.replace('_', '-')}-cpu.yaml"
                  for family in FAMILIES}
# the whole flow per family on its shipped config; DeepSeek-V2 with SGLang's MLA draft form (its Llama-layer draft
# config differs from tiny-cpu.yaml by the target alone, and the Kimi-kind flow serves a Llama-layer draft on MLA)
MLA_DRAFT_CONFIG = Path(__file__).parent.parent / "configs" / "tiny-deepseek-v2-mla-cpu.yaml"
DFLASH_CONFIG = Path(__file__).parent.parent / "configs" / "tiny-dflash-cpu.yaml"  # tests/test_dflash.py
DSPARK_CONFIG = Path(__file__).parent.parent / "configs" / "tiny-dspark-cpu.yaml"  # tests/test_dspark.py
CONTENDERS_CONFIG = Path(__file__).parent.parent / "configs" / "tiny-contenders-cpu.yaml"  # tests/test_contenders.py
THREE_KINDS_CONFIG = Path(__file__).parent.parent / "configs" / "tiny-three-kinds-cpu.yaml"  # tests/test_contenders.py
VLLM_CONFIG = Path(__file__).parent.parent / "configs" / "tiny-vllm-cpu.yaml"  # tests/conformance/test_vllm_server.py
STREAMED_CONFIG = Path(__file__).parent.parent / "configs" / "tiny-streamed-cpu.yaml"  # tests/test_streamed.py
FLOW_CONFIGS = {**FAMILY_CONFIGS, "deepseek_v2": MLA_DRAFT_CONFIG}
NUM_LAYERS = 5
AUX_LAYERS = [1, 2, 3]
VOCAB = 512
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=NUM_LAYERS,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)


def build_family_target(out: Path, family: str, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    model = family_model(family, **SHAPE).float()
    with torch.no_grad():  # norms away from their initial value, so a norm applied or skipped shows in the features
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    model.save_pretrained(out)
    return out
