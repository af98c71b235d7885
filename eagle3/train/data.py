"""Training batches from the captured dataset: a deterministic, length-bucketed order that every
rank computes alike, so a global batch is the same whatever the number of ranks."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3.data.shards import ShardReader

BUCKET_BATCHES = 16  # batches sorted by length together: less padding, order still shuffled


@dataclass(frozen=True)
class SampleRef:
    shard: int
    index: int
    length: int
    id: str


def is_eval_sample(sample_id: str, fraction: float) -> bool:
    """Stable by id, so resumed and multi-rank runs agree on the split."""
    return int(hashlib.sha256(f"eval:{sample_id}".encode()).hexdigest()[:8], 16) / 16**8 < fraction


class TrainingData:
    def __init__(self, dataset_dir: Path, seq_len: int, eval_fraction: float):
        self.readers = [ShardReader(p) for p in sorted(Path(dataset_dir).glob("shard-?????.safetensors"))]
        self.seq_len = seq_len
        refs = [
            SampleRef(s, i, min(int(r.offsets[i + 1] - r.offsets[i]), seq_len), r.ids[i])
            for s, r in enumerate(self.readers)
            for i in range(len(r))
        ]
        self.eval = [ref for ref in refs if is_eval_sample(ref.id, eval_fraction)]
        self.train = [ref for ref in refs if not is_eval_sample(ref.id, eval_fraction)]

    def batches(self, epoch: int, batch_size: int, seed: int) -> list[list[SampleRef]]:
        """The epoch's global batches: shuffled, bucketed by length, batch order shuffled again."""
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        order = [self.train[i] for i in torch.randperm(len(self.train), generator=generator).tolist()]
        batches = []
        window = batch_size * BUCKET_BATCHES
        for start in range(0, len(order) - batch_size + 1, window):
            chunk = sorted(order[start : start + window], key=lambda ref: ref.length)
            batches += [chunk[i : i + batch_size] for i in range(0, len(chunk) - batch_size + 1, batch_size)]
        return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]

    def collate(self, refs: list[SampleRef]) -> dict[str, torch.Tensor]:
        """Right-padded tensors for a list of samples (padding has loss_mask 0)."""
        samples = [self.readers[ref.shard].sample(ref.index) for ref in refs]
        width = max(ref.length for ref in refs)
        aux_width, hidden = samples[0].aux_hidden.shape[1], samples[0].last_hidden.shape[1]
        batch = {
            "input_ids": torch.zeros(len(refs), width, dtype=torch.long),  # [B, T]
            "loss_mask": torch.zeros(len(refs), width, dtype=torch.long),
            "aux": torch.zeros(len(refs), width, aux_width),  # [B, T, n_aux * H]
            "last": torch.zeros(len(refs), width, hidden),  # [B, T, H]
        }
        for row, (ref, sample) in enumerate(zip(refs, samples)):
            n = ref.length
            batch["input_ids"][row, :n] = sample.input_ids[:n].long()
            batch["loss_mask"][row, :n] = sample.loss_mask[:n].long()
            batch["aux"][row, :n] = sample.aux_hidden[:n].float()
            batch["last"][row, :n] = sample.last_hidden[:n].float()
        return batch
