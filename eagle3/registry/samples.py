"""The sample store: the target's replies, and offline its captured features, kept beside the registry (its directory
or its bucket) and shared by the runs of that registry, so a retrain makes only what no earlier run made under the
same settings.

Two kinds, each kept under its *context*, the hash of everything that made an entry other than its key:
- `samples/`: replies, found by their prompt's id (the prompt's content hash). The context holds the target's
  weights, config and tokenizer files (the chat template among them), the thinking switch, the sampling settings and
  the token caps (`reply_context`).
- `features/`: a sample's captured features (training.features offline), found by a hash of its tokens and loss
  mask (eagle3.data.capture.sample_key). The context holds the target, the aux layers, the last hidden state's side
  of the norm, the capture engine and the feature dtype (`feature_context`).
A changed target, template, temperature, cap or layer is another context, so it shares nothing: nothing stale is
ever taken.

Layout under the registry's store (docs/production-loop.md, "What a retrain reuses"), for each kind:
- `<kind>/<context>/context.json`: what the context hash covers, readable;
- `<kind>/<context>/packs/<uuid>.<jsonl|safetensors>`: what one run published: sample records one per line as the
  data stage writes them, or one feature shard as capture writes it (eagle3/data/shards.py). A pack is written whole
  before the index names it;
- `<kind>/<context>/index.json`: {"packs": {pack: {"sha256", "entries", "keys", "created", "runs"}}, "entries": {key:
  pack}}. It only changes by compare-and-swap (the store's `put_if`, as the registry's production pointer and lock),
  so two runs that publish at once both land: the loser re-reads the winner's index and merges again.

Retention follows run.keep_runs: a pack lists the run directories that wrote or took it (`runs`). When a promotion
prunes old retrain directories, they leave every pack's list; a pack no kept run uses is dropped from the index,
then deleted. A run that read the index just before finds the pack gone and makes those entries again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from eagle3.config.data import DataSection
from eagle3.config.deployment import RegistrySection
from eagle3.config.run import TargetSection
from eagle3.config.training import TrainingSection
from eagle3.data.shards import ShardReader, StoredSample
from eagle3.runtime.targets import has_weight_files, target_identity, weights_sha256
from eagle3.registry.registry import open_registry
from eagle3.registry.store import PointerConflict, RegistryError, Store

Log = Callable[[str], None]
KINDS = {"samples": ".jsonl", "features": ".safetensors"}  # kind -> its packs' suffix
# What a stored entry holds, by kind: bump one when the code that builds its records or features changes what they
# hold (eagle3/data/conversation.py's samples, capture's layers), so that no run takes the old ones.
FORMATS = {"samples": 1, "features": 1}
ORPHAN_AGE_S = 86400  # a pack the index never named (its publisher died before the compare-and-swap) after a day
CAS_TRIES = 20  # compare-and-swap rounds before giving up: each loss means another run's write landed


def target_context(target: TargetSection) -> dict:
    """The target by content: its config's and tokenizer's files (the chat template among them) and its weights."""
    return {"target": target_identity(target) | {"path": None}, "weights_sha256": weights_sha256(target)}


def reply_context(data: DataSection, target: TargetSection) -> dict:
    """Everything a reply depends on besides its prompt."""
    return {"format": FORMATS["samples"], **target_context(target), "thinking": data.thinking,
            "sampling": {"temperature": data.temperature, "max_new_tokens": data.max_new_tokens},
            "max_length": data.max_length}


def feature_context(data: DataSection, target: TargetSection) -> dict:
    """Everything a sample's captured features depend on besides its tokens."""
    return {"format": FORMATS["features"], **target_context(target), "aux_layers": list(data.aux_layers),
            "last_hidden": data.last_hidden,
            "engine": data.feature_backend, "dtype": data.feature_dtype}


def context_key(context: dict) -> str:
    return hashlib.sha256(json.dumps(context, sort_keys=True).encode()).hexdigest()[:32]


class PackStore:
    """One kind's entries of one context in a registry store (`context`: what its hash covers, written beside the
    first pack)."""

    def __init__(self, store: Store, kind: str, key: str, log: Log = print, context: dict | None = None):
        self.store, self.kind, self.key, self.log, self.context = store, kind, key, log, context
        self.base = f"{kind}/{key}/"
        self.where = f"{store.location}/{self.base.rstrip('/')}"

    def index(self) -> tuple[dict, str | None]:
        data, etag = self.store.read(self.base + "index.json")
        try:
            return (json.loads(data) if data else {"packs": {}, "entries": {}}), etag
        except json.JSONDecodeError as err:
            raise RegistryError(f"{self.where}/index.json: not valid JSON ({err}); remove {self.where} to start this "
                                "context's store afresh") from None

    def pack_key(self, pack: str) -> str:
        return f"{self.base}packs/{pack}{KINDS[self.kind]}"

    def packs_for(self, wanted: Iterable[str], run_dir: str) -> tuple[dict, dict[str, set[str]]]:
        """The index, and {pack: the wanted keys it holds}; those packs are marked used by `run_dir` (retention keeps
        them while that run is kept)."""
        index, _ = self.index()
        by_pack: dict[str, set[str]] = {}
        for key in wanted:
            if key in index["entries"]:
                by_pack.setdefault(index["entries"][key], set()).add(key)
        self.update(lambda current: mark_used(current, by_pack, run_dir))
        return index, by_pack

    def download_pack(self, pack: str, sha256: str, path: Path, count: int) -> bool:
        """The pack at `path`; False (said) when it is gone or corrupt: its `count` entries are made again."""
        try:
            self.store.download(self.pack_key(pack), path, sha256)
        except RegistryError as err:  # pruned since the index was read, or corrupt
            self.log(f"{self.kind} store: pack {pack} unreadable ({err}); its {count} entries are made again")
            return False
        return True

    def absent(self, keys: Iterable[str]) -> list[str]:
        index, _ = self.index()
        return [key for key in keys if key not in index["entries"]]

    def publish_file(self, path: Path, keys: list[str], run_dir: str) -> None:
        """Keep `path` as a new pack holding `keys` (row order); a key already kept stays with its first pack."""
        if self.context is not None:
            self.store.put_bytes(self.base + "context.json", json.dumps(self.context, indent=1, sort_keys=True).encode())
        pack = f"{int(time.time())}-{uuid.uuid4().hex}"  # its time: an orphan is told by age (prune_samples)
        digest = self.store.put_file(self.pack_key(pack), path)  # whole before the index names it
        entry = {"sha256": digest.sha256, "entries": len(keys), "keys": keys, "runs": [run_dir],
                 "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        self.update(lambda current: add_pack(current, pack, entry))

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


class SampleStore(PackStore):
    """Replies by prompt id."""

    def __init__(self, store: Store, key: str, log: Log = print, context: dict | None = None):
        super().__init__(store, "samples", key, log, context)

    def take(self, wanted: Iterable[str], run_dir: str) -> Iterator[dict]:
        """Yield the stored record of every prompt id in `wanted` the store holds, pack by pack."""
        index, by_pack = self.packs_for(wanted, run_dir)
        with tempfile.TemporaryDirectory() as scratch:
            for pack, ids in sorted(by_pack.items()):
                path = Path(scratch) / f"{pack}.jsonl"
                if not self.download_pack(pack, index["packs"][pack]["sha256"], path, len(ids)):
                    continue
                with open(path) as lines:
                    for line in lines:
                        record = json.loads(line)
                        if record["id"] in ids:
                            yield record
                path.unlink()

    def publish(self, records: Iterable[dict], run_dir: str) -> int:
        """Keep the records whose prompts the store does not hold yet, as one new pack (written through a file: a
        run's records can be GBs); returns how many."""
        index, _ = self.index()
        ids = []
        with tempfile.TemporaryDirectory() as scratch:
            path = Path(scratch) / "pack.jsonl"
            with open(path, "w") as pack_file:
                for record in records:
                    if record["id"] not in index["entries"]:
                        ids.append(record["id"])
                        pack_file.write(json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n")
            if ids:
                self.publish_file(path, ids, run_dir)
        return len(ids)


class FeatureStore(PackStore):
    """Captured features by the sample's tokens (eagle3.data.capture.sample_key); a pack is a feature shard, its rows
    named in the index."""

    def __init__(self, store: Store, key: str, log: Log = print, context: dict | None = None):
        super().__init__(store, "features", key, log, context)

    @contextmanager
    def rows(self, wanted: Iterable[str], run_dir: str) -> Iterator[dict[str, Callable[[], StoredSample]]]:
        """For the block: {key: a reader of its stored features} for every key in `wanted` the store holds. Each
        pack is downloaded once, into a scratch directory in the temporary directory ($TMPDIR: outside the run
        directory, whose files are its stages' own), and read row by row (a shard need not fit in memory)."""
        index, by_pack = self.packs_for(wanted, run_dir)
        found: dict[str, Callable[[], StoredSample]] = {}
        with tempfile.TemporaryDirectory(prefix="eagle3-feature-store-") as scratch:
            for pack, keys in sorted(by_pack.items()):
                path = Path(scratch) / f"{pack}.safetensors"
                if self.download_pack(pack, index["packs"][pack]["sha256"], path, len(keys)):
                    reader = ShardReader(path)
                    found.update({key: functools.partial(reader.sample, row)
                                  for row, key in enumerate(index["packs"][pack]["keys"]) if key in keys})
            yield found

    def publish_shards(self, shards: list[tuple[Path, list[str]]], run_dir: str) -> int:
        """Keep each feature shard (path, its rows' keys) that holds a key the store lacks (the index read once);
        returns how many keys they add. A shard reused from an interrupted run is published too."""
        absent = set(self.absent(key for _, keys in shards for key in keys))
        added = 0
        for path, keys in shards:
            new = absent.intersection(keys)
            if new:
                self.publish_file(path, keys, run_dir)
                absent -= new
                added += len(new)
        return added


def mark_used(index: dict, by_pack: dict[str, set[str]], run_dir: str) -> dict | None:
    """The index with `run_dir` among the users of every pack read (packs pruned meanwhile stay out)."""
    packs = [pack for pack in by_pack if pack in index["packs"] and run_dir not in index["packs"][pack]["runs"]]
    for pack in packs:
        index["packs"][pack]["runs"].append(run_dir)
    return index if packs else None


def add_pack(index: dict, pack: str, entry: dict) -> dict:
    """The index with the new pack; a key another run published meanwhile keeps its first pack."""
    index["packs"][pack] = entry
    for key in entry["keys"]:
        index["entries"].setdefault(key, pack)
    return index


def drop_runs(index: dict, removed: set[str]) -> tuple[dict | None, dict[str, int]]:
    """The index without the removed runs and the packs no remaining run uses (None when unchanged), and those
    packs with their entry counts."""
    changed, dropped = False, {}
    for pack, entry in list(index["packs"].items()):
        kept = [run for run in entry["runs"] if run not in removed]
        changed |= len(kept) != len(entry["runs"])
        entry["runs"] = kept
        if not kept:
            dropped[pack] = entry["entries"]
            del index["packs"][pack]
    if dropped:
        index["entries"] = {key: pack for key, pack in index["entries"].items() if pack not in dropped}
    return (index if changed else None), dropped


def prune_samples(store: Store, removed_runs: Iterable[str], log: Log = print) -> int:
    """Retention: the removed run directories leave every context's packs, of both kinds; packs no kept run uses are
    deleted. Returns the entries deleted."""
    removed = {str(run) for run in removed_runs}
    deleted = 0
    for kind in KINDS if removed else ():
        for key in sorted({name.split("/")[1] for name in store.list(kind) if name.endswith("/index.json")}):
            deleted += prune_context(PackStore(store, kind, key, log), removed)
    return deleted


def prune_context(packs: PackStore, removed: set[str]) -> int:
    """One context's retention (prune_samples), orphans swept too; returns the entries deleted."""
    dropped: dict[str, int] = {}

    def change(index: dict) -> dict | None:
        changed, found = drop_runs(index, removed)
        dropped.clear()  # a lost compare-and-swap round recomputes it on the fresh index
        dropped.update(found)
        return changed

    packs.update(change)
    packs.store.delete([packs.pack_key(pack) for pack in dropped] + orphans(packs))
    if dropped:
        packs.log(f"{packs.kind} store: {len(dropped)} pack(s), {sum(dropped.values())} entries of context {packs.key} "
                  "deleted: no kept run uses them (run.keep_runs)")
    return sum(dropped.values())


def orphans(packs: PackStore, now: float | None = None) -> list[str]:
    """The pack objects of a context its index does not name, a day after they were written: a publisher that died
    between the upload and the compare-and-swap, or a delete that failed after a prune."""
    index, _ = packs.index()
    cutoff = (now or time.time()) - ORPHAN_AGE_S
    found = []
    for key in packs.store.list(f"{packs.base}packs"):
        pack = key.rsplit("/", 1)[1].split(".")[0]
        written = pack.split("-")[0]
        if pack not in index["packs"] and written.isdigit() and int(written) < cutoff:
            found.append(key)
    return found


# ---------------------------------------------------------------------------------------------
# The data stages' side


def open_sample_store(registry: RegistrySection | None, data: DataSection, target: TargetSection,
                      log: Log = print) -> SampleStore | None:
    """The reply store of the config's registry for this run's context; None (said) without a registry or with
    data.share_samples off."""
    store = registry_store(registry, data, target, log)
    if store is None:
        return None
    context = reply_context(data, target)
    return SampleStore(store, context_key(context), log, context)


def open_feature_store(registry: RegistrySection | None, data: DataSection, target: TargetSection,
                       training: TrainingSection, log: Log = print) -> FeatureStore | None:
    """The feature store for this run's capture settings; None with features online (nothing captured for
    training), with SGLang's capture (its tensor-parallel ranks must all compute the same samples: said), without a
    registry, or with data.share_samples off."""
    if training.tokens_only:
        return None
    if data.feature_backend != "local":
        log("feature store: used by the local capture engine only (SGLang's ranks capture every sample together)")
        return None
    store = registry_store(registry, data, target, log)
    if store is None:
        return None
    context = feature_context(data, target)
    return FeatureStore(store, context_key(context), log, context)


def registry_store(registry: RegistrySection | None, data: DataSection, target: TargetSection, log: Log) -> Store | None:
    if registry is None:
        log("sample store: no registry section, so no store: everything is made anew")
        return None
    if not has_weight_files(target):
        log(f"sample store: the target's weights are not under target.path {target.path} on this machine, "
            "so they cannot be fingerprinted: no store, everything is made anew")
        return None
    if not data.share_samples:
        log("sample store: data.share_samples is off: everything is made anew, nothing kept")
        return None
    return open_registry(registry, log).store
