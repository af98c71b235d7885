"""DFlash (block-diffusion) drafts as a draft algorithm: the draft of `model.py`, trained on blocks at anchors and
drafting a block in one forward (`blocks.py`), exported and validated in SGLang's layout (`layout.py`) and
speculators' (`speculators.py`, which vLLM serves), served by
SGLang's DFLASH worker (or the reference server, which drafts as it does). It trains from the same data stages as
EAGLE-3 (online or offline features, the run's vocab map for its loss) and its evaluation replays the held-out
sequences (docs/algorithms.md, "DFlash")."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle3.algorithms.base import DraftAlgorithm, ExportTarget, Log
from eagle3.algorithms.dflash.blocks import BlockDrafter, BlockModel, BlockRows, block_loss
from eagle3.algorithms.dflash.contract import dflash_shape_problem
from eagle3.algorithms.dflash.imports import convert_dflash
from eagle3.algorithms.dflash.layout import ARCHITECTURE, native_config, validate_sglang, write_sglang
from eagle3.algorithms.dflash.speculators import validate_speculators, write_speculators
from eagle3.algorithms.dflash.warm_start import warm_start, write_copy
from eagle3.algorithms.dflash.model import DFLASH_FORMAT, DFlashConfig, DFlashDraft
from eagle3.algorithms.dflash.section import DFlashSection, config_problem, default_layer_ids
from eagle3.algorithms.init_copy import ResolvedInit
from eagle3.algorithms.sizes import draft_sizes
from eagle3.config.draft import DraftSection
from eagle3.config.run import TargetSection
from eagle3.config.serving import ServingSection, SweepSection
from eagle3.config.training import TrainingSection
from eagle3.contract.problems import Report
from eagle3.draft.files import CONFIG_FILE, WEIGHTS_FILE
from eagle3.draft.vocab_map import VocabMap
from eagle3.errors import Eagle3Error
from eagle3.fsutil import atomic_write_json, read_json
from eagle3.model.blocks import init_weights
from eagle3.model.teacher import Teacher
from eagle3.model.weights import target_head
from eagle3.records.manifest import write_manifest
from eagle3.shape import DraftShape
from eagle3.validation.external import Converted, Serving

class DFlashAlgorithm(DraftAlgorithm):
    name = "dflash"
    served_as = {"sglang": "DFLASH", "vllm": "dflash"}
    section_type = DFlashSection
    config_type = DFlashConfig
    model_type = DFlashDraft  # a kind built on this backbone names its own model (its config_type is the model's)
    warm_start = ("dflash",)

    def reads(self, config: dict) -> bool:
        return config.get("format") == DFLASH_FORMAT or ARCHITECTURE in (config.get("architectures") or [])

    def default_aux_layers(self, num_layers: int, draft: DraftSection) -> list[int]:
        return default_layer_ids(num_layers, draft)

    def config_problem(self, draft: DraftSection, target: TargetSection, serving: ServingSection | None,
                       sweep: SweepSection) -> str | None:
        return config_problem(draft, target, serving, sweep)

    def draft_config(self, draft: DraftSection, target: TargetSection, draft_vocab_size: int,
                     aux_layers: list[int]) -> DFlashConfig:
        return DFlashConfig(**self.backbone_sizes(draft, target, draft_vocab_size, aux_layers, draft.dflash))

    @staticmethod
    def backbone_sizes(draft: DraftSection, target: TargetSection, draft_vocab_size: int, aux_layers: list[int],
                       section) -> dict:
        """The backbone's config fields: the draft section's sizes around the target's (its embedding feeds the
        blocks, its head reads them) and the kind's section's layers, block and mask token."""
        return dict(**draft_sizes(draft, target, draft_vocab_size, aux_layers),
                    num_hidden_layers=section.num_layers,
                    num_key_value_heads=draft.num_key_value_heads,
                    head_dim=target.hidden_size // draft.num_attention_heads,
                    block_size=section.block_size,
                    mask_token_id=section.mask_token_id)

    def reserved_ids(self, cfg: DFlashConfig) -> dict[int, str]:
        # the mask token would stand for itself and for "unknown" at once
        return {cfg.mask_token_id: "draft.dflash.mask_token_id"}

    def new_model(self, cfg: DFlashConfig, embed: torch.Tensor) -> DFlashDraft:
        return self.model_type(cfg, embed)

    def target_tensors(self, cfg: DFlashConfig) -> dict[str, int]:
        embedding = cfg.vocab_size * cfg.hidden_size
        return {"target embedding, fp32, frozen": 4 * embedding,
                "target head, bf16, frozen (the draft's logits; one tensor with the embedding when tied)": 2 * embedding}

    def initial_model(self, cfg: DFlashConfig, training: TrainingSection, head: dict[str, torch.Tensor],
                      vocab_map: VocabMap, device: torch.device, init: ResolvedInit | None, log: Log) -> DFlashDraft:
        """Seeded, on `device`; the target's embedding and head (one tensor when they are tied), the loss scoring
        the run's draft vocabulary."""
        model = self.seeded_model(cfg, training, head, vocab_map, device)
        if init is not None:
            warm_start(model, init, log)
        log(f"train: DFlash draft, {cfg.num_hidden_layers} layer(s), block {cfg.block_size}, mask token "
            f"{cfg.mask_token_id}, target layers {cfg.aux_layers}")
        return model

    def seeded_model(self, cfg: DFlashConfig, training: TrainingSection, head: dict[str, torch.Tensor],
                     vocab_map: VocabMap, device: torch.device) -> DFlashDraft:
        """The model of `cfg` on `device` with the target's embedding and head, seeded by training.seed."""
        embed = head["embed"].to(device)
        head_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # its matmuls run in bf16 there
        lm_head = embed if head["lm_head"] is head["embed"] else head["lm_head"].to(device, head_dtype)
        with torch.device(device):
            model = self.model_type(cfg, embed, lm_head)
        init_weights(model, training.seed)  # from a CPU generator: the same draft on any device
        model.loss_ids.copy_(vocab_map.target_ids())
        return model

    def warm_start_copy(self, source: Path, out: Path, target: ExportTarget, source_name: str, log: Log) -> str:
        """A native draft or an SGLang export of this project's (every registry version holds one; a draft from
        elsewhere is imported first: `eagle3 registry import`). Its target layer ids are this project's numbering in
        both, whatever the release."""
        write_copy(source, out, source_name, self.config_type)
        native = self.config_type.model_fields["format"].default
        return "sglang" if "eagle3" in read_json(source / CONFIG_FILE, "missing") else native

    def served_model(self, path: Path, release: str | None, target_dir: Path, prefix: str) -> DFlashDraft:
        """The draft at `path` (an SGLang export, or what `write_draft` wrote), with the target's embedding and head:
        SGLang's loader reads every tensor of an export as it is (tests/conformance/test_dflash_loader.py)."""
        head = target_head(target_dir, prefix)
        if "eagle3" in read_json(path / CONFIG_FILE, "missing"):
            cfg = native_config(path, self.config_type)
            tensors = {name: t.float() for name, t in load_file(path / WEIGHTS_FILE).items()}
        else:
            cfg = self.config_type.model_validate(read_json(path / CONFIG_FILE, "missing"))
            tensors = self.read_draft(path)
        model = self.model_type(cfg, head["embed"], head["lm_head"])
        model.load_draft_state(tensors)
        return model

    def write_draft(self, cfg: DFlashConfig, tensors: dict[str, torch.Tensor], directory: Path,
                    manifest_fields: dict) -> None:
        save_file({name: t.contiguous() for name, t in tensors.items()}, directory / WEIGHTS_FILE,
                  metadata={"format": "pt"})
        atomic_write_json(directory / CONFIG_FILE, cfg.model_dump())
        write_manifest(directory, kind=f"draft-{cfg.format}", fields={"layout": cfg.format, **manifest_fields})

    def read_draft(self, directory: Path) -> dict[str, torch.Tensor]:
        return load_file(directory / WEIGHTS_FILE)

    def predictions(self, draft: DraftSection, training: TrainingSection) -> int:
        return draft.dflash.block_size - 1

    def draft_passes(self, draft: DraftSection, training: TrainingSection) -> tuple[float, str]:
        """Each sequence's blocks: its anchors (at most one a position) x the block's positions."""
        dflash = draft.dflash
        anchors = min(dflash.num_anchors, training.seq_len)
        return (anchors * dflash.block_size / training.seq_len,
                f"draft.dflash.num_anchors {anchors} x block_size {dflash.block_size} / training.seq_len "
                f"{training.seq_len} block positions")

    def loss_rows(self, loss_mask: torch.Tensor, predictions: int, draft: DraftSection) -> BlockRows:
        return BlockRows.drawn(loss_mask, predictions, draft.dflash.num_anchors)

    def normaliser(self, loss_mask: torch.Tensor, predictions: int, draft: DraftSection) -> torch.Tensor:
        """[K] the blocks' predictions of generated tokens: the rows' own count (their draw is the mask's)."""
        rows = self.loss_rows(loss_mask, predictions, draft)
        return torch.stack([present.sum() for present in rows.present]).float()

    def training_module(self, model: DFlashDraft) -> BlockModel:
        return BlockModel(model)

    def loss(self, model: DFlashDraft, aux: torch.Tensor, input_ids: torch.Tensor, teacher: Teacher,
             rows: BlockRows):
        return block_loss(model, aux, input_ids, teacher, rows)

    def drafter(self, model: DFlashDraft, shape: DraftShape) -> BlockDrafter:
        return BlockDrafter(model, shape)

    def export(self, source: Path, directory: Path, layout: str, target: ExportTarget, log: Log) -> Path:
        if layout == "speculators":
            write_speculators(source, directory, target.verifier, target.num_steps)
        elif layout == "sglang":
            write_sglang(source, directory)
        else:
            raise Eagle3Error(f"{layout}: a DFlash draft is written in SGLang's or speculators' layout")
        log(f"export: DFlash draft in {layout}'s layout (DFlashDraftModel) -> {directory}")
        return directory

    def validate(self, directory: Path, layout: str, release: str | None, target_dir: Path | None,
                 data_manifest: Path | None, context_length: int | None) -> Report:
        if layout == "speculators":
            return validate_speculators(directory, data_manifest)
        return validate_sglang(directory, release, data_manifest, context_length)

    def convert_external(self, source: Path, dst: Path, serving: Serving, log: Log) -> Converted:
        return convert_dflash(source, dst, serving, log)

    def kv_cache_entries(self, cfg: DFlashConfig, tp: int) -> float:
        """Keys and values of every layer; SGLang gives each rank max(1, kv_heads / tp) heads (DFlashAttention)."""
        return cfg.num_hidden_layers * 2 * max(1, cfg.num_key_value_heads // tp) * cfg.head_dim

    def server_flags(self, draft_path: Path, serving: ServingSection) -> list[str]:
        """SGLang's DFLASH worker verifies one block of --speculative-num-draft-tokens a step (it sets num_steps and
        eagle_topk to 1 itself, and takes the block from here over the draft's block_size)."""
        return ["--speculative-algorithm", self.served_as["sglang"], "--speculative-draft-model-path", str(draft_path),
                "--speculative-num-draft-tokens", str(serving.num_draft_tokens)]

    def shape_problem(self, draft_path: Path, shape: DraftShape) -> str | None:
        block = read_json(draft_path / CONFIG_FILE, "no config.json: not a draft's directory").get("block_size")
        return dflash_shape_problem(block if isinstance(block, int) else None, shape)


DFLASH = DFlashAlgorithm()
