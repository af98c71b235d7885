"""Launch a serving engine (SGLang, or the reference server) locally, over ssh or through srun; wait
until it serves; validate the draft against the release it reports; stop it and wait for the GPUs.

The server runs in its own process group, so a stop takes its workers with it. Every log line names
the endpoint and the launcher in effect (docs/gpu-node.md).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Callable

import httpx

from eagle3 import guard
from eagle3.algorithms import DraftAlgorithm, algorithm, draft_algorithm
from eagle3.config import PipelineConfig
from eagle3.config.deployment import TelemetrySection
from eagle3.contract.engines import TWO_BATCH_OVERLAP_LOSES_CAPTURE, parse_release
from eagle3.records.telemetry import PIPELINE_LABEL
from eagle3.procs import (
    GPU_QUERY, STOP_GRACE_S, LaunchError, ProcessTree, cpu_threads, in_systemd_scope, timestamp, wait_gpus_free, wrap,
)
from eagle3.warm import ForkedProcess, fork_module

LOG_TAIL_LINES = 40

# Every spelling SGLang's parser accepts for each flag the launcher sets (read from its releases'
# `ServerArgs.add_cli_args`; tests/conformance checks the table against each release's parser).
LAUNCHER_FLAGS = {
    "--model-path": ("--model-path", "--model"),
    "--speculative-algorithm": ("--speculative-algorithm",),
    "--speculative-draft-model-path": ("--speculative-draft-model-path", "--speculative-draft-model"),
    "--speculative-num-steps": ("--speculative-num-steps",),
    "--speculative-eagle-topk": ("--speculative-eagle-topk",),
    "--speculative-num-draft-tokens": ("--speculative-num-draft-tokens",),
    "--tp-size": ("--tp-size", "--tensor-parallel-size"),
    "--host": ("--host",),
    "--port": ("--port",),
    "--context-length": ("--context-length",),
    "--enable-metrics": ("--enable-metrics",),
    "--export-metrics-to-file": ("--export-metrics-to-file",),
    "--export-metrics-to-file-dir": ("--export-metrics-to-file-dir",),
    "--tokenizer-metrics-allowed-custom-labels": ("--tokenizer-metrics-allowed-custom-labels",),
}
TWO_BATCH_OVERLAP_FLAG = "--enable-two-batch-overlap"


def _flag(arg: str) -> str:
    return arg.split("=", 1)[0].replace("_", "-")


def _launcher_flag_for(arg: str) -> str | None:
    """The launcher's flag that `arg` would set: one of its spellings, or an abbreviation of one (argparse
    accepts any unambiguous prefix of a long option, so `--tp` or `--context-len` set the same field)."""
    flag = _flag(arg)
    for canonical, spellings in LAUNCHER_FLAGS.items():
        if any(spelling.startswith(flag) for spelling in spellings):
            return canonical
    return None


def telemetry_flags(telemetry: TelemetrySection | None) -> list[str]:
    """SGLang's flags for production.telemetry (the reference server takes the same spellings); [] when off.

    With telemetry on, the custom-label keys the pipeline and its users send are declared: with --enable-metrics
    SGLang's tokenizer manager labels a request's metrics with its custom_labels, and a key its collector was not
    started with raises inside the manager's loop (the server goes down on the benchmark's own re-measure); and
    the OpenAI routes keep only declared keys of an x-custom-labels header, metrics or not."""
    if telemetry is None or not (telemetry.metrics or telemetry.records_dir is not None):
        return []
    flags = ["--enable-metrics"] if telemetry.metrics else []
    if telemetry.records_dir is not None:
        flags += ["--export-metrics-to-file", "--export-metrics-to-file-dir", str(telemetry.records_dir)]
    return flags + ["--tokenizer-metrics-allowed-custom-labels", *custom_label_keys(telemetry)]


def custom_label_keys(telemetry: TelemetrySection) -> list[str]:
    """The custom_labels keys production must declare: the benchmark's own and the operator's slice label."""
    return list(dict.fromkeys([PIPELINE_LABEL[0], telemetry.slice_label]))


def sglang_command(config: PipelineConfig, target_path, draft_path, telemetry: TelemetrySection | None = None,
                   entry: DraftAlgorithm | None = None) -> list[str]:
    """telemetry: the production server's reporting (production.telemetry); candidates and baselines get none.
    entry: the draft's algorithm (None: the config's draft.algorithm), whose flags serve it."""
    s = config.serving
    command = [config.data.sglang_python, "-m", "sglang.launch_server", "--model-path", str(target_path)]
    if draft_path is not None:
        command += (entry or algorithm(config.draft.algorithm)).server_flags(draft_path, s)
    command += ["--tp-size", str(s.tp), "--host", s.host, "--port", str(s.port),
                "--context-length", str(s.context_length)]
    command += ["--trust-remote-code"] if config.target.trust_remote_code else []
    command += telemetry_flags(telemetry)
    extra_flags = [a for a in s.extra_args if a.startswith("--")]
    if any(_launcher_flag_for(a) == "--speculative-algorithm" for a in extra_flags):
        raise LaunchError(
            f"serving.extra_args {s.extra_args} sets --speculative-algorithm; the launcher sets it (EAGLE3 for an "
            "EAGLE-3 draft: EAGLE would serve it with the wrong fc input and no aux states); remove it")
    overlap = [a for a in extra_flags if TWO_BATCH_OVERLAP_FLAG.startswith(_flag(a)) and len(_flag(a)) > len("--enable-t")]
    if draft_path is not None and overlap and config.target.family in TWO_BATCH_OVERLAP_LOSES_CAPTURE:
        raise LaunchError(
            f"serving.extra_args sets {overlap[0]}: with two-batch overlap SGLang's {config.target.family} model file "
            "captures aux hidden states only below first_k_dense_replace (every release read), so the EAGLE3 draft "
            "would get fewer states than it was trained on; remove it for the speculative server")
    clash = sorted({f"{_flag(a)} (= {_launcher_flag_for(a)})" for a in extra_flags if _launcher_flag_for(a)})
    if clash:
        raise LaunchError(f"serving.extra_args repeats {', '.join(clash)}, which the launcher sets from the "
                          "serving section (the telemetry flags from production.telemetry, for the production server "
                          "only: --tokenizer-metrics-allowed-custom-labels declares eagle3 and "
                          "production.telemetry.slice_label); set the field instead")
    return command + list(s.extra_args)


def reference_command(config: PipelineConfig, target_path, draft_path,
                      telemetry: TelemetrySection | None = None) -> list[str]:
    s = config.serving
    command = [sys.executable, "-m", "eagle3.cli", "serve", "--target", str(target_path)]
    command += ["--draft", str(draft_path)] if draft_path is not None else []
    command += ["--num-steps", str(s.num_steps), "--eagle-topk", str(s.eagle_topk),
                "--num-draft-tokens", str(s.num_draft_tokens)]
    command += ["--release", s.release] if s.release else []
    command += ["--trust-remote-code"] if config.target.trust_remote_code else []
    command += ["--dtype", config.target.dtype, "--threads", str(cpu_threads(config.run.cpu_threads))]
    return command + ["--host", s.host, "--port", str(s.port)] + telemetry_flags(telemetry)


class Server:
    """One server process group; `with Server(...) as s:` starts it and always stops it. `warm`: forked from the warm
    process (eagle3/warm.py; `command` runs a module with this interpreter) instead of a new interpreter."""

    def __init__(self, command: list[str], host: str, port: int, log_dir: Path, log: Callable[[str], None] = print,
                 label: str = "", gpu_query: list[str] | None = GPU_QUERY, gpu_free_mib: int = 2048,
                 gpu_free_timeout_s: float = 600.0, grace_s: float = STOP_GRACE_S, warm: bool = False):
        self.command, self.url, self.log_dir, self.warm = command, f"http://{host}:{port}", Path(log_dir), warm
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
        self.refuse_a_held_endpoint()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.log_dir / f"server-{self.url.rsplit(':', 1)[1]}-{timestamp()}.log"
        forked = ", forked from the warm process" if self.warm else ""
        self.log(f"starting: {shlex.join(self.command)} (log {self.log_path}{forked})")
        if self.warm:
            self.process = fork_module(self.command, self.log_path)
            return
        with open(self.log_path, "ab") as out:
            try:
                self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, start_new_session=True)
            except OSError as err:
                raise LaunchError(f"[{self.label}] cannot start {self.command[0]}: {err.strerror}") from None

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
        release from /server_info."""
        self.log(f"waiting up to {deadline_s:.0f} s for {self.url}/health_generate")
        start = time.monotonic()
        deadline = start + deadline_s
        pause = 0.05  # a forked reference server answers within a second (a fixed 1 s poll cost it ~0.8 s a start)
        while True:
            code = self.process.poll()
            if code is not None:
                raise self._fail(f"the server exited with status {code} before it became healthy")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._fail(f"the server was not healthy after {deadline_s:.0f} s")
            try:
                if httpx.get(f"{self.url}/health_generate", timeout=min(request_timeout_s, remaining)).status_code == 200:
                    break
            except httpx.HTTPError:
                pass  # not listening yet, or busy loading
            time.sleep(min(pause, max(deadline - time.monotonic(), 0)))
            pause = min(2 * pause, interval_s)
        try:
            info = httpx.get(f"{self.url}/server_info", timeout=request_timeout_s).raise_for_status().json()
        except (httpx.HTTPError, ValueError) as err:
            raise self._fail(f"healthy, but /server_info failed: {err}") from None
        if not info.get("version"):
            raise self._fail(f"/server_info has no version: {info}")
        self.release = str(info["version"])  # SGLang's own __version__: it selects the loader rules
        self.log(f"healthy after {time.monotonic() - start:.1f} s; the server reports version {self.release}")
        return self.release

    def stop(self) -> None:
        """TERM the group, KILL what is left after the grace, then wait for the GPUs' memory."""
        if (process := self.process) is None:
            return
        self.process = None
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


def server_for(config: PipelineConfig, target, draft, log: Callable[[str], None] = print, role: str = "candidate",
               unit: str | None = None, telemetry: TelemetrySection | None = None, outlives_run: bool = False,
               entry: DraftAlgorithm | None = None) -> Server:
    """The server for `config.serving`; with `unit`, its local process (the server, or the ssh / srun that holds it)
    runs in that transient systemd scope; with `telemetry` (production only), SGLang's metrics and request records;
    `entry` the draft's algorithm (None: the config's), whose flags serve it.
    A local reference server that ends with this process (not `outlives_run`, no unit) starts warm
    (run.warm_start)."""
    s = config.serving
    if s.engine == "sglang":
        built = sglang_command(config, target, draft, telemetry, entry)
    else:
        built = reference_command(config, target, draft, telemetry)  # the reference server reads the draft's kind
    ssh_host = s.ssh_host or s.host
    command = wrap(built, s.launcher, ssh_host, s.srun_args)
    via = {"local": "local", "ssh": f"ssh {ssh_host}", "srun": "srun"}[s.launcher]
    if unit is not None:
        command = in_systemd_scope(command, unit)
        via += f", systemd unit {unit}"
    return Server(command, s.host, s.port, s.log_dir or config.run.dir / "logs", log,
                  label=f"{role} {s.engine} endpoint http://{s.host}:{s.port}, launcher {via}",
                  gpu_query=wrap(GPU_QUERY, s.launcher, ssh_host, s.srun_args),
                  gpu_free_mib=s.gpu_free_mib, gpu_free_timeout_s=s.gpu_free_timeout_s,
                  warm=config.run.warm_start and s.engine == "reference" and s.launcher == "local" and unit is None
                  and not outlives_run)


def launch_and_validate(config: PipelineConfig, target, draft, log: Callable[[str], None] = print,
                        role: str = "candidate", unit: str | None = None,
                        telemetry: TelemetrySection | None = None, outlives_run: bool = False) -> Server:
    """Start the server (in the systemd scope `unit`, if given), wait until healthy, validate the draft (by its own
    algorithm's checks) for the live release; return it running. Error codes in `export.waive` are accepted (the
    export stage logged and recorded them)."""
    if draft is not None and not Path(draft).is_dir():
        raise LaunchError(f"draft {draft}: no such directory; nothing was launched")
    entry = draft_algorithm(Path(draft)) if draft is not None else None  # an earlier run's version may be another's
    if entry is not None and (problem := entry.shape_problem(Path(draft), config.serving.shape)):
        raise LaunchError(f"draft {draft} ({entry.name}): {problem}; nothing was launched")
    server = server_for(config, target, draft, log, role, unit, telemetry, outlives_run, entry)
    server.start()
    try:
        live = server.wait_healthy(config.serving.health_timeout_s)
        if draft is None:
            server.log("no draft: nothing to validate")
            return server
        release = live if config.serving.engine == "sglang" else config.serving.release
        try:
            parse_release(release) if release else None
        except ValueError as err:
            raise LaunchError(f"[{server.label}] {err}: cannot pick SGLang's loader rules") from None
        if config.serving.release and release != config.serving.release:
            server.log(f"the server reports {live}, the config says {config.serving.release}: validating for {live}")
        local_target = Path(target) if Path(target).is_dir() else None  # a hub id on the node is not read here
        if local_target is None:
            server.log(f"target {target} is not a directory here: checks against the target are left unknown")
        report = entry.validate(Path(draft), "sglang", release, local_target, None, config.serving.context_length)
    except BaseException:
        server.stop()
        raise
    errors = report.errors(config.export.waive)
    if errors:
        server.stop()
        listed = "\n".join(f"  {p.code}: {p.message} (fix: {p.fix})" for p in errors)
        raise LaunchError(f"[{server.label}] the draft {draft} would be served wrongly by SGLang {release}:\n{listed}")
    server.log(f"draft {draft} validated for SGLang {release or '(strictest rules)'}")
    return server
