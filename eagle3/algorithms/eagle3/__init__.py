"""EAGLE-3 (both attention forms) as a draft algorithm: the Llama-layer or MLA draft of `model.py`, trained by
training-time test (`ttt.py`), drafting chains and trees (`tree.py`), served by SGLang's EAGLE3
worker. Its layouts and their checks are `eagle3.draft` and `eagle3.validation`'s (docs/contracts.md)."""

from __future__ import annotations

from pathlib import Path

import torch

from eagle3.algorithms.base import DraftAlgorithm, Drafter, ExportTarget, Log
from eagle3.algorithms.eagle3.contract import FLAG_CONFIG_KEYS, MLA_DRAFT_ARCHITECTURE, served_draft_problem
from eagle3.algorithms.eagle3.architecture import trained_draft_config
from eagle3.algorithms.eagle3.warm_start import warm_start
from eagle3.algorithms.init_copy import ResolvedInit
from eagle3.config.draft import DraftSection
from eagle3.config.run import TargetSection
from eagle3.config.serving import ServingSection, SweepSection
from eagle3.config.training import TrainingSection
from eagle3.contract.problems import Report
from eagle3.algorithms.eagle3.checkpoint import (DraftConfig, NativeDraft, convert, load_native, read_checkpoint, save_native_draft,
                                    to_native, write_draft_files)
from eagle3.draft.vocab_map import VocabMap
from eagle3.algorithms.eagle3.model import Eagle3Draft, freeze_head
from eagle3.model.blocks import init_weights
from eagle3.model.teacher import Teacher
from eagle3.algorithms.eagle3.tree import DraftCache, draft_tree
from eagle3.model.blocks import LossRows, StepStats
from eagle3.algorithms.eagle3.ttt import TTTModel, target_positions, ttt_loss
from eagle3.algorithms.eagle3.served import draft_as_served
from eagle3.model.weights import target_embedding
from eagle3.shape import DraftShape
from eagle3.validation.external import Converted, Serving
from eagle3.algorithms.eagle3.external import convert_external
from eagle3.algorithms.eagle3.validate import validate


class Eagle3Algorithm(DraftAlgorithm):
    name = "eagle3"
    served_as = {"sglang": "EAGLE3", "vllm": "eagle3"}
    config_type = DraftConfig
    warm_start = ("eagle3",)

    def config_problem(self, draft: DraftSection, target: TargetSection, serving: ServingSection | None,
                       sweep: SweepSection) -> str | None:
        """SGLang's EAGLE-3 drafts: the attention form and the EAGLE 3.1 switches the served release loads."""
        release = serving.release if serving is not None else None
        if draft.attention == "mla" and draft.norm_before_fc:
            return (f"draft.norm_before_fc: SGLang's MLA draft ({MLA_DRAFT_ARCHITECTURE}) has no input norm and would "
                    "skip it; use draft.fc_norm")
        switches = [name for name in FLAG_CONFIG_KEYS if getattr(draft, name)]
        if problem := served_draft_problem(draft.attention, switches, release):
            return f"draft.attention {draft.attention} with {switches or 'no switches'}: {problem}"
        return None

    def draft_config(self, draft: DraftSection, target: TargetSection, draft_vocab_size: int,
                     aux_layers: list[int]) -> DraftConfig:
        return trained_draft_config(draft, target, draft_vocab_size, aux_layers)

    def reserved_ids(self, cfg: DraftConfig) -> dict[int, str]:
        return {}

    def new_model(self, cfg: DraftConfig, embed: torch.Tensor) -> Eagle3Draft:
        return Eagle3Draft(cfg, embed)

    def target_tensors(self, cfg: DraftConfig) -> dict[str, int]:
        return {"target embedding, fp32, frozen": 4 * cfg.vocab_size * cfg.hidden_size}

    def initial_model(self, cfg: DraftConfig, training: TrainingSection, head: dict[str, torch.Tensor],
                      vocab_map: VocabMap, device: torch.device, init: ResolvedInit | None, log: Log) -> Eagle3Draft:
        """Made on `device` (no CPU copy of the weights to move); the head holds the target's rows of the draft
        vocabulary, its d2t and t2d are the run's vocab map."""
        with torch.device(device):
            model = self.new_model(cfg, head["embed"].to(device))
        init_weights(model, training.seed)  # from a CPU generator: the same draft on any device
        with torch.no_grad():
            model.d2t.copy_(vocab_map.d2t)
            model.t2d.copy_(vocab_map.t2d)
            model.lm_head.weight.copy_(head["lm_head"][vocab_map.target_ids()])  # the target's rows
        if init is not None:
            warm_start(model, vocab_map, init, log)
        if training.freeze_head:
            freeze_head(model, None if init is not None else head["norm"].to(device))
        return model

    def warm_start_copy(self, source: Path, out: Path, target: ExportTarget, source_name: str, log: Log) -> str:
        """Any layout the project reads (native, sglang, speculators), its aux ids decoded for the target's family
        and release; the conversion refuses what a loader would misread (an absolute d2t, say)."""
        raw = read_checkpoint(source)
        native = to_native(raw, target.family, target.release, target.num_layers, log)
        save_native_draft(native, out, "native", overwrite=True, source=source_name)
        return raw.layout

    def served_model(self, path: Path, release: str | None, target_dir: Path, prefix: str) -> Eagle3Draft:
        return draft_as_served(path, release, target_embedding(target_dir, prefix))

    def write_draft(self, cfg: DraftConfig, tensors: dict[str, torch.Tensor], directory: Path,
                    manifest_fields: dict) -> None:
        write_draft_files(NativeDraft(cfg, tensors), directory, "native", manifest_fields=manifest_fields)

    def read_draft(self, directory: Path) -> dict[str, torch.Tensor]:
        return load_native(directory).tensors

    def predictions(self, draft: DraftSection, training: TrainingSection) -> int:
        return training.ttt_steps

    def draft_passes(self, draft: DraftSection, training: TrainingSection) -> tuple[float, str]:
        return training.ttt_steps, f"training.ttt_steps {training.ttt_steps}"

    def loss_rows(self, loss_mask: torch.Tensor, predictions: int, draft: DraftSection) -> LossRows:
        return LossRows.of(loss_mask, predictions)

    def normaliser(self, loss_mask: torch.Tensor, predictions: int, draft: DraftSection) -> torch.Tensor:
        return target_positions(loss_mask, predictions)

    def training_module(self, model: Eagle3Draft) -> TTTModel:
        return TTTModel(model)

    def loss(self, model: Eagle3Draft, aux: torch.Tensor, input_ids: torch.Tensor, teacher: Teacher,
             rows: LossRows) -> StepStats:
        return ttt_loss(model, aux, input_ids, teacher, rows)

    def drafter(self, model: Eagle3Draft, shape: DraftShape) -> Drafter:
        cache = DraftCache(model)  # the prefix's keys and values, extended as the verified sequence grows
        return lambda aux, tokens: draft_tree(model, aux, tokens, shape, cache)

    def export(self, source: Path, directory: Path, layout: str, target: ExportTarget, log: Log) -> Path:
        return convert(source, directory, to=layout, target_family=target.family, release=target.release,
                       target_num_layers=target.num_layers, overwrite=True, num_steps=target.num_steps, log=log,
                       verifier=target.verifier)

    def validate(self, directory: Path, layout: str, release: str | None, target_dir: Path | None,
                 data_manifest: Path | None, context_length: int | None) -> Report:
        return validate(directory, engine=layout, release=release, target=target_dir, data_manifest=data_manifest,
                        context_length=context_length)

    def convert_external(self, source: Path, dst: Path, serving: Serving, log: Log) -> Converted:
        return convert_external(source, dst, serving, log)

    def kv_cache_entries(self, cfg: DraftConfig, tp: int) -> float:
        if cfg.attention == "mla":  # one latent plus the shared RoPE key per token, on every rank (not split by tp)
            return cfg.kv_lora_rank + cfg.qk_rope_head_dim
        return 2 * cfg.num_key_value_heads * cfg.head_dim / tp  # one layer

    def server_flags(self, draft_path: Path, serving: ServingSection) -> list[str]:
        return ["--speculative-algorithm", self.served_as["sglang"], "--speculative-draft-model-path", str(draft_path),
                "--speculative-num-steps", str(serving.num_steps), "--speculative-eagle-topk", str(serving.eagle_topk),
                "--speculative-num-draft-tokens", str(serving.num_draft_tokens)]


EAGLE3 = Eagle3Algorithm()
