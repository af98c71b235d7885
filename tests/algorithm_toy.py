"""A toy draft algorithm, the worked example of docs/algorithms.md: Medusa-style heads, one per drafted position,
each a linear map of the target's captured states at index t to the draft vocabulary (head k predicts x_{t+2+k}).
No attention, no recurrence: the smallest entry that trains, replays and writes checkpoints through the seam."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from eagle3.algorithms.base import DraftAlgorithm
from eagle3.algorithms.eagle3.architecture import trained_draft_config
from eagle3.algorithms.eagle3.checkpoint import DraftConfig
from eagle3.fsutil import atomic_write_json, read_json
from eagle3.model.blocks import init_weights
from eagle3.model.weights import target_embedding
from eagle3.model.tree import DraftTree
from eagle3.model.blocks import LossRows, StepStats, step_stats
from eagle3.algorithms.eagle3.ttt import target_positions

HEADS = 2  # drafted positions: the chain's longest (the micro config trains TTT 3: the trainer asks the entry)


class ToyHeads(nn.Module):
    def __init__(self, cfg, embed: torch.Tensor):
        super().__init__()
        self.config = cfg
        width = len(cfg.aux_layers) * cfg.target_hidden_size
        self.heads = nn.Linear(width, HEADS * cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))

    def forward(self, aux: torch.Tensor) -> list[torch.Tensor]:
        """aux [..., n_aux * TH] -> each head's logits [..., Dv]."""
        return list(self.heads(aux).chunk(HEADS, dim=-1))

    def export_state(self) -> dict[str, torch.Tensor]:
        return {name: t.detach().to("cpu", copy=True) for name, t in self.state_dict().items()}

    def load_draft_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.load_state_dict(tensors, strict=True)

    def set_recompute(self, on: bool) -> None:
        """Nothing to recompute."""


class ToyLoss(nn.Module):
    def __init__(self, algorithm: ToyAlgorithm, draft: ToyHeads):
        super().__init__()
        self.algorithm, self.draft = algorithm, draft

    def forward(self, aux, input_ids, teacher, rows) -> torch.Tensor:
        stats = self.algorithm.loss(self.draft, aux, input_ids, teacher, rows)
        return torch.stack([stats.loss_sum, stats.correct, stats.count])


class ToyAlgorithm(DraftAlgorithm):
    name = "toy"
    config_type = DraftConfig
    deployable = False
    # served_as: none (no engine serves it): the toy is trained and replayed, never served

    def draft_config(self, draft, target, draft_vocab_size, aux_layers):
        # the sizes it reads: aux layers, widths, draft vocabulary
        return trained_draft_config(draft, target, draft_vocab_size, aux_layers)

    def reserved_ids(self, cfg):
        return {}

    def new_model(self, cfg, embed):
        return ToyHeads(cfg, embed)

    def target_tensors(self, cfg):
        return {}

    def initial_model(self, cfg, training, head, vocab_map, device, init, log):
        with torch.device(device):
            model = self.new_model(cfg, head["embed"])
        init_weights(model, training.seed)
        model.d2t.copy_(vocab_map.d2t)
        return model

    def served_model(self, path, release, target_dir, prefix):
        cfg = DraftConfig.model_validate(read_json(path / "config.json", "missing"))
        model = self.new_model(cfg, target_embedding(target_dir, prefix))
        model.load_draft_state(self.read_draft(path))
        return model

    def write_draft(self, cfg, tensors, directory: Path, manifest_fields):
        save_file(tensors, directory / "toy.safetensors")
        atomic_write_json(directory / "config.json", cfg.model_dump())

    def read_draft(self, directory: Path):
        return load_file(directory / "toy.safetensors")

    def predictions(self, draft, training):
        return HEADS

    def draft_passes(self, draft, training):
        return HEADS, f"{HEADS} heads"

    def loss_rows(self, loss_mask, predictions, draft):
        return LossRows.of(loss_mask, predictions)  # head k at index t reaches x_{t+2+k}: TTT step k's alignment

    def normaliser(self, loss_mask, predictions, draft):
        return target_positions(loss_mask, predictions)

    def training_module(self, model):
        return ToyLoss(self, model)

    def loss(self, model, aux, input_ids, teacher, rows) -> StepStats:
        return step_stats(model(aux), teacher, rows)  # each head's [B, T, Dv], gathered at its rows

    def drafter(self, model, shape):
        def draft(aux, tokens) -> DraftTree:  # the heads at the last verified feature draft the next HEADS tokens
            rows = [int(logits.argmax()) for logits in model(aux[-1])][: shape.num_steps]
            return DraftTree.chain([row + int(model.d2t[row]) for row in rows])
        return draft

    def export(self, source, directory, layout, target, log):
        raise ValueError(f"no {layout} layout holds the toy's heads: it is trained and replayed here, never exported")

    def validate(self, directory, layout, release, target_dir, data_manifest, context_length):
        raise ValueError(f"no {layout} layout holds the toy's heads: there is no export to validate")

    def convert_external(self, source, dst, serving, log):
        raise ValueError(f"{source}: no layout holds the toy's heads, so none is imported")

    def kv_cache_entries(self, cfg, tp):
        return 0  # no attention: nothing cached

    def server_flags(self, draft_path, serving):
        raise ValueError("no SGLang release serves the toy's heads: it is trained and replayed here, never served")


TOY = ToyAlgorithm()
