"""The draft vocabulary from data: counts of the target's loss-masked (generated) tokens in the
regenerated training split, fed to the one vocab-map builder."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from eagle3.config.data import DataSection, VocabSection
from eagle3.config.run import RunSection, TargetSection
from eagle3.data.capture import regenerated_manifest
from eagle3.data.regenerate import read_regenerated, regen_dir
from eagle3.runtime.targets import DataMismatch
from eagle3.records.manifest import fingerprint, write_manifest
from eagle3.draft.vocab_map import build_vocab_map, save_vocab_map


def count_loss_tokens(records, vocab_size: int) -> torch.Tensor:
    """[vocab_size] int64: how often each target id appears where loss_mask is 1."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for record in records:
        ids = torch.tensor(record["input_ids"], dtype=torch.int64)
        mask = torch.tensor(record["loss_mask"], dtype=torch.bool)
        if ids.numel() and int(ids.max()) >= vocab_size:
            raise DataMismatch(
                f"sample {record['id']} holds token id {int(ids.max())}, outside target.vocab_size {vocab_size}"
            )
        counts += torch.bincount(ids[mask], minlength=vocab_size)
    return counts


def build_vocab(run: RunSection, data: DataSection, target: TargetSection, vocab: VocabSection,
                log: Callable[[str], None] = print) -> Path:
    """The draft vocabulary of the run's regenerated data (refused when made for another target or template)."""
    regenerated_manifest(run, data, target)
    regen = regen_dir(run)
    counts = count_loss_tokens(read_regenerated(regen), target.vocab_size)
    vocab_map, stats = build_vocab_map(counts, vocab.draft_vocab_size)
    out = run.stage_dir("vocab")
    save_vocab_map(vocab_map, out, stats)
    write_manifest(
        out,
        kind="vocab-map",
        fields={"regenerated_fingerprint": fingerprint(regen), "stats": stats.__dict__},
    )
    log(
        f"vocab: {stats.draft_vocab_size} draft ids cover {stats.coverage:.2%} of {stats.counted_tokens:,} generated "
        f"target tokens ({stats.distinct_ids_seen:,} distinct ids seen, {stats.padding} padding) -> {out}"
    )
    return out
