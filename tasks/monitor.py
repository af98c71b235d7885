"""The production monitor (eagle3.deployment.monitor): one window observed and recorded, the degraded event on an
alarm, and the `monitor` artifact. None of it takes the registry's lock: it reads production and writes only its own
keys in the registry's store."""

from __future__ import annotations

import time

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.events import emit_event

from eagle3.config import PipelineConfig, require_sections
from eagle3.resolve import load_config
from eagle3.deployment.monitor import Monitor, baseline_of
from eagle3.registry.registry import open_registry
from eagle3.report import POINTER_MOVES, monitor_report
from tasks.common import log_to_run
from tasks.run import registry_resource

DEGRADED = "eagle3.acceptance.degraded"


@task(name="load-config", cache_policy=NO_CACHE)
def load_monitor_config(config: str, overrides: list[str]) -> PipelineConfig:
    run_config = load_config(config, overrides)
    require_sections(run_config, ("registry",), "the production monitor")
    return run_config


@task(name="watch-production", cache_policy=NO_CACHE)
def watch_production(config: PipelineConfig) -> dict:
    """One window of production judged and kept in the registry's store (its `alarm` set when one completes)."""
    log = log_to_run()
    registry = open_registry(config.registry, log=log)
    return Monitor(config.monitor, config.production, config.serving, registry, log).run_window()


@task(name="emit-degraded", cache_policy=NO_CACHE)
def emit_degraded(config: PipelineConfig, alarm: dict) -> str:
    """The event the retrain deployment's trigger waits for, on this registry's resource, with the figures."""
    resource = registry_resource(config.registry)
    event = emit_event(DEGRADED, resource={"prefect.resource.id": resource, "prefect.resource.name": alarm["registry"]},
                       payload=alarm)
    log_to_run()(f"emit-degraded: {DEGRADED} on {resource} (version {alarm['version']}): event {event and event.id}")
    return str(event.id) if event else ""


@task(name="monitor-report", cache_policy=NO_CACHE)
def publish_monitor_report(config: PipelineConfig) -> None:
    registry = open_registry(config.registry, log=log_to_run())
    monitor = Monitor(config.monitor, config.production, config.serving, registry, log_to_run())
    windows = monitor.windows(config.monitor.keep_windows)
    history = registry.history()
    moved_to = {e["version"] for e in history if e.get("event") in POINTER_MOVES and e["version"]}
    speedups = {v: baseline_of(registry.manifest(v))["speedup"] for v in moved_to}
    create_markdown_artifact(key="monitor", markdown=monitor_report(windows, history, speedups, time.time()),
                             description="production's accept length over time per version, promotions marked; "
                             "recent windows and traffic slices")
