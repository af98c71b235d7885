"""Hidden-state dataset shards: safetensors files shared by every capture engine.

One shard packs S samples end to end:
    input_ids    int32 [N]              N = total tokens of the shard's samples
    loss_mask    uint8 [N]              1 on tokens the target generated
    aux_hidden   bf16  [N, n_aux * H]   outputs of the captured layers, concatenated in layer order
    last_hidden  bf16  [N, H]           the target's last hidden state (pre/post norm: see the manifest)
    offsets      int64 [S + 1]          sample i is rows offsets[i]:offsets[i+1]
The sample ids ride in the safetensors metadata. Shards are written atomically, so a shard file that
exists is complete and a resumed capture skips it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from eagle3.fsutil import atomic_write_bytes

STORED_DTYPE = torch.bfloat16
KINDS = ("aux_hidden", "last_hidden")


def shard_file(directory: Path, index: int) -> Path:
    return Path(directory) / f"shard-{index:05d}.safetensors"


def partial_file(directory: Path, index: int, kind: str) -> Path:
    """One kind of a shard, written by a capture pass that returns only that kind."""
    return Path(directory) / f"shard-{index:05d}.{kind}.safetensors"


def write_partial(path: Path, rows: list[torch.Tensor], stamp: dict) -> None:
    lengths = torch.tensor([0] + [r.shape[0] for r in rows], dtype=torch.int64)
    tensors = {"rows": torch.cat(rows).to(STORED_DTYPE), "offsets": torch.cumsum(lengths, 0)}
    atomic_write_bytes(path, save(tensors, metadata={"stamp": json.dumps(stamp)}))


def read_partial(path: Path) -> list[torch.Tensor]:
    with safe_open(path, framework="pt") as f:
        rows, offsets = f.get_tensor("rows"), f.get_tensor("offsets").tolist()
    return [rows[a:b] for a, b in zip(offsets, offsets[1:])]


def read_stamp(path: Path) -> dict | None:
    """What a shard or partial file was made from (sample ids and capture settings); None if unreadable."""
    try:
        with safe_open(path, framework="pt") as f:
            return json.loads((f.metadata() or {}).get("stamp", "null"))
    except (OSError, ValueError, SafetensorError):
        return None


def bytes_per_token(num_aux: int, hidden: int) -> int:
    """Stored bytes per token: aux + last hidden state in bf16, an int32 id and a uint8 mask."""
    return (num_aux + 1) * hidden * 2 + 4 + 1


@dataclass
class CapturedSample:
    id: str
    input_ids: torch.Tensor  # [T] int
    loss_mask: torch.Tensor  # [T] 0/1
    aux_hidden: torch.Tensor  # [T, n_aux * H]
    last_hidden: torch.Tensor  # [T, H]


def write_shard(path: Path, samples: list[CapturedSample], stamp: dict) -> None:
    lengths = torch.tensor([0] + [s.input_ids.numel() for s in samples], dtype=torch.int64)
    tensors = {
        "input_ids": torch.cat([s.input_ids for s in samples]).to(torch.int32),
        "loss_mask": torch.cat([s.loss_mask for s in samples]).to(torch.uint8),
        "aux_hidden": torch.cat([s.aux_hidden for s in samples]).to(STORED_DTYPE),
        "last_hidden": torch.cat([s.last_hidden for s in samples]).to(STORED_DTYPE),
        "offsets": torch.cumsum(lengths, 0),
    }
    metadata = {"sample_ids": json.dumps([s.id for s in samples]), "stamp": json.dumps(stamp)}
    atomic_write_bytes(path, save(tensors, metadata=metadata))


class ShardReader:
    """Random access to the samples of one shard without loading the whole file."""

    def __init__(self, path: Path):
        self.path = Path(path)
        with safe_open(self.path, framework="pt") as f:
            self.ids = json.loads(f.metadata()["sample_ids"])
            self.offsets = f.get_tensor("offsets")

    def __len__(self) -> int:
        return len(self.ids)

    def sample(self, index: int) -> CapturedSample:
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        with safe_open(self.path, framework="pt") as f:
            rows = {name: f.get_slice(name)[start:end] for name in ("input_ids", "loss_mask", "aux_hidden", "last_hidden")}
        return CapturedSample(id=self.ids[index], **rows)


def read_dataset(directory: Path):
    """Yield every captured sample of a dataset directory, shard by shard."""
    for path in sorted(Path(directory).glob("shard-?????.safetensors")):
        reader = ShardReader(path)
        for index in range(len(reader)):
            yield reader.sample(index)
