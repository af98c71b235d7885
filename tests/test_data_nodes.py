"""Regeneration spread over servers the regenerate stage starts itself (data.nodes), through the serving launcher:
for real, two reference servers started over ssh to an sshd on 127.0.0.1 (tests/sshd.py); and the config's and the
launcher's rules for them."""

import json
from pathlib import Path

import httpx
import pytest

from eagle3.resolve import load_config
from eagle3.data.regenerate import read_samples
from eagle3.runtime.generators import EngineError, make_generator
from eagle3.errors import ConfigError, Eagle3Error
from eagle3.procs import LaunchError, process_table
from eagle3.serve.data_nodes import check_engines, node_endpoints, on_nodes
from eagle3.serve.nodes import node_spec
from eagle3.serving.base import launch_spec
from eagle3.stages.table import STAGES, StageRun
from helpers import TINY, micro_overrides
from ports import free_port, held_port


def config_for(tmp_path, *overrides):
    return load_config(TINY, [f"run.dir={tmp_path / 'run'}", *overrides])


# ---------------------------------------------------------------------------------------------
# The config and the launcher's commands


@pytest.mark.parametrize("overrides, message", [
    (["data.generator=sglang", "data.servers=[http://a:30000]", "data.nodes=[node-1]"],
     "data.nodes starts servers and data.servers names running ones: give one of them"),
    (["data.nodes=[node-1]"], "data.nodes starts servers for data.generator sglang or vllm; generator local generates here"),
    (["data.generator=sglang", "data.nodes=['node-1:http']"], "data.nodes entry 'node-1:http' is not host or host:port"),
    (["data.generator=sglang", "data.nodes=[':30001']"], "data.nodes entry ':30001' is not host or host:port"),
    (["data.generator=sglang", "data.nodes=[node-1, node-1]"], "names an endpoint twice"),
    (["data.generator=sglang"], "needs data.servers .* or data.nodes"),
])
def test_data_nodes_that_cannot_be_started_are_refused_naming_the_field(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        config_for(tmp_path, *overrides)


def test_each_node_gets_its_endpoint_through_the_serving_launcher(tmp_path):
    config = config_for(tmp_path, "data.generator=sglang", "data.nodes=[node-1, 'node-2:31000']", "serving.port=30500",
                        "serving.launcher=ssh", "serving.ssh_host=login-1", "serving.ssh_args=[-p, '2222']")
    assert node_endpoints(config.data, config.serving) == [("node-1", 30500), ("node-2", 31000)]
    node = node_spec(launch_spec(config), "node-2", 31000).serving
    assert (node.host, node.port, node.ssh_host, node.ssh_args) == ("node-2", 31000, None, ["-p", "2222"])
    srun = config_for(tmp_path, "data.generator=sglang", "data.nodes=[node-1]", "serving.launcher=srun",
                      "serving.srun_args=[--gres=gpu:8]")
    assert node_spec(launch_spec(srun), "node-1", 30000).serving.srun_args == [
        "--gres=gpu:8", "--nodes=1", "--ntasks=1", "--nodelist=node-1"]  # one step on that node
    twice = config_for(tmp_path, "data.generator=sglang", "data.nodes=[node-1, 'node-1:30000']")
    with pytest.raises(Eagle3Error, match="names an endpoint twice once serving.port 30000 fills in"):
        node_endpoints(twice.data, twice.serving)


def test_the_started_engine_must_speak_the_clients_api(tmp_path):
    speaks = config_for(tmp_path, "data.generator=sglang", "data.nodes=[n1]")
    check_engines(speaks.data, speaks.serving)  # the reference server speaks SGLang's
    other = config_for(tmp_path, "data.generator=vllm", "data.nodes=[n1]")
    with pytest.raises(Eagle3Error, match="does not speak the API of data.generator vllm"):
        check_engines(other.data, other.serving)


def test_other_commands_than_the_stage_reach_running_servers_only(tmp_path):
    config = config_for(tmp_path, "data.generator=sglang", "data.nodes=[n1]")
    with pytest.raises(EngineError, match="only the regenerate stage .* starts the target's servers"):
        make_generator(config.data, config.target, config.training.seed)


# ---------------------------------------------------------------------------------------------
# For real: reference servers over ssh


def node_overrides(run_dir, micro_target, sshd, nodes):
    return [*micro_overrides(run_dir, micro_target), "data.generator=sglang", f"data.nodes={json.dumps(nodes)}",
            "data.num_samples=8", "data.max_new_tokens=8", "data.concurrency=4", "data.temperature=0",
            "benchmark.num_prompts=4", "benchmark.max_new_tokens=8", "run.cpu_threads=1",
            "serving.launcher=ssh", f"serving.ssh_args={json.dumps(sshd.ssh_args)}", f"serving.log_dir={run_dir}/logs",
            f"registry.path={run_dir}/registry"]  # a registry of its own: no replies shared between the runs


def run_stage(overrides) -> list[str]:
    """The flow's regenerate stage, as its task runs it."""
    config = load_config(TINY, overrides)
    lines = []
    STAGES["regenerate"].runner(StageRun(config, config.run.dir / "config.resolved.yaml", lines.append))
    return lines


def samples(run_dir: Path) -> dict:
    regen = run_dir / "data" / "regen"
    rows = {r["id"]: (r["input_ids"], r["loss_mask"]) for r in read_samples(regen)}
    return {"rows": rows, "greedy": (regen / "heldout_greedy.jsonl").read_text()}


def serving(port: int) -> list[int]:
    """Live processes started with `--port PORT` (the reference server's command line)."""
    found = []
    for pid, (state, _, _) in process_table().items():
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # exited meanwhile
        if state not in "ZX" and any(a == b"--port" and b == str(port).encode() for a, b in zip(args, args[1:])):
            found.append(pid)
    return found


def test_regeneration_spread_over_two_servers_started_over_ssh_equals_one_server(tmp_path, micro_target, sshd):
    ports = [free_port(), free_port()]
    two = tmp_path / "two"
    lines = run_stage(node_overrides(two, micro_target, sshd, [f"127.0.0.1:{port}" for port in ports]))
    text = "\n".join(lines)
    for i, port in enumerate(ports, start=1):
        url = f"http://127.0.0.1:{port}"
        assert f"[data node {i}/2 reference endpoint {url}, launcher ssh 127.0.0.1] healthy" in text
        [answered] = [int(line.split()[-4]) for line in lines if line.startswith(f"regenerate: server {url} answered")]
        assert answered > 0, text  # both servers answered: the client spread the requests over them
        assert len(list((two / "logs").glob(f"server-{port}-*.log"))) == 1  # each its own server, its own log
        assert not serving(port), f"the server on {port} outlived the stage"
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/health", timeout=2)
    assert sshd.log_path.read_text().count("Accepted publickey") >= 2  # each started through the launcher's ssh
    one_port = free_port()
    one = tmp_path / "one"
    run_stage(node_overrides(one, micro_target, sshd, [f"127.0.0.1:{one_port}"]))
    spread, single = samples(two), samples(one)
    assert len(spread["rows"]) == 8 and spread == single  # temperature 0: the same replies, whichever server answered


def test_a_node_that_cannot_start_stops_the_servers_already_started(tmp_path, micro_target, sshd):
    first, held = free_port(), free_port()
    with held_port(held):  # another server holds the endpoint
        config = load_config(TINY, node_overrides(tmp_path, micro_target, sshd,
                                                  [f"127.0.0.1:{first}", f"127.0.0.1:{held}"]))
        lines = []
        with pytest.raises(LaunchError, match=f"127.0.0.1:{held} already answers before this server started"):
            with on_nodes(config, lines.append):
                raise AssertionError("no block runs without every server")
    assert any(f"127.0.0.1:{first}, launcher ssh 127.0.0.1] stopping process group" in line for line in lines)
    assert not serving(first)
