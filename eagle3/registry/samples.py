"""The sample store: the target's replies kept beside the registry (its directory or its bucket) and shared by the
runs of that registry, so a retrain regenerates only the prompts no earlier run answered under the same settings.

A reply is kept under its *context*, the hash of everything that made it other than the prompt: the target's
weights, config and tokenizer files, the chat template and thinking switch, the sampling settings and the token
caps (`context_of`). Inside a context a reply is found by its prompt's id, the prompt's content hash. A changed
target, template, temperature or cap is another context, so it shares nothing: nothing stale is ever taken.

Layout under the registry's store (docs/production-loop.md, "The sample store"):
- `samples/<context>/context.json`: what the context hash covers, readable;
- `samples/<context>/packs/<uuid>.jsonl`: the sample records one run published, one per line, as the data stage
  writes them (eagle3/data/regenerate.py); a pack is written whole before the index names it;
- `samples/<context>/index.json`: {"packs": {pack: {"sha256", "samples", "created", "runs"}}, "samples": {prompt id:
  pack}}. It only changes by compare-and-swap (the store's `put_if`, as the registry's production pointer and
  lock), so two runs that publish at once both land: the loser reads the winner's index and merges again.

Retention follows run.keep_runs: a pack lists the run directories that wrote or took it (`runs`). When a promotion
prunes old retrain directories, they leave every pack's list; a pack no kept run uses is dropped from the index,
then deleted. A run that read the index just before finds the pack gone and regenerates those prompts.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import uuid
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path

from eagle3.config import PipelineConfig
from eagle3.engines.targets import target_identity, weights_sha256
from eagle3.registry.registry import open_registry
from eagle3.registry.store import PointerConflict, RegistryError, Store

Log = Callable[[str], None]
PREFIX = "samples/"
CAS_TRIES = 20  # compare-and-swap rounds before giving up: each loss means another run's write landed


def context_of(config: PipelineConfig) -> dict:
    """Everything a reply depends on besides its prompt. The target's identity holds its config's and tokenizer's
    files, the chat template among them."""
    data = config.data
    return {"target": target_identity(config.target) | {"path": None},  # the content counts, not where it lies
            "weights_sha256": weights_sha256(config.target), "thinking": data.thinking,
            "sampling": {"temperature": data.temperature, "max_new_tokens": data.max_new_tokens},
            "max_length": data.max_length}


def context_key(context: dict) -> str:
    return hashlib.sha256(json.dumps(context, sort_keys=True).encode()).hexdigest()[:32]


class SampleStore:
    """One context's replies in a registry store (`context`: what its hash covers, written beside the first pack)."""

    def __init__(self, store: Store, key: str, log: Log = print, context: dict | None = None):
        self.store, self.key, self.log, self.context = store, key, log, context
        self.base = f"{PREFIX}{key}/"
        self.where = f"{store.location}/{self.base.rstrip('/')}"

    def index(self) -> tuple[dict, str | None]:
        data, etag = self.store.read(self.base + "index.json")
        return (json.loads(data) if data else {"packs": {}, "samples": {}}), etag

    def take(self, wanted: Iterable[str], run_dir: str) -> Iterable[dict]:
        """Yield the stored record of every prompt id in `wanted` the store holds, pack by pack; the packs read are
        marked used by `run_dir` (retention keeps them while that run is kept)."""
        index, _ = self.index()
        by_pack: dict[str, set[str]] = {}
        for pid in wanted:
            if pid in index["samples"]:
                by_pack.setdefault(index["samples"][pid], set()).add(pid)
        self.update(lambda current: mark_used(current, by_pack, run_dir))
        with tempfile.TemporaryDirectory() as scratch:
            for pack, ids in sorted(by_pack.items()):
                path = Path(scratch) / "pack.jsonl"
                try:
                    self.store.download(f"{self.base}packs/{pack}.jsonl", path, index["packs"][pack]["sha256"])
                except RegistryError as err:  # pruned since the index was read, or corrupt: made again instead
                    self.log(f"sample store: pack {pack} unreadable ({err}); its {len(ids)} prompt(s) are regenerated")
                    continue
                with open(path) as lines:
                    for line in lines:
                        record = json.loads(line)
                        if record["id"] in ids:
                            yield record

    def publish(self, records: Iterable[dict], run_dir: str) -> int:
        """Keep the records whose prompts the store does not hold yet, as one new pack (written through a file: a
        run's records can be GBs); returns how many."""
        index, _ = self.index()
        ids = []
        with tempfile.TemporaryDirectory() as scratch:
            path = Path(scratch) / "pack.jsonl"
            with open(path, "w") as pack_file:
                for record in records:
                    if record["id"] not in index["samples"]:
                        ids.append(record["id"])
                        pack_file.write(json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n")
            if not ids:
                return 0
            if self.context is not None:
                self.store.put_bytes(self.base + "context.json",
                                     json.dumps(self.context, indent=1, sort_keys=True).encode())
            pack = uuid.uuid4().hex
            digest = self.store.put_file(f"{self.base}packs/{pack}.jsonl", path)  # whole before the index names it
        entry = {"sha256": digest.sha256, "samples": len(ids), "runs": [run_dir],
                 "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        self.update(lambda current: add_pack(current, pack, entry, ids))
        return len(ids)

    def update(self, change: Callable[[dict], dict | None]) -> None:
        """Apply `change` to the index by compare-and-swap, re-reading it after each lost race; `change` returns
        None when it has nothing to write."""
        for _ in range(CAS_TRIES):
            index, etag = self.index()
            changed = change(index)
            if changed is None:
                return
            try:
                self.store.put_if(self.base + "index.json", json.dumps(changed, sort_keys=True).encode(), etag)
                return
            except PointerConflict:
                continue
        raise RegistryError(f"{self.where}/index.json: lost {CAS_TRIES} compare-and-swap rounds in a row to other "
                            "writers; run again")


def mark_used(index: dict, by_pack: dict[str, set[str]], run_dir: str) -> dict | None:
    """The index with `run_dir` among the users of every pack read (packs pruned meanwhile stay out)."""
    packs = [pack for pack in by_pack if pack in index["packs"] and run_dir not in index["packs"][pack]["runs"]]
    for pack in packs:
        index["packs"][pack]["runs"].append(run_dir)
    return index if packs else None


def add_pack(index: dict, pack: str, entry: dict, ids: list[str]) -> dict:
    """The index with the new pack; a prompt another run published meanwhile keeps its first pack."""
    index["packs"][pack] = entry
    for pid in ids:
        index["samples"].setdefault(pid, pack)
    return index


def drop_runs(index: dict, removed: set[str]) -> tuple[dict | None, list[str]]:
    """The index without the removed runs and the packs no remaining run uses (None when unchanged), and those
    packs."""
    changed, dropped = False, []
    for pack, entry in list(index["packs"].items()):
        kept = [run for run in entry["runs"] if run not in removed]
        changed |= len(kept) != len(entry["runs"])
        entry["runs"] = kept
        if not kept:
            dropped.append(pack)
            del index["packs"][pack]
    if dropped:
        index["samples"] = {pid: pack for pid, pack in index["samples"].items() if pack not in dropped}
    return (index if changed else None), dropped


def prune_samples(store: Store, removed_runs: Iterable[str], log: Log = print) -> int:
    """Retention: the removed run directories leave every context's packs; packs no kept run uses are deleted.
    Returns the samples deleted."""
    removed = {str(run) for run in removed_runs}
    if not removed:
        return 0
    deleted = 0
    for key in sorted({name.split("/")[1] for name in store.list(PREFIX) if name.endswith("/index.json")}):
        context = SampleStore(store, key, log)
        dropped: list[str] = []
        sizes: dict[str, int] = {}

        def change(index: dict) -> dict | None:
            nonlocal dropped
            sizes.update({pack: entry["samples"] for pack, entry in index["packs"].items()})
            changed, dropped = drop_runs(index, removed)
            return changed

        context.update(change)
        store.delete([f"{context.base}packs/{pack}.jsonl" for pack in dropped])
        deleted += sum(sizes[pack] for pack in dropped)
        if dropped:
            log(f"sample store: {len(dropped)} pack(s), {sum(sizes[p] for p in dropped)} samples of context {key} "
                "deleted: no kept run uses them (run.keep_runs)")
    return deleted


# ---------------------------------------------------------------------------------------------
# The data stage's side


def open_sample_store(config: PipelineConfig, log: Log = print) -> SampleStore | None:
    """The store of the config's registry for this run's context; None (said) without a registry or with
    data.share_samples off."""
    if config.registry is None:
        log("sample store: no registry section, so no store: every reply is generated")
        return None
    if not config.data.share_samples:
        log("sample store: data.share_samples is off: every reply is generated, none kept")
        return None
    context = context_of(config)
    return SampleStore(open_registry(config.registry, log).store, context_key(context), log, context)
