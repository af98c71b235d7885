"""Warm starts: a module run with this interpreter (`python -m eagle3.cli serve`), forked from one process that
imported torch, transformers and the project once.

A new interpreter spends ~8 s importing torch and transformers (measured on 2 cores) before a reference server does
anything; a CPU run starts several (the candidate, the no-draft baseline, each sweep point). Forked from Python's fork
server (multiprocessing "forkserver", PRELOAD imported there), a reference server is healthy in ~1.2 s instead of
~9.7 s. The fork is a process of its own as a new interpreter would be: its own session and process group, the
caller's environment as of the start (torch's thread count from OMP_NUM_THREADS included), its output in a log file.
Its command line (ps, /proc) is the fork server's, and it ends with the caller's process: whatever must outlive the
caller, or be found by its command line (the trainer), starts as a new interpreter (run.warm_start,
docs/serving-and-benchmark.md).
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

# What a reference server imports on its way to healthy, transformers' model-loading and masking code included (its
# heavy part: torch.distributed.tensor, torch._dynamo); a target of another architecture imports its own modeling
# file in the fork.
PRELOAD = ["eagle3.cli", "eagle3.serve.reference", "transformers.modeling_utils", "transformers.masking_utils"]
RUN_MODULE = [sys.executable, "-m"]


class ForkedProcess:
    """What the launcher uses of subprocess.Popen (pid, poll, wait), for a process forked by the fork server."""

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


def fork_module(command: list[str], log_path: Path) -> ForkedProcess:
    """Run `command` (this interpreter's `python -m MODULE ARGS...`) as a fork of the warm process, as runpy runs
    `-m`, in this process's environment, its output appended to `log_path`. Returns once the fork leads its own
    process group, so that a stop can signal the group at once."""
    if command[:2] != RUN_MODULE or len(command) < 3:
        raise ValueError(f"{command[:3]} does not run a module with this interpreter ({sys.executable} -m)")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    process = context.Process(target=_run_module, args=(command[2:], str(log_path), dict(os.environ)),
                              daemon=True)  # stopped with the caller if it exits first
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
    """The fork's body: detached as a new interpreter started with start_new_session, output and errors to the log,
    then the module argv[0] as __main__ with sys.argv = argv. SIGTERM ends it through SystemExit, so its exit handlers
    run (uvicorn raises the signal again after its graceful shutdown)."""
    os.setsid()
    out = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for stream in (1, 2):
        os.dup2(out, stream)
    os.close(out)
    # Python's streams over them, buffered as a new interpreter's (by line under PYTHONUNBUFFERED), stderr by line
    sys.stdout = open(1, "w", buffering=1 if environ.get("PYTHONUNBUFFERED") else -1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)
    os.environ.clear()
    os.environ.update(environ)
    if "OMP_NUM_THREADS" in environ:  # a new interpreter's OpenMP reads it at start; the fork server's did already
        import torch

        torch.set_num_threads(int(environ["OMP_NUM_THREADS"]))
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    sys.argv = list(argv)
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
