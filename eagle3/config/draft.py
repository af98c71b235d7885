"""The `draft` section: the draft algorithm and its architecture around the target's width and vocabulary
(docs/configuration.md).

Two attention forms, both served by SGLang's EAGLE-3 drafts (eagle3/algorithms/eagle3/contract.py): `mha` (a Llama
decoder layer) and `mla` (DeepSeek-V2 multi-latent attention, the form whose KV cache matches a DeepSeek or Kimi
target's). The EAGLE 3.1 norms are switches of either form (docs/contracts.md, "The EAGLE 3.1 switches in our
draft").

The kind of draft is a name (`algorithm`) and the kind's own fields a section named after it (`draft.<algorithm>`):
both are the draft algorithms' (eagle3.algorithms), which this layer does not know. The section validates without
them, keeping the kinds' sections as given; the resolve step (eagle3.resolve) checks the name against the registry and
puts the kind's typed section in their place."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from eagle3.config.base import Section


MLA_SIZES = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")  # mla's own sizes

class DraftSection(Section):
    # the fields beyond the section's own (model_extra) are the kinds' own sections, draft.<algorithm>: kept as given
    # here, checked and typed by eagle3.resolve
    model_config = ConfigDict(extra="allow")

    algorithm: str = Field(
        default="eagle3", description="the kind of draft, an entry of eagle3.algorithms (docs/algorithms.md), whose "
        "own fields are the section draft.<algorithm> where it has any")
    attention: Literal["mha", "mla"] = Field(default="mha", description="mha: a Llama layer's attention (grouped "
                                             "heads); mla: DeepSeek-V2's multi-latent attention (the q_lora_rank, "
                                             "kv_lora_rank and head-dim fields), SGLang >= 0.5.12")
    intermediate_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int | None = Field(default=None, gt=0, description="mha (required); mla has one latent for "
                                            "all heads")
    q_lora_rank: int | None = Field(default=None, gt=0)
    kv_lora_rank: int | None = Field(default=None, gt=0)
    qk_nope_head_dim: int | None = Field(default=None, gt=0)
    qk_rope_head_dim: int | None = Field(default=None, gt=0)
    v_head_dim: int | None = Field(default=None, gt=0)
    rms_norm_eps: float = Field(default=1e-6, gt=0.0)
    rope_theta: float = Field(default=10000.0, gt=0.0)
    max_position_embeddings: int = Field(gt=0)
    torch_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    fc_norm: bool = Field(default=False, description="EAGLE 3.1: an RMSNorm on each aux state before fc")
    norm_before_fc: bool = Field(default=False, description="EAGLE 3.1: one RMSNorm over the concatenated aux states "
                                 "before fc (mha only: SGLang's MLA draft has none)")
    norm_output: bool = Field(default=False, description="EAGLE 3.1: the next drafting step is fed the output after "
                              "the final norm rather than before it")
    norm_before_residual: bool = Field(default=False, description="speculators' option; no SGLang release serves it")

    @model_validator(mode="after")
    def _form_is_complete(self) -> DraftSection:
        if self.norm_before_residual:
            raise ValueError("draft.norm_before_residual: no SGLang release implements it (its drafts would run the "
                             "residual path another way and say nothing); set it false")
        if self.attention == "mha" and self.num_key_value_heads is None:
            raise ValueError("draft.num_key_value_heads is required for draft.attention mha")
        if self.attention == "mha" and self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        given = [name for name in MLA_SIZES if getattr(self, name) is not None]
        if self.attention == "mla":
            if missing := [name for name in MLA_SIZES if name not in given]:
                raise ValueError(f"draft.attention mla needs {', '.join('draft.' + n for n in missing)} (SGLang's MLA "
                                 "draft refuses a checkpoint without q_lora_rank)")
        elif given:
            raise ValueError(f"{', '.join('draft.' + n for n in given)} describe an MLA draft: set draft.attention mla "
                             "or remove them")
        return self
