"""The data set the trainer reads, and the held-out features the simulator replays, made with a target-feature backend.

- `training.features offline`: the target's features of every regenerated sample, stored as shards (in
  data.feature_dtype, bf16 by default) under
  `run.dir/data/hidden/` (57,344 bytes per token at Kimi-K2.5's size: see eagle3/data/storage.py).
- `training.features online` or `streamed`: token shards only, under `run.dir/data/tokens/` (5 bytes per token); the trainer
  computes the features batch by batch and no hidden state is stored. Hidden-state capture is skipped.
- Both: the target's greedy continuations of the held-out benchmark prompts with their features, under
  `run.dir/data/heldout/`, so the acceptance simulator needs no target (200 prompts x ~2.5 k tokens at Kimi's size:
  ~29 GB).

Convention (docs/contracts.md): aux layer k is the output of decoder layer k, i.e. HF hidden_states[k + 1]. The last hidden
state is the input (`pre_norm`) or the output (`post_norm`, the default) of the target's final norm. Features go from
the backend's device through pinned host memory straight to their place in the shard file (eagle3/data/shards.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from eagle3.config.data import DataSection
from eagle3.config.run import RunSection, TargetSection
from eagle3.config.training import TrainingSection
from eagle3.data.conversation import chat_template_hash
from eagle3.data.regenerate import read_greedy, read_regenerated, regen_dir, training_ids
from eagle3.data.shards import FEATURE_DTYPES, SPLIT_FILE, ShardWriter, read_stamp, shard_file, stored_feature_dtype
from eagle3.data.storage import check_storage, projected_bytes
from eagle3.runtime.backends import local_device, target_backend
from eagle3.runtime.features import FeatureBackend, Features, pad_rows
from eagle3.runtime.targets import check_same, load_tokenizer, target_identity
from eagle3.errors import Eagle3Error, UnreadableInput
from eagle3.records.manifest import code_version, read_manifest, write_manifest
from eagle3.fsutil import atomic_write_json
from eagle3.progress import Progress

Log = Callable[[str], None]
HIDDEN_DIR = "hidden"
TOKENS_DIR = "tokens"
HELDOUT_DIR = "heldout"


def dataset_dir(run: RunSection, training: TrainingSection) -> Path:
    """What the trainer reads: feature shards (offline) or token shards (online)."""
    return run.stage_dir("data") / (TOKENS_DIR if training.tokens_only else HIDDEN_DIR)


def regenerated_manifest(run: RunSection, data: DataSection, target: TargetSection) -> dict:
    """The regeneration manifest, refused when it was made for another target, tokenizer or template."""
    regen = regen_dir(run)
    try:
        manifest = read_manifest(regen)
    except FileNotFoundError:
        raise UnreadableInput(f"{regen}: no finished regeneration here; run `eagle3 data regenerate` first") from None
    expected = target_identity(target)
    check_same(f"regenerated data in {regen}", manifest["target"], expected, ("path", "config_sha256", "tokenizer_sha256", "family"))
    tokenizer = load_tokenizer(target)
    check_same(
        f"regenerated data in {regen}",
        manifest,
        {"chat_template_sha256": chat_template_hash(tokenizer), "thinking": data.thinking},
        ("chat_template_sha256", "thinking"),
    )
    return manifest


def capture_settings(data: DataSection, target: TargetSection) -> dict:
    """What stored features depend on besides the samples themselves."""
    return {
        "target": target_identity(target),
        "aux_layers": list(data.aux_layers),
        "last_hidden": data.last_hidden,
        "engine": data.feature_backend,
    }


def is_current(path: Path, stamp: dict, dtype: str | None) -> bool:
    """Whether the shard at `path` was made from `stamp` and holds its features in `dtype` (None: a token shard)."""
    if not path.exists():
        return False
    recorded = read_stamp(path)
    same = recorded is not None and {k: v for k, v in recorded.items() if k != "engine_release"} == stamp
    return same and stored_feature_dtype(path) == dtype


def heldout_records(run: RunSection) -> list[dict]:
    """The held-out suite's greedy sequences as samples (`greedy_records`)."""
    return greedy_records(read_greedy(regen_dir(run)))


def greedy_records(rows: list[dict]) -> list[dict]:
    """Greedy sequences (read_greedy's rows) as samples: loss_mask marks the continuation (the prompt's end is where
    it starts)."""
    return [{"id": r["id"], "input_ids": r["prompt_ids"] + r["continuation_ids"],
             "loss_mask": [0] * len(r["prompt_ids"]) + [1] * len(r["continuation_ids"])} for r in rows]


def capture(run: RunSection, data: DataSection, target: TargetSection, training: TrainingSection, log: Log = print,
            backend_for: Callable[[], FeatureBackend] | None = None, main: bool = True, store=None) -> Path:
    """Make the training data set and the held-out features; returns the data set's directory.

    `backend_for()` starts the feature backend (default: transformers on this machine's device), only when some
    shard needs features. Every rank of a tensor-parallel backend runs this with the same shards in the same order;
    only `main` writes. On a re-run, a shard whose stamp matches (samples, their tokens, settings) is reused.
    `store`: the registry's feature store for these settings (eagle3.registry.samples.FeatureStore; offline, local
    engine): a training sample's features it holds are copied, not computed, and the shards made here are kept there.
    """
    regen_manifest = regenerated_manifest(run, data, target)
    # in split order, so that more samples fill new shards and leave the full shards before them current
    regen = regen_dir(run)
    order = {sample_id: index for index, sample_id in enumerate(training_ids(regen))}
    records = sorted(read_regenerated(regen), key=lambda r: order[r["id"]])
    online = training.tokens_only
    out = dataset_dir(run, training)
    settings = capture_settings(data, target)
    dtype = data.feature_dtype
    if online:  # token shards: no features, so no feature dtype
        jobs = shard_jobs(records, out, data.shard_samples, {"tokens_only": True}, None)
    else:
        jobs = shard_jobs(records, out, data.shard_samples, settings, dtype)
    sequences = heldout_records(run)
    heldout = shard_jobs(sequences, run.stage_dir("data") / HELDOUT_DIR, max(len(sequences), 1), settings, dtype)
    feature_jobs = heldout if online else jobs + heldout
    if online:
        log(f"capture: hidden-state capture skipped (training.features online: the trainer computes the features); "
            f"{len(records)} samples stored as token shards in {out}")
    else:
        tokens = sum(len(r["input_ids"]) for job in jobs if job.todo for r in job.samples)
        check_storage(data, target, tokens, out, log)
    pending = [job for job in feature_jobs if job.todo]
    release = None
    if online and main:
        for job in jobs:
            if job.todo:
                write_shard(job.path, job.samples, job.stamp, None, {}, data.batch_size)
    store = None if online else store  # token shards hold no features to take or keep
    stored_jobs = [] if store is None else [job for job in jobs if job.todo]
    with stored_rows(store, stored_jobs, run, log) as stored:
        if pending:
            backend = backend_for() if backend_for else target_backend(data, target, local_device())
            release = backend.release
            progress = Progress("capture", total=sum(len(job.samples) for job in pending), unit="samples", log=log)
            try:
                for job in pending:
                    write_shard(job.path, job.samples, {**job.stamp, "engine_release": release}, backend,
                                feature_widths(data, target), data.batch_size, main, progress,
                                FEATURE_DTYPES[dtype], stored if job in stored_jobs else {})
            finally:
                backend.close()
    if main and store is not None:  # every shard, reused ones too: a crash may have come before this
        kept = store.publish_shards([(job.path, [sample_key(r) for r in job.samples]) for job in jobs],
                                    str(run.data_dir.resolve()))
        log(f"capture: feature store {store.where}: {kept} samples' new features kept for later runs")
    if main:
        remove_stale(out, len(jobs))
        named_eval = write_split(out, records)
        release = release or recorded_release([job.path for job in feature_jobs])
        heldout_manifest = write_manifest(run.stage_dir("data") / HELDOUT_DIR, kind="heldout",
                                          fields=heldout_fields(data, target, heldout, release))
        write_manifest(out, kind="tokens" if online else "dataset",
                       fields={**dataset_fields(data, target, training, regen_manifest, release, records,
                                                heldout_manifest),
                               "named_eval_samples": named_eval})
        log(f"capture: {len(records)} samples in {len(jobs)} shard(s) at {out} "
            f"({sum(not job.todo for job in jobs)} reused); {len(sequences)} held-out sequences with features")
    return out


class ShardJob(NamedTuple):
    path: Path
    samples: list[dict]
    todo: bool  # no current shard at `path`
    stamp: dict  # what the shard is made from


def shard_jobs(records: list[dict], out: Path, per_shard: int, settings: dict, dtype: str | None) -> list[ShardJob]:
    """One job per shard of `records`, its features stored in `dtype` (None: token shards). The stamp holds the
    samples' ids and a hash of their tokens: a regeneration that rewrote the samples under the same ids makes the
    shard again, and so does another data.feature_dtype."""
    jobs = []
    for k, start in enumerate(range(0, max(len(records), 1), per_shard)):
        shard = records[start : start + per_shard]
        stamp = {"sample_ids": [r["id"] for r in shard], "tokens_sha256": tokens_hash(shard), **settings}
        jobs.append(ShardJob(shard_file(out, k), shard, not is_current(shard_file(out, k), stamp, dtype), stamp))
    return jobs


@contextlib.contextmanager
def stored_rows(store, jobs: list[ShardJob], run: RunSection, log: Log):
    """For the block: {sample key: a reader of its stored features} for the jobs' samples the feature store holds
    ({} without a store or jobs), counted in the log."""
    if store is None or not jobs:
        yield {}
        return
    keys = [sample_key(r) for job in jobs for r in job.samples]
    with store.rows(keys, str(run.data_dir.resolve())) as found:
        log(f"capture: feature store {store.where}: {len(found)} of {len(keys)} samples' features taken from earlier "
            f"runs, {len(keys) - len(found)} to compute")
        yield found


def sample_key(record: dict) -> str:
    """A sample's features by content: its tokens and loss mask (the feature store's key)."""
    return tokens_hash([record])[:32]


def tokens_hash(records: list[dict]) -> str:
    digest = hashlib.sha256()
    for record in records:
        digest.update(json.dumps([record["input_ids"], record["loss_mask"]]).encode())
    return digest.hexdigest()


def write_shard(path: Path, shard: list[dict], stamp: dict, backend: FeatureBackend | None, widths: dict[str, int],
                batch_size: int, main: bool = True, progress: Progress | None = None,
                dtype: torch.dtype = torch.bfloat16, stored: dict | None = None) -> None:
    """One shard, batch by batch: tokens, and the backend's features when there is a backend (`widths` names them,
    stored in `dtype`); a sample `stored` holds (by sample_key) is copied from there instead of computed."""
    lengths = [len(r["input_ids"]) for r in shard]
    stored = stored or {}
    writer = ShardWriter(path, [r["id"] for r in shard], lengths, widths, stamp, dtype) if main else contextlib.nullcontext()
    with writer:
        for start in range(0, len(shard), batch_size):
            batch = shard[start : start + batch_size]
            keys = [sample_key(r) if stored else None for r in batch]
            fresh = [i for i, key in enumerate(keys) if key not in stored]
            computed_row = {i: row for row, i in enumerate(fresh)}  # a batch row -> its row of the computed features
            features = None
            if backend is not None and fresh:
                computed = [batch[i] for i in fresh]
                features = backend.features(pad_rows([r["input_ids"] for r in computed], [r["id"] for r in computed]))
                check_rows(computed, features, widths)
                features = Features(to_host(features.aux), to_host(features.last))  # one copy per batch
            for i, record in enumerate(batch if main else []):
                n = lengths[start + i]
                rows = {"input_ids": torch.tensor(record["input_ids"]), "loss_mask": torch.tensor(record["loss_mask"])}
                if features is not None and i in computed_row:
                    row = computed_row[i]
                    rows.update(aux_hidden=features.aux[row, :n], last_hidden=features.last[row, :n])
                elif backend is not None:
                    sample = stored[keys[i]]()
                    rows.update(aux_hidden=sample.aux_hidden, last_hidden=sample.last_hidden)
                writer.write(start + i, **rows)
            if progress is not None:
                progress.advance(len(batch), tokens=sum(lengths[start : start + batch_size]))


def feature_widths(data: DataSection, target: TargetSection) -> dict[str, int]:
    hidden = target.hidden_size
    return {"aux_hidden": len(data.aux_layers) * hidden, "last_hidden": hidden}


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A device tensor copied into pinned host memory (the fast path for device-to-host copies); CPU ones as they are."""
    if tensor.device.type == "cpu":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    torch.cuda.current_stream(tensor.device).synchronize()
    return host


def check_rows(batch: list[dict], features: Features, widths: dict[str, int]) -> None:
    """The backend must give a row for every token (one that drops rows - prefix-cache hits, chunked prefill - would
    misalign every later position), as wide as the config says."""
    width = max(len(r["input_ids"]) for r in batch)
    for name, tensor in (("aux_hidden", features.aux), ("last_hidden", features.last)):
        if tuple(tensor.shape) != (len(batch), width, widths[name]):
            raise Eagle3Error(f"the feature backend returned {name} of shape {tuple(tensor.shape)}; expected "
                              f"{(len(batch), width, widths[name])} ({len(batch)} rows of up to {width} tokens)")


def write_split(out: Path, records: list[dict]) -> int | None:
    """The eval rows imported data named (the trainer evaluates on exactly these, whatever training.eval_fraction
    says); no file when none is named (the trainer splits by id). Kept out of the shards' stamps: another split of
    the same rows reuses their features. Returns how many eval rows, or None."""
    path = out / SPLIT_FILE
    if not any("split" in record for record in records):
        path.unlink(missing_ok=True)
        return None
    eval_ids = [record["id"] for record in records if record.get("split") == "eval"]
    atomic_write_json(path, {"eval": eval_ids})
    return len(eval_ids)


def remove_stale(out: Path, count: int) -> None:
    for stale in out.glob("shard-*.safetensors"):
        if int(stale.name[len("shard-") :][:5]) >= count:
            stale.unlink()  # left by an earlier, larger capture into the same directory


def recorded_release(paths: list[Path]) -> str | None:
    """The engine release stamped on the shards, when every one was reused (no backend started now)."""
    releases = {(read_stamp(path) or {}).get("engine_release") for path in paths}
    return releases.pop() if len(releases) == 1 else None


def heldout_fields(data: DataSection, target: TargetSection, jobs: list[ShardJob], release: str | None) -> dict:
    sequences = [r for job in jobs for r in job.samples]
    tokens = sum(len(r["input_ids"]) for r in sequences)
    return {"target": target_identity(target), "capture": capture_fields(data, release),
            "sequences": len(sequences), "tokens": tokens, "bytes": projected_bytes(data, target, tokens)[1],
            "continuation_tokens": sum(sum(r["loss_mask"]) for r in sequences), "code_version": code_version()}


def capture_fields(data: DataSection, release: str | None) -> dict:
    return {"aux_layers": list(data.aux_layers), "last_hidden": data.last_hidden,
            "dtype": data.feature_dtype,  # every shard holds it: a reused one is checked (is_current)
            "engine": data.feature_backend, "engine_release": release}


def dataset_fields(data: DataSection, target: TargetSection, training: TrainingSection, regen_manifest: dict,
                   release: str | None, records: list[dict], heldout_manifest: dict) -> dict:
    tokens = sum(len(r["input_ids"]) for r in records)
    online = training.tokens_only
    per_token, total = projected_bytes(data, target, tokens)
    return {
        "target": regen_manifest["target"],
        "chat_template_sha256": regen_manifest["chat_template_sha256"],
        "thinking": regen_manifest["thinking"],
        "regeneration": {
            key: regen_manifest[key] for key in ("engine", "engine_release", "source", "sampling", "max_length")
        },
        "features": training.features,
        "capture": capture_fields(data, release),
        "samples": len(records),
        "tokens": tokens,
        "loss_tokens": sum(sum(r["loss_mask"]) for r in records),
        "bytes_per_token": 0 if online else per_token,  # hidden states stored (online: none)
        "bytes": 0 if online else total,
        "heldout": {key: heldout_manifest[key] for key in ("sequences", "tokens", "bytes", "files")},
        "code_version": code_version(),
    }


def check_dataset(run: RunSection, data: DataSection, target: TargetSection, training: TrainingSection,
                  manifest: dict) -> None:
    """Refuse a data set made for another target, other layers, another template or the other feature mode."""
    where = f"the data set in {dataset_dir(run, training)}"
    check_same(where, manifest["target"], target_identity(target), ("path", "config_sha256", "tokenizer_sha256", "family"))
    check_same(where, manifest["capture"], {"aux_layers": list(data.aux_layers), "last_hidden": data.last_hidden},
               ("aux_layers", "last_hidden"))
    check_same(where, {**manifest, "features": stored_kind(manifest["features"])},
               {"thinking": data.thinking, "features": stored_kind(training.features)}, ("thinking", "features"))


def stored_kind(features: str) -> str:
    """What a data set made for training.features `features` holds: token rows serve online and streamed alike."""
    return "offline" if features == "offline" else "token rows"
