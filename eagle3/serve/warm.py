"""Warm starts of the reference server: `eagle3 serve` forked from one process that imported its modules once.

A new interpreter spends ~8 s of a reference server's ~9 s start importing torch and transformers (measured on 2
cores); a CPU run starts several servers (the candidate, the no-draft baseline, each sweep point). Forked from
Python's fork server (multiprocessing "forkserver", its modules preloaded), each start takes ~0.7 s. The fork is a
process of its own as a new interpreter would be: its own session and process group, its output in the log file, the
caller's environment as of the start. Only a server that ends with the caller's process starts this way: the fork
server's children are the caller's to stop, and a server meant to outlive the run starts as its own interpreter.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import time

# What `eagle3 serve` imports on its way to healthy, transformers' model-loading and masking code included (its
# heavy part: torch.distributed.tensor, torch._dynamo); a target of another architecture imports its own modeling file.
PRELOAD = ["eagle3.cli", "eagle3.serve.reference", "transformers.modeling_utils", "transformers.masking_utils"]
RUN_MODULE = [sys.executable, "-m"]


class ForkedProcess:
    """The subprocess.Popen calls the launcher makes (pid, poll, wait), for a process forked by the fork server."""

    def __init__(self, process: multiprocessing.Process):
        self._process = process
        self.pid = process.pid

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"fork {self.pid}", timeout)
        return self._process.exitcode


def fork_module(command: list[str], log_path) -> ForkedProcess:
    """Run `command` (this interpreter's `python -m MODULE ARGS...`) as a fork of the warm process, as runpy runs
    `-m`, its output appended to `log_path`; return once the fork leads its own process group, so that a stop can
    signal the group at once."""
    if command[:2] != RUN_MODULE or len(command) < 3:
        raise ValueError(f"{command[:3]} does not run a module with this interpreter ({sys.executable} -m)")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    process = context.Process(target=_run_module, args=(command[2:], str(log_path), dict(os.environ)),
                              daemon=True)  # stopped with the caller if it exits first, as its servers are
    process.start()
    while process.exitcode is None and not _leads_group(process.pid):
        time.sleep(0.005)
    return ForkedProcess(process)


def _leads_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except ProcessLookupError:
        return False


def _run_module(argv: list[str], log_path: str, environ: dict[str, str]) -> None:
    """The fork's body: detached as a new interpreter started with start_new_session, output to the log, then the
    module argv[0] as __main__ with sys.argv = argv. SIGTERM ends it through SystemExit, so its exit handlers run
    (uvicorn raises the signal again after its graceful shutdown)."""
    os.setsid()
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for stream in (1, 2):
        os.dup2(log, stream)
    os.close(log)
    os.environ.clear()
    os.environ.update(environ)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    sys.argv = list(argv)
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
