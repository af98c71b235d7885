"""The `eagle3` flow on the micro target under one session-scoped Prefect test server: a full run promotes and
its artifacts read back; a broken export (absolute d2t) ends RolledBack with production unchanged and re-measured;
validation problems fail the run before any server; a re-run skips finished stages through the cache; two runs
for one registry never overlap; a promotion removes old retrain runs. And the production endpoint, managed and
external.

Every test holds in any order: a run whose outcome depends on what ran before it (the cache, the production
pointer) is made by a module fixture that runs its flows one after the other and keeps what the tests read, taken
right after each run; a test that runs a flow itself compares with the registry as it found it."""

import json
import logging
import shutil
import socket
import threading
import time
from typing import NamedTuple

import httpx
import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, temporary_settings
from prefect.states import State

from eagle3.resolve import load_config
from eagle3.procs import group_alive
from eagle3.deployment.production import Production
from eagle3.algorithms.eagle3.contract import DRAFT_ARCHITECTURES
from eagle3.records.manifest import read_manifest
from eagle3.target.info import read_target_info
from eagle3.registry.registry import open_registry
from eagle3.runs import retrain_runs
from eagle3.serve.inprocess import serve_in_thread
from eagle3.stages.keys import IN_PROGRESS, TOKEN_FILE, marker
from eagle3.stages.run import StageOutput
from eagle3.stages.table import STAGES, output_of
from flows.eagle3 import eagle3
from flows.summary import summary
from tasks.stages import stage_task
from family_targets import FLOW_CONFIGS
from fixtures_tiny import micro_target_of
from helpers import (
    BASELINE, TINY, TOY, ProductionEdge, make_run, micro_run_overrides, monitor_for, monitor_overrides, traffic,
)
from kimi_target import VOCAB_SIZE as KIMI_VOCAB

CONFIG = str(TINY)
BROKEN = ["export.fault=absolute-d2t", "export.waive=[d2t-absolute]"]


SWEEP = "sweep.enabled=true"  # no stage's cache key holds it: the runs after the first take its stages from the cache


class Outcome(NamedTuple):
    """A flow run's final state, and the registry as it stood before and right after it (later runs move it on)."""

    state: State
    before: str | None  # the production version
    after: str | None
    events: list[str]  # the registry's history, oldest first


def run_flow(overrides: list[str], *extra: str, config: str = CONFIG) -> Outcome:
    registry = open_registry(load_config(config, overrides).registry)
    before = registry.production_version()
    state = eagle3(config, [*overrides, *extra], return_state=True)
    return Outcome(state, before, registry.production_version(), [e["event"] for e in registry.history()])


class MicroFlow(NamedTuple):
    overrides: list[str]
    first: Outcome  # the first run: every stage made, the draft promoted
    table: dict  # its bench/suites.json (the swept shapes' columns too), read before the re-run rewrites it
    rerun: Outcome  # at once the same inputs but a speedup bar out of reach: every stage from the cache, rolled back


@pytest.fixture(scope="module")
def micro_flow(prefect_api, tmp_path_factory, micro_target):
    """The first run, and a re-run before any test can touch the run directory. The re-run changes only a gate
    field, which no stage's cache key holds: it shows the skipped stages and the throughput rule in one run."""
    run_dir = tmp_path_factory.mktemp("micro-flow")
    # no no-draft server beside the candidate (~9 s a run): the first run's sweep measures one, the re-run asks for it
    overrides = micro_run_overrides(run_dir, micro_target) + ["benchmark.baseline=false"]
    for day in range(4):  # earlier retrains of this registry: the promotion keeps the newest run.keep_runs (3)
        make_run(run_dir, day, (run_dir / "registry").resolve())
    first = run_flow(overrides, SWEEP)
    table = json.loads((load_config(CONFIG, overrides).stage_dir("bench") / "suites.json").read_text())
    return MicroFlow(overrides, first, table, run_flow(overrides, "gate.min_speedup=50", "benchmark.baseline=true"))


class OverwrittenExport(NamedTuple):
    broken: Outcome  # absolute d2t, its checks waived: served, rejected by the gate
    refused: Outcome  # absolute d2t, checked: failed before any server
    again: Outcome  # the first run's inputs once more: the export made again, not taken from the cache


@pytest.fixture(scope="module")
def overwritten_export(micro_flow):
    """Two runs with other export inputs, each overwriting export/sglang, then the first run's inputs again."""
    overrides = micro_flow.overrides
    broken = run_flow(overrides, *BROKEN)
    refused = run_flow(overrides, "export.fault=absolute-d2t")
    return OverwrittenExport(broken, refused, run_flow(overrides))


def task_states(flow_run_id) -> dict[str, str]:
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {run.name.rsplit("-", 1)[0]: run.state_name for run in runs}


def artifacts(flow_run_id) -> dict[str, str]:
    with get_client(sync_client=True) as client:
        found = client.read_artifacts()
    return {a.key: a.data for a in found if a.flow_run_id == flow_run_id and a.key}


def test_a_full_micro_run_promotes_and_its_artifacts_read_back(micro_flow):
    state = micro_flow.first.state
    assert state.is_completed() and state.name == "Completed", state.message
    version = state.result()
    config = load_config(CONFIG, micro_flow.overrides)
    assert micro_flow.first.after == version
    found = artifacts(state.state_details.flow_run_id)
    assert {"data", "vocab", "training", "export-validation", "acceptance", "decision"} <= set(found)
    assert found["decision"].startswith("# Decision: promoted") and version in found["decision"]
    oldest = config.run.dir / "retrain-20240101T000000Z"
    assert "## Run directories removed (run.keep_runs 3)" in found["decision"] and str(oldest) in found["decision"]
    assert not oldest.exists() and len(retrain_runs(config.run.dir)) == 3
    assert "accept length" in found["acceptance"] and "coverage" in found["vocab"]
    # online: no hidden state under the run, and the data artifact says capture was skipped
    assert not (config.stage_dir("data") / "hidden").exists()
    assert "hidden-state capture skipped (training.features online)" in found["data"]
    assert "## Data quality: passed" in found["data"]
    # the micro target's tests waive two checks on purpose (test_data.micro_overrides): the decision says so
    assert "## Notes (checks waived on purpose" in found["decision"] and "empty-replies waived" in found["decision"]
    # the version keeps its data's quality report and the prompt set it was measured on
    manifest = open_registry(config.registry).manifest(version)
    assert manifest["data_quality"]["passed"] and manifest["benchmark"]["prompts"] == 8  # 4 held out, 4 MT-bench turns
    assert "benchmark/prompts.jsonl" in manifest["files"]
    # the sweep served (3, 1, 4) and (2, 2, 4); the faster one is recorded, production serves it, and the
    # decision names its speedup
    chosen = manifest["serving"]
    assert (chosen["num_steps"], chosen["eagle_topk"], chosen["num_draft_tokens"]) in {(3, 1, 4), (2, 2, 4)}
    assert chosen["concurrency"] == 2 and manifest["metrics"]["production"]["speedup"] > 0
    assert "# Serving sweep" in found["sweep"] and "data:image/svg+xml;base64," in found["sweep"]
    assert "data:image/svg+xml;base64," in found["training"]
    assert "median step time (s)" in found["training"] and "evaluation, total (s)" in found["training"]
    speedup = f"speedup {manifest['metrics']['production']['speedup']:.2f}x over the no-draft server"
    assert speedup in found["decision"]
    # `eagle3 run`'s summary of this run: the artifacts it made, and where to open them (a UI link on a Prefect server
    # the run did not start; the database and how to open it after a run on its own temporary API, which is gone)
    lines = summary(state, config, "full", private_api=False).splitlines()
    listed = next(line for line in lines if line.startswith("artifacts ("))
    assert set(listed.split("(")[1].split(")")[0].split(", ")) == set(found), listed
    run_id = state.state_details.flow_run_id
    assert listed.endswith(f"/v2/runs/flow-run/{run_id}?tab=Artifacts") and "127.0.0.1:4200" not in listed
    assert lines[-1] == f"decision: promoted {version}"
    lines = summary(state, config, "full", private_api=True).splitlines()
    listed = next(line for line in lines if line.startswith("artifacts ("))
    assert f"run `prefect server start` and open http://127.0.0.1:4200/v2/runs/flow-run/{run_id}" in listed


def test_every_suite_is_simulated_served_and_tabled_per_shape(micro_flow):
    """Suites as rows, shapes as columns: simulated = served on each suite in the serving shape, MT-bench's categories
    as its slices, both turns of each question counted; the table in bench/ and in the `suites` artifact."""
    state = micro_flow.first.state
    config = load_config(CONFIG, micro_flow.overrides)
    columns = {c["name"]: c for c in micro_flow.table["columns"]}
    simulated, served = columns["3/1/4 simulated"]["suites"], columns["3/1/4 served"]["suites"]
    assert list(served) == ["heldout", "mtbench"] and served["heldout"]["requests"] == 4
    assert served["mtbench"]["requests"] == 4 and set(served["mtbench"]["slices"]) == {"writing", "roleplay"}
    for suite in ("heldout", "mtbench"):
        assert served[suite]["verify_ct"] == simulated[suite]["verify_ct"] > 0
        assert served[suite]["accept_length"] == pytest.approx(simulated[suite]["accept_length"])
    assert "2/2/4 simulated" in columns and "2/2/4 served @ 2" in columns
    found = artifacts(state.state_details.flow_run_id)
    assert "# Acceptance per suite and drafting shape" in found["suites"] and "| mtbench |" in found["suites"]
    assert "data:image/svg+xml;base64," in found["suites"] and "## Per suite" in found["acceptance"]
    # the version keeps each suite's figures with its requests' sha256, which the next run's gate compares against
    recorded = open_registry(config.registry).manifest(micro_flow.first.after)["metrics"]["served"]["suites"]
    assert recorded["mtbench"]["sha256"] == served["mtbench"]["sha256"] and len(recorded["mtbench"]["sha256"]) == 64


def test_a_draft_below_the_speedup_bar_rolls_back_by_the_throughput_rule(micro_flow):
    state = micro_flow.rerun.state
    assert state.is_completed() and state.name == "RolledBack", state.message
    assert "throughput: speedup" in state.message and "is below gate.min_speedup 50.00" in state.message
    assert micro_flow.rerun.after == micro_flow.first.state.result()  # unchanged


def test_a_rerun_with_unchanged_inputs_skips_finished_stages(micro_flow):
    stages = task_states(micro_flow.rerun.state.state_details.flow_run_id)  # only a gate field changed
    for stage in STAGES:
        assert stages[stage] == "Cached", stages


def test_a_finished_run_started_again_without_prefects_results_makes_nothing_again(micro_flow, tmp_path, caplog):
    """As on a new worker machine, a reset Prefect database or expired results: Prefect's result store is empty, so
    it caches nothing; the markers in the run directory say the stages are done. Regeneration, marked unfinished
    (as by a crash after its last sample), runs again and rewrites its manifest at a later time with the same
    content: no key downstream changes, nothing is trained again and the export is the same version."""
    config = load_config(CONFIG, micro_flow.overrides)
    model = config.stage_dir("train") / "final" / "model.safetensors"
    trained, regen = model.stat(), output_of(config, "regenerate")
    made = read_manifest(regen)["created"]
    stages = tuple(STAGES)  # regenerate first
    markers = {stage: marker(config, stage).read_text() for stage in stages}
    marker(config, "regenerate").write_text(IN_PROGRESS + markers["regenerate"])
    with caplog.at_level(logging.INFO, "prefect.task_runs"), \
            temporary_settings({PREFECT_LOCAL_STORAGE_PATH: tmp_path / "empty-result-store"}):
        outcome = run_flow(micro_flow.overrides)
    logged = caplog.messages  # the stages' log lines
    state = outcome.state
    assert state.is_completed() and state.result() == micro_flow.first.state.result(), state.message
    assert outcome.after == state.result()
    states = task_states(state.state_details.flow_run_id)
    assert all(states[stage] == "Completed" for stage in stages), states  # not Cached: Prefect holds no result
    assert read_manifest(regen)["created"] != made and any("regenerate: resuming" in line for line in logged)
    for stage in stages[1:]:
        assert any(line.startswith(f"{stage}: ") and "kept, not made again" in line for line in logged), stage
    assert not [line for line in logged if "starting it afresh" in line]
    now = model.stat()
    assert (now.st_ino, now.st_mtime_ns) == (trained.st_ino, trained.st_mtime_ns)
    assert {stage: marker(config, stage).read_text() for stage in stages} == markers


def test_a_broken_export_rolls_back_and_production_keeps_serving(overwritten_export):
    broken = overwritten_export.broken
    state = broken.state
    assert state.is_completed() and state.name == "RolledBack", state.message
    assert "near-baseline" in state.message and "likely cause (train-serve checklist): d2t encoding" in state.message
    assert broken.after == broken.before  # unchanged
    assert broken.events[-1] == "rejected"
    decision = artifacts(state.state_details.flow_run_id)["decision"]
    assert "rolled back" in decision and "d2t encoding (offsets)" in decision  # the cause, named
    assert "PRODUCTION SHORTFALL" not in decision and "Production re-measured" in decision
    stages = task_states(state.state_details.flow_run_id)
    assert stages["train"] == "Cached" and stages["export"] == "Completed"  # only what the change touches re-ran


def test_an_output_overwritten_by_other_inputs_is_made_again_not_taken_from_the_cache(overwritten_export):
    state = overwritten_export.again.state  # after two runs that wrote export/sglang with a broken d2t
    stages = task_states(state.state_details.flow_run_id)
    assert stages["train"] == "Cached" and stages["export"] == "Completed" and stages["simulate"] == "Completed"
    # the same content again: the same version as production (the version is named after the export's content)
    assert state.name == "Completed", state.message


def test_two_runs_for_one_registry_do_not_overlap(micro_flow):
    overrides = micro_flow.overrides
    states = []
    runs = [threading.Thread(target=lambda: states.append(eagle3(CONFIG, overrides, "benchmark", return_state=True)))
            for _ in range(2)]
    for run in runs:
        run.start()
    for run in runs:
        run.join()
    assert all(s.is_completed() for s in states), [s.message for s in states]
    with get_client(sync_client=True) as client:
        spans = sorted((r.start_time, r.end_time) for s in states
                       for r in [client.read_flow_run(s.state_details.flow_run_id)])
        measured = [client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[s.state_details.flow_run_id])))
                    for s in states]
    windows = sorted((r.start_time, r.end_time) for runs_ in measured for r in runs_ if r.name.startswith("remeasure"))
    assert len(windows) == 2 and windows[0][1] <= windows[1][0], windows  # one after the other
    assert spans[0][0] < spans[1][1]


def test_validation_problems_fail_the_run_before_any_server_starts(overwritten_export):
    refused = overwritten_export.refused
    state = refused.state
    assert state.is_failed() and "d2t-absolute" in state.message and "no server was started" in state.message
    stages = task_states(state.state_details.flow_run_id)
    assert stages["export"] == "Failed" and "measure-candidate" not in stages
    assert stages["serve-production"] == "Completed"  # the failed run left production serving
    assert "NOT valid" in artifacts(state.state_details.flow_run_id)["export-validation"]
    assert refused.after == refused.before
    # the failed run overwrote export/sglang: the next run makes it again instead of taking the cached result
    again = overwritten_export.again.state
    assert task_states(again.state_details.flow_run_id)["export"] == "Completed" and again.is_completed()


def test_a_managed_production_server_outlives_the_run_until_released(micro_flow, tmp_path):
    overrides, first = micro_flow.overrides, micro_flow.first.state
    config = load_config(CONFIG, overrides + ["production.keep_serving=true", f"production.state_dir={tmp_path}"])
    lines = []
    production = Production(config, open_registry(config.registry), lines.append)
    measured = production.serve(first.result(), "test")
    recorded = production.recorded()
    try:
        assert recorded["version"] == first.result() and group_alive(recorded["pgid"])
        assert httpx.get(f"{production.url}/health", timeout=10).status_code == 200
        assert production.check(first.result(), measured, 0.05) is None  # measures what it was promoted on
        assert "PRODUCTION SHORTFALL" in production.check(first.result(), {"accept_length": 1.0}, 0.05)
    finally:
        production.release_node()
    assert not group_alive(recorded["pgid"]) and production.recorded() is None
    assert all(line.startswith(f"[production managed {production.url}]") for line in lines)


def test_a_failure_after_the_promotion_rolls_the_pointer_back(micro_flow):
    config = load_config(CONFIG, micro_flow.overrides)
    registry = open_registry(config.registry)
    before = registry.production_version()
    with socket.socket() as taken:  # the production server cannot bind its port: verify-production fails
        taken.bind((config.production.host, config.production.port))
        taken.listen()
        # another layout list: a new export (a new candidate version) of the same draft, so the gate passes
        state = eagle3(CONFIG, micro_flow.overrides + ["export.layouts=[sglang, speculators]"], return_state=True)
    assert state.is_failed(), state.message
    stages = task_states(state.state_details.flow_run_id)
    # Prefect marks the transaction's committed-then-undone tasks RolledBack
    assert (stages["gate"], stages["promote"], stages["verify-production"]) == ("RolledBack", "RolledBack", "Failed")
    events = [e["event"] for e in registry.history()][-2:]
    assert events == ["promoted", "rolled-back"]  # the promote task's rollback hook
    assert registry.production_version() == before


def test_data_that_fails_its_quality_check_fails_the_run_at_regenerate(micro_flow, tmp_path):
    # in a copy of the run's data: the failed regeneration marks data/regen unfinished, which would make every
    # later run in the shared directory regenerate and so train again
    run_dir = load_config(CONFIG, micro_flow.overrides).run.dir
    shutil.copytree(run_dir / "data", tmp_path / "data")
    shutil.copy(run_dir / TOKEN_FILE, tmp_path / TOKEN_FILE)  # the same cache keys as the shared directory
    overrides = micro_flow.overrides + [f"run.dir={tmp_path}"]
    registry = open_registry(load_config(CONFIG, overrides).registry)
    before = registry.production_version()
    # a bar the micro target's replies cannot meet: the samples written are kept (the check is a refinement), and
    # judged again
    state = eagle3(CONFIG, overrides + ["data.quality.max_top_token_share=0.01"], return_state=True)
    assert state.is_failed() and "data quality check failed" in state.message, state.message
    assert "of generated tokens are id" in state.message and "(threshold 1%)" in state.message
    stages = task_states(state.state_details.flow_run_id)
    assert stages["regenerate"] == "Failed" and "capture" not in stages and "publish-candidate" not in stages
    data = artifacts(state.state_details.flow_run_id)["data"]
    assert "## Data quality: **FAILED**" in data and "**failed** `repeated-token`" in data
    assert registry.production_version() == before


def test_a_kimi_kind_tied_target_goes_through_the_whole_flow_to_a_promotion(prefect_api, tmp_path_factory, kimi_target):
    """tiktoken.model + its own tokenization_kimi.py (tests/kimi_target.py), trusted: regenerate, capture, vocab,
    train, export, validate, serve and gate all load it (untrusted, config load refuses it: test_kimi.py). Its head is
    tied to its embedding and its files hold no lm_head tensor: the teacher, the simulator, the export checks and the
    reference server take the embedding as its head, so simulated and served count the same draft on the same target."""
    from safetensors import safe_open

    with safe_open(kimi_target / "model.safetensors", framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
    run_dir = tmp_path_factory.mktemp("kimi-flow")
    # a 1 M-parameter model decoding greedily loops in most replies (62 % measured): the check that measures it is
    # waived here, this test is about loading the target and its head (test_quality covers the check)
    overrides = micro_run_overrides(run_dir, kimi_target) + [f"target.vocab_size={KIMI_VOCAB}",
                                                             "target.trust_remote_code=true",
                                                             "data.quality.waive=[looping]",
                                                             # loading the target is the point: one suite
                                                             "benchmark.suites=[heldout]"]
    promoted_with_simulated_equal_to_served(overrides)


def promoted_with_simulated_equal_to_served(overrides: list[str], config: str = CONFIG) -> None:
    """Runs the flow: the draft is promoted, and served acceptance equals the simulated one (no no-draft server
    beside the candidate: the throughput rule is off, and the micro flow's tests measure the speedup)."""
    outcome = run_flow(overrides, "benchmark.baseline=false", config=config)
    state = outcome.state
    assert state.is_completed() and state.name == "Completed", state.message
    assert outcome.after == state.result() and outcome.events[-1] == "promoted"
    metrics = open_registry(load_config(config, overrides).registry).manifest(state.result())["metrics"]
    assert metrics["served"]["accept_length"] == pytest.approx(metrics["simulated"]["accept_length"])


@pytest.mark.parametrize("family", FLOW_CONFIGS)
def test_a_tiny_target_of_each_family_goes_through_the_whole_flow_to_a_promotion(prefect_api, tmp_path_factory,
                                                                                 family):
    """The family's shipped config (tiny-F-cpu.yaml: its family, release and aux layers) on the MICRO recipe as Qwen2,
    Qwen3, Qwen3-MoE, Gemma 3 (tied head) and DeepSeek-V2 (MLA target, with SGLang's MLA draft form): regenerate,
    train, export for that family's SGLang file and the draft's form, serve, gate; simulated = served."""
    config = FLOW_CONFIGS[family]
    target = micro_target_of(tmp_path_factory, family)
    run_dir = tmp_path_factory.mktemp(f"{family}-flow")
    overrides = micro_run_overrides(run_dir, target) + [
        "benchmark.suites=[heldout]",
        # these micro targets answer with newlines more than the Llama one (Qwen3-MoE and Gemma 3: 42-44 % of the
        # generated tokens measured): the check that measures it is waived, this test is about the family
        "data.quality.waive=[empty-replies, duplicate-replies, repeated-token, looping]"]
    assert read_target_info(target).family == family
    promoted_with_simulated_equal_to_served(overrides, str(config))
    exported = json.loads((load_config(config, overrides).stage_dir("export") / "sglang" / "config.json").read_text())
    assert exported["architectures"] == [DRAFT_ARCHITECTURES[load_config(config, overrides).draft.attention]]


def degraded_events(resource: str, expected: int, timeout_s: float = 60.0) -> list[dict]:
    """The server's `eagle3.acceptance.degraded` events on `resource`, once it holds `expected` (events are stored
    asynchronously after the flow run sends them)."""
    from prefect.settings import PREFECT_API_URL

    body = {"filter": {"event": {"name": ["eagle3.acceptance.degraded"]}, "resource": {"id": [resource]}},
            "limit": 50}
    deadline = time.monotonic() + timeout_s
    while True:
        found = httpx.post(f"{PREFECT_API_URL.value()}/events/filter", json=body, timeout=30).json()["events"]
        if len(found) >= expected or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def test_the_monitor_mode_emits_the_degraded_event_and_plots_production(prefect_api, tmp_path):
    """Production serves traffic far below what its version measured at promotion: the monitor mode (no registry
    lock) emits the event with the figures on this registry's resource, and a second drop in the cool-down none."""
    from tasks.run import registry_resource

    server = ProductionEdge()
    with serve_in_thread(server.app) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        monitor = monitor_for(None, tmp_path, port)
        overrides = monitor_overrides(tmp_path, port, "monitor.consecutive=1")
        now = time.time()
        traffic(tmp_path, now - 600, accept=1.8)
        states = [eagle3(CONFIG, overrides, "monitor", return_state=True) for _ in range(2)]
    first, second = (state.result() for state in states)
    assert first["verdict"] == "low" and first["alarm"]["state"] == "raised"
    assert second["alarm"]["state"] == "suppressed"  # the same traffic still in the window: within the cool-down
    resource = registry_resource(load_config(CONFIG, overrides).registry)
    events = degraded_events(resource, 1)
    assert len(events) == 1, events
    payload = events[0]["payload"]
    assert payload["version"] == "v1" and payload["baseline"]["accept_length"] == BASELINE
    assert payload["windows"][0]["accept_length"] == pytest.approx(1.8) and payload["slices"]["code"]["requests"] == 4
    time.sleep(1)
    assert len(degraded_events(resource, 2, timeout_s=2)) == 1  # none from the suppressed drop
    report = artifacts(states[1].state_details.flow_run_id)["monitor"]
    assert "data:image/svg+xml;base64," in report and report.count("| low |") == 2 and "| code |" in report


def test_a_stage_added_to_the_table_is_a_task_cached_on_its_key(prefect_api, tmp_path, monkeypatch):
    """The toy stage (tests/helpers.py) as the flow runs the table's stages: the second call is a cache hit, and
    another value of a field of its key makes it again."""
    monkeypatch.setitem(STAGES, "toy", TOY)
    make = lambda *sets: load_config(CONFIG, [f"run.dir={tmp_path / 'run'}", f"target.path={tmp_path}", *sets])  # noqa: E731
    vocab = output_of(make(), "vocab")
    vocab.mkdir(parents=True)
    (vocab / "d2t.txt").write_text("0\n")
    upstream = {"vocab": StageOutput("vocab", vocab, "vocab-fingerprint")}
    toy = stage_task("toy")

    @flow
    def run_toy(config):
        return toy(config, "resolved.yaml", upstream, return_state=True)

    first, again, other = run_toy(make()), run_toy(make()), run_toy(make("training.seed=9"))
    assert first.is_completed() and first.result().path == output_of(make(), "toy")
    assert again.name == "Cached" and other.name != "Cached"
    assert output_of(make(), "toy").read_text().startswith("9 ")
