"""Run training as a subprocess in its own process group: `python -m eagle3.train` here (under
`torchrun --standalone` for several processes), or torchrun on every node, started through ssh or srun.

Output streams line by line into the caller's log and into run.dir/logs/train-<stamp>.log; each record the
trainer adds to metrics.jsonl goes to `on_metrics`. The file, not the `train: {json}` log lines, feeds the
metrics: the trainer logs only every tenth step and the evaluations, and under torchrun its lines share the
output with warnings and tracebacks from every rank, while the file holds every record, written by rank 0 alone.

The trainer's processes are stopped in a `finally`: an exception from a callback, a KeyboardInterrupt or a
SIGTERM turned into an exception (`terminate_on_sigterm`) never leaves them running. A Prefect cancel signals
the flow's process only (docs/pipeline.md), and the trainer, in a session of its own, would not see it.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from eagle3 import guard
from eagle3.config.data import DataSection
from eagle3.config.run import RunSection
from eagle3.config.serving import ServingSection
from eagle3.config.training import TrainingSection
from eagle3.errors import Eagle3Error
from eagle3.procs import ProcessTree, cpu_threads, timestamp, with_threads
from eagle3.procs import GPU_QUERY, on_ssh_host, wait_gpus_free, wrap
from eagle3.stream.session import Session, streaming
from eagle3.stream.store import QUIET_CLIENT, is_client_chatter
from eagle3.train.__main__ import STOPPED_BY_SIGTERM
from eagle3.train.trainer import METRICS_FILE

Log = Callable[[str], None]
TAIL_LINES = 30  # of output in a failure's message
POLL_S = 0.5  # how often metrics.jsonl is read while the trainer runs
RANK_LINE = re.compile(r"^(\S+ )?\[rank\d+\]:")  # torch prefixes a worker's traceback lines with its rank
TORCHRUN_TERMINATED = re.compile(r"SignalException: Process \d+ got signal: (15|SIGTERM)$")


class TrainingFailed(Eagle3Error):
    """The trainer exited with an error."""


class TrainingStopped(Eagle3Error):
    """SIGTERM stopped the trainer (a preemption, a scheduler's time limit): not finished, a re-run resumes."""


# -- commands -----------------------------------------------------------------------------------


def node_command(run: RunSection, training: TrainingSection, resolved: Path | str, python: str) -> list[str]:
    """What runs on each node: the trainer itself, or torchrun starting nproc_per_node of them."""
    entry = ["-m", "eagle3.train", "--config", str(resolved)]
    torchrun = [python, "-m", "torch.distributed.run"]
    if training.nnodes > 1:
        return [*torchrun, "--nnodes", str(training.nnodes), "--nproc-per-node", str(training.nproc_per_node),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", training.rdzv_endpoint, "--rdzv-id", run.name,
                *entry]
    if training.nproc_per_node > 1:
        return [*torchrun, "--standalone", "--nproc-per-node", str(training.nproc_per_node), *entry]
    return [python, *entry]


def launch_commands(run: RunSection, data: DataSection, t: TrainingSection, resolved: Path | str,
                    cwd: Path) -> list[list[str]]:
    """The local processes to start: the node command itself, one srun step, or one ssh per host."""
    if t.launcher == "local":
        return [node_command(run, t, resolved, trainer_python(data, t))]
    command = node_command(run, t, resolved, t.python)
    if t.launcher == "srun":
        # --kill-on-bad-exit: a node that fails takes the others down instead of leaving them at a collective
        counts = [f"--nodes={t.nnodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
        return [wrap(command, "srun", srun_args=[*counts, *t.srun_args])]
    # relative paths in the config resolve against our directory (srun passes our environment on; ssh does not)
    return [on_ssh_host(command, host, cwd, node_env(run, t), t.ssh_args) for host in t.hosts]


def trainer_python(data: DataSection, training: TrainingSection) -> str:
    """Here: this python, or the node's SGLang python when the trainer builds SGLang's model runner (online)."""
    online_sglang = training.features == "online" and data.feature_backend == "sglang"
    return data.sglang_python if online_sglang else sys.executable


def node_env(run: RunSection, training: TrainingSection) -> dict[str, str]:
    """What the trainer's environment must hold on every node: unbuffered output (a pipe would hold its lines back
    until it exits) and each rank's share of the CPU threads (run.cpu_threads, eagle3.procs.cpu_threads)."""
    quiet = QUIET_CLIENT if training.features == "streamed" else {}
    return with_threads({"PYTHONUNBUFFERED": "1", **quiet}, cpu_threads(run.cpu_threads, training.busy_processes_here))


def child_env(run: RunSection, training: TrainingSection) -> dict[str, str]:
    return {**os.environ, **node_env(run, training)}


# -- metrics ------------------------------------------------------------------------------------


class MetricsFollower:
    """Hands out each record the trainer adds to metrics.jsonl, once, and only complete lines.

    The records already there at the start are not handed out. A resumed trainer first rewrites the file down
    to the records up to its checkpoint, then appends: after a rewrite the records are handed out from the
    first line that differs from what was read before.
    """

    def __init__(self, path: Path, log: Log):
        self.path, self.log = path, log
        self.lines: list[bytes] = []  # every complete line read, newline included
        self.offset = 0
        self.poll()

    def poll(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                if self.unchanged(f):
                    f.seek(self.offset)
                    new = self.complete_lines(f.read())
                else:
                    new = self.reread(f)
        except FileNotFoundError:
            return []  # the trainer has not written its first record yet
        self.lines += new
        self.offset += sum(map(len, new))
        return [record for line in new if (record := self.parse(line)) is not None]

    def unchanged(self, f: BinaryIO) -> bool:
        """Whether the file still holds the last line read where it was read."""
        if not self.lines:
            return True
        last = self.lines[-1]
        f.seek(self.offset - len(last))
        return f.read(len(last)) == last

    def reread(self, f: BinaryIO) -> list[bytes]:
        f.seek(0)
        lines = self.complete_lines(f.read())
        kept = 0
        while kept < min(len(lines), len(self.lines)) and lines[kept] == self.lines[kept]:
            kept += 1
        self.lines, self.offset = self.lines[:kept], sum(map(len, lines[:kept]))
        return lines[kept:]

    @staticmethod
    def complete_lines(data: bytes) -> list[bytes]:
        return data[: data.rfind(b"\n") + 1].splitlines(keepends=True)

    def parse(self, line: bytes) -> dict | None:
        try:
            return json.loads(line)
        except ValueError:  # a line torn by a crash, with the next run's first record appended to it
            self.log(f"train: {self.path}: skipping a line that is not JSON: {line[:200]!r}")
            return None


# -- running --------------------------------------------------------------------------------------


def train(run: RunSection, data: DataSection, training: TrainingSection, serving: ServingSection | None,
          resolved: Path | str, log: Log, on_metrics: Callable[[dict], None] | None = None) -> Path:
    """Train as the run's resolved config file `resolved` says (these sections are its own: the launch reads them, the
    trainers the file), in subprocesses; return the directory with best/, final/ and metrics.jsonl. `serving`: the
    server that needs this node's GPUs next (None: a training-only config).

    Raises TrainingStopped when the trainer stopped on SIGTERM (a re-run resumes), TrainingFailed on any other
    failure. However this returns or raises, no process of the training is left running.
    """
    guard.require("starting the trainer")
    train_dir = run.stage_dir("train")
    log_path = run.dir / "logs" / f"train-{timestamp()}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    commands = launch_commands(run, data, training, resolved, Path.cwd())
    prefixes = [f"[{host}] " for host in training.hosts] if len(commands) > 1 else [""]
    metrics = MetricsFollower(train_dir / METRICS_FILE, log)
    output: queue.Queue = queue.Queue()
    recent: deque[str] = deque(maxlen=400)  # enough for the ranks' tracebacks and the tail
    tree, readers = ProcessTree(), []
    # unbuffered: each line is one write to a file opened for appending, so the readers' lines never interleave
    with open(log_path, "ab", buffering=0) as log_file, feature_stream(run, data, training, serving, resolved, log) as stream:
        try:
            for command, prefix in zip(commands, prefixes):
                process = start(command, child_env(run, training))
                tree.add(process)
                log(f"train: process group {process.pid}: {shlex.join(command)} (log {log_path})")
                readers.append(read_output(process, prefix, log_file, recent, output))
            ended = relay(output, tree, log, metrics, on_metrics)
            hand_out(metrics, on_metrics)  # the records written since the last poll
            code = exit_code(tree.processes, ended)
        finally:
            tree.stop(training.stop_grace_s, log)
            for reader in readers:
                reader.join(timeout=5.0)  # a pipe still held open by a stranger must not hold us
    # the next stage's server needs this node's GPUs (docs/gpu-node.md); a training-only config serves nothing next
    if training.launcher == "local" and serving is not None:
        wait_gpus_free(GPU_QUERY, serving.gpu_free_mib, serving.gpu_free_timeout_s, log, "train: ")
    if code != 0 and stream is not None and stream.failure:
        raise TrainingFailed(f"training failed: {stream.failure} (log {log_path})")
    if code == 0:
        log(f"train: done; best/, final/ and {METRICS_FILE} in {train_dir}")
        return train_dir
    if stopped_by_sigterm(code, list(recent)):
        raise TrainingStopped(f"training was stopped by SIGTERM (exit code {code}); run it again to resume from the "
                              f"latest checkpoint in {train_dir / 'checkpoints'} (log {log_path})")
    raise TrainingFailed(failure_message(code, list(recent), log_path))


def feature_stream(run: RunSection, data: DataSection, training: TrainingSection, serving: ServingSection | None,
                   resolved: Path | str, log: Log) -> contextlib.AbstractContextManager[Session | None]:
    """training.features streamed: the master, coordinator and capture workers the trainers read from."""
    if training.features != "streamed":
        return contextlib.nullcontext()
    return streaming(run, data, training, serving, resolved, log)


def start(command: list[str], env: dict[str, str]) -> subprocess.Popen:
    try:
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
    except OSError as err:
        raise TrainingFailed(f"cannot start {command[0]}: {err.strerror}") from None


def read_output(process: subprocess.Popen, prefix: str, log_file: BinaryIO, recent: deque[str],
                output: queue.Queue) -> threading.Thread:
    """A thread that copies the process's lines to the log file and the queue, then queues the process itself.

    A thread keeps the pipe drained whatever the caller does meanwhile (a stop's grace included): a full pipe
    would block the trainer in the middle of its checkpoint.
    """

    def copy() -> None:
        with process.stdout as stream:
            for raw in stream:
                line = raw.decode(errors="replace").rstrip("\r\n")  # ssh -tt ends lines with \r\n
                if is_client_chatter(line):  # a streamed trainer's Mooncake client
                    continue
                line = prefix + line
                log_file.write(line.encode() + b"\n")
                recent.append(line)
                output.put(line)
        output.put(process)

    reader = threading.Thread(target=copy, name=f"train-output-{process.pid}", daemon=True)
    reader.start()
    return reader


def relay(output: queue.Queue, tree: ProcessTree, log: Log, metrics: MetricsFollower,
          on_metrics: Callable[[dict], None] | None) -> list[subprocess.Popen]:
    """Pass lines to `log` and records to `on_metrics` until every process's output ended, or one process
    failed (the other nodes would wait for it at their next collective), or every process exited while a
    stranger holds a pipe open. Return the processes whose output ended, in that order."""
    processes, ended = tree.processes, []
    polled = time.monotonic()
    while len(ended) < len(processes):
        try:
            item = output.get(timeout=POLL_S)
        except queue.Empty:
            item = None
        if isinstance(item, str):
            log(item)
        elif item is not None:
            ended.append(item)
        if time.monotonic() - polled >= POLL_S:
            polled = time.monotonic()
            tree.refresh()  # learn the workers' groups while their launcher is alive to lead us to them
            hand_out(metrics, on_metrics)
        if any(p.poll() not in (None, 0) for p in ended):
            return ended
        if item is None and all(p.poll() is not None for p in processes):
            return ended
    return ended


def hand_out(metrics: MetricsFollower, on_metrics: Callable[[dict], None] | None) -> None:
    for record in metrics.poll():
        if on_metrics is not None:
            on_metrics(record)


def exit_code(processes: list[subprocess.Popen], ended: list[subprocess.Popen]) -> int:
    """The first failure's code; 0 when every process exited cleanly. A process is reaped a moment after its
    output ends, so those are waited for; one still running is left to the stop (another one failed)."""
    for process in ended + [p for p in processes if p not in ended]:
        if code := process.wait() if process in ended else process.poll():
            return code
    return 0


def stopped_by_sigterm(code: int, lines: list[str]) -> bool:
    """The trainer exits 143 once SIGTERM made it save a checkpoint. torchrun passes the signal on to its workers
    (they save) and then exits 1, its SignalException the last thing it prints."""
    if code == STOPPED_BY_SIGTERM:
        return True
    return code == 1 and any(TORCHRUN_TERMINATED.search(line) for line in lines[-TAIL_LINES:])


def failure_message(code: int, lines: list[str], log_path: Path) -> str:
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    message = f"training failed: the trainer {how} (log {log_path})"
    ranks = [line for line in lines if RANK_LINE.match(line)]
    if ranks:  # torchrun's own traceback only says that a worker failed; the workers' lines say why
        message += "\nthe workers' errors:\n" + "\n".join(ranks[-TAIL_LINES:])
    rest = [line for line in lines if not RANK_LINE.match(line)]
    return message + f"\nlast {TAIL_LINES} lines of output:\n" + ("\n".join(rest[-TAIL_LINES:]) or "(none)")
