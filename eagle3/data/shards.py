"""Dataset shards: safetensors files written by every capture backend, streamed to disk as features arrive.

One shard packs S samples end to end:
    input_ids    int32 [N]              N = total tokens of the shard's samples
    loss_mask    uint8 [N]              1 on tokens the target generated
    aux_hidden   F     [N, n_aux * H]   outputs of the captured layers, concatenated in layer order (feature shards)
    last_hidden  F     [N, H]           the target's last hidden state (pre/post norm: see the manifest) (feature shards)
    offsets      int64 [S + 1]          sample i is rows offsets[i]:offsets[i+1]
F is data.feature_dtype (bf16 by default; the manifest records it). Token shards (online training: features are
computed by the trainer) hold no aux_hidden / last_hidden. The sample
ids and the capture stamp ride in the safetensors metadata. A shard is written under a temporary name and renamed
when every row is in, so a shard file that exists is complete and a resumed capture skips it.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

FEATURES = ("aux_hidden", "last_hidden")
FEATURE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}  # data.feature_dtype
SAFETENSORS_DTYPES = {torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bfloat16: "BF16",
                      torch.float16: "F16", torch.float32: "F32"}


def shard_file(directory: Path, index: int) -> Path:
    return Path(directory) / f"shard-{index:05d}.safetensors"


def read_stamp(path: Path) -> dict | None:
    """What a shard was made from (sample ids and capture settings); None if unreadable."""
    try:
        with safe_open(path, framework="pt") as f:
            return json.loads((f.metadata() or {}).get("stamp", "null"))
    except (OSError, ValueError, SafetensorError):
        return None


def stored_feature_dtype(path: Path) -> str | None:
    """The dtype a shard's features are stored in, as data.feature_dtype names it (None: a token shard)."""
    with safe_open(path, framework="pt") as f:
        if FEATURES[0] not in f.keys():
            return None
        code = f.get_slice(FEATURES[0]).get_dtype()  # safetensors' name, e.g. BF16
    return next((name for name, dtype in FEATURE_DTYPES.items() if SAFETENSORS_DTYPES[dtype] == code), code)


def bytes_per_token(num_aux: int, hidden: int, feature_bytes: int = 2) -> int:
    """Stored bytes per token of a feature shard: aux + last hidden state (bf16: 2 bytes each), an int32 id and a
    uint8 mask."""
    return (num_aux + 1) * hidden * feature_bytes + 4 + 1


TOKEN_BYTES = 4 + 1  # a token shard: the id and the mask


class ShardWriter:
    """Writes one shard in place, sample by sample: the layout is fixed up front from the samples' lengths, so each
    sample's rows go straight to their offset in the file and no shard is ever held in memory whole (at Kimi-K2.5's
    width a 256-sample shard of 4,096-token samples is ~60 GB).

        with ShardWriter(path, ids, lengths, widths={"aux_hidden": n_aux * H, "last_hidden": H}, stamp=...) as w:
            w.write(i, input_ids=..., loss_mask=..., aux_hidden=..., last_hidden=...)

    `widths` names the feature columns (none: a token shard), stored as `feature_dtype`. The file appears at `path`
    only when every sample's every column has been written; an error leaves nothing there."""

    def __init__(self, path: Path, sample_ids: list[str], lengths: list[int], widths: dict[str, int], stamp: dict,
                 feature_dtype: torch.dtype = torch.bfloat16):
        self.path = Path(path)
        self.lengths = lengths
        self.starts = [0]
        for n in lengths:
            self.starts.append(self.starts[-1] + n)
        tokens = self.starts[-1]
        # largest alignment first, so every column starts aligned for a memory-mapped reader
        columns = [("offsets", torch.int64, (len(lengths) + 1,))]
        columns += [(name, feature_dtype, (tokens, width)) for name, width in widths.items()]
        columns += [("input_ids", torch.int32, (tokens,)), ("loss_mask", torch.uint8, (tokens,))]
        header, position = {}, 0
        self.columns: dict[str, tuple[int, int]] = {}  # name -> (byte offset in the data, bytes per token)
        for name, dtype, shape in columns:
            size = dtype.itemsize * int(torch.tensor(shape).prod())
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [position, position + size]}
            self.columns[name] = (position, dtype.itemsize * (shape[1] if len(shape) == 2 else 1))
            position += size
        header["__metadata__"] = {"sample_ids": json.dumps(sample_ids), "stamp": json.dumps(stamp)}
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        self.data_start = 8 + len(encoded)
        self.dtypes = {name: dtype for name, dtype, _ in columns}
        self.pending = {(i, name) for i in range(len(lengths)) for name in self.columns if name != "offsets"}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, self.tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        self.file = os.fdopen(fd, "wb")
        self.file.write(struct.pack("<Q", len(encoded)) + encoded)
        self.file.truncate(self.data_start + position)
        self._put("offsets", 0, torch.tensor(self.starts, dtype=torch.int64))

    def write(self, index: int, **rows: torch.Tensor) -> None:
        """Sample `index`'s rows for the named columns ([T] or [T, width], any device and dtype)."""
        for name, tensor in rows.items():
            if name not in self.columns or name == "offsets":
                raise ValueError(f"{self.path.name}: no column {name!r} (columns: {sorted(self.columns)})")
            if tensor.shape[0] != self.lengths[index]:
                raise ValueError(f"{self.path.name}: sample {index} has {self.lengths[index]} tokens, got "
                                 f"{tensor.shape[0]} rows of {name}")
            self._put(name, self.starts[index], tensor)
            self.pending.discard((index, name))

    def _put(self, name: str, row: int, tensor: torch.Tensor) -> None:
        base, row_bytes = self.columns[name]
        host = tensor.detach().to("cpu", self.dtypes[name]).contiguous()
        if host.numel() * host.element_size() != tensor.shape[0] * row_bytes and name != "offsets":
            raise ValueError(f"{self.path.name}: {name} rows of {tuple(tensor.shape[1:])} do not fit its width")
        self.file.seek(self.data_start + base + row * row_bytes)
        self.file.write(host.view(torch.uint8).numpy().data)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, kind, error, trace) -> None:
        try:
            if kind is None and self.pending:
                missing = sorted(self.pending)[:3]
                raise ValueError(f"{self.path.name}: {len(self.pending)} (sample, column) pairs never written, e.g. {missing}")
            self.file.flush()
            if kind is None:
                os.fsync(self.file.fileno())
            self.file.close()
            if kind is None:
                os.replace(self.tmp, self.path)
        finally:
            Path(self.tmp).unlink(missing_ok=True)


@dataclass
class StoredSample:
    id: str
    input_ids: torch.Tensor  # [T] int
    loss_mask: torch.Tensor  # [T] 0/1
    aux_hidden: torch.Tensor | None = None  # [T, n_aux * H] (feature shards)
    last_hidden: torch.Tensor | None = None  # [T, H]


class ShardReader:
    """Random access to the samples of one shard without loading the whole file."""

    def __init__(self, path: Path):
        self.path = Path(path)
        with safe_open(self.path, framework="pt") as f:
            self.ids = json.loads(f.metadata()["sample_ids"])
            self.offsets = f.get_tensor("offsets")
            self.columns = [name for name in ("input_ids", "loss_mask", *FEATURES) if name in f.keys()]

    def __len__(self) -> int:
        return len(self.ids)

    def length(self, index: int) -> int:
        return int(self.offsets[index + 1] - self.offsets[index])

    def loss_tokens(self, limit: int) -> torch.Tensor:
        """[S] each sample's loss-masked tokens among its first `limit` (one read of the mask column)."""
        with safe_open(self.path, framework="pt") as f:
            counted = torch.cat([torch.zeros(1, dtype=torch.int64), f.get_tensor("loss_mask").long().cumsum(0)])
        starts = self.offsets[:-1]
        return counted[torch.minimum(starts + limit, self.offsets[1:])] - counted[starts]

    def sample(self, index: int, columns: tuple[str, ...] | None = None) -> StoredSample:
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        wanted = [c for c in (columns or self.columns) if c in self.columns]
        with safe_open(self.path, framework="pt") as f:
            rows = {name: f.get_slice(name)[start:end] for name in wanted}
        return StoredSample(id=self.ids[index], **rows)


SPLIT_FILE = "split.json"  # beside the shards when the rows named their split: {"eval": [sample ids]}


def named_eval_ids(directory: Path) -> set[str] | None:
    """The sample ids the data named as eval rows (an import with a split), or None: no split named."""
    path = Path(directory) / SPLIT_FILE
    return set(json.loads(path.read_text())["eval"]) if path.is_file() else None


def read_dataset(directory: Path):
    """Yield every sample of a dataset directory, shard by shard."""
    for path in sorted(Path(directory).glob("shard-?????.safetensors")):
        reader = ShardReader(path)
        for index in range(len(reader)):
            yield reader.sample(index)
