"""Storage budget: what a captured dataset costs on disk, checked before any work starts."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

from eagle3.config.data import DataSection
from eagle3.config.run import RunSection, TargetSection
from eagle3.config.training import TrainingSection
from eagle3.data.shards import FEATURE_DTYPES, TOKEN_BYTES, bytes_per_token
from eagle3.errors import Eagle3Error

Log = Callable[[str], None]


DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


class StorageError(Eagle3Error):
    """The projected dataset does not fit on the disk."""


def projected_bytes(data: DataSection, target: TargetSection, tokens: int) -> tuple[int, int]:
    itemsize = FEATURE_DTYPES[data.feature_dtype].itemsize
    per_token = bytes_per_token(len(data.aux_layers), target.hidden_size, itemsize)
    return per_token, per_token * tokens


def check_storage(data: DataSection, target: TargetSection, tokens: int, directory: Path, log: Log) -> None:
    """Print the projection and refuse to start when it exceeds the free space (with the numbers)."""
    per_token, total = projected_bytes(data, target, tokens)
    existing = directory
    while not existing.exists():
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    log(
        f"capture: {per_token:,} bytes per token ({len(data.aux_layers)} aux + 1 last state x "
        f"{target.hidden_size} x {DTYPE_NAMES[data.feature_dtype]}) x {tokens:,} tokens = {human_bytes(total)}; "
        f"{human_bytes(free)} free at {existing}"
    )
    if total > free:
        raise StorageError(
            f"the dataset needs {human_bytes(total)} ({tokens:,} tokens x {per_token:,} bytes) but only "
            f"{human_bytes(free)} is free at {existing}: free space, lower data.num_samples or data.max_length, "
            "or point run.dir at a larger disk"
        )


def human_bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if count < 1000 or unit == "TB":
            return f"{count:,.1f} {unit}"
        count /= 1000
    return f"{count:,.1f} TB"


def log_projection(run: RunSection, data: DataSection, target: TargetSection, training: TrainingSection,
                   log: Log) -> None:
    """Before regeneration: the upper bound for the configured dataset (every sample at max_length)."""
    tokens = data.num_samples * data.max_length
    if training.tokens_only:
        log(f"storage: no hidden state will be stored (training.features {training.features}): 0 bytes; token shards "
            f"{TOKEN_BYTES} bytes per token, up to {human_bytes(TOKEN_BYTES * tokens)} under {run.stage_dir('data')}")
        return
    per_token, total = projected_bytes(data, target, tokens)
    log(
        f"storage: capture will store {per_token:,} bytes per token; {data.num_samples:,} samples x up to "
        f"{data.max_length:,} tokens = up to {human_bytes(total)} under {run.stage_dir('data')}"
    )
