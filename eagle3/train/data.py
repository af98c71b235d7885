"""Training batches from the data set's shards: a deterministic, length-bucketed order that every rank computes
alike, so a global batch is the same whatever the number of ranks. Token rows come from the shards; features from a
backend (eagle3/runtime/features.py): the target itself (online) or the shards' stored columns (offline). The eval
samples are the ones the data named (an import with a split: split.json beside the shards), else a hash of the sample
id picks training.eval_fraction of them."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3.data.shards import ShardReader, named_eval_ids
from eagle3.runtime.features import FeatureBackend, Features, TokenBatch, empty_features
from eagle3.errors import Eagle3Error

BUCKET_BATCHES = 16  # batches sorted by length together: less padding, order still shuffled


@dataclass(frozen=True)
class SampleRef:
    shard: int
    index: int
    length: int
    id: str


def micro_batches(batch: list[SampleRef], world: int, per_rank: int) -> list[list[SampleRef]]:
    """A global batch cut into global micro-batches of world x per_rank rows, in order: rank r's rows of them
    (rows r::world of each) are, together, its rows of the whole batch."""
    size = world * per_rank
    return [batch[start : start + size] for start in range(0, len(batch), size)]


def is_eval_sample(sample_id: str, fraction: float) -> bool:
    """Stable by id, so resumed and multi-rank runs agree on the split."""
    return int(hashlib.sha256(f"eval:{sample_id}".encode()).hexdigest()[:8], 16) / 16**8 < fraction


class TrainingData:
    """The data set's samples that hold a generated (loss-masked) token in their first seq_len, split into training
    and eval. One without (a prompt that filled data.max_length before the target answered, or a reply cut off by
    seq_len) has nothing to learn: it would take a batch slot, and a batch of them an optimizer step on momentum alone.
    `without_loss` counts them."""

    def __init__(self, dataset_dir: Path, seq_len: int, eval_fraction: float):
        self.readers = [ShardReader(p) for p in sorted(Path(dataset_dir).glob("shard-?????.safetensors"))]
        self.seq_len = seq_len
        counts = [r.loss_tokens(seq_len) for r in self.readers]
        refs = [
            SampleRef(s, i, min(r.length(i), seq_len), r.ids[i])
            for s, r in enumerate(self.readers)
            for i in range(len(r))
            if counts[s][i] > 0
        ]
        self.without_loss = sum(len(r) for r in self.readers) - len(refs)
        self.left_out_why = f"no generated token in their first {seq_len} tokens (training.seq_len), nothing to learn"
        named = named_eval_ids(dataset_dir)  # the rows' own split (imported data) wins over eval_fraction
        in_eval = [ref.id in named if named is not None else is_eval_sample(ref.id, eval_fraction) for ref in refs]
        self.eval = [ref for ref, evaluated in zip(refs, in_eval) if evaluated]
        self.train = [ref for ref, evaluated in zip(refs, in_eval) if not evaluated]

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

    def tokens(self, refs: list[SampleRef], every_position: bool = False) -> tuple[TokenBatch, torch.Tensor]:
        """Right-padded token rows of `refs` cut to seq_len, and their loss mask [B, T] (padding has mask 0):
        the generated tokens, or with `every_position` (training.loss_positions all) every real one."""
        samples = [self.readers[ref.shard].sample(ref.index, ("input_ids", "loss_mask")) for ref in refs]
        width = max(ref.length for ref in refs)
        ids = torch.zeros(len(refs), width, dtype=torch.long)  # [B, T]
        loss_mask = torch.zeros(len(refs), width, dtype=torch.long)
        for row, (ref, sample) in enumerate(zip(refs, samples)):
            ids[row, : ref.length] = sample.input_ids[: ref.length].long()
            loss_mask[row, : ref.length] = sample.loss_mask[: ref.length].long()
        lengths = torch.tensor([ref.length for ref in refs], dtype=torch.long)
        if every_position:
            loss_mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
        return TokenBatch(ids, lengths, [ref.id for ref in refs]), loss_mask


class ShardFeatures(FeatureBackend):
    """The `shards` feature backend: features an offline capture stored, read back by sample id (and checked to be
    for the same tokens)."""

    name = "shards"

    def __init__(self, data: TrainingData, release: str | None, device: torch.device):
        self.readers, self.release, self.device = data.readers, release, device
        self.where = {reader.ids[i]: (reader, i) for reader in self.readers for i in range(len(reader))}

    def features(self, batch: TokenBatch, rows: slice = slice(None)) -> Features:
        mine = batch.select(rows)
        width = mine.input_ids.shape[1]
        stored = [self.where[sample_id][0].sample(self.where[sample_id][1]) for sample_id in mine.sample_ids]
        if not stored:
            any_sample = self.readers[0].sample(0)
            return empty_features(any_sample.aux_hidden.shape[1], any_sample.last_hidden.shape[1], self.device)
        dtype = stored[0].aux_hidden.dtype  # as the capture stored them (data.feature_dtype)
        aux = torch.zeros(len(stored), width, stored[0].aux_hidden.shape[1], dtype=dtype)  # [b, T, n_aux * H]
        last = torch.zeros(len(stored), width, stored[0].last_hidden.shape[1], dtype=dtype)  # [b, T, H]
        for row, (sample, n) in enumerate(zip(stored, mine.lengths.tolist())):
            if not torch.equal(sample.input_ids[:n].long(), mine.input_ids[row, :n]):
                raise Eagle3Error(f"sample {sample.id}: the stored features are for other tokens than its token row")
            aux[row, :n], last[row, :n] = sample.aux_hidden[:n], sample.last_hidden[:n]
        return Features(aux.to(self.device, non_blocking=True).float(), last.to(self.device, non_blocking=True).float())

    def close(self) -> None:
        self.where.clear()
