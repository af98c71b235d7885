"""Long work (trainers, servers) runs in sessions of its own: a signal meant for the caller never reaches it,
and a stop takes every process it started.

torchrun starts each worker in a session of its own as well, so a stop covers the process groups of every
descendant, remembered while the tree is intact: a worker whose launcher died is re-parented and can no longer
be found by walking down from the launcher.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

from eagle3.errors import Eagle3Error


def process_table() -> dict[int, tuple[str, int, int]]:
    """pid -> (state, parent pid, process group) of every process (Linux /proc)."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # exited meanwhile
        state, ppid, group = text[text.rindex(")") + 2:].split()[:3]  # the name in parentheses may hold spaces
        table[int(stat.parent.name)] = (state, int(ppid), int(group))
    return table


def alive(state: str) -> bool:
    return state not in "ZX"  # a zombie holds nothing (PID 1 may never reap an orphan's)


def group_alive(pgid: int) -> bool:
    """Whether a live process is left in the group."""
    return any(group == pgid and alive(state) for state, _, group in process_table().values())


def timestamp() -> str:
    """For log file names: to the millisecond, so two starts in one second get two files."""
    return time.strftime("%Y%m%d-%H%M%S") + f".{time.time_ns() // 1_000_000 % 1000:03d}"


class ProcessTree:
    """Processes started with `start_new_session=True` and every process group their descendants are in."""

    def __init__(self, processes: list[subprocess.Popen] = ()):
        self.processes: list[subprocess.Popen] = []
        self.groups: set[int] = set()
        for process in processes:
            self.add(process)

    @classmethod
    def of_group(cls, pgid: int) -> ProcessTree:
        """A tree for a process group started by an earlier process (known only by its id, e.g. from a pid file)."""
        tree = cls()
        tree.groups.add(pgid)
        return tree

    def add(self, process: subprocess.Popen) -> None:
        self.processes.append(process)
        self.groups.add(process.pid)  # it leads its own group

    def refresh(self) -> set[int]:
        """Add the groups of the known groups' live descendants; return the known groups that have a live process."""
        table = process_table()
        children = defaultdict(list)
        for pid, (_, ppid, _) in table.items():
            children[ppid].append(pid)
        pending = [pid for pid, (_, _, group) in table.items() if group in self.groups]
        while pending:
            pid = pending.pop()
            state, _, group = table[pid]
            if alive(state):
                self.groups.add(group)
            pending += children[pid]
        return {group for state, _, group in table.values() if group in self.groups and alive(state)}

    def finished(self) -> bool:
        return all(process.poll() is not None for process in self.processes) and not self.refresh()

    def stop(self, grace_s: float, log: Callable[[str], None], kill_wait_s: float = 30.0) -> None:
        """TERM every group, KILL what is still alive after the grace; return once no process of them is alive."""
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, kill_wait_s)):
            live = self.refresh()
            if not live and self.finished():
                break
            for group in live:
                try:
                    os.killpg(group, sig)
                except ProcessLookupError:
                    continue  # its last process exited since the scan
            if self.wait(wait_s):
                break
            log(f"process group {', '.join(map(str, sorted(self.refresh())))} still alive {wait_s:.0f} s after {sig.name}")
        for process in self.processes:
            process.wait()

    def wait(self, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while not self.finished():
            if time.monotonic() > end:
                return False
            time.sleep(0.1)
        return True


class Terminated(SystemExit):
    """SIGTERM arrived inside `terminate_on_sigterm()`; uncaught, the process exits with status 143 like a
    process the signal ended."""


@contextlib.contextmanager
def terminate_on_sigterm() -> Iterator[None]:
    """Make SIGTERM raise `Terminated` while the block runs, so `finally` blocks (the trainer's stop) run.

    Only the default action is replaced: it ends the process on the spot and leaves the trainer running. A
    Python handler already in place is kept (Prefect's flow engine raises its own TerminationSignal, and reports
    a cancel by it), and so is an ignored SIGTERM. Must be entered in the main thread, where Python runs handlers.
    """
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    if threading.current_thread() is not threading.main_thread():
        raise Eagle3Error("terminate_on_sigterm() must be entered in the main thread: Python runs signal handlers "
                          "only there; start training from the main thread")

    def raise_terminated(signum, frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the first one's stop short
        raise Terminated(128 + signum)

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
