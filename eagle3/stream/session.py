"""What the train stage runs around the trainers when training.features is streamed: the Mooncake master (when
training.stream.master is start), the coordinator with the store's memory and the ledger, and the capture workers
(here, or through ssh on training.stream.capture_hosts). A supervisor thread watches them: a worker that exits hands
its claims to the others; a master that exits (or stops answering) fails the stream, which the trainers report and
the train stage raises, naming it. Everything stops when the session ends, however it ends."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections import deque
from dataclasses import asdict
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Callable

from eagle3.config.data import DataSection
from eagle3.config.run import RunSection
from eagle3.config.serving import ServingSection
from eagle3.config.stream import StreamSection
from eagle3.config.training import TrainingSection
from eagle3.data.storage import human_bytes
from eagle3.fsutil import atomic_write_json
from eagle3.procs import ProcessTree, cpu_threads, on_ssh_host, with_threads
from eagle3.stream.coordinator import Coordinator, serve
from eagle3.stream.ledger import Ledger
from eagle3.stream.store import (GIB, GLOG_LINE, QUIET_CLIENT, Store, is_client_chatter, metadata_answers,
                                 start_master)

Log = Callable[[str], None]
WATCH_S = 0.5
STREAM_DIR = "stream"
LEDGER_FILE = "ledger.sqlite"
SUMMARY_FILE = "summary.json"
FREEING_JOIN_S = 5.0  # the freeing thread's wait for a key (1 s) and a remove's wait on a read's lease (2 s), and room


def ledger_path(run: RunSection) -> Path:
    return run.stage_dir("train") / STREAM_DIR / LEDGER_FILE


class Worker:
    """A capture worker's process and the last lines it printed (what its exit is reported with)."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], log: Log):
        self.name = name
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self.tail: deque[str] = deque(maxlen=5)
        self.reported = False
        threading.Thread(target=self.relay, args=(log,), name=f"stream-{name}", daemon=True).start()

    def relay(self, log: Log) -> None:
        """The worker's lines to the log, Mooncake's chatter left out; its own lines kept for its exit's report."""
        with self.process.stdout as stream:
            for raw in stream:
                line = raw.decode(errors="replace").rstrip("\r\n")
                if is_client_chatter(line):
                    continue
                if not GLOG_LINE.match(line):  # Mooncake's warnings are logged, not kept as the worker's last word
                    self.tail.append(line)
                log(f"[{self.name}] {line}")

    def why_gone(self) -> str:
        code = self.process.returncode
        # a worker that ends itself prints why last; one killed by a signal (code < 0) said nothing about it
        said = f": {self.tail[-1]}" if self.tail and code > 0 else ""
        return f"exited with code {code}{said}"


class Session:
    def __init__(self, run: RunSection, data: DataSection, training: TrainingSection, replica_ranks: int,
                 resolved: Path | str, log: Log):
        """`replica_ranks`: the processes (GPUs) of one capture worker (replica_ranks())."""
        self.run, self.data, self.training, self.resolved, self.log = run, data, training, str(resolved), log
        self.replica_ranks = replica_ranks
        self.stream = training.stream
        self.master_tree, self.workers_tree = ProcessTree(), ProcessTree()
        self.master: subprocess.Popen | None = None
        self.workers: list[Worker] = []
        self.stopping = threading.Event()
        self.store: Store | None = None
        self.ledger: Ledger | None = None
        self.coordinator: Coordinator | None = None
        self.server: ThreadingHTTPServer | None = None

    def start(self) -> None:
        stream = self.stream
        if stream.master == "start":
            log_path = self.run.dir / "logs" / "mooncake-master.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            self.master = start_master(stream, log_path)
            self.master_tree.add(self.master)
            self.log(f"stream: started mooncake_master on {stream.master_address()} (log {log_path})")
        self.store = Store(stream, stream.host, int(stream.store_gib * GIB))  # the store's memory lives here
        self.ledger = Ledger(ledger_path(self.run))
        self.coordinator = Coordinator(self.ledger, self.store, stream, self.log)
        self.coordinator.resume()
        self.server = serve(self.coordinator, stream.host, stream.coordinator_port)
        for name, command, variables in self.worker_commands():
            worker = Worker(name, command, {**os.environ, **variables}, self.log)
            self.workers_tree.add(worker.process)
            self.workers.append(worker)
            self.coordinator.worker_started(name)
        self.log(f"stream: coordinator on {stream.host}:{stream.coordinator_port}, store {stream.store_gib:g} GiB "
                 f"(watermarks {stream.low_watermark_gib:g}-{stream.high_watermark_gib:g} GiB), "
                 f"{len(self.workers)} capture worker(s): {', '.join(w.name for w in self.workers)}")
        threading.Thread(target=self.watch, name="stream-watch", daemon=True).start()

    def worker_commands(self) -> list[tuple[str, list[str], dict[str, str]]]:
        """(name, command, its variables) of each capture worker."""
        stream = self.stream
        remote = bool(stream.capture_hosts)
        python = self.data.sglang_python if self.data.feature_backend == "sglang" else (
            self.training.python if remote else sys.executable)
        ranks = self.replica_ranks
        launcher = [python] if ranks == 1 else [python, "-m", "torch.distributed.run", "--standalone",
                                                 "--nproc-per-node", str(ranks)]
        commands = []
        for node, host in enumerate(stream.capture_hosts or ["here"]):
            for replica in range(stream.workers_per_host):
                name = f"capture-{node}-{replica}"
                command = [*launcher, "-m", "eagle3.stream.worker", "--config", self.resolved, "--name", name]
                variables = self.worker_variables(replica)
                if remote:
                    command = on_ssh_host(command, host, Path.cwd(), variables, self.training.ssh_args)
                commands.append((name, command, variables))
        return commands

    def worker_variables(self, replica: int) -> dict[str, str]:
        """Unbuffered lines, the replica's own GPUs on its node, and each process's share of the node's CPU threads."""
        ranks = self.replica_ranks
        gpus = ",".join(str(gpu) for gpu in range(replica * ranks, (replica + 1) * ranks))
        here = not self.stream.capture_hosts and self.training.launcher == "local"  # beside the trainers
        threads = cpu_threads(self.run.cpu_threads, self.training.busy_processes_here if here else
                              self.stream.workers_per_host * ranks)
        # TQDM_DISABLE: the target's load bar is no line worth relaying
        return with_threads({"PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1", "CUDA_VISIBLE_DEVICES": gpus,
                             **QUIET_CLIENT}, threads)

    def watch(self) -> None:
        """Report each worker's exit to the coordinator, and fail the stream when the master is gone."""
        while not self.stopping.wait(WATCH_S):
            for worker in self.workers:
                if worker.process.poll() is not None and not worker.reported:
                    worker.reported = True
                    self.coordinator.worker_gone(worker.name, worker.why_gone())
            if self.coordinator.failure is None and (problem := self.master_problem()):
                self.log(f"stream: {problem}")
                self.coordinator.fail(problem)

    def master_problem(self) -> str | None:
        address = self.stream.master_address()
        if self.master is not None and self.master.poll() is not None:
            return (f"the Mooncake master on {address} (pid {self.master.pid}) exited with code "
                    f"{self.master.returncode}; the features in its store are gone. Run the train stage again: it "
                    f"resumes from the latest checkpoint and the ledger {ledger_path(self.run)}")
        if self.master is None and not metadata_answers(self.stream):
            return (f"the Mooncake master at {address} stopped answering ({self.stream.metadata_url()}); start it "
                    "again and run the train stage again to resume")
        return None

    @property
    def failure(self) -> str | None:
        return self.coordinator.failure

    def stop(self) -> None:
        self.stopping.set()
        if self.coordinator is not None:
            self.summarise()
            self.coordinator.ended = True  # workers asking for more stop on their own
        self.workers_tree.stop(self.training.stop_grace_s, self.log)
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
        if self.coordinator is not None and not self.coordinator.failure:
            # a remove under way ends before the store closes (after a failure it may hang on the master's RPC)
            self.coordinator.freeing.join(timeout=FREEING_JOIN_S)
        if self.store is not None:  # before the master: its segment is unmounted there
            self.close_store()
        if self.ledger is not None:
            self.ledger.close()
        self.master_tree.stop(self.training.stop_grace_s, self.log)

    def summarise(self) -> None:
        """The ledger's totals and the store's peak, logged and written beside the ledger (summary.json)."""
        totals = self.ledger.totals()
        summary = {**asdict(totals), "peak_bytes": self.coordinator.peak_bytes,
                   "high_watermark_bytes": self.coordinator.high, "failure": self.coordinator.failure,
                   "workers": {name: why or "running at the end" for name, why in self.coordinator.workers.items()}}
        atomic_write_json(ledger_path(self.run).with_name(SUMMARY_FILE), summary)
        self.log(f"stream: {totals.captures} capture(s) of {totals.samples} sample(s), {totals.consumptions} "
                 f"consumed, {totals.dropped} captured again after their store copy was lost; store peak "
                 f"{human_bytes(self.coordinator.peak_bytes)} (high watermark {human_bytes(self.coordinator.high)})")

    def close_store(self) -> None:
        """Unmount the store's memory. After a failure the master may be gone, and the unmount retries its RPC for
        ~15 s: then it closes in the background, holding up nothing."""
        if self.coordinator is not None and self.coordinator.failure:
            threading.Thread(target=self.store.close, name="stream-store-close", daemon=True).start()
        else:
            self.store.close()


def replica_ranks(stream: StreamSection, data: DataSection, serving: ServingSection | None) -> int:
    """Processes of one capture worker: training.stream.replica_ranks, else SGLang's runner over serving.tp GPUs."""
    if stream.replica_ranks is not None:
        return stream.replica_ranks
    return serving.tp if data.feature_backend == "sglang" and serving is not None else 1


@contextlib.contextmanager
def streaming(run: RunSection, data: DataSection, training: TrainingSection, serving: ServingSection | None,
              resolved: Path | str, log: Log) -> Iterator[Session]:
    """The stream for the trainers started inside; stopped however the block ends."""
    session = Session(run, data, training, replica_ranks(training.stream, data, serving), resolved, log)
    try:
        session.start()
        yield session
    finally:
        session.stop()
