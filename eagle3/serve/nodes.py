"""Servers on several nodes at once: a launch spec moved to one endpoint (data.nodes' servers, serving.nodes'
measuring servers), and jobs run in lanes, one lane a node, the lanes side by side.

A measuring server has its node to itself (on the GPU node one target fits at a time, docs/gpu-node.md), so a lane runs
its jobs one after another; the lanes run in threads of this process, each waiting on its own server."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import replace
from typing import TypeVar

from eagle3.config.serving import ServingSection
from eagle3.procs import cpu_threads
from eagle3.serve.launch import LIVE
from eagle3.serving.base import LaunchSpec

T = TypeVar("T")


def node_spec(spec: LaunchSpec, host: str, port: int) -> LaunchSpec:
    """`spec` serving from host:port, reached by serving.launcher: ssh to that host, or an srun step on that node."""
    s = spec.serving
    on_the_node = ["--nodes=1", "--ntasks=1", f"--nodelist={host}"] if s.launcher == "srun" else []
    serving = ServingSection.model_validate({**s.model_dump(), "host": host, "port": port, "ssh_host": None,
                                             "nodes": [], "srun_args": [*s.srun_args, *on_the_node]})
    return replace(spec, serving=serving)


def measuring_specs(spec: LaunchSpec) -> list[LaunchSpec]:
    """The spec of each node the serve and sweep stages measure on (serving.nodes; serving's own endpoint without
    them). Servers started here at once (launcher local) share this machine's cores."""
    if not spec.serving.nodes:
        return [spec]
    endpoints = spec.serving.endpoints
    threads = spec.cpu_threads
    if spec.serving.launcher == "local":
        threads = max(1, cpu_threads(spec.cpu_threads) // len(endpoints))
    return [replace(node_spec(spec, host, port), cpu_threads=threads) for host, port in endpoints]


def endpoint(spec: LaunchSpec) -> str:
    """host:port of the server `spec` starts: how a measurement names the node it was taken on."""
    return f"{spec.serving.host}:{spec.serving.port}"


def in_lanes(lanes: list[list[Callable[[], T]]]) -> list[list[T]]:
    """Each lane's jobs one after another, the lanes at once (a thread each; one lane runs in this thread). Every
    lane runs to its end or its first error; then the first lane's error, in lane order, is raised. Should this thread
    be stopped meanwhile (a cancelled flow run's TerminationSignal, Ctrl-C), every server the process runs is stopped
    and no other starts before the lanes have ended: a lane's server on another node must not outlive the run."""
    def run(lane: list[Callable[[], T]]) -> list[T]:
        return [job() for job in lane]

    if len(lanes) == 1:
        return [run(lanes[0])]
    with ThreadPoolExecutor(max_workers=len(lanes), thread_name_prefix="lane") as pool:
        futures = [pool.submit(run, lane) for lane in lanes]
        try:
            wait(futures)
        except BaseException:
            LIVE.stop_all()  # the lanes' jobs then fail fast: their servers are gone and no new one starts
            raise
        finally:
            pool.shutdown(wait=True)
            LIVE.resume()
    return [future.result() for future in futures]
