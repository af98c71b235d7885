"""The serving sweep on the micro target: real reference servers on 127.0.0.1, one start per drafting shape, every
concurrency level against the no-draft server; the fastest shape is chosen, the budget skips what would run past
it, and a version records how production serves it. With serving.nodes (two "nodes": two ports here) the sweep and
the serve stage's servers run on both at once, each speedup against its own node's no-draft server."""

import json
import os
import signal

import httpx
import pytest

from drafts import write_draft
from eagle3.resolve import load_config
from eagle3.deployment.production import Production
from eagle3.deployment.promotion import PROMPTS_LAYOUT, benchmark_prompts_file, measure_candidate, prompt_set_fields
from eagle3.deployment.sweep import run_sweep
from eagle3.stages.table import record_path
from eagle3.errors import ConfigError
from eagle3.report import sweep_report
from eagle3.serve.launch import LIVE
from eagle3.registry.registry import metrics_of, open_registry
from eagle3.serving.base import launch_spec
from helpers import MICRO_DRAFT, RELEASE, TINY, micro_overrides, write_heldout
from ports import free_port, held_port


@pytest.fixture
def sweep_config(tmp_path, micro_target):
    def config(*overrides):
        return load_config(TINY, micro_overrides(tmp_path / "run", micro_target) + [
            f"serving.port={free_port()}", f"serving.log_dir={tmp_path / 'logs'}", "serving.context_length=512",
            f"registry.path={tmp_path / 'registry'}", f"production.state_dir={tmp_path / 'production'}",
            "benchmark.num_prompts=2", "benchmark.max_new_tokens=8", "benchmark.concurrency=[2, 1]",
            "sweep.points=[[2, 2, 4]]", *overrides])

    write_heldout(config())
    return config, write_draft(tmp_path / "export" / "sglang", layout="sglang", release=RELEASE, **MICRO_DRAFT)


def test_the_fastest_shape_at_the_production_concurrency_is_chosen(sweep_config):
    make, draft = sweep_config
    config, lines = make(), []
    result = run_sweep(config, draft, record_path(config, "sweep"), log=lines.append)
    assert [p["label"] for p in result["points"]] == ["steps 3, topk 1, draft tokens 4", "steps 2, topk 2, draft tokens 4"]
    for point in result["points"]:
        assert point["error"] is None and [row["concurrency"] for row in point["levels"]] == [2, 1]
        for row in point["levels"]:
            assert row["speedup"] == row["output_tokens_per_s"] / row["baseline_output_tokens_per_s"]
            assert row["accept_length"] > 1.0 and row["lost_requests"] == 0
    fastest = max(result["points"], key=lambda p: p["levels"][0]["output_tokens_per_s"])
    chosen = result["chosen"]
    assert chosen["label"] == fastest["label"] and chosen["concurrency"] == 2 and chosen["num_prompts"] == 2
    assert json.loads(record_path(config, "sweep").read_text()) == result
    assert any(line.startswith("  chosen: ") for line in lines)


def test_points_past_the_budget_are_skipped_and_named_but_the_serving_shape_is_measured(sweep_config):
    make, draft = sweep_config
    lines = []
    config = make("sweep.budget_s=0.5", "benchmark.concurrency=1")
    result = run_sweep(config, draft, record_path(config, "sweep"), log=lines.append)
    assert [p["label"] for p in result["points"]] == ["steps 3, topk 1, draft tokens 4"]
    assert result["skipped"] == [{"num_steps": 2, "eagle_topk": 2, "num_draft_tokens": 4}]
    assert any("skipped steps 2, topk 2, draft tokens 4" in line and "sweep.budget_s" in line for line in lines)


def test_production_serves_and_remeasures_a_version_as_it_was_chosen(sweep_config):
    """The version's `serving` and `metrics.production`, as eagle3.deployment.promotion.version_fields records the sweep's choice."""
    make, draft = sweep_config
    config = make()
    registry = open_registry(config.registry, log=lambda line: None)
    serving = {"num_steps": 2, "eagle_topk": 2, "num_draft_tokens": 4, "temperature": 0.7, "concurrency": 1,
               "num_prompts": 1}
    production = {"accept_length": 1.9, "speedup": 1.5, "concurrency": 1, "temperature": 0.7,
                  "output_tokens_per_s": 30.0, "baseline_output_tokens_per_s": 20.0}
    prompts = benchmark_prompts_file(config.benchmark, config.run).parent
    registry.publish("v1", {"sglang": draft, PROMPTS_LAYOUT: prompts},
                     {"serving": serving, "benchmark": prompt_set_fields(config.benchmark, config.run),
                      "metrics": {"served": {"accept_length": 2.3}, "production": production}})
    prod = Production(config, registry, lambda line: None)
    served_config, prompts, temperature = prod.measurement("v1")
    assert served_config.serving.shape.label() == "steps 2, topk 2, draft tokens 4" and temperature == 0.7
    assert served_config.benchmark.production_concurrency == 1 and len(prompts) == 1
    # compared with the chosen shape's numbers, not the candidate's greedy chain measurement (2.3)
    assert prod.check("v1", {"accept_length": 1.88}, 0.05) is None
    assert "SHORTFALL" in prod.check("v1", {"accept_length": 1.7}, 0.05)
    assert metrics_of(registry.manifest("v1")).speedup == 1.5


# ---------------------------------------------------------------------------------------------
# On several nodes at once (serving.nodes)


def two_nodes(make, *overrides):
    ports = [free_port(), free_port()]
    return make(f"serving.nodes={json.dumps([f'127.0.0.1:{port}' for port in ports])}", "run.cpu_threads=1",
                *overrides), [f"127.0.0.1:{port}" for port in ports]


def ran_at_once(lines: list[str], first: str, second: str) -> bool:
    """A server on `second` started before the last one on `first` stopped (one after another, it would start after
    every server of `first`'s lane had stopped)."""
    def at(endpoint: str, what: str) -> list[int]:
        return [i for i, line in enumerate(lines) if f"http://{endpoint}," in line and what in line]
    return at(second, "] starting: ")[0] < at(first, "] stopping process group")[-1]


def test_a_sweep_on_two_nodes_measures_each_shape_once_against_its_own_nodes_no_draft_server(sweep_config):
    make, draft = sweep_config
    config, nodes = two_nodes(make, "sweep.points=[[2, 2, 4], [1, 1, 2]]")
    lines = []
    result = run_sweep(config, draft, record_path(config, "sweep"), log=lines.append)
    assert [p["label"] for p in result["points"]] == [  # the sweep's order, whichever node measured each
        "steps 3, topk 1, draft tokens 4", "steps 2, topk 2, draft tokens 4", "steps 1, topk 1, draft tokens 2"]
    assert sorted(result["baselines"]) == sorted(nodes) and result["failed_nodes"] == {}
    assert {p["node"] for p in result["points"]} <= set(nodes)
    for point in result["points"]:
        own = [level["output_tokens_per_s"] for level in result["baselines"][point["node"]]["levels"]]
        assert [row["baseline_output_tokens_per_s"] for row in point["levels"]] == own
    chosen = max(result["points"], key=lambda p: p["levels"][0]["speedup"])
    assert result["chosen"]["label"] == chosen["label"] and result["chosen"]["speedup"] == chosen["levels"][0]["speedup"]
    assert sum("sweep baseline (no draft) reference endpoint" in line and "] healthy" in line for line in lines) == 2
    assert ran_at_once(lines, *nodes) or ran_at_once(lines, *reversed(nodes))
    assert f"| {chosen['label']} on {chosen['node']} |" in sweep_report(result)  # the artifact names each row's node
    # a contender's sweep takes both nodes' no-draft servers, starting none
    again = []
    run_sweep(config, draft, record_path(config, "sweep"), again.append, result["baselines"])
    assert not any("sweep baseline (no draft) reference endpoint" in line for line in again)
    assert sum("as measured for the run's first draft" in line for line in again) == 2


def test_a_node_whose_no_draft_server_fails_measures_nothing_and_the_other_measures_every_shape(sweep_config):
    make, draft = sweep_config
    config, (good, held) = two_nodes(make)
    with held_port(int(held.split(":")[1])):
        result = run_sweep(config, draft, record_path(config, "sweep"), log=lambda line: None)
    assert list(result["baselines"]) == [good] and [p["node"] for p in result["points"]] == [good, good]
    assert "already answers before this server started" in result["failed_nodes"][held]
    assert f"- {held}: the no-draft server did not serve: " in sweep_report(result)


@pytest.mark.parametrize("nodes", [1, 2])
def test_the_serve_stage_measures_production_on_the_second_node_beside_the_candidate(sweep_config, tmp_path, nodes):
    """Production re-measured on the run's prompts (its version was measured on others): beside the candidate on a
    second node, after it on one."""
    make, draft = sweep_config
    if nodes == 2:
        config, (first, second) = two_nodes(make)
    else:
        config = make()
        first = second = f"127.0.0.1:{config.serving.port}"
    registry = open_registry(config.registry, log=lambda line: None)
    registry.publish("v1", {"sglang": draft}, {"benchmark": {"sha256": "another prompt set"}})
    registry.promote("v1", None, ["test"], by="test")
    lines = []
    served = measure_candidate(launch_spec(config), config.benchmark, config.data, config.run, config.registry, draft,
                               tmp_path / "served.json", lines.append)
    production = served["production_on_run_prompts"]
    assert production["version"] == "v1" and production["lost_requests"] == 0 and production["accept_length"] > 1
    assert served["baseline"]["url"] == f"http://{first}" and served["url"] == f"http://{first}"
    assert served["speedup"] == served["output_tokens_per_s"] / served["baseline"]["output_tokens_per_s"]
    on = [i for i, line in enumerate(lines) if f"production v1 on this run's prompts reference endpoint http://{second}," in line]
    candidate_stopped = next(i for i, line in enumerate(lines) if "[candidate reference" in line and "stopping" in line)
    assert on and (ran_at_once(lines, first, second) if nodes == 2 else on[0] > candidate_stopped)


@pytest.mark.parametrize("overrides, message", [
    (["serving.nodes=['127.0.0.1', '127.0.0.1:30000']"], "names an endpoint twice once serving.port 30000 fills in"),
    (["serving.nodes=['node-1:x']"], "serving.nodes entry 'node-1:x' is not host or host:port"),
    (["serving.nodes=[node-2]"], r"serving.nodes \['node-2'\] name other hosts than serving.host 127.0.0.1, where "
                                 "serving.launcher local cannot start a server"),
])
def test_serving_nodes_that_cannot_be_started_are_refused_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, overrides)


def test_serving_nodes_elsewhere_are_reached_through_the_ssh_launcher():
    serving = load_config(TINY, ["serving.nodes=[node-1, 'node-2:31000']", "serving.launcher=ssh"]).serving
    assert serving.endpoints == [("node-1", 30000), ("node-2", 31000)]


def test_a_stop_while_the_nodes_measure_stops_every_nodes_server(sweep_config):
    """A run stopped while the nodes measure (a cancelled flow run's TerminationSignal in the flow's thread; here
    Ctrl-C's KeyboardInterrupt) stops the servers the other threads started: none outlives it."""
    make, draft = sweep_config
    config, nodes = two_nodes(make, "benchmark.max_new_tokens=64", "benchmark.num_prompts=8")
    lines, stopped_at = [], []

    def log(line: str) -> None:
        lines.append(line)
        if not stopped_at and sum("] healthy after" in line for line in lines) == 2:  # both nodes' lanes are busy
            stopped_at.append(len(lines))
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        run_sweep(config, draft, record_path(config, "sweep"), log=log)
    for node in nodes:
        assert any(f"http://{node}," in line and "stopping process group" in line for line in lines), node
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://{node}/health", timeout=2)
    assert not LIVE.stopping.is_set()  # the process may start servers again
    assert not any("] healthy after" in line for line in lines[stopped_at[0]:])  # no server started after the stop
