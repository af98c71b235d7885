"""Deployment steps between the export and the decision: measure a draft on a live server the way production
will serve it, turn the measurements into the gate's inputs, and describe a candidate version for the registry.

On the GPU node one model fits at a time (docs/gpu-node.md): the no-draft baseline server and the candidate server run
one after the other on one node, each stopped (and the GPUs' memory awaited) before the next starts; with
serving.nodes another node measures production beside them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

from eagle3.algorithms import algorithm
from eagle3.bench.client import BenchmarkError, SlicedPrompt, run_benchmark, suite_digests, suite_lines
from eagle3.bench.counting import pooled
from eagle3.bench.diagnose import diagnose
from eagle3.config import PipelineConfig
from eagle3.config.data import DataSection
from eagle3.config.deployment import GateSection, RegistrySection, TelemetrySection
from eagle3.config.run import RunSection, TargetSection
from eagle3.config.serving import BenchmarkSection, ServingSection
from eagle3.config.training import TrainingSection
from eagle3.data.capture import dataset_dir
from eagle3.data.continuations import benchmark_requests
from eagle3.registry.samples import prune_samples
from eagle3.data.prompts import load_prompts
from eagle3.data.regenerate import regen_dir, sent_ids
from eagle3.runtime.targets import load_tokenizer
from eagle3.errors import UnreadableInput
from eagle3.records.manifest import code_version, read_manifest
from eagle3.fsutil import atomic_write_bytes, atomic_write_json, sha256_file
from eagle3.registry.gate import Decision, Metrics, SuiteFigures, suite_figures, throughput_text
from eagle3.registry.registry import (decide_against_production, open_registry, registry_location, version_algorithm,
                                      version_run_dir)
from eagle3.runs import prune_runs, retrain_dir, runs_base
from eagle3.serve.launch import launch_and_validate
from eagle3.serve.nodes import in_lanes, measuring_specs
from eagle3.serving import serving_engine
from eagle3.serving.base import LaunchSpec, ServingEngine
from eagle3.train.trainer import best_draft

Log = Callable[[str], None]
PROMPTS_LAYOUT, PROMPTS_FILE = "benchmark", "prompts.jsonl"  # a version's prompt set, published beside its layouts



@dataclass(frozen=True)
class Candidate:
    """The draft a run made, as the gate judges it and its registry version records it: the served export and its
    fingerprint, the simulate stage's record, the candidate's served record, and the serving shape chosen for it
    (the sweep's, or serving's own as served; None until chosen)."""
    export: Path
    fingerprint: str
    simulated: dict
    served: dict
    chosen: dict | None = None
    sweep_baselines: dict | None = None  # the sweep's no-draft servers by node ({"levels", "wall_s"}), for another draft

def benchmark_prompts_file(benchmark: BenchmarkSection, run: RunSection) -> Path:
    """The run's benchmark requests (every configured suite's, as the data stage made them: ids, suite, slice) as a
    file under run.dir/bench/benchmark/: published with the version, so production is re-measured on the very
    requests it was measured on."""
    path = run.stage_dir("bench") / PROMPTS_LAYOUT / PROMPTS_FILE
    suites = {suite.name for suite in benchmark.suites}
    rows = [row for row in benchmark_requests(run) if row["suite"] in suites]
    atomic_write_bytes(path, "".join(json.dumps({"id": r["id"], "suite": r["suite"], "slice": r["slice"],
                                                 "input_ids": r["prompt_ids"]}) + "\n" for r in rows).encode())
    return path


def prompt_ids_in(data: DataSection, target: TargetSection, path: Path) -> list[SlicedPrompt]:
    """A prompt-set file's requests as the target is sent them, each naming its suite and slice: the ids as they are
    (a run's benchmark requests), or for a version published before suites its prompts through the chat template
    (except a traffic prompt that was rendered already)."""
    requests = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    if requests and all("input_ids" in r for r in requests):
        return [SlicedPrompt(r["input_ids"], r["slice"], r["suite"]) for r in requests]
    prompt_set = load_prompts(str(path))
    if prompt_set.malformed or not prompt_set.prompts:
        number, why = prompt_set.malformed[0] if prompt_set.malformed else (0, "no prompt")
        raise UnreadableInput(f"{path}:{number}: {why}; write the prompt set again (eagle3 data regenerate)")
    tokenizer = load_tokenizer(target)
    return [SlicedPrompt(sent_ids(tokenizer, p, data.thinking), p.slice) for p in prompt_set.prompts]


def run_prompt_ids(benchmark: BenchmarkSection, data: DataSection, run: RunSection,
                   target: TargetSection) -> list[SlicedPrompt]:
    """The ids of the run's benchmark requests, each with its suite and slice."""
    return prompt_ids_in(data, target, benchmark_prompts_file(benchmark, run))


def label_suites(benchmark: BenchmarkSection, result: dict, prompts: list[SlicedPrompt]) -> None:
    """Each suite of a benchmark `result` gets its requests' sha256 (the gate compares figures on equal ones only) and
    whether the config marks it informational."""
    informational = {suite.name for suite in benchmark.suites if suite.informational}
    for name, digest in suite_digests(prompts).items():
        result["suites"][name].update(sha256=digest, informational=name in informational)


def benchmark_on(benchmark: BenchmarkSection, engine: ServingEngine, url: str, prompts: list[list[int]], log: Log,
                 concurrency: int | None = None, temperature: float = 0.0) -> dict:
    """The benchmark of `prompts` on `engine`'s server at `url` (at the production concurrency unless given; greedy
    unless a temperature is given). Requests lost after their retries give a result with `lost_requests` (the gate
    rejects it) instead of numbers."""
    try:
        result = run_benchmark(url, prompts, benchmark.max_new_tokens, concurrency or benchmark.production_concurrency,
                               benchmark.request_timeout_s, benchmark.retries, log=log, temperature=temperature,
                               engine=engine)
        label_suites(benchmark, result, prompts)
        for line in suite_lines(result["suites"]):
            log(f"{url}:{line}")
        return result | {"lost_requests": 0}
    except BenchmarkError as err:
        if not err.lost:
            raise
        log(f"{url}: {err}")
        return {"url": url, "accept_length": None, "accept_rate": None, "lost_requests": len(err.lost), "error": str(err)}


def measure_server(spec: LaunchSpec, benchmark: BenchmarkSection, draft: Path | None, prompts: list[list[int]],
                   log: Log, role: str, keep_running: bool = False, unit: str | None = None, temperature: float = 0.0,
                   telemetry: TelemetrySection | None = None) -> dict:
    """Launch `spec`'s server of its target (in the systemd scope `unit`, if given, and validate the draft for the live
    release), benchmark `prompts` at the production concurrency, stop - or, with `keep_running`, leave the server up
    and return its process group as `pgid`."""
    server = launch_and_validate(spec, spec.target.path, draft, log, role=role, unit=unit, telemetry=telemetry,
                                 outlives_run=keep_running)
    try:
        result = benchmark_on(benchmark, server.engine, server.url, prompts, log, temperature=temperature) | {
            "server_version": server.release}
    except BaseException:
        server.stop()
        raise
    if keep_running:
        result["pgid"] = server.process.pid
    else:
        server.stop()
    return result


def measure_candidate(spec: LaunchSpec, benchmark: BenchmarkSection, data: DataSection, run: RunSection,
                      registry_section: RegistrySection | None, draft: Path, out: Path, log: Log = print,
                      baseline: dict | None = None, production: dict | None = None) -> dict:
    """The candidate's served result (written to `out`), with a no-draft baseline's throughput and the
    speedup when `benchmark.baseline` is set. `baseline` and `production`: the no-draft server and production's draft
    measured on these requests already (by another draft of the run: its result's `baseline` and
    `production_on_run_prompts`), taken instead of a server start each. The no-draft server and the candidate run on
    the first node (serving.nodes): the speedup divides by a server of the candidate's node; production's
    re-measurement runs on the second beside them, or after them on one node."""
    prompts_file = benchmark_prompts_file(benchmark, run)
    prompts = prompt_ids_in(data, spec.target, prompts_file)
    nodes = measuring_specs(spec)
    lane = [partial(measure_baseline, nodes[0], benchmark, prompts, log, baseline),
            partial(measure_server, nodes[0], benchmark, draft, prompts, log, role="candidate")]
    lanes = [lane]
    if production is not None:
        log(f"production on the run's prompts: accept length {production['accept_length']}, as measured for the run's "
            "first draft on these requests")
    elif (stale := production_to_remeasure(run, registry_section, prompts_file, log)) is not None:
        second = nodes[1] if len(nodes) > 1 else None
        on_production = partial(measure_production, second or nodes[0], benchmark, *stale, prompts, log)
        lanes = [lane, [on_production]] if second else [[*lane, on_production]]
    measured = [result for done in in_lanes(lanes) for result in done]
    baseline, result = measured[:2]
    production = production or (measured[2] if len(measured) > 2 else None)
    if baseline is not None and not result["lost_requests"]:
        result.update(baseline=baseline, speedup=result["output_tokens_per_s"] / baseline["output_tokens_per_s"])
    if production is not None:
        result["production_on_run_prompts"] = production
    atomic_write_json(out, result)
    return result


def measure_baseline(spec: LaunchSpec, benchmark: BenchmarkSection, prompts: list[SlicedPrompt], log: Log,
                     earlier: dict | None) -> dict | None:
    """The no-draft server's throughput on `prompts` (`earlier`: as another draft of the run measured it), or None
    when benchmark.baseline is off or it lost requests."""
    if earlier is not None:
        log(f"baseline (no draft): {earlier['output_tokens_per_s']:.1f} output tokens/s, as measured for the run's "
            "first draft on these requests")
        return earlier
    if not benchmark.baseline:
        return None
    measured = measure_server(spec, benchmark, None, prompts, log, role="baseline (no draft)")
    return None if measured["lost_requests"] else {k: measured[k] for k in ("url", "wall_s", "output_tokens_per_s",
                                                                            "latency_s")}


def production_to_remeasure(run: RunSection, registry_section: RegistrySection | None, prompts_file: Path,
                            log: Log) -> tuple[str, Path] | None:
    """Production's version and its draft (fetched) when its recorded figures come from other prompts than this run's
    (a retrain whose prompts include new traffic): the gate then compares the candidate with production on the same
    prompts. None when production was measured on these very prompts, or there is none."""
    if registry_section is None:
        return None
    registry = open_registry(registry_section, log)
    version = registry.production_version()
    if version is None:
        return None
    recorded = (registry.manifest(version).get("benchmark") or {}).get("sha256")
    if recorded == sha256_file(prompts_file):
        return None
    log(f"production {version} was measured on other prompts than this run's: measuring it on this run's, so the gate "
        "compares like with like")
    return version, registry.fetch(version, "sglang", run.stage_dir("bench") / "production-draft" / version,
                                   overwrite=True)


def measure_production(spec: LaunchSpec, benchmark: BenchmarkSection, version: str, draft: Path,
                       prompts: list[SlicedPrompt], log: Log) -> dict:
    """Production's draft (`version`, fetched to `draft`) measured on this run's benchmark prompts."""
    result = measure_server(spec, benchmark, draft, prompts, log, role=f"production {version} on this run's prompts")
    return {"version": version, **{k: result.get(k) for k in ("accept_length", "accept_rate", "lost_requests", "suites",
                                                              "output_tokens_per_s")}}


def gating(benchmark: BenchmarkSection, measured: dict) -> dict:
    """Accept length and rate over the requests of the gating suites (an informational suite never moves the gate);
    the measurement's own figures when it has no suites."""
    names = benchmark.gating_suites
    suites = [figures for name, figures in (measured.get("suites") or {}).items() if name in names]
    return pooled(suites, measured.get("draft_tokens_per_step")) if suites else measured


def candidate_metrics(benchmark: BenchmarkSection, served: dict, simulated: dict, data_quality: dict,
                      chosen: dict) -> Metrics:
    """The gate's inputs: acceptance from the candidate's greedy measurement and its simulation, over the gating suites
    and per suite (a gating suite that made no request counts as 0 verify steps), throughput from the serving shape
    production would get (`chosen`: the sweep's choice, or the serving section's shape)."""
    head = gating(benchmark, served)
    measured = suite_figures(served.get("suites"))
    missing = [SuiteFigures(name, None, 0, "") for name in benchmark.gating_suites
               if name not in {s.name for s in measured}]
    return Metrics(accept_length=head.get("accept_length"), accept_rate=head.get("accept_rate"),
                   simulated_accept_length=gating(benchmark, simulated).get("accept_length"),
                   lost_requests=served.get("lost_requests", 0), data_problems=tuple(data_quality["problems"]),
                   speedup=chosen.get("speedup"), throughput=throughput_text(chosen), suites=measured + tuple(missing))


def gate_decision(benchmark: BenchmarkSection, gate: GateSection, run: RunSection, registry, production: str | None,
                  candidate: Candidate) -> Decision:
    """The gate on the candidate against the production version's recorded metrics (re-measured on this run's
    requests, when they differ from those it was measured on and that measurement is whole). With its shape not
    chosen yet (`chosen` None: no speedup measured) it judges acceptance alone."""
    metrics = candidate_metrics(benchmark, candidate.served, candidate.simulated, data_quality_of(run),
                                candidate.chosen or {})
    here = candidate.served.get("production_on_run_prompts") or {}
    whole = here.get("version") == production and not here.get("lost_requests") and here.get("accept_length")
    return decide_against_production(registry, metrics, production, gate, here if whole else None)


def data_quality_of(run: RunSection) -> dict:
    """The quality report of the run's regenerated data (its manifest's `quality`: figures, problems, passed)."""
    return read_manifest(regen_dir(run))["quality"]


def diagnosis_of(serving: ServingSection, target: TargetSection, run: RunSection, training: TrainingSection,
                 draft: Path, served: dict, simulated_accept_length: float | None) -> dict:
    """The train-serve checklist (which contract the served draft breaks), for the decision's record."""
    longest = max(((row["prompt_tokens"] or 0) + row["completion_tokens"] for row in served.get("prompts", [])),
                  default=None)
    engine, reported = serving_engine(serving.engine), served.get("server_version")
    release = engine.served_release(reported, serving.release) if reported else serving.release
    return diagnose(draft, release, Path(target.path), dataset_dir(run, training),
                    simulated_accept_length, served.get("accept_length"), longest,
                    trust_remote_code=target.trust_remote_code, engine=engine).to_dict()


def registry_metrics(served: dict, simulated_accept_length: float | None, chosen: dict) -> dict:
    """The metrics block of a registry manifest (keys read back by eagle3.registry.registry.metrics_of): `served` -
    the candidate's greedy measurement in the serving section's shape (what the gate compares across versions);
    `production` - the shape production serves, as measured when chosen (what production is re-measured against)."""
    keys = ("accept_length", "accept_rate", "histogram", "output_tokens_per_s", "lost_requests", "server_version",
            "speedup", "suites")
    production = ("accept_length", "output_tokens_per_s", "baseline_output_tokens_per_s", "speedup", "concurrency",
                  "temperature")
    return {"served": {k: served.get(k) for k in keys}, "simulated": {"accept_length": simulated_accept_length},
            "production": {k: chosen.get(k) for k in production}, "engine_release": served.get("server_version")}


def retrain_overrides(run: RunSection, algorithm_name: str, registry, log: Log = print) -> list[str]:
    """A retrain is a fresh run (new run directory: the prompt source is read anew) that fine-tunes the production
    version (training.init_from, resolved by the train stage as any version is) when the run's algorithm warm starts
    from production's kind (`DraftAlgorithm.warm_start`; otherwise it trains from scratch, as a contender of another
    kind does: eagle3.resolve.contender_configs)."""
    run_dir = retrain_dir(run.dir)
    overrides = [f"run.dir={run_dir}"]
    production = registry.production_version()
    if production is None:
        log("retrain: the registry has no production draft: training from scratch")
        return overrides
    kind = version_algorithm(registry.manifest(production))
    if kind not in algorithm(algorithm_name).warm_start:
        log(f"retrain: production {production} is a {kind} draft, which draft.algorithm {algorithm_name} does not warm "
            f"start from: training from scratch in {run_dir}")
        return overrides
    log(f"retrain: warm start from production version {production} (a {kind} draft) in {run_dir}")
    return overrides + [f"training.init_from={json.dumps(production)}"]  # quoted: an id like 2024 stays a string


def prune_after_promotion(run: RunSection, section: RegistrySection, registry, log: Log = print) -> list[dict]:
    """Retention, once production serves the promoted version: remove this registry's retrain runs beyond the
    newest run.keep_runs, never the one that built production (its manifest names it) nor this run. Returns the
    removed runs ({"path", "bytes"})."""
    protected = [run.dir]
    production = registry.production_version()
    if production is not None:
        built = version_run_dir(registry.manifest(production))
        if built is None:
            log(f"retention: the manifest of production {production} names no run directory: none removed, as the "
                "one that built it cannot be told apart")
            return []
        protected.append(Path(built))
    removed = prune_runs(runs_base(run.dir), run.keep_runs, registry_location(section), protected, log)
    prune_samples(registry.store, [str(Path(entry["path"]).resolve()) for entry in removed], log)
    return removed


def version_id(run: RunSection, export_fingerprint: str) -> str:
    """<run name>-<export hash>: one version per export, so a re-run of the same export re-verifies it instead of
    publishing a copy."""
    return f"{run.name}-{export_fingerprint[:16]}"


def version_fields(recorded: dict, benchmark: BenchmarkSection, run: RunSection, fingerprints: dict[str, str],
                   served: dict, simulated: float | None, chosen: dict, parent: str | None,
                   flow_run: str | None = None) -> dict:
    """What a version's manifest says of where it came from (`recorded`: the config as config_fields records it) and
    what it measured."""
    return {
        **recorded,
        "inputs": fingerprints,  # stage -> content hash of its output (eagle3.stages.stage_fingerprint)
        "data_quality": data_quality_of(run),
        **measured_fields(benchmark, run, served, simulated, chosen),
        # the draft it was fine-tuned from, as its training recorded it (kind, where, sha256), or None
        "lineage": {"parent": parent, "init_from": read_manifest(best_draft(run)).get("init_from"),
                    "flow_run": flow_run},
    }


def config_fields(config: PipelineConfig) -> dict:
    """What a version's manifest says of the config and the code that made it."""
    return {"config": config.model_dump(mode="json"),
            "config_sha256": hashlib.sha256(config.model_dump_json().encode()).hexdigest(),
            "code_version": code_version()}


def measured_fields(benchmark: BenchmarkSection, run: RunSection, served: dict, simulated: float | None,
                    chosen: dict) -> dict:
    """What a version's manifest says of its measurement: the prompt set (published with it), the shape production
    serves it with and is re-measured in (the chosen shape, on the first num_prompts requests of each suite), the figures."""
    return {
        "benchmark": prompt_set_fields(benchmark, run),
        "serving": {**chosen["shape"], **{k: chosen[k] for k in ("temperature", "concurrency", "num_prompts")}},
        "metrics": registry_metrics(served, simulated, chosen),
    }


def prompt_set_fields(benchmark: BenchmarkSection, run: RunSection) -> dict:
    """What a version records of the prompt set it was measured on (the file is published with it)."""
    path = run.stage_dir("bench") / PROMPTS_LAYOUT / PROMPTS_FILE
    return {"file": f"{PROMPTS_LAYOUT}/{PROMPTS_FILE}", "sha256": sha256_file(path),
            "prompts": sum(1 for line in path.read_text().splitlines() if line.strip()),
            "max_new_tokens": benchmark.max_new_tokens}


def version_dirs(run: RunSection, exported: dict[str, str]) -> dict[str, Path]:
    """What a version publishes: each exported layout's directory, and the prompt set it was measured on."""
    return {layout: Path(path) for layout, path in exported.items()} | {
        PROMPTS_LAYOUT: run.stage_dir("bench") / PROMPTS_LAYOUT}
