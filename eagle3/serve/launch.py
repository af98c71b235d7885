"""Launch a serving engine (serving.engine: eagle3.serving) locally, over ssh or through srun; wait
until it serves; validate the draft against the release it reports; stop it and wait for the GPUs.

The server runs in its own process group, so a stop takes its workers with it. Every log line names
the endpoint and the launcher in effect (docs/gpu-node.md).
"""

from __future__ import annotations

import hashlib
import shlex
import subprocess
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable

import httpx

from eagle3 import guard
from eagle3.algorithms import DraftAlgorithm, draft_algorithm
from eagle3.algorithms.base import export_target
from eagle3.config.deployment import TelemetrySection
from eagle3.contract.releases import parse_release
from eagle3.model.weights import target_verifier
from eagle3.procs import (
    GPU_QUERY, STOP_GRACE_S, LaunchError, ProcessTree, in_systemd_scope, timestamp, wait_gpus_free, wrap,
)
from eagle3.serving import serving_engine
from eagle3.serving.base import LaunchSpec, ServingEngine, refuse_pipeline_parallel
from eagle3.serving.sglang import SGLANG
from eagle3.warm import ForkedProcess, fork_module

LOG_TAIL_LINES = 40
CONVERTING = threading.Lock()  # one draft converted at a time (served_form)


class LiveServers:
    """The servers this process has started and not stopped, so that a stop of the run reaches the ones other threads
    started (eagle3.serve.nodes.in_lanes): `stop_all` stops them and refuses new starts until `resume`."""

    def __init__(self):
        self._servers: set[Server] = set()
        self._lock = threading.Lock()
        self.stopping = threading.Event()

    def add(self, server: Server) -> None:
        with self._lock:
            self._servers.add(server)

    def discard(self, server: Server) -> None:
        with self._lock:
            self._servers.discard(server)

    def stop_all(self) -> None:
        self.stopping.set()
        with self._lock:
            servers = list(self._servers)
        for server in servers:
            server.stop()

    def resume(self) -> None:
        self.stopping.clear()


LIVE = LiveServers()


class Server:
    """One server process group; `with Server(...) as s:` starts it and always stops it. `warm`: forked from the warm
    process (eagle3/warm.py; `command` runs a module with this interpreter) instead of a new interpreter."""

    def __init__(self, command: list[str], host: str, port: int, log_dir: Path, log: Callable[[str], None] = print,
                 label: str = "", gpu_query: list[str] | None = GPU_QUERY, gpu_free_mib: int = 2048,
                 gpu_free_timeout_s: float = 600.0, grace_s: float = STOP_GRACE_S, warm: bool = False,
                 engine: ServingEngine = SGLANG):
        self.command, self.url, self.log_dir, self.warm = command, f"http://{host}:{port}", Path(log_dir), warm
        self.engine = engine  # its health probe and release report
        self.label = label or f"endpoint {self.url}, launcher {command[0]}"
        self._log, self.gpu_query, self.gpu_free_mib = log, gpu_query, gpu_free_mib
        self.gpu_free_timeout_s, self.grace_s = gpu_free_timeout_s, grace_s
        self.process: subprocess.Popen | ForkedProcess | None = None
        self.log_path: Path | None = None
        self.release: str | None = None

    def log(self, message: str) -> None:
        self._log(f"[{self.label}] {message}")

    def start(self) -> None:
        guard.require(f"starting the server {self.label}")
        if LIVE.stopping.is_set():
            raise LaunchError(f"[{self.label}] not started: the run is stopping")
        self.refuse_a_held_endpoint()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.log_dir / f"server-{self.url.rsplit(':', 1)[1]}-{timestamp()}.log"
        forked = ", forked from the warm process" if self.warm else ""
        self.log(f"starting: {shlex.join(self.command)} (log {self.log_path}{forked})")
        if self.warm:
            self.process = fork_module(self.command, self.log_path)
        else:
            with open(self.log_path, "ab") as out:
                try:
                    self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT,
                                                    stdin=subprocess.DEVNULL, start_new_session=True)
                except OSError as err:
                    raise LaunchError(f"[{self.label}] cannot start {self.command[0]}: {err.strerror}") from None
        LIVE.add(self)

    def refuse_a_held_endpoint(self) -> None:
        """A server that already answers on the endpoint (one a stopped run left behind) would pass the new one's
        health check and be measured in its place, while the new one fails to bind: refuse before starting."""
        try:
            httpx.get(f"{self.url}/health", timeout=2.0)
        except httpx.HTTPError:
            return  # nothing listens there
        raise LaunchError(f"[{self.label}] {self.url} already answers before this server started: another server "
                          "holds the endpoint (one a stopped run left behind?); stop it or use another port")

    def tail(self, lines: int = LOG_TAIL_LINES) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(deque(f, maxlen=lines)).rstrip() or "(the log is empty)"

    def _fail(self, reason: str) -> LaunchError:
        self.stop()
        return LaunchError(f"[{self.label}] {reason}; last lines of {self.log_path}:\n{self.tail()}")

    def wait_healthy(self, deadline_s: float, interval_s: float = 1.0, request_timeout_s: float = 10.0) -> str:
        """Poll /health_generate until it answers 200 (every 0.05 s at first, doubling to interval_s); return the
        release it reports (the engine's probe)."""
        health = f"{self.url}{self.engine.health_path}"
        self.log(f"waiting up to {deadline_s:.0f} s for {health}")
        start = time.monotonic()
        deadline = start + deadline_s
        pause = 0.05  # a forked reference server answers within a second (a fixed 1 s poll cost it ~0.8 s a start)
        while True:
            if (process := self.process) is None:  # stopped from another thread (LiveServers.stop_all)
                raise LaunchError(f"[{self.label}] stopped before it became healthy")
            code = process.poll()
            if code is not None:
                raise self._fail(f"the server exited with status {code} before it became healthy")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._fail(f"the server was not healthy after {deadline_s:.0f} s")
            try:
                if httpx.get(health, timeout=min(request_timeout_s, remaining)).status_code == 200:
                    break
            except httpx.HTTPError:
                pass  # not listening yet, or busy loading
            time.sleep(min(pause, max(deadline - time.monotonic(), 0)))
            pause = min(2 * pause, interval_s)
        try:
            self.release = self.engine.reported_release(self.url, request_timeout_s)
        except (httpx.HTTPError, ValueError) as err:
            raise self._fail(f"healthy, but its release report failed: {err}") from None
        self.log(f"healthy after {time.monotonic() - start:.1f} s; the server reports version {self.release}")
        return self.release

    def stop(self) -> None:
        """TERM the group, KILL what is left after the grace, then wait for the GPUs' memory."""
        if (process := self.process) is None:
            return
        self.process = None
        LIVE.discard(self)
        self.log(f"stopping process group {process.pid}")
        ProcessTree([process]).stop(self.grace_s, self.log)
        self.wait_gpus_free()

    def wait_gpus_free(self) -> None:
        wait_gpus_free(self.gpu_query, self.gpu_free_mib, self.gpu_free_timeout_s, self.log, f"[{self.label}] ")

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def server_for(spec: LaunchSpec, target, draft, log: Callable[[str], None] = print, role: str = "candidate",
               unit: str | None = None, telemetry: TelemetrySection | None = None, outlives_run: bool = False,
               entry: DraftAlgorithm | None = None) -> Server:
    """The server for `spec.serving`; with `unit`, its local process (the server, or the ssh / srun that holds it)
    runs in that transient systemd scope; with `telemetry` (production only), the engine's metrics and request records;
    `entry` the draft's algorithm (None: the spec's), whose flags serve it.
    A local reference server that ends with this process (not `outlives_run`, no unit) starts warm
    (run.warm_start)."""
    s, engine = spec.serving, serving_engine(spec.serving.engine)
    refuse_pipeline_parallel(s)
    built = engine.command(spec, target, draft, telemetry, entry)
    ssh_host = s.ssh_host or s.host
    command = wrap(built, s.launcher, ssh_host, s.srun_args, s.ssh_args)
    via = {"local": "local", "ssh": f"ssh {ssh_host}", "srun": "srun"}[s.launcher]
    if unit is not None:
        command = in_systemd_scope(command, unit)
        via += f", systemd unit {unit}"
    return Server(command, s.host, s.port, spec.log_dir, log,
                  label=f"{role} {engine.name} endpoint http://{s.host}:{s.port}, launcher {via}",
                  gpu_query=wrap(GPU_QUERY, s.launcher, ssh_host, s.srun_args, s.ssh_args),
                  gpu_free_mib=s.gpu_free_mib, gpu_free_timeout_s=s.gpu_free_timeout_s,
                  warm=spec.warm_start and engine.forks_warm and s.launcher == "local" and unit is None
                  and not outlives_run, engine=engine)


def served_form(spec: LaunchSpec, target, draft: Path, entry: DraftAlgorithm, engine: ServingEngine,
                log: Callable[[str], None]) -> Path:
    """`draft` (SGLang's layout, as exports and registry versions hold it) in the layout `engine` loads: itself, or
    converted into spec.served_dir (vLLM's speculators layout ships the target's embedding, read from `target`)."""
    if engine.served_layout == "sglang":
        return draft
    if not Path(target).is_dir():
        raise LaunchError(f"target {target} is not a directory here: {engine.title} loads the draft in the "
                          f"{engine.served_layout} layout, which ships the target's embedding; nothing was launched")
    key = hashlib.sha256(str(draft.resolve()).encode()).hexdigest()[:12]
    out = spec.served_dir / f"{draft.name}-{engine.served_layout}-{key}"
    written_for = export_target(spec.target, spec.serving, target_verifier(Path(target), spec.target.weight_prefix))
    log(f"{engine.title} loads the {engine.served_layout} layout: converting {draft} -> {out}")
    with CONVERTING:  # servers started at once on several nodes (serving.nodes) would write one directory together
        return entry.export(draft, out, engine.served_layout, written_for, log)


def launch_and_validate(spec: LaunchSpec, target, draft, log: Callable[[str], None] = print,
                        role: str = "candidate", unit: str | None = None,
                        telemetry: TelemetrySection | None = None, outlives_run: bool = False) -> Server:
    """Start the server (in the systemd scope `unit`, if given), wait until healthy, validate the draft (by its own
    algorithm's checks, in the layout the engine loads) for the live release; return it running. Error codes in
    `spec.waive` (export.waive) are accepted (the export stage logged and recorded them)."""
    if draft is not None and not Path(draft).is_dir():
        raise LaunchError(f"draft {draft}: no such directory; nothing was launched")
    entry = draft_algorithm(Path(draft)) if draft is not None else None  # an earlier run's version may be another's
    if entry is not None and (problem := entry.shape_problem(Path(draft), spec.serving.shape)):
        raise LaunchError(f"draft {draft} ({entry.name}): {problem}; nothing was launched")
    engine = serving_engine(spec.serving.engine)
    served = served_form(spec, target, Path(draft), entry, engine, log) if draft is not None else None
    server = server_for(spec, target, served, log, role, unit, telemetry, outlives_run, entry)
    server.start()
    try:
        live = server.wait_healthy(spec.serving.health_timeout_s)
        if draft is None:
            server.log("no draft: nothing to validate")
            return server
        release = engine.served_release(live, spec.serving.release)
        try:
            parse_release(release) if release else None
        except ValueError as err:
            raise LaunchError(f"[{server.label}] {err}: cannot pick {engine.title}'s loader rules") from None
        if spec.serving.release and release and release != spec.serving.release:
            server.log(f"the server reports {live}, the config says {spec.serving.release}: validating for {live}")
        local_target = Path(target) if Path(target).is_dir() else None  # a hub id on the node is not read here
        if local_target is None:
            server.log(f"target {target} is not a directory here: checks against the target are left unknown")
        report = entry.validate(served, engine.served_layout, release, local_target, None,
                                spec.serving.context_length)
    except BaseException:
        server.stop()
        raise
    rules = (f"SGLang {release or '(strictest rules)'}" if engine.served_layout == "sglang"  # the reference server's too
             else f"{engine.title} {live} ({engine.served_layout} layout)")
    errors = report.errors(spec.waive)
    if errors:
        server.stop()
        listed = "\n".join(f"  {p.code}: {p.message} (fix: {p.fix})" for p in errors)
        raise LaunchError(f"[{server.label}] the draft {served} would be served wrongly by {rules}:\n{listed}")
    server.log(f"draft {served} validated for {rules}")
    return server
