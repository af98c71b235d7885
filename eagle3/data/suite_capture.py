"""The suite features stage: the target's features of the suites stage's greedy continuations (the benchmark suites
besides the held-out prompts), under `run.dir/data/suite-features/`, for the simulator alone. The training data set
and the held-out prompts' features (eagle3.data.capture), which training reads, are another output: a suite added to a
finished run captures its own sequences and nothing else."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from eagle3.config.data import DataSection
from eagle3.config.run import RunSection, TargetSection
from eagle3.data.capture import (Log, capture_settings, feature_widths, greedy_records, heldout_fields,
                                 recorded_release, remove_stale, shard_jobs, write_shard)
from eagle3.data.continuations import suites_dir
from eagle3.data.regenerate import read_greedy
from eagle3.data.shards import FEATURE_DTYPES
from eagle3.runtime.backends import local_device, target_backend
from eagle3.runtime.features import FeatureBackend
from eagle3.progress import Progress
from eagle3.records.manifest import write_manifest

SUITE_FEATURES_DIR = "suite-features"


def suite_features_dir(run: RunSection) -> Path:
    return run.stage_dir("data") / SUITE_FEATURES_DIR


def capture_suites(run: RunSection, data: DataSection, target: TargetSection, log: Log = print,
                   backend_for: Callable[[], FeatureBackend] | None = None, main: bool = True) -> Path:
    """The suites' sequences with their features, one shard (none without a suite besides the held-out one), reused
    while its stamp matches; `backend_for` and `main` as eagle3.data.capture.capture takes them."""
    out = suite_features_dir(run)
    sequences = greedy_records(read_greedy(suites_dir(run)))
    settings, dtype = capture_settings(data, target), data.feature_dtype
    jobs = shard_jobs(sequences, out, len(sequences), settings, dtype) if sequences else []
    pending = [job for job in jobs if job.todo]
    release = None
    if pending:
        backend = backend_for() if backend_for else target_backend(data, target, local_device())
        release = backend.release
        progress = Progress("capture suites", total=len(sequences), unit="samples", log=log)
        try:
            for job in pending:
                write_shard(job.path, job.samples, {**job.stamp, "engine_release": release}, backend,
                            feature_widths(data, target), data.batch_size, main, progress,
                            FEATURE_DTYPES[dtype])
        finally:
            backend.close()
    if main:
        out.mkdir(parents=True, exist_ok=True)
        remove_stale(out, len(jobs))
        release = release or recorded_release([job.path for job in jobs])
        write_manifest(out, kind="suite_features", fields=heldout_fields(data, target, jobs, release))
        log(f"capture: {len(sequences)} sequences of the other suites with features in {out} "
            f"({'made' if pending else 'reused'})")
    return out
