"""The target's greedy token at each scored position of a stored sample, remembered after its first scoring.

Stored (offline) features never change between epochs, so neither does the teacher's full-vocabulary argmax: over
SmolLM2's 49,152 ids it is the training step's largest matmul on the CPU (docs/training.md). The memo keeps it on
the host, int32 per position (4 bytes per stored token a rank has scored: 0.12 MB for SmolLM2's 96 samples of 320
tokens, 3.3 GB for 200,000 of 4,096), and a batch whose rows it all knows skips the argmax. The teacher's
draft-vocabulary distribution is still computed every time ([R, Dv] float32 is too large to keep). Online features
are computed anew by the target every time, so only stored ones have a memo.
"""

from __future__ import annotations

import torch

from eagle3.runtime.features import TokenBatch
from eagle3.model.teacher import Teacher, TeacherHead

UNKNOWN = -1


class ArgmaxMemo:
    def __init__(self) -> None:
        self.known: dict[str, torch.Tensor] = {}  # sample id -> [its length] int32, UNKNOWN where never scored

    def lookup(self, batch: TokenBatch, rows: torch.Tensor) -> torch.Tensor | None:
        """rows [R] (host, flat indices into the batch's B x T) -> the greedy tokens there [R] int64, or None when
        any of them was never scored."""
        width = batch.input_ids.shape[1]
        table = torch.full((len(batch.sample_ids), width), UNKNOWN, dtype=torch.int32)  # [B, T]
        for row, sample_id in enumerate(batch.sample_ids):
            seen = self.known.get(sample_id)
            if seen is not None:
                table[row, : len(seen)] = seen
        found = table.flatten().index_select(0, rows)
        return None if bool((found == UNKNOWN).any()) else found.long()

    def remember(self, batch: TokenBatch, rows: torch.Tensor, argmax: torch.Tensor) -> None:
        """argmax [R] (host): the greedy tokens at flat rows [R] (host). Static shapes only (index_copy, where)."""
        width = batch.input_ids.shape[1]
        table = torch.full((len(batch.sample_ids) * width,), UNKNOWN, dtype=torch.int32)
        table = table.index_copy_(0, rows, argmax.to(torch.int32)).view(-1, width)  # [B, T]
        for row, (sample_id, length) in enumerate(zip(batch.sample_ids, batch.lengths.tolist())):
            scored = table[row, :length].clone()  # its own storage, not a view of the batch's table
            seen = self.known.get(sample_id)
            self.known[sample_id] = scored if seen is None else torch.where(scored == UNKNOWN, seen, scored)


class RememberingTeacher(TeacherHead):
    """A TeacherHead that, over stored features (`remember`), takes the argmax from its memo when the memo knows every
    row asked for, and otherwise computes it and remembers it."""

    def __init__(self, *args, remember: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.memo = ArgmaxMemo() if remember else None

    def at(self, last: torch.Tensor, batch: TokenBatch, rows: torch.Tensor) -> Teacher:
        """The teacher at flat `rows` [R] (host) of last [B, T, H] (`batch`'s rows)."""
        device_rows = rows.to(last.device, non_blocking=True)
        known = None if self.memo is None else self.memo.lookup(batch, rows)
        teacher = self(last, device_rows, None if known is None else known.to(last.device, non_blocking=True))
        if self.memo is not None and known is None:
            self.memo.remember(batch, rows, teacher.argmax.cpu())
        return teacher
