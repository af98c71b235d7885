"""Production traffic as a prompt source (config data.traffic; off unless given: it is the operator's users' text).

SGLang's request records (eagle3.records.telemetry) hold each request as the server received it: for a chat request
SGLang has already applied the chat template, so the record's `text` (or `input_ids`) is the rendered prompt. Each
becomes a rendered Prompt (eagle3.data.prompts), sent to the target as is; ids-only records are decoded with the
target's tokenizer. The pipeline's own requests (PIPELINE_LABEL) never become prompts. Duplicates, records without a
prompt and what the caps leave out are counted, never silently dropped.

A run reads the records once: the prompts (run.dir/data/traffic.jsonl) and where they came from (traffic.json) are
kept, so every later step of the run - and its stage key, which hashes the prompts' content - sees the same
prompts. A retrain runs in a fresh run directory and so reads the current window.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from datetime import datetime, timezone
from typing import Callable, Iterable

from eagle3.config.data import DataSection
from eagle3.config.run import RunSection, TargetSection
from eagle3.data.prompts import Prompt, load_prompts, rendered_prompt, write_prompts
from eagle3.runtime.targets import load_tokenizer
from eagle3.records.telemetry import RequestRecord, read_request_records
from eagle3.fsutil import atomic_write_json, read_json, sha256_file

TRAFFIC_FILE, TRAFFIC_PROMPTS = "traffic.json", "traffic.jsonl"  # under run.dir/data


def select_traffic(records: Iterable[RequestRecord], decode: Callable[[list[int]], str], slice_label: str,
                   max_per_slice: int, max_prompts: int) -> tuple[list[Prompt], dict]:
    """The records' prompts, deduplicated, the newest `max_per_slice` of each slice, then at most `max_prompts`
    taken round-robin over the slices (newest first), so no slice owns the data; and the counts of what was left."""
    newest: dict[str, deque[Prompt]] = {}
    unique: Counter[str] = Counter()
    seen: set[str] = set()
    counts = {"records": 0, "pipeline_records": 0, "without_prompt": 0, "duplicates": 0}
    for record in records:
        counts["records"] += 1
        if record.from_pipeline:  # the benchmark's own measurements are no one's traffic
            counts["pipeline_records"] += 1
            continue
        text = record.text or (decode(record.input_ids) if record.input_ids else None)
        if not text:
            counts["without_prompt"] += 1
            continue
        prompt = rendered_prompt(text, record.slice_of(slice_label))
        if prompt.id in seen:
            counts["duplicates"] += 1
            continue
        seen.add(prompt.id)
        unique[prompt.slice] += 1
        newest.setdefault(prompt.slice, deque(maxlen=max_per_slice)).append(prompt)
    queues = [list(reversed(newest[name])) for name in sorted(newest)]
    chosen = [queue[i] for i in range(max((len(q) for q in queues), default=0)) for queue in queues if i < len(queue)]
    chosen = chosen[:max_prompts]
    kept = Counter(p.slice for p in chosen)
    counts["slices"] = {name: {"unique": unique[name], "kept": kept[name]} for name in sorted(unique)}
    counts["capped"] = len(seen) - len(chosen)
    return chosen, counts


def traffic_snapshot(run: RunSection, data: DataSection, target: TargetSection, slice_label: str,
                     tokenizer=None) -> dict | None:
    """Where the run's traffic prompts came from (None when data.traffic is off): read from the records the first
    time the run asks (the window ends then), kept in run.dir/data and read again while the selection settings are
    the same. `slice_label`: production.telemetry.slice_label, the request label that names a record's slice."""
    traffic = data.traffic
    if traffic is None:
        return None
    directory = run.stage_dir("data")
    selection = {**traffic.model_dump(mode="json", exclude={"share"}), "slice_label": slice_label}
    if (directory / TRAFFIC_FILE).is_file() and (directory / TRAFFIC_PROMPTS).is_file():
        made = read_json(directory / TRAFFIC_FILE, "no traffic snapshot")
        if made.get("selection") == selection:
            return made
    tokenizer = tokenizer or load_tokenizer(target)
    until = time.time()
    since = until - traffic.hours * 3600
    records = read_request_records(traffic.records, since, until)
    prompts, counts = select_traffic(records, lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
                                     selection["slice_label"], traffic.max_per_slice, traffic.max_prompts)
    write_prompts(directory / TRAFFIC_PROMPTS, prompts)
    made = {"records_location": traffic.records, "window": {"since": _iso(since), "until": _iso(until)},
            "selection": selection, **counts, "prompts": len(prompts),
            "prompts_sha256": sha256_file(directory / TRAFFIC_PROMPTS)}
    atomic_write_json(directory / TRAFFIC_FILE, made)  # last: the snapshot is whole once this is there
    return made


def describe_traffic(made: dict) -> str:
    """One line of what a traffic snapshot took and left."""
    per_slice = ", ".join(f"{name} {c['kept']}/{c['unique']}" for name, c in made["slices"].items()) or "none"
    return (f"{made['prompts']} prompts from {made['records']} request records in {made['records_location']} "
            f"({made['window']['since']} .. {made['window']['until']}); per slice (kept/unique) {per_slice}; "
            f"{made['duplicates']} duplicates, {made['pipeline_records']} of the pipeline's own requests, "
            f"{made['without_prompt']} without a prompt, {made['capped']} over the caps")


def traffic_prompts(run: RunSection, data: DataSection, target: TargetSection, slice_label: str,
                    tokenizer=None) -> tuple[dict, list[Prompt]]:
    """The run's traffic snapshot and its prompts (data.traffic on)."""
    made = traffic_snapshot(run, data, target, slice_label, tokenizer)
    return made, load_prompts(str(run.stage_dir("data") / TRAFFIC_PROMPTS)).prompts


def mixed(base: list[Prompt], traffic: list[Prompt], share: float) -> list[Prompt]:
    """Base and traffic prompts interleaved so that every prefix holds floor(share x its length) traffic prompts
    while both last; then the rest of the other. A prefix stays a prefix when more samples are asked for."""
    out: list[Prompt] = []
    b = t = 0
    while b < len(base) or t < len(traffic):
        if t < len(traffic) and (b == len(base) or t < math.floor(share * (len(out) + 1) + 1e-9)):
            out.append(traffic[t])
            t += 1
        else:
            out.append(base[b])
            b += 1
    return out


def prompt_sources(run: RunSection, data: DataSection, target: TargetSection, slice_label: str,
                   train_ids: list[str]) -> dict:
    """The manifest's account of where the training split's prompts came from: the base source, and the traffic
    snapshot with its samples per slice."""
    snapshot = traffic_snapshot(run, data, target, slice_label)
    slices = {} if snapshot is None else {
        p.id: p.slice for p in load_prompts(str(run.stage_dir("data") / TRAFFIC_PROMPTS)).prompts}
    used = Counter(slices[i] for i in train_ids if i in slices)
    traffic = None if snapshot is None else {**snapshot, "samples": sum(used.values()), "samples_per_slice": dict(used)}
    return {"base": {"source": data.prompts, "samples": len(train_ids) - sum(used.values())}, "traffic": traffic}


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="seconds")
