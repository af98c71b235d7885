"""The `eagle3` flow: data -> vocab -> train -> export -> simulate -> serve + measure -> sweep -> gate -> promote /
roll back. With contenders (the `contenders` section) every draft trains on the same data and is measured and swept
in turn; the gate judges the fastest (tasks.bench.choose_draft).

Ends Completed (promoted), Completed named RolledBack (the gate, or production's check after the promotion,
rejected the candidate; the message gives the reasons), or Failed (an error). Runs for one registry never overlap,
on any Prefect API or machine: each holds the lock kept in the registry's own store (eagle3/registry/lock.py); a
waiting run says who holds it and takes over a holder whose lease ran out. Modes: `full`; `retrain` (a fresh
run directory, warm start from the production draft); `benchmark` (re-measure production only); `monitor` (one window of
production's acceptance on live traffic; the event `eagle3.acceptance.degraded` on an alarm; takes no lock). A run
marks its directory in use while it runs; after a promotion that production serves, old retrain run directories are
removed (run.keep_runs).
"""

from __future__ import annotations

from typing import Literal

from prefect import flow
from prefect.states import Completed, Failed
from prefect.transactions import transaction

from eagle3.config import resolved_config_path
from eagle3.resolve import draft_configs
from eagle3.deployment.contenders import Contender
from eagle3.registry.gate import GateRejected
from eagle3.runs import run_in_use
from eagle3.stages.table import STAGES
from tasks.bench import choose_draft, measure_served, sweep_serving
from tasks.common import log_to_run
from tasks.deploy import (
    check_gate,
    promote,
    prune_old_runs,
    publish_candidate,
    record_rejection,
    release_production,
    remeasure,
    report_decision,
    serve_production,
    verify_production,
)
from tasks.lock import flow_run_lock
from tasks.monitor import emit_degraded, load_monitor_config, publish_monitor_report, watch_production
from tasks.run import load_run_config
from tasks.stages import STAGE_TASKS


@flow(name="eagle3")
def eagle3(config: str, overrides: list[str] | None = None,
           mode: Literal["full", "retrain", "benchmark", "monitor"] = "full"):
    if mode == "monitor":  # never the registry's lock: it must neither wait behind a 14-hour retrain nor block one
        return watch(config, overrides or [])
    run_config, resolved = load_run_config(config, overrides or [], mode)
    log = log_to_run()
    with flow_run_lock(run_config.registry, log):
        if mode == "benchmark":
            return remeasure_production(run_config)
        with run_in_use(run_config.run.dir, log):  # the retention of another run never removes this one
            return train_and_deploy(run_config, resolved)


def run_stages(config, resolved: str, made: dict, per_draft: bool) -> dict:
    """The cached stages in the table's order (the shared ones, or those each draft runs), each given the outputs it
    reads; `made`: what the stages before made."""
    made = dict(made)
    for stage in STAGES.values():
        if stage.per_draft == per_draft:
            made[stage.name] = STAGE_TASKS[stage.name](
                config, resolved, {name: made[source] for name, source in stage.upstream.items()})
    return made


def train_and_deploy(run_config, resolved: str):
    before = release_production(run_config)  # managed on the node: every stage below needs its GPUs (docs/gpu-node.md)
    version = None
    try:
        shared = run_stages(run_config, resolved, {}, per_draft=False)
        drafts, made = [], {}
        for label, config in draft_configs(run_config).items():  # the run's draft, then each contender, on its data
            made[label] = run_stages(config, str(resolved_config_path(config)), shared, per_draft=True)
            first = drafts[0].candidate if drafts else None  # its no-draft baselines serve every draft
            measured = measure_served(config, made[label]["export"], made[label]["simulate"], first)
            drafts.append(Contender(label, config, sweep_serving(config, measured, before, first)))
        chosen = choose_draft(run_config, drafts, before)
        config, candidate, made = chosen.config, chosen.candidate, made[chosen.label]
        fingerprints = {name: made[stage].fingerprint for name, stage in
                        (("data", "capture"), ("vocab", "vocab"), ("train", "train"), ("export", "export"))}
        version = publish_candidate(config, fingerprints, candidate, before)
        with transaction():
            decision = check_gate(config, version, candidate, before)
            promote(config, version, before, decision.notes)
            production = verify_production(config, version)
    except GateRejected as rejected:
        record_rejection(config, version, rejected, candidate, before)
        production = serve_production(config, before, f"candidate {version} rejected")
        report_decision(config, version, rejected.decision, before, production)
        return Completed(name="RolledBack", message=rejected.decision.summary())
    except Exception:  # not a cancellation: the 30 s Prefect leaves before SIGKILL would not load a target
        # production serves again; should that fail too, its task run says why and the run's error stays the first one
        serve_production(run_config, before, "the run failed", return_state=True)
        raise
    # outside the try: the promotion stands whatever the retention does
    report_decision(config, version, decision, before, production, prune_old_runs(run_config))
    return version


def watch(config: str, overrides: list[str]):
    run_config = load_monitor_config(config, overrides)
    window = watch_production(run_config)
    if (window.get("alarm") or {}).get("state") == "raised":
        emit_degraded(run_config, window["alarm"])
    publish_monitor_report(run_config)
    return window


def remeasure_production(config):
    production = remeasure(config)
    return Failed(message=production.warning) if production.warning else production
