"""Deployment: free the node, publish the candidate, gate it, promote or roll back, serve production again, and
after a promotion remove old retrain run directories.

`promote` runs inside the flow's transaction; its rollback hook moves the registry pointer back when a later step
of the transaction (the production check) fails. None of these tasks retries inside the transaction: the HTTP and
S3 clients retry in their own bodies.
"""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.context import FlowRunContext
from prefect.events import emit_event
from prefect.transactions import get_transaction

from eagle3.config import PipelineConfig
from eagle3.deployment.promotion import (
    Candidate,
    config_fields,
    diagnosis_of,
    gate_decision,
    prune_after_promotion,
    version_dirs,
    version_fields,
    version_id,
)
from eagle3.deployment.production import Production, ProductionCheck
from eagle3.export import export_dirs
from eagle3.registry.gate import Decision, GateRejected, Reason
from eagle3.registry.registry import open_registry
from eagle3.report import decision_report
from tasks.common import log_to_run


def flow_run_id() -> str | None:
    context = FlowRunContext.get()
    return str(context.flow_run.id) if context and context.flow_run else None


@task(name="release-production", cache_policy=NO_CACHE)
def release_production(config: PipelineConfig) -> str | None:
    """Stop a managed production server (the node holds one model); return the production version."""
    registry = open_registry(config.registry, log=log_to_run())
    version = registry.production_version()  # read first: a registry that cannot be read leaves production up
    Production(config, registry, log_to_run()).release_node()
    return version


@task(name="publish-candidate", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=10)
def publish_candidate(config: PipelineConfig, fingerprints: dict, candidate: Candidate, production: str | None) -> str:
    registry = open_registry(config.registry, log=log_to_run())
    version = version_id(config.run, candidate.fingerprint)
    if version in registry.versions():
        log_to_run()(f"registry: version {version} (this export) is already published: not uploading it again")
        return version
    fields = version_fields(config_fields(config), config.benchmark, config.run, fingerprints, candidate.served,
                            candidate.simulated["accept_length"], candidate.chosen, production, flow_run_id())
    registry.publish(version, version_dirs(config.run, export_dirs(config.run, config.export)), fields)
    return version


@task(name="gate", cache_policy=NO_CACHE)
def check_gate(config: PipelineConfig, version: str, candidate: Candidate, production: str | None) -> Decision:
    """The gate's decision; a rejection raises GateRejected with the train-serve diagnosis attached."""
    registry = open_registry(config.registry, log=log_to_run())
    decision = gate_decision(config.benchmark, config.gate, config.run, registry, production, candidate)
    log_to_run()(f"gate: {decision.summary()}")
    if not decision.promote:
        decision.diagnosis = diagnosis_of(config.serving, config.target, config.run, config.training, candidate.export,
                                          candidate.served, candidate.simulated["accept_length"])
        raise GateRejected(decision)
    return decision


@task(name="promote", cache_policy=NO_CACHE)
def promote(config: PipelineConfig, version: str, production: str | None, notes: list[str]) -> None:
    """Point production at `version`; the history's reasons keep the gate's notes (checks waived on purpose)."""
    registry = open_registry(config.registry, log=log_to_run())
    if version == production:
        log_to_run()(f"registry: {version} is production already (a re-run of the same export): nothing to move")
        return
    # staged before the write: a write that lands but whose answer is lost must still be rolled back
    get_transaction().set("promotion", {"registry": config.registry, "version": version, "previous": production})
    registry.promote(version, expected=production, reasons=["every gate rule passed", *notes], by="pipeline",
                     run=flow_run_id())


@promote.on_rollback
def restore_pointer(transaction) -> None:
    """A step after the promotion failed: production is the previous version again."""
    promotion = transaction.get("promotion", None)
    if promotion is None:  # the pointer was not moved
        return
    registry = open_registry(promotion["registry"])
    if registry.production_version() != promotion["version"]:
        return  # the promotion's write never landed
    registry.rollback(to=promotion["previous"], expected=promotion["version"], by="pipeline", run=flow_run_id(),
                      reasons=[f"rolled back {promotion['version']}: a later step of the promotion failed"])


@task(name="serve-production", cache_policy=NO_CACHE)
def serve_production(config: PipelineConfig, version: str | None, why: str) -> ProductionCheck:
    """Serve `version` on the production endpoint (managed) and re-measure it against its recorded numbers."""
    log = log_to_run()
    production = Production(config, open_registry(config.registry, log=log), log)
    return production.checked(version, production.serve(version, why))


@task(name="verify-production", cache_policy=NO_CACHE)
def verify_production(config: PipelineConfig, version: str) -> ProductionCheck:
    """After the promotion: production serves the new version at the accept length it was promoted on, or rolls back."""
    served = serve_production.fn(config, version, "promoted")
    if served.warning:
        raise GateRejected(Decision(False, [Reason("production-check", served.warning)]))
    return served


@task(name="record-rejection", cache_policy=NO_CACHE)
def record_rejection(config: PipelineConfig, version: str | None, rejection: GateRejected, candidate: Candidate,
                     production: str | None) -> None:
    """History records the rejection with the candidate's measurement. Production must still be what it was
    before the run: a rollback hook that failed is an error here, not a line in a log."""
    registry = open_registry(config.registry, log=log_to_run())
    registry.require_production(production, f"after rejecting {version}")
    measured = {k: candidate.served.get(k) for k in ("accept_length", "accept_rate", "lost_requests")}
    registry.record("rejected", version, [f"{r.rule}: {r.message}" for r in rejection.decision.reasons],
                    by="pipeline", run=flow_run_id(), extra={"candidate": measured})


@task(name="prune-runs", cache_policy=NO_CACHE)
def prune_old_runs(config: PipelineConfig) -> list[dict]:
    """Once production serves the promoted version: remove old retrain run directories (run.keep_runs); return
    what was removed."""
    log = log_to_run()
    return prune_after_promotion(config.run, config.registry, open_registry(config.registry, log=log), log)


@task(name="report-decision", cache_policy=NO_CACHE)
def report_decision(config: PipelineConfig, version: str | None, decision: Decision, before: str | None,
                    production: ProductionCheck, removed_runs: list[dict] | None = None) -> None:
    """The decision artifact and event. `removed_runs`: what the retention removed (None: it did not run)."""
    registry = open_registry(config.registry, log=log_to_run())
    outcome = "promoted" if decision.promote else "rolled back"
    text = decision_report(outcome, version, [vars(r) for r in decision.reasons], decision.diagnosis,
                           registry.location, before, registry.production_version(), production.measured,
                           production.warning, removed_runs, config.run.keep_runs, decision.notes,
                           decision.measured)
    create_markdown_artifact(key="decision", markdown=text, description=f"{outcome}: {decision.summary()}")
    emit_event(event=f"eagle3.draft.{'promoted' if decision.promote else 'rolled-back'}",
               resource={"prefect.resource.id": f"eagle3.draft.{version}", "prefect.resource.name": str(version)},
               payload={"version": version, "production": registry.production_version(),
                        "reasons": [f"{r.rule}: {r.message}" for r in decision.reasons], "notes": decision.notes})


@task(name="remeasure-production", cache_policy=NO_CACHE)
def remeasure(config: PipelineConfig) -> ProductionCheck:
    """The benchmark deployment: production measured again (managed: restarted and measured; external: measured
    where it serves) and compared with its recorded numbers."""
    log = log_to_run()
    registry = open_registry(config.registry, log=log)
    production = Production(config, registry, log)
    version = registry.production_version()
    return production.checked(version, production.remeasure(version))
