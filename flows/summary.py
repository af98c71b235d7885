"""The end-of-run table `eagle3 run` prints: stage times, accept lengths, the decision, where the artifacts are."""

from __future__ import annotations

from pathlib import Path

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterId
from prefect.client.schemas.sorting import ArtifactSort, TaskRunSort
from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL

from eagle3.config import PipelineConfig
from eagle3.resolve import derived
from eagle3.deployment.contenders import contenders_text
from eagle3.fsutil import read_json
from eagle3.registry.registry import open_registry, version_run_dir
from eagle3.report import suites_text
from eagle3.stages.table import record_path


def stage_rows(flow_run_id) -> list[tuple[str, str, float]]:
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                                     sort=TaskRunSort.EXPECTED_START_TIME_ASC)
    return [(run.name.rsplit("-", 1)[0], run.state_name or "",
             (run.end_time - run.start_time).total_seconds() if run.start_time and run.end_time else 0.0) for run in runs]


def artifact_keys(flow_run_id) -> list[str]:
    """The keys of the artifacts this flow run made, oldest first (a stage the cache skipped made none)."""
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])),
            sort=ArtifactSort.CREATED_DESC)
    return list(dict.fromkeys(artifact.key for artifact in reversed(artifacts) if artifact.key))


def run_dir_of(flow_run_id, config: PipelineConfig, mode: str) -> Path | None:
    """The run's own directory: run.dir, except for a retrain, which made a fresh one under it; the version it
    published names that one (the registry's history keeps each decision's flow run). None for a retrain that
    published nothing."""
    if mode != "retrain":
        return config.run.dir
    registry = open_registry(config.registry, log=lambda line: None)
    versions = [e["version"] for e in registry.history() if e.get("run") == str(flow_run_id) and e.get("version")]
    return Path(version_run_dir(registry.manifest(versions[-1]))) if versions else None


def read_record(run_dir: Path, config: PipelineConfig, record: str) -> dict:
    path = record_path(derived(config, {"run.dir": run_dir}), record)
    return read_json(path, "") if path.is_file() else {}


def bench_records(run_dir: Path | None, config: PipelineConfig) -> tuple[dict, dict, dict, dict]:
    """The run's contenders.json and the chosen draft's simulated.json, served.json and suites.json ({} for each one
    not written)."""
    if run_dir is None:
        return {}, {}, {}, {}
    contenders = read_record(run_dir, config, "contenders")
    chosen = next((Path(row["run_dir"]) for row in contenders.get("drafts", []) if row["label"] == contenders["chosen"]),
                  run_dir)
    return contenders, *(read_record(chosen, config, record) for record in ("simulated", "served", "suites"))


def ui_url() -> str:
    return PREFECT_UI_URL.value() or PREFECT_API_URL.value().removesuffix("/").removesuffix("/api")


def decision(state) -> str:
    if state.name == "RolledBack":
        return f"rolled back - {state.message}"
    if state.is_completed():
        result = state.result()
        return f"promoted {result}" if isinstance(result, str) else "production re-measured"
    return f"{state.name} - {state.message}"


def summary(state, config: PipelineConfig, mode: str, private_api: bool) -> str:
    """`private_api`: the run's own temporary API (flows/api.py), which serves no UI and stops with the run: the
    artifacts are then named by where they stay, the Prefect database, not by a link that is dead once the run ends."""
    flow_run_id = state.state_details.flow_run_id
    lines = ["", f"{'stage':24s} {'state':10s} {'seconds':>8s}"]
    rows = stage_rows(flow_run_id)
    lines += [f"{name:24s} {state_name:10s} {seconds:8.1f}" for name, state_name, seconds in rows]
    lines.append(f"{'total (task work)':24s} {'':10s} {sum(r[2] for r in rows):8.1f}")
    run_dir = run_dir_of(flow_run_id, config, mode)
    contenders, simulated, served, suites = bench_records(run_dir, config)
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    lines.append("")
    if contenders:
        lines += contenders_text(contenders) + suites_text(contenders["columns"]) + [""]
    lines += [f"accept length: simulated {fmt(simulated.get('accept_length'))}, served "
              f"{fmt(served.get('accept_length'))}", *suites_text(suites.get("columns") or []),
              f"artifacts ({', '.join(artifact_keys(flow_run_id)) or 'none'}) of flow run {flow_run_id}: "
              + (f"{ui_url()}/v2/runs/flow-run/{flow_run_id}?tab=Artifacts" if not private_api else
                 f"kept in the Prefect database under PREFECT_HOME; run `prefect server start` and open "
                 f"http://127.0.0.1:4200/v2/runs/flow-run/{flow_run_id}?tab=Artifacts"),
              f"outputs: {run_dir or f'a retrain directory under {config.run.dir}'}",
              f"decision: {decision(state)}"]  # last: what a reader of the run's end looks for
    return "\n".join(lines)
