"""The regenerate stage's own servers (data.nodes): the target served from every node, started through the serving
launcher, regenerated over together and stopped when the stage ends, a failure included.

Each entry of data.nodes ('host' or 'host:port', the port serving.port by default) gets the server serving.engine
launches without a draft, as the baseline's is launched (eagle3.serve.launch.server_for), at that endpoint and through
serving.launcher: ssh to the host (with serving.ssh_args), an srun step on that node, or here. The servers start
together and are then waited for (a large target loads for minutes on each node), the client round-robins over them
as over data.servers, and the log says how many requests each one answered. (In eagle3.serve, not eagle3.data: it
launches servers, a layer above the data stage's library.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

from eagle3.config import PipelineConfig
from eagle3.config.data import DataSection, split_node
from eagle3.config.serving import ServingSection
from eagle3.resolve import derived
from eagle3.runtime.generators import ServerClient, make_generator
from eagle3.errors import Eagle3Error
from eagle3.serve.launch import Server, server_for
from eagle3.serve.nodes import node_spec
from eagle3.serving import serving_engine
from eagle3.serving.base import LaunchSpec, launch_spec

Log = Callable[[str], None]


def node_endpoints(data: DataSection, serving: ServingSection) -> list[tuple[str, int]]:
    """(host, port) of each data.nodes entry, in order."""
    endpoints = [(host, port or serving.port) for host, port in map(split_node, data.nodes)]
    if len(set(endpoints)) < len(endpoints):
        raise Eagle3Error(f"data.nodes {data.nodes} names an endpoint twice once serving.port "
                          f"{serving.port} fills in the missing ports: give each server its own host or port")
    return endpoints


def check_engines(data: DataSection, serving: ServingSection | None) -> None:
    """The servers data.nodes starts are serving.engine's, and the client speaks data.generator's API."""
    if serving is None:
        raise Eagle3Error("data.nodes starts the target's servers as serving.engine and serving.launcher say: the "
                          "config needs a serving section (engine, launcher, context_length)")
    started, client = serving_engine(serving.engine), serving_engine(data.generator)
    if not isinstance(started, type(client)):
        raise Eagle3Error(f"data.nodes would start {started.title} (serving.engine {started.name}), which does not "
                          f"speak the API of data.generator {client.name}: set data.generator to the engine it serves")


def served_target(path: str) -> str:
    """The target as every node's server names it: a directory here by its absolute path (ssh starts the server in
    the home directory, not ours), anything else (a hub id, a path only the nodes have) as written."""
    return str(Path(path).resolve()) if Path(path).is_dir() else path


@contextlib.contextmanager
def node_servers(spec: LaunchSpec, data: DataSection, log: Log) -> Iterator[list[str]]:
    """Start a server on every data.nodes endpoint, wait until each serves, yield their URLs; stop them all at the
    end, whatever ends the block (a server that fails to start stops the others too)."""
    endpoints = node_endpoints(data, spec.serving)
    target = served_target(spec.target.path)
    servers: list[Server] = [
        server_for(node_spec(spec, host, port), target, None, log, role=f"data node {i}/{len(endpoints)}")
        for i, (host, port) in enumerate(endpoints, start=1)]
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_healthy(spec.serving.health_timeout_s)
        yield [server.url for server in servers]
    finally:
        for server in servers:
            server.stop()


@contextlib.contextmanager
def on_nodes(config: PipelineConfig, log: Log) -> Iterator[tuple[PipelineConfig, ServerClient | None]]:
    """What the regenerate stage generates with: (config, None) without data.nodes (the stage makes its own
    generator); with it, (config reaching the started servers as data.servers, the client for them), and once the
    block ends the requests each server answered are logged and the servers stopped."""
    if not config.data.nodes:
        yield config, None
        return
    check_engines(config.data, config.serving)
    with node_servers(launch_spec(config), config.data, log) as urls:
        served = derived(config, {"data.nodes": [], "data.servers": urls})
        client = make_generator(served.data, served.target, served.training.seed)
        log(f"regenerate: {len(urls)} servers started for data.nodes: {', '.join(urls)}")
        try:
            yield served, client
        finally:
            total = sum(client.answered.values())
            for url in client.urls:
                log(f"regenerate: server {url} answered {client.answered[url]} of {total} requests")
