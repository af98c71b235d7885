"""What every stage task shares: the run logger as the library's `log`, and caching on content hashes."""

from __future__ import annotations

from collections.abc import Callable

from prefect import get_run_logger

from eagle3.config import PipelineConfig
from eagle3.stages import STAGE_UPSTREAM, cache_key, done, marker, output_of, run_marked, stage_fingerprint


def log_to_run():
    """The library's `log(line)` callback, writing into the Prefect run's log."""
    return get_run_logger().info


def upstream_fingerprints(parameters: dict) -> dict[str, str]:
    """The content hashes of the stage outputs among a task's parameters, by parameter name."""
    return {name: value["fingerprint"] for name, value in sorted(parameters.items())
            if isinstance(value, dict) and "fingerprint" in value}


def cached(stage: str) -> dict:
    """Task options: cache on eagle3.stages' content-hash key (config fields, upstream fingerprints, code)."""

    def key(context, parameters: dict) -> str | None:
        return cache_key(stage, parameters["config"], upstream_fingerprints(parameters))

    return {"cache_key_fn": key, "persist_result": True, "name": stage}


def run_stage(stage: str, config: PipelineConfig, upstream: dict, work: Callable[[], None],
              outputs: Callable[[], dict] = dict) -> dict:
    """Run a cached stage's work between its in-progress and finished marks - unless its output is already finished
    under this key, which Prefect's result store may have forgotten - and return where its output is, its content
    hash (the next stage's cache input) and what `outputs` reads from it. `upstream`: the task's stage-output
    parameters, by name."""
    if set(upstream) != set(STAGE_UPSTREAM[stage]):  # the one list of what each stage reads (eagle3/stages.py)
        raise ValueError(f"the {stage} task passes {sorted(upstream)}, STAGE_UPSTREAM names "
                         f"{sorted(STAGE_UPSTREAM[stage])}")
    fingerprints = upstream_fingerprints(upstream)
    if done(stage, config, fingerprints):
        log_to_run()(f"{stage}: {output_of(config, stage)} was finished under this very key ({marker(config, stage)}):"
                     " kept, not made again")
    else:
        run_marked(stage, config, fingerprints, work, log_to_run())
    return {"path": str(output_of(config, stage)), "fingerprint": stage_fingerprint(config, stage), **outputs()}
