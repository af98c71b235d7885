"""What every stage task shares: the run logger as the library's `log`, and cache options from content hashes."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger

from eagle3.stages import fingerprint, stage_key


def log_to_run():
    """The library's `log(line)` callback, writing into the Prefect run's log."""
    logger = get_run_logger()
    return logger.info


def cached(stage: str) -> dict:
    """Task options: cache on eagle3.stages' content-hash key (config sections, upstream fingerprints, code)."""

    def key(context, parameters: dict) -> str:
        upstream = [value["fingerprint"] for _, value in sorted(parameters.items())
                    if isinstance(value, dict) and "fingerprint" in value]
        return stage_key(stage, parameters["config"], upstream)

    return {"cache_key_fn": key, "persist_result": True, "name": stage}


def stage_output(path: Path, **extra) -> dict:
    """A stage's result: where its output is and its content hash (the next stage's cache input)."""
    return {"path": str(path), "fingerprint": fingerprint(path), **extra}
