"""The draft vocabulary map: which target tokens the draft's head predicts.

Contract (docs/contracts.md):
- the draft vocabulary is the `draft_vocab_size` most frequent target ids among the counted
  (loss-masked assistant) tokens, ties broken by the lower id, sorted ascending; when fewer distinct
  ids were seen, the lowest unused ids fill the rest;
- `d2t`: int64 [draft_vocab], **offsets**: target_id = i + d2t[i] (what SGLang reads as
  `hot_token_id = d2t + arange`);
- `t2d`: bool [target_vocab], exactly draft_vocab_size entries true.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from eagle3.errors import UnreadableInput
from eagle3.fsutil import atomic_write_bytes, atomic_write_json

MAP_FILE = "vocab_map.safetensors"
STATS_FILE = "vocab_stats.json"


@dataclass(frozen=True)
class VocabMap:
    d2t: torch.Tensor  # [draft_vocab] int64 offsets
    t2d: torch.Tensor  # [target_vocab] bool

    @property
    def draft_vocab_size(self) -> int:
        return self.d2t.numel()

    @property
    def target_vocab_size(self) -> int:
        return self.t2d.numel()

    def target_ids(self) -> torch.Tensor:
        """[draft_vocab] int64: the target id that row i of the draft head predicts."""
        return self.d2t + torch.arange(self.d2t.numel(), dtype=self.d2t.dtype)


@dataclass(frozen=True)
class VocabStats:
    draft_vocab_size: int
    target_vocab_size: int
    counted_tokens: int
    distinct_ids_seen: int
    covered_tokens: int
    coverage: float  # share of counted target tokens whose id is in the draft vocab
    padding: int  # draft ids filled with unseen target ids


class VocabMapError(UnreadableInput):
    """A vocab map that breaks an invariant of the contract."""


def build_vocab_map(counts: torch.Tensor, draft_vocab_size: int) -> tuple[VocabMap, VocabStats]:
    """Build the map from per-target-id token counts ([target_vocab] integer tensor)."""
    counts = counts.to(torch.int64)
    target_vocab = counts.numel()
    if counts.dim() != 1 or (counts < 0).any():
        raise ValueError("counts must be a 1-D tensor of non-negative token counts")
    if not 0 < draft_vocab_size <= target_vocab:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in [1, {target_vocab}]")
    total = int(counts.sum())
    if total == 0:
        raise ValueError("no tokens were counted: the draft vocabulary would be arbitrary")
    # A stable sort of -counts orders by count descending, then id ascending; unseen ids (count 0)
    # come last in ascending order, which is exactly the padding rule.
    order = torch.argsort(-counts, stable=True)
    chosen = torch.sort(order[:draft_vocab_size]).values  # [draft_vocab] target ids, ascending
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[chosen] = True
    d2t = chosen - torch.arange(draft_vocab_size, dtype=torch.int64)
    distinct = int((counts > 0).sum())
    covered = int(counts[chosen].sum())
    stats = VocabStats(
        draft_vocab_size=draft_vocab_size,
        target_vocab_size=target_vocab,
        counted_tokens=total,
        distinct_ids_seen=distinct,
        covered_tokens=covered,
        coverage=covered / total,
        padding=max(0, draft_vocab_size - distinct),
    )
    return VocabMap(d2t=d2t, t2d=t2d), stats


def save_vocab_map(vocab_map: VocabMap, directory: Path, stats: VocabStats) -> None:
    directory = Path(directory)
    check_invariants(vocab_map, source=str(directory))
    atomic_write_bytes(directory / MAP_FILE, _safetensors_bytes(vocab_map))
    atomic_write_json(directory / STATS_FILE, asdict(stats))


def _safetensors_bytes(vocab_map: VocabMap) -> bytes:
    return save({"d2t": vocab_map.d2t.contiguous(), "t2d": vocab_map.t2d.contiguous()})


def load_vocab_map(path: Path) -> VocabMap:
    """Read a map we wrote, or the files SpecForge and speculators write, and check every invariant.

    Accepted: our directory (vocab_map.safetensors), a .safetensors file with d2t and t2d, a .pt file
    holding {"d2t", "t2d"} (loaded with weights_only=True: no arbitrary objects are unpickled), or a
    directory with d2t/t2d as .npy or .pt files.
    """
    d2t, t2d = read_d2t_t2d(Path(path))
    vocab_map = VocabMap(d2t=d2t, t2d=t2d)
    check_invariants(vocab_map, source=str(path))
    return vocab_map


def read_d2t_t2d(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Read the raw tensors without judging them (inspect wants to diagnose broken maps too)."""
    if not path.exists():
        raise UnreadableInput(f"{path}: no such file or directory")
    if path.is_dir():
        if (path / MAP_FILE).exists():
            return read_d2t_t2d(path / MAP_FILE)
        return _read_pair(path)
    tensors = _read_tensor_file(path)
    if not isinstance(tensors, dict) or not {"d2t", "t2d"} <= tensors.keys():
        found = sorted(tensors) if isinstance(tensors, dict) else type(tensors).__name__
        raise UnreadableInput(f"{path}: expected tensors 'd2t' and 't2d', found {found}")
    for name in ("d2t", "t2d"):
        if not isinstance(tensors[name], torch.Tensor):
            raise UnreadableInput(f"{path}: '{name}' is a {type(tensors[name]).__name__}, not a tensor")
    return tensors["d2t"], tensors["t2d"]


def _read_pair(directory: Path) -> tuple[torch.Tensor, torch.Tensor]:
    found = {}
    for name in ("d2t", "t2d"):
        # speculators writes d2t.npy (older) or d2t-<draft_vocab>.npy
        existing = sorted(p for ext in (".npy", ".pt") for p in directory.glob(f"{name}*{ext}"))
        if len(existing) != 1:
            raise UnreadableInput(
                f"{directory}: expected {MAP_FILE}, or one {name}.npy / {name}-<size>.npy / {name}.pt file; "
                f"found {[p.name for p in existing] or 'none'}"
            )
        value = _read_tensor_file(existing[0])
        if isinstance(value, dict):
            value = value.get(name)
        if not isinstance(value, torch.Tensor):
            raise UnreadableInput(f"{existing[0]}: expected a tensor named {name}")
        found[name] = value
    return found["d2t"], found["t2d"]


def _read_tensor_file(path: Path) -> torch.Tensor | dict:
    try:
        if path.suffix == ".safetensors":
            return load_file(path)
        if path.suffix == ".npy":
            array = np.load(path, allow_pickle=False)
            if array.dtype.kind not in "biu":
                raise UnreadableInput(f"{path}: holds {array.dtype} values, not integer or bool ids")
            return torch.from_numpy(array)
        if path.suffix in (".pt", ".pth", ".bin"):
            return torch.load(path, map_location="cpu", weights_only=True)
    except (SafetensorError, ValueError, OSError, RuntimeError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise UnreadableInput(f"{path}: cannot read tensors: {reason}") from None
    except Exception as err:  # torch's weights_only unpickler raises UnpicklingError for objects
        if type(err).__name__ == "UnpicklingError":
            raise UnreadableInput(
                f"{path}: holds Python objects that are not plain tensors; refusing to unpickle them"
            ) from None
        raise
    raise UnreadableInput(f"{path}: unknown vocab map file type (use .safetensors, .pt or .npy)")


def check_invariants(vocab_map: VocabMap, source: str) -> None:
    """Raise VocabMapError naming the first broken invariant of the offsets contract."""
    d2t, t2d = vocab_map.d2t, vocab_map.t2d
    if d2t.dim() != 1 or d2t.dtype != torch.int64:
        raise VocabMapError(f"{source}: d2t must be a 1-D int64 tensor, got {d2t.dtype} {list(d2t.shape)}")
    if t2d.dim() != 1 or t2d.dtype != torch.bool:
        raise VocabMapError(f"{source}: t2d must be a 1-D bool tensor, got {t2d.dtype} {list(t2d.shape)}")
    if d2t.numel() == 0:
        raise VocabMapError(f"{source}: the draft vocabulary is empty")
    selected = int(t2d.sum())
    if selected != d2t.numel():
        raise VocabMapError(
            f"{source}: t2d has {selected} true entries but d2t has {d2t.numel()} rows; they must be equal"
        )
    analysis = analyze_d2t(d2t, t2d)
    if analysis.encoding != "offsets":
        raise VocabMapError(f"{source}: d2t is not offsets (target = i + d2t[i]): {analysis.verdict}")


@dataclass(frozen=True)
class D2TAnalysis:
    """What can be said about a d2t tensor's encoding, with the evidence for it."""

    encoding: str  # "offsets", "absolute", "invalid", or "unknown" (no t2d and no decisive shape)
    verdict: str  # one sentence
    evidence: list[str]
    draft_vocab_size: int
    target_vocab_size: int | None
    nonzero: int
    leading_zeros: int
    unique_values: int
    non_decreasing: bool
    offsets_in_range: bool | None  # all i + d2t[i] in [0, target_vocab)
    offsets_distinct: bool
    offsets_sorted: bool
    t2d_agreement: bool | None  # set(i + d2t[i]) == set(t2d.nonzero()); None without t2d
    absolute_t2d_agreement: bool | None  # set(d2t) == set(t2d.nonzero())
    first_mappings: list[tuple[int, int]]  # (draft id, target id) under the offsets reading
    last_mappings: list[tuple[int, int]]


def analyze_d2t(d2t: torch.Tensor, t2d: torch.Tensor | None = None, target_vocab_size: int | None = None) -> D2TAnalysis:
    """Judge the encoding by t2d agreement, range and the shape of the values — never by monotonicity
    alone (absolute ids are increasing too)."""
    d2t = d2t.to(torch.int64).flatten()
    k = d2t.numel()
    if t2d is not None:
        t2d = t2d.flatten()
        target_vocab_size = t2d.numel()
    ids = d2t + torch.arange(k)  # the offsets reading
    diffs = d2t[1:] - d2t[:-1]
    non_decreasing = bool((diffs >= 0).all())
    strictly_increasing = bool((diffs > 0).all())
    unique_values = int(torch.unique(d2t).numel())
    nonzero = int((d2t != 0).sum())
    leading_zeros = int((torch.cumprod((d2t == 0).to(torch.int64), 0)).sum())
    offsets_distinct = int(torch.unique(ids).numel()) == k
    negative = bool((ids < 0).any())
    offsets_sorted = bool((ids[1:] > ids[:-1]).all())
    in_range = None
    if target_vocab_size is not None:
        in_range = bool(((ids >= 0) & (ids < target_vocab_size)).all())
    agreement = absolute_agreement = None
    if t2d is not None:
        selected = torch.nonzero(t2d.to(torch.bool)).flatten()
        agreement = _same_set(ids, selected)
        absolute_agreement = _same_set(d2t, selected)

    evidence = []
    if agreement is not None:
        evidence.append(f"i + d2t[i] {'equals' if agreement else 'does NOT equal'} the set of true entries of t2d")
        if absolute_agreement:
            evidence.append("d2t itself equals the set of true entries of t2d (the absolute-id reading)")
    if in_range is not None:
        evidence.append(
            f"i + d2t[i] is {'within' if in_range else 'OUTSIDE'} the target vocabulary [0, {target_vocab_size})"
        )
    repeats = k - unique_values
    if non_decreasing and repeats:
        evidence.append(f"values are non-decreasing with {repeats} repeats (the shape of offsets)")
    elif strictly_increasing:
        evidence.append("values are strictly increasing with no repeats (the shape of absolute ids)")
    elif not non_decreasing:
        evidence.append("values decrease somewhere (an unsorted map, or not a d2t tensor)")

    if agreement is True:
        encoding, verdict = "offsets", "offsets: i + d2t[i] matches t2d"
    elif absolute_agreement:
        encoding, verdict = "absolute", "absolute ids: d2t[i] itself is the target id (SGLang adds i again)"
    elif agreement is False:
        encoding, verdict = "invalid", "neither reading agrees with t2d: d2t and t2d come from different maps"
    elif negative:
        encoding, verdict = "invalid", "invalid: i + d2t[i] is negative for some draft ids"
    elif in_range is False:
        absolute_fits = bool(((d2t >= 0) & (d2t < target_vocab_size)).all())
        encoding = "absolute" if absolute_fits and strictly_increasing else "invalid"
        verdict = (
            "absolute ids: i + d2t[i] leaves the target vocabulary while d2t alone fits"
            if encoding == "absolute"
            else "invalid: i + d2t[i] leaves the target vocabulary"
        )
    elif not offsets_distinct:
        encoding, verdict = "invalid", "invalid: two draft ids map to the same target id under the offsets reading"
    elif non_decreasing and repeats:
        encoding, verdict = "offsets", "offsets (judged by shape; pass t2d to confirm)"
    else:
        encoding, verdict = "unknown", "cannot tell offsets from absolute ids without t2d"

    mapping = [(i, int(ids[i])) for i in range(k)]
    return D2TAnalysis(
        encoding=encoding,
        verdict=verdict,
        evidence=evidence,
        draft_vocab_size=k,
        target_vocab_size=target_vocab_size,
        nonzero=nonzero,
        leading_zeros=leading_zeros,
        unique_values=unique_values,
        non_decreasing=non_decreasing,
        offsets_in_range=in_range,
        offsets_distinct=offsets_distinct,
        offsets_sorted=offsets_sorted,
        t2d_agreement=agreement,
        absolute_t2d_agreement=absolute_agreement,
        first_mappings=mapping[:5],
        last_mappings=mapping[-5:] if k > 5 else [],
    )


def _same_set(values: torch.Tensor, selected: torch.Tensor) -> bool:
    if values.numel() != selected.numel():
        return False
    return bool(torch.equal(torch.sort(values).values, torch.sort(selected.to(values.dtype)).values))


def read_stats(directory: Path) -> VocabStats | None:
    path = Path(directory) / STATS_FILE
    if not path.exists():
        return None
    return VocabStats(**json.loads(path.read_text()))


def carry_rows(head: torch.Tensor, old_head: torch.Tensor, old_ids: torch.Tensor, new_ids: torch.Tensor) -> int:
    """Copy into `head` [new draft vocab, H] the rows of `old_head` [old draft vocab, H] whose target id (`old_ids`
    [old draft vocab]) is also in `new_ids` [new draft vocab]; return how many rows were carried."""
    row_of = {int(t): i for i, t in enumerate(old_ids.tolist())}
    pairs = [(j, row_of[int(t)]) for j, t in enumerate(new_ids.tolist()) if int(t) in row_of]
    if pairs:
        new_rows, old_rows = (torch.tensor(side) for side in zip(*pairs))
        head[new_rows] = old_head[old_rows].to(head.dtype)
    return len(pairs)
