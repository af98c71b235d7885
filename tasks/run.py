"""Run set-up: the config for this mode, and the name of the registry's Prefect event resource."""

from __future__ import annotations

import hashlib

from prefect import task
from prefect.cache_policies import NO_CACHE

from eagle3.algorithms import require_deployable
from eagle3.config import (
    DEPLOYMENT_SECTIONS, PipelineConfig, check_local_inputs, require_sections, resolved_config_file,
)
from eagle3.resolve import contender_configs, load_config
from eagle3.config.deployment import RegistrySection
from eagle3.deployment.promotion import retrain_overrides
from eagle3.init_draft import init_draft
from eagle3.plan import chosen_recompute, require_fit
from eagle3.serving import serving_engine
from eagle3.serving.base import launch_spec
from eagle3.registry.registry import open_registry, registry_location
from tasks.common import log_to_run


def registry_hash(section: RegistrySection) -> str:
    """A short name of one registry location (a path or s3://bucket/prefix), in Prefect's allowed characters."""
    return hashlib.sha256(registry_location(section).encode()).hexdigest()[:16]


def registry_resource(section: RegistrySection) -> str:
    """The Prefect event resource of one registry: the monitor's events name it, the retrain's trigger matches it."""
    return "eagle3.registry." + registry_hash(section)


@task(name="load-config", cache_policy=NO_CACHE)
def load_run_config(config: str, overrides: list[str], mode: str) -> tuple[PipelineConfig, str]:
    """The validated config (a retrain adds its run directory and warm start) and the path of its resolved file,
    which the stages' subprocesses (trainers, node commands) read."""
    run_config = load_config(config, overrides)
    require_sections(run_config, DEPLOYMENT_SECTIONS, "the eagle3 flow (the whole pipeline)")
    require_deployable(run_config.draft.algorithm, "the eagle3 flow (the whole pipeline)")
    check_local_inputs(run_config)
    require_fit(run_config, config)  # refused before any stage when a GPU stage would not fit
    # what its launches would refuse, before training
    serving_engine(run_config.serving.engine).check(launch_spec(run_config), run_config.production.telemetry,
                                                     run_config.sweep)
    if mode == "retrain":
        registry = open_registry(run_config.registry, log=log_to_run())
        overrides = overrides + retrain_overrides(run_config.run, run_config.draft.algorithm, registry, log_to_run())
        run_config = load_config(config, overrides)
    # a training.init_from that names no draft is refused before any stage
    init_draft(run_config.training, run_config.draft, run_config.registry)
    run_config, recompute = chosen_recompute(run_config)  # the trainers read the plan's choice
    log_to_run()(f"load-config: {recompute}")
    resolved = resolved_config_file(run_config)
    log_to_run()(f"load-config: resolved config in {resolved}")
    for name, contender in contender_configs(run_config).items():  # each one's stages read its own resolved file
        by = f"{config}'s contenders.{name}"
        require_deployable(contender.draft.algorithm, by)
        require_fit(contender, by)
        init_draft(contender.training, contender.draft, contender.registry)
        log_to_run()(f"load-config: contender {name} ({contender.draft.algorithm}) in {contender.run.dir}, its "
                     f"resolved config in {resolved_config_file(contender)}")
    return run_config, str(resolved)
