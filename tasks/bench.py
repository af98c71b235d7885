"""Acceptance: offline (simulated) and served (the candidate on a live server), reported side by side."""

from __future__ import annotations

from dataclasses import replace

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from eagle3.config import PipelineConfig
from eagle3.deployment.contenders import Contender, contenders_record, contenders_text, pick, write_contenders
from eagle3.deployment.promotion import Candidate, gate_decision, measure_candidate
from eagle3.deployment.suites import acceptance_columns, production_on_these_requests, suite_columns, write_suites
from eagle3.deployment.sweep import choose_serving
from eagle3.fsutil import read_json
from eagle3.registry.registry import open_registry
from eagle3.serving.base import launch_spec
from eagle3.report import acceptance_report, contenders_report, suites_report, suites_text, sweep_report
from eagle3.stages.run import StageOutput
from eagle3.stages.table import record_path
from tasks.common import log_to_run


@task(name="measure-candidate", cache_policy=NO_CACHE)
def measure_served(config: PipelineConfig, exported: StageOutput, simulated: StageOutput,
                   earlier: Candidate | None = None) -> Candidate:
    """`earlier`: another draft of the run on the same requests, whose no-draft baseline and production measurement
    are taken."""
    served = measure_candidate(launch_spec(config), config.benchmark, config.data, config.run, config.registry,
                               exported.path, record_path(config, "served"), log=log_to_run(),
                               baseline=earlier.served.get("baseline") if earlier else None,
                               production=earlier.served.get("production_on_run_prompts") if earlier else None)
    candidate = Candidate(exported.path, exported.fingerprint, read_json(simulated.path, "the simulated record"), served)
    columns = acceptance_columns(config.serving, candidate.simulated, served)
    create_markdown_artifact(key="acceptance", markdown=acceptance_report(candidate.simulated, served, columns),
                             description="simulated vs served accept length per suite, histogram, per request, speedup")
    return candidate


@task(name="sweep", cache_policy=NO_CACHE)
def sweep_serving(config: PipelineConfig, candidate: Candidate, production: str | None,
                  earlier: Candidate | None = None) -> Candidate:
    """The candidate with the serving shape production gets (eagle3.deployment.sweep.choose_serving); the `sweep`
    artifact when it swept. `earlier`: another draft of the run, whose sweep's no-draft server is taken."""
    log = log_to_run()
    registry = open_registry(config.registry, log=log)
    # its shape not chosen yet: acceptance alone
    acceptance = gate_decision(config.benchmark, config.gate, config.run, registry, production, candidate)
    result = choose_serving(config, candidate.export, candidate.served, acceptance, record_path(config, "sweep"), log,
                            earlier.sweep_baselines if earlier else None)
    if result["points"] is not None:
        chosen = result["chosen"]
        create_markdown_artifact(key="sweep", markdown=sweep_report(result),
                                 description=f"chosen: {chosen['label']}, {chosen['speedup']:.2f}x the no-draft server")
    manifest = registry.manifest(production) if production else None
    columns = suite_columns(config.serving, candidate.simulated, candidate.served, result,
                            production_on_these_requests(candidate.served, manifest, production))
    log(f"suites table: {write_suites(config.benchmark, columns, record_path(config, 'suites'))}")
    for line in suites_text(columns):
        log(line)
    create_markdown_artifact(key="suites", markdown=suites_report(columns),
                             description="accept length per suite and drafting shape: simulated, served, sweep, "
                             "production")
    return replace(candidate, chosen=result["chosen"], sweep_baselines=result.get("baselines"))


@task(name="choose-draft", cache_policy=NO_CACHE)
def choose_draft(config: PipelineConfig, drafts: list[Contender], production: str | None) -> Contender:
    """The draft the gate judges, of those the run trained (eagle3.deployment.contenders.pick); with contenders, the
    `contenders` artifact and record show them side by side."""
    log = log_to_run()
    if len(drafts) == 1:
        write_contenders(None, record_path(config, "contenders"))
        return drafts[0]
    registry = open_registry(config.registry, log=log)
    decisions = [gate_decision(draft.config.benchmark, draft.config.gate, draft.config.run, registry, production,
                               draft.candidate) for draft in drafts]
    chosen = pick(drafts, decisions)
    record = contenders_record(drafts, decisions, chosen)
    log(f"contenders: {write_contenders(record, record_path(config, 'contenders'))}")
    for line in contenders_text(record) + suites_text(record["columns"]):
        log(line)
    create_markdown_artifact(key="contenders", markdown=contenders_report(record),
                             description=f"drafts side by side: production gets {record['chosen']}")
    return drafts[chosen]
