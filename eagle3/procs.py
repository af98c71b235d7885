"""Long work (trainers, servers) runs in sessions of its own: a signal meant for the caller never reaches it,
and a stop takes every process it started.

torchrun starts each worker in a session of its own as well, so a stop covers the process groups of every
descendant, remembered while the tree is intact: a worker whose launcher died is re-parented and can no longer
be found by walking down from the launcher.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

from eagle3.errors import Eagle3Error

STOP_GRACE_S = 20.0  # under the 30 s a cancelled flow run has between SIGTERM and SIGKILL
GPU_QUERY = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
SYSTEMD_RUNNING = Path("/run/systemd/system")  # exists only when systemd is the running init (sd_booted()'s test)


BUSY_AT_ONCE = 2  # a CPU run's busy processes at a time: the production server beside the trainer or a server under test


def cpu_threads(configured: int | None, ranks: int = 1) -> int:
    """Threads for each of `ranks` processes of one busy job (a server: 1; the trainer: its ranks): `configured`
    (run.cpu_threads) or else this machine's cores shared by the jobs busy at once, split among the ranks, at least 1.
    Two processes each running a pool as wide as the machine make every thread wait on another (measured on 2 cores:
    a tiny training step 0.27 -> 5.8 s)."""
    threads = configured or max(1, len(os.sched_getaffinity(0)) // BUSY_AT_ONCE)
    return max(1, threads // ranks)


def with_threads(env: dict[str, str], threads: int) -> dict[str, str]:
    """`env` with OpenMP's and MKL's pools (torch's intra-op threads read them at start) set to `threads`."""
    return {**env, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


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


def on_parent_exit(parent: int, act: Callable[[], None], poll_s: float = 0.5) -> threading.Thread:
    """Call `act` once the parent process `parent` of this one is gone (this one is then re-parented): a SIGKILL of
    the parent, which no clean-up of its own can answer, included. The parent's pid is passed rather than read
    here, so a parent gone before this process started is seen too."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        act()

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread


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


class LaunchError(Eagle3Error):
    """A server that did not start, did not become healthy, or serves a draft it would serve wrongly."""


def wrap(command: list[str], launcher: str, ssh_host: str | None = None, srun_args: list[str] = (),
         ssh_args: list[str] = ()) -> list[str]:
    """`command` as `launcher` starts it: itself, over ssh to `ssh_host` (with the options `ssh_args`: port, key,
    known hosts, jump host; ssh_args_problem checked them at config load), or as an srun step."""
    if launcher == "local":
        return list(command)
    if launcher == "ssh":
        if not ssh_host:
            raise LaunchError("launcher ssh needs a host (serving.ssh_host or serving.host)")
        # -tt: the remote command gets a terminal, so killing the local ssh hangs it up on the node too
        return ["ssh", "-tt", *ssh_args, ssh_host, shlex.join(command)]
    if launcher == "srun":
        return ["srun", *srun_args, *command]
    raise LaunchError(f"unknown launcher {launcher!r}; use local, ssh or srun")


def on_ssh_host(command: list[str], host: str, cwd: Path, variables: dict[str, str], ssh_args: list[str]) -> list[str]:
    """`command` run over ssh on `host` from `cwd`, with `variables` set: ssh runs a command from the home directory,
    in a login's environment, not ours, so relative paths and the variables the command needs go with it."""
    assignments = [f"{name}={value}" for name, value in variables.items()]
    remote = ["sh", "-c", f"cd {shlex.quote(str(cwd))} && exec {shlex.join(['env', *assignments, *command])}"]
    return wrap(remote, "ssh", host, ssh_args=ssh_args)


SSH_OPTIONS_WITH_VALUE = set("BbcDEeFIiJLlmOoPpQRSWw")  # ssh(1)'s options that take an argument (OpenSSH 9)
SSH_FLAGS = set("46AaCfGgKkMNnqsTtVvXxYy")
SSH_REFUSED = {  # what would leave the launcher without its remote command, or without a stop that reaches it
    "-f": "puts ssh in the background: a stop would no longer reach the remote command",
    "-G": "prints ssh's configuration and runs nothing", "-V": "prints ssh's version and runs nothing",
    "-N": "runs no remote command", "-O": "sends a control command to a master connection and runs nothing",
    "-s": "asks for a subsystem instead of the command", "-W": "forwards stdin and stdout instead of the command",
    "-T": "takes away the terminal the launcher asks for (-tt), through which a stop hangs the command up",
}
SSH_REFUSED_CONFIG = {  # -o keywords (case-insensitive) with the same effect
    "remotecommand": "replaces the launcher's command",
    "requesttty": "changes the terminal the launcher asks for (-tt)",
    "sessiontype": "runs no command or a subsystem", "forkafterauthentication": "puts ssh in the background",
}


def ssh_args_problem(args: list[str]) -> str | None:
    """Why `args` cannot go before the host in the launcher's ssh command (None: they can): an argument that is no
    option (ssh would take it for the host, and the host for the command), an option ssh lacks, or one that would stop
    the launcher from running or stopping its command."""
    at = 0
    while at < len(args):
        arg = args[at]
        if not arg.startswith("-") or arg.startswith("--") or arg == "-":
            return (f"{arg!r} is not an ssh option: the launcher puts the host and the command after these, so give "
                    "options with their values only, e.g. [-p, '2222', -i, ~/.ssh/cluster, -o, ProxyJump=login-1]")
        for place, letter in enumerate(arg[1:], start=2):
            option = f"-{letter}"
            if option in SSH_REFUSED:
                return f"{option} {SSH_REFUSED[option]}; remove it"
            if letter in SSH_OPTIONS_WITH_VALUE:
                value = arg[place:]
                if not value:
                    at += 1
                    if at == len(args):
                        return f"{option} needs a value after it"
                    value = args[at]
                keyword = value.replace("=", " ").split(maxsplit=1)[0].lower() if value.strip() else ""
                if letter == "o" and keyword in SSH_REFUSED_CONFIG:
                    return f"-o {value} {SSH_REFUSED_CONFIG[keyword]}; remove it"
                break
            if letter not in SSH_FLAGS:
                return f"ssh has no option {option} (in {arg!r})"
        at += 1
    return None


def user_runtime_dir() -> Path:
    """The runtime directory of a non-root user, where that user's systemd manager listens: $XDG_RUNTIME_DIR, else
    /run/user/UID."""
    return Path(os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{os.geteuid()}")


def systemd_missing() -> str | None:
    """Why no transient systemd unit can be started here; None when one can."""
    if not SYSTEMD_RUNNING.is_dir():
        return f"systemd is not running on this machine (no {SYSTEMD_RUNNING})"
    if shutil.which("systemd-run") is None:
        return "systemd-run is not on PATH"
    if os.geteuid() != 0:
        # not root: the system manager would refuse us, so the unit goes to the user's own manager (systemd-run --user)
        socket = user_runtime_dir() / "systemd" / "private"
        if not socket.exists():
            return (f"no systemd user manager for uid {os.geteuid()} (no {socket}); `loginctl enable-linger USER` "
                    "starts one at boot and keeps it running without a login")
    return None


def in_systemd_scope(command: list[str], unit: str) -> list[str]:
    """`command` in the transient systemd scope `unit`. systemd-run moves itself into the scope and then execs the
    command, so the server stays our child under the same process id (its log, process group and stop are unchanged)
    but in a cgroup of its own, out of reach of a stop of the caller's unit (a worker restart kills its whole cgroup).
    --collect unloads the unit when it ends, even failed, so the next start can take the name again."""
    user = [] if os.geteuid() == 0 else ["--user"]  # not root: the user's own manager (see systemd_missing)
    # systemd-run --user finds that manager through XDG_RUNTIME_DIR, which a system service's environment lacks
    runtime = ["env", f"XDG_RUNTIME_DIR={user_runtime_dir()}"] if user and not os.environ.get("XDG_RUNTIME_DIR") else []
    return [*runtime, "systemd-run", *user, "--scope", f"--unit={unit}", "--quiet", "--collect", "--", *command]


def wait_gpus_free(query: list[str] | None, free_mib: int, timeout_s: float, log: Callable[[str], None],
                   label: str = "") -> None:
    """After a stop on the GPU node: wait until every GPU uses less than `free_mib` (docs/gpu-node.md: one model at a time).
    No query, or no nvidia-smi here, is no wait."""
    if query is None:
        return
    if query[0] == "nvidia-smi" and shutil.which("nvidia-smi") is None:
        log("nvidia-smi not found here: not waiting for GPU memory")
        return
    end = time.monotonic() + timeout_s
    while True:
        try:
            out = subprocess.run(query, capture_output=True, text=True, timeout=60, check=True).stdout
            used = [int(v) for v in out.split()]
        except (OSError, subprocess.SubprocessError, ValueError) as err:
            log(f"cannot read GPU memory ({shlex.join(query)}: {err}): not waiting for it")
            return
        if all(u < free_mib for u in used):
            log(f"GPU memory used (MiB) {used}: below {free_mib}, free")
            return
        if time.monotonic() > end:
            raise LaunchError(f"{label}GPU memory still in use {timeout_s:.0f} s after the stop: {used} MiB "
                              f"(threshold {free_mib}); find the process holding it")
        time.sleep(2.0)
