"""Importing token rows made elsewhere (`eagle3 data import`, or the data stage when `data.import_path` is set).

Input: one JSONL file, one row per line, each either
    {"input_ids": [int, ...], "loss_mask": [0|1, ...]}                      token rows, used as they are
    {"messages": [{"role": ..., "content": ...}, ...]}  (or ShareGPT "conversations")
                                                                            through the target's chat template
with an optional "id" (default: a hash of the line) and an optional "split": "train" | "eval". A file either names
the split on every row or on none: named, the trainer evaluates on exactly the eval rows; unnamed, it splits by a
hash of the id (training.eval_fraction).

Output: exactly what regeneration writes (eagle3/data/regenerate.py) under `run.dir/data/regen/`, so capture, online
features, the vocab map and training read imported rows as they read regenerated ones. data.prompts still gives the
benchmark's held-out prompts and their greedy continuations. A bad row stops the import with its file, line and
field; the directory appears only when every row is in.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from array import array
from dataclasses import dataclass, field
from pathlib import Path

from eagle3.config import PipelineConfig
from eagle3.config.data import DataSection
from eagle3.config.run import TargetSection
from eagle3.data.conversation import split_reasoning, template_sample
from eagle3.data.prompts import parse_turns
from eagle3.data.quality import refuse_failed
from eagle3.data.regenerate import (
    GREEDY_FILE,
    IDS_FILE,
    Log,
    append_records,
    check_quality,
    continue_heldout,
    continuing,
    regen_dir,
    regenerate,
    samples_fields,
    split_prompts,
)
from eagle3.runtime.generators import make_generator
from eagle3.runtime.targets import load_tokenizer
from eagle3.errors import Eagle3Error, UnreadableInput
from eagle3.records.manifest import write_manifest
from eagle3.fsutil import atomic_directory, atomic_write_json
from eagle3.progress import Progress

SPLITS = ("train", "eval")
WRITE_ROWS = 256  # rows appended to the shards at a time


class RowError(UnreadableInput):
    """A row that cannot be imported: the message names the file, the line and the field."""


def make_samples(config: PipelineConfig, log: Log = print, store=None, generator=None) -> Path:
    """The data stage's samples: the rows of data.import_path when it is set, else the target's regenerated answers
    (with the replies `store`, the registry's sample store, holds)."""
    if config.data.import_path is not None:
        log(f"data: data.import_path is set: importing {config.data.import_path} instead of regenerating answers")
        return import_rows(config, log=log, generator=generator)
    return regenerate(config, log=log, generator=generator, store=store)


@dataclass
class Tally:
    rows: int = 0
    tokens: int = 0
    formats: dict[str, int] = field(default_factory=lambda: {"tokens": 0, "conversations": 0})
    splits: dict[str, int] = field(default_factory=lambda: {"train": 0, "eval": 0})
    named: bool | None = None  # whether the file names the split (decided by its first row)
    ids: dict[str, int] = field(default_factory=dict)  # id -> line
    order: list[str] = field(default_factory=list)


def import_rows(config: PipelineConfig, source: Path | None = None, log: Log = print, generator=None) -> Path:
    """Import `source` (default data.import_path) into run.dir/data/regen; returns that directory."""
    source = source or config.data.import_path
    if source is None:
        raise Eagle3Error("nothing to import: give the JSONL file (eagle3 data import FILE) or set data.import_path")
    out = regen_dir(config.run)
    tokenizer = load_tokenizer(config.target)
    with atomic_directory(out, overwrite=True) as tmp:
        tally, digest = write_rows(source, tmp, config.data, config.target, tokenizer, log)
        prompt_set, _, heldout = split_prompts(config.run, config.data, config.target,
                                               config.production.telemetry.slice_label, tokenizer, log)
        if (out / GREEDY_FILE).is_file():  # reused when made for the same prompts and length
            shutil.copy2(out / GREEDY_FILE, tmp / GREEDY_FILE)
        generator = generator or make_generator(config.data, config.target, config.training.seed)
        greedy = continue_heldout(continuing(config), generator, tokenizer, tmp / GREEDY_FILE, log)
        atomic_write_json(tmp / IDS_FILE, tally.order)
        quality = check_quality(config.data, tmp, tokenizer, log)
        fields = samples_fields(config.run, config.data, config.target, config.production.telemetry.slice_label, tmp,
                                tokenizer, prompt_set, len(heldout), greedy, quality, generator.release)
        fields["imported"] = {"path": str(source), "sha256": digest, "rows": tally.rows, "formats": tally.formats,
                              "split": tally.splits if tally.named else None}
        write_manifest(tmp, kind="regenerated", fields=fields)
    split = (f"split as named: {tally.splits['train']} train, {tally.splits['eval']} eval" if tally.named
             else "no split named: training.eval_fraction splits by id")
    log(f"import: {tally.rows} rows, {tally.tokens} tokens ({fields['loss_tokens']} with loss) from {source} in {out}; "
        f"{split}")
    refuse_failed(quality, str(out))
    return out


def write_rows(source: Path, out: Path, data: DataSection, target: TargetSection, tokenizer,
               log: Log) -> tuple[Tally, str]:
    """Check every row of `source` and append it to the shards in `out`, in file order; returns the tally and the
    file's sha256."""
    tally, digest, pending = Tally(), hashlib.sha256(), []
    try:
        size = source.stat().st_size
        handle = open(source, "rb")
    except OSError as err:
        raise UnreadableInput(f"{source}: cannot read the rows to import ({err.strerror})") from None
    progress = Progress("import", total=size, unit="bytes", log=log)
    with handle:
        for number, line in enumerate(handle, start=1):
            digest.update(line)
            tokens = 0
            if line.strip():
                record = parse_row(line, Where(source, number), data, target, tokenizer, tally)
                pending.append((tally.rows - 1, record))
                tokens = len(record["input_ids"])
            if len(pending) >= WRITE_ROWS:
                append_records(out, pending, data.shard_samples)
                pending = []
            progress.advance(len(line), tokens=tokens)
    append_records(out, pending, data.shard_samples)
    if not tally.rows:
        raise RowError(f"{source}: no rows (the file is empty); give one JSON object per line")
    if tally.named and not tally.splits["train"]:
        raise RowError(f"{source}: every row has split 'eval'; name at least one row 'train'")
    return tally, digest.hexdigest()


@dataclass(frozen=True)
class Where:
    path: Path
    line: int

    def error(self, name: str, what: str) -> RowError:
        return RowError(f"{self.path}, line {self.line}, field {name}: {what}")


def parse_row(line: bytes, where: Where, data: DataSection, target: TargetSection, tokenizer, tally: Tally) -> dict:
    """One line as a sample record in regeneration's format (id, input_ids, loss_mask, replies; conversation,
    ended_early and split when there are), counted in `tally`; RowError names what is wrong."""
    try:
        row = json.loads(line)
    except ValueError as err:  # UnicodeDecodeError is one
        raise RowError(f"{where.path}, line {where.line}: not a JSON object ({err})") from None
    if not isinstance(row, dict):
        raise RowError(f"{where.path}, line {where.line}: not a JSON object")
    sample_id = row_id(row, line, where)
    if "input_ids" in row:
        record = token_row(row, where)
        tally.formats["tokens"] += 1
    else:
        record = conversation_row(row, line, where, tokenizer, data.thinking)
        tally.formats["conversations"] += 1
    check_fits(record["input_ids"], where, data, target)
    split = row_split(row, where, tally)
    if split is not None:
        record["split"] = split
    if sample_id in tally.ids:
        raise where.error("id", f"{sample_id!r} is also the id of line {tally.ids[sample_id]}; ids must be unique "
                          "(drop the duplicate row or give it its own id)")
    tally.ids[sample_id] = where.line
    tally.order.append(sample_id)
    tally.rows += 1
    tally.tokens += len(record["input_ids"])
    return {"id": sample_id, **record}


def row_id(row: dict, line: bytes, where: Where) -> str:
    if "id" not in row:
        return hashlib.sha256(line.strip()).hexdigest()[:20]
    if not isinstance(row["id"], str) or not row["id"]:
        raise where.error("id", f"{row['id']!r} is not a non-empty string")
    return row["id"]


def token_row(row: dict, where: Where) -> dict:
    """input_ids and loss_mask as given: whole numbers, the mask 0/1 and as long as the ids."""
    if "loss_mask" not in row:
        raise where.error("loss_mask", "missing; a token row needs input_ids and loss_mask (1 on the tokens to learn)")
    ids, mask = row["input_ids"], row["loss_mask"]
    if not isinstance(ids, list) or not ids:
        raise where.error("input_ids", "not a non-empty list of token ids")
    try:
        array("q", ids)  # C-speed check: whole numbers within int64
    except (TypeError, OverflowError):
        raise where.error("input_ids", f"holds a value that is not a token id: {first_bad(ids)!r}") from None
    if not isinstance(mask, list) or not all_binary(mask):
        raise where.error("loss_mask", "not a list of 0 and 1")
    if len(mask) != len(ids):
        raise where.error("loss_mask", f"{len(mask)} values for {len(ids)} input_ids; give one per token")
    return {"input_ids": ids, "loss_mask": mask, "replies": replies_of(mask)}


def first_bad(ids: list) -> object:
    return next(i for i in ids if not isinstance(i, int) or not -(2**63) <= i < 2**63)


def all_binary(mask: list) -> bool:
    try:
        return not bytes(mask).translate(None, b"\x00\x01")  # bytes() refuses anything but ints in 0..255
    except (TypeError, ValueError):
        return False


def replies_of(mask: list[int]) -> list[list]:
    """Each run of loss_mask 1 as a reply [start, end, None] (no finish reason: the data-quality report measures it
    as a reply whose end is unknown)."""
    return [[m.start(), m.end(), None] for m in re.finditer(b"\x01+", bytes(mask))]


def conversation_row(row: dict, line: bytes, where: Where, tokenizer, thinking: bool) -> dict:
    """A conversation through the target's chat template, as regeneration builds its samples."""
    name = "messages" if "messages" in row else "conversations"
    try:
        turns = parse_turns(line.decode())
    except ValueError as err:
        raise where.error(name, f"{err}; a row needs input_ids + loss_mask, or messages / conversations") from None
    if not any(turn["role"] == "assistant" for turn in turns):
        raise where.error(name, "no assistant turn: nothing to learn from")
    turns = split_reasoning(tokenizer, turns)
    sample, ended_early = template_sample(tokenizer, turns, thinking)
    if not sample.replies:
        raise where.error(name, "the target's chat template renders the first assistant turn differently from its "
                          "generation prompt; import the row as input_ids + loss_mask instead")
    record = {"conversation": sample.conversation, "input_ids": sample.input_ids, "loss_mask": sample.loss_mask,
              "replies": [[start, end, None] for start, end in sample.replies]}
    if ended_early:
        record["ended_early"] = True  # the template rewrote history: later turns were dropped
    return record


def check_fits(ids: list[int], where: Where, data: DataSection, target: TargetSection) -> None:
    if len(ids) > data.max_length:
        raise where.error("input_ids", f"{len(ids)} tokens, longer than data.max_length {data.max_length}; "
                          "raise data.max_length or shorten the row")
    low, high = min(ids), max(ids)
    if low < 0 or high >= target.vocab_size:
        bad = low if low < 0 else high
        raise where.error("input_ids", f"token id {bad} is outside the target's vocabulary (target.vocab_size "
                          f"{target.vocab_size}); the rows must be tokenized with the target's tokenizer")


def row_split(row: dict, where: Where, tally: Tally) -> str | None:
    """The row's split; the first row decides whether the file names one (then every row must)."""
    named = "split" in row
    if tally.named is None:
        tally.named = named
    if named != tally.named:
        first = "names" if tally.named else "does not name"
        raise where.error("split", f"{'missing' if not named else 'given'}, but the first row {first} a split; name "
                          "the split on every row or on none")
    if not named:
        return None
    if row["split"] not in SPLITS:
        raise where.error("split", f"{row['split']!r} is neither 'train' nor 'eval'")
    tally.splits[row["split"]] += 1
    return row["split"]
