"""DSpark drafts as a draft algorithm: DFlash's parallel backbone (it is one: `DSparkDraft` extends `DFlashDraft`, as
SGLang's DSparkDraftModel extends its DFlashDraftModel) with a Markov head that drafts the block left to right and a
confidence head (`model.py`), trained on DFlash's blocks with the DSpark objective and drafting as SGLang's DSPARK
worker does (`spark.py`), exported and validated in SGLang's layout (`layout.py`), served by SGLang 0.5.16 on or the
reference server (docs/algorithms.md, "DSpark")."""

from __future__ import annotations

from pathlib import Path

import torch

from eagle3.algorithms.base import ExportTarget, Log
from eagle3.algorithms.dflash import DFlashAlgorithm
from eagle3.algorithms.dflash.blocks import BlockRows
from eagle3.algorithms.dspark.contract import ARCHITECTURE, dspark_shape_problem
from eagle3.algorithms.dspark.imports import convert_dspark
from eagle3.algorithms.dspark.layout import validate_sglang, write_sglang
from eagle3.algorithms.dspark.model import DSPARK_FORMAT, DSparkConfig, DSparkDraft
from eagle3.algorithms.dspark.section import DSparkSection, config_problem, default_layer_ids
from eagle3.algorithms.dspark.spark import SparkDrafter, SparkModel, spark_loss
from eagle3.algorithms.dspark.warm_start import warm_start
from eagle3.algorithms.init_copy import ResolvedInit
from eagle3.config.draft import DraftSection
from eagle3.config.run import TargetSection
from eagle3.config.serving import ServingSection, SweepSection
from eagle3.config.training import TrainingSection
from eagle3.contract.problems import Report
from eagle3.draft.files import CONFIG_FILE
from eagle3.draft.vocab_map import VocabMap
from eagle3.errors import Eagle3Error
from eagle3.fsutil import read_json
from eagle3.model.teacher import Teacher
from eagle3.shape import DraftShape
from eagle3.validation.external import Converted, Serving


class DSparkAlgorithm(DFlashAlgorithm):
    """DFlash's entry where the backbone is the same (its target tensors, KV cache, seeding, checkpoints, warm-start
    copy, the served model read back); its own wherever the heads, the block's gamma entries or the layout differ."""

    name = "dspark"
    # vLLM 0.32's method is "dspark", but only its V2 GPU model runner drafts it, and this pipeline's vLLM launcher
    # serves the speculators layout (docs/algorithms.md, "DSpark"): not served by vLLM here
    served_as = {"sglang": "DSPARK"}
    section_type = DSparkSection
    config_type = DSparkConfig
    model_type = DSparkDraft
    warm_start = ("dspark",)

    def reads(self, config: dict) -> bool:
        return config.get("format") == DSPARK_FORMAT or bool(
            {ARCHITECTURE, "DSparkDraftModel", "Qwen3DSparkForCausalLM"} & set(config.get("architectures") or []))

    def default_aux_layers(self, num_layers: int, draft: DraftSection) -> list[int]:
        return default_layer_ids(num_layers, draft)

    def config_problem(self, draft: DraftSection, target: TargetSection, serving: ServingSection | None,
                       sweep: SweepSection) -> str | None:
        return config_problem(draft, target, serving, sweep)

    def draft_config(self, draft: DraftSection, target: TargetSection, draft_vocab_size: int,
                     aux_layers: list[int]) -> DSparkConfig:
        spark = draft.dspark
        return DSparkConfig(**self.backbone_sizes(draft, target, draft_vocab_size, aux_layers, spark),
                            markov_rank=spark.markov_rank, markov_head_type=spark.markov_head,
                            confidence_head=spark.confidence_head,
                            confidence_head_with_markov=spark.confidence_head_with_markov,
                            ce_weight=spark.ce_weight, l1_weight=spark.l1_weight,
                            confidence_weight=spark.confidence_weight)

    def reserved_ids(self, cfg: DSparkConfig) -> dict[int, str]:
        return {cfg.mask_token_id: "draft.dspark.mask_token_id"}

    def initial_model(self, cfg: DSparkConfig, training: TrainingSection, head: dict[str, torch.Tensor],
                      vocab_map: VocabMap, device: torch.device, init: ResolvedInit | None, log: Log) -> DSparkDraft:
        """Seeded, on `device`, with the target's embedding and head; the Markov bias starts at zero."""
        model = self.seeded_model(cfg, training, head, vocab_map, device)
        model.reset_heads()
        if init is not None:
            warm_start(model, init, log)
        log(f"train: DSpark draft, {cfg.num_hidden_layers} layer(s), gamma {cfg.block_size}, {cfg.markov_head_type} "
            f"Markov head of rank {cfg.markov_rank}, confidence head {'on' if cfg.confidence_head else 'off'}, mask "
            f"token {cfg.mask_token_id}, target layers {cfg.aux_layers}")
        return model

    def predictions(self, draft: DraftSection, training: TrainingSection) -> int:
        return draft.dspark.block_size  # every entry, the anchor's too

    def draft_passes(self, draft: DraftSection, training: TrainingSection) -> tuple[float, str]:
        spark = draft.dspark
        anchors = min(spark.num_anchors, training.seq_len)
        return (anchors * spark.block_size / training.seq_len,
                f"draft.dspark.num_anchors {anchors} x block_size {spark.block_size} / training.seq_len "
                f"{training.seq_len} block entries")

    def loss_rows(self, loss_mask: torch.Tensor, predictions: int, draft: DraftSection) -> BlockRows:
        return BlockRows.drawn(loss_mask, predictions, draft.dspark.num_anchors)

    def training_module(self, model: DSparkDraft) -> SparkModel:
        return SparkModel(model)

    def loss(self, model: DSparkDraft, aux: torch.Tensor, input_ids: torch.Tensor, teacher: Teacher, rows: BlockRows):
        return spark_loss(model, aux, input_ids, teacher, rows)

    def drafter(self, model: DSparkDraft, shape: DraftShape) -> SparkDrafter:
        return SparkDrafter(model, shape)

    def export(self, source: Path, directory: Path, layout: str, target: ExportTarget, log: Log) -> Path:
        if layout != "sglang":
            raise Eagle3Error(f"export.layouts {layout}: a DSpark draft is written in SGLang's layout")
        write_sglang(source, directory)
        log(f"export: DSpark draft in SGLang's layout ({ARCHITECTURE}) -> {directory}")
        return directory

    def validate(self, directory: Path, layout: str, release: str | None, target_dir: Path | None,
                 data_manifest: Path | None, context_length: int | None) -> Report:
        return validate_sglang(directory, release, data_manifest, context_length)

    def convert_external(self, source: Path, dst: Path, serving: Serving, log: Log) -> Converted:
        return convert_dspark(source, dst, serving, log)

    def server_flags(self, draft_path: Path, serving: ServingSection) -> list[str]:
        """SGLang's DSPARK worker drafts --speculative-num-draft-tokens - 1 tokens (its gamma) a step, verified in a
        window of --speculative-num-draft-tokens."""
        return ["--speculative-algorithm", self.served_as["sglang"], "--speculative-draft-model-path", str(draft_path),
                "--speculative-num-draft-tokens", str(serving.num_draft_tokens)]

    def shape_problem(self, draft_path: Path, shape: DraftShape) -> str | None:
        gamma = read_json(draft_path / CONFIG_FILE, "no config.json: not a draft's directory").get("block_size")
        return dspark_shape_problem(gamma if isinstance(gamma, int) else None, shape)


DSPARK = DSparkAlgorithm()
