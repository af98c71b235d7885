"""What every stage task shares: the run logger as the library's `log`, and cache options from content hashes."""

from __future__ import annotations

from prefect import get_run_logger

from eagle3.config import PipelineConfig
from eagle3.stages import cache_key, fingerprint, record_key


def log_to_run():
    """The library's `log(line)` callback, writing into the Prefect run's log."""
    return get_run_logger().info


def upstream_fingerprints(parameters: dict) -> list[str]:
    """The content hashes of the stage outputs among a task's parameters, in parameter-name order."""
    return [value["fingerprint"] for _, value in sorted(parameters.items())
            if isinstance(value, dict) and "fingerprint" in value]


def cached(stage: str) -> dict:
    """Task options: cache on eagle3.stages' content-hash key (config sections, upstream fingerprints, code)."""

    def key(context, parameters: dict) -> str | None:
        return cache_key(stage, parameters["config"], upstream_fingerprints(parameters))

    return {"cache_key_fn": key, "persist_result": True, "name": stage}


def finished(stage: str, config: PipelineConfig, upstream: dict, **extra) -> dict:
    """A stage's result - where its output is and its content hash (the next stage's cache input) - with the
    output marked by the key it was made under. `upstream`: the task's stage-output parameters, by name."""
    path = record_key(stage, config, upstream_fingerprints(upstream))
    return {"path": str(path), "fingerprint": fingerprint(path), **extra}
