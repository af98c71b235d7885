"""The Mooncake store the features stream through, and the master the pipeline may start for it.

Mooncake (PyPI `mooncake-transfer-engine-non-cuda` on a CPU machine, `mooncake-transfer-engine` on the node; the apt
libraries libibverbs1, librdmacm1 and libnuma1 beside it) keeps objects in the memory segments its clients mount.
Only the coordinator mounts one (training.stream.store_gib): a worker that dies takes none of the captured features
with it. Workers and trainers mount nothing and move bytes through their transfer buffer.

A sample's features are one tensor [T, (n_aux + 1) * H]: the aux states then the last hidden state, in the dtype the
target computed them (bf16 on a GPU, the target's dtype on the CPU, as in-rank online training reads them). Its key
is the content's: the feature settings and the token ids, so a store shared by runs never serves another target's,
layers' or tokens' features.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import torch

from eagle3.config.stream import StreamSection
from eagle3.errors import Eagle3Error

GIB = 1 << 30
TRANSFER_BUFFER = 256 << 20  # each client's staging memory for puts and gets
LEASE_MS = 200  # how long a read pins an object: the coordinator frees a consumed sample after it
MASTER_START_S = 30.0
# Mooncake logs every client's set-up and transfers at INFO; a worker's or trainer's log keeps its errors (its own
# variable: glog's GLOG_minloglevel does not reach it)
QUIET_CLIENT = {"MC_LOG_LEVEL": "ERROR"}
GLOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d")  # Mooncake's (glog's) line prefix: level, date, time


def is_client_chatter(line: str) -> bool:
    """A Mooncake client's INFO line (printed before its level is read), or glog's note that it logs before its
    set-up: not worth a log line."""
    return (line.startswith("I") and bool(GLOG_LINE.match(line))) or line.startswith(
        "WARNING: Logging before InitGoogleLogging")


def reachable_address(host: str, port: int) -> str:
    """This machine's address on the route to host:port: what the store's other clients reach it by."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))  # UDP: picks the route, sends nothing
        return probe.getsockname()[0]
MISSING_LIBRARIES = ("Mooncake needs the system libraries libibverbs1, librdmacm1 and libnuma1 (Debian: apt-get install "
                     "libibverbs1 librdmacm1 libnuma1) and the PyPI package mooncake-transfer-engine-non-cuda (CPU) or "
                     "mooncake-transfer-engine (GPU node): pip install 'eagle3[stream]'")


def content_key(settings: str, input_ids: torch.Tensor) -> str:
    """The store key of one sample's features: `settings` (feature_settings) and its token ids [T]."""
    digest = hashlib.sha256(settings.encode())
    digest.update(input_ids.to(torch.int64).contiguous().numpy().tobytes())
    return "eagle3/" + digest.hexdigest()[:40]


def feature_settings(settings: dict) -> str:
    """What a sample's features depend on besides its tokens (eagle3.data.capture.capture_settings), as key text."""
    return json.dumps(settings, sort_keys=True)


def import_store():
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as err:
        raise Eagle3Error(f"training.features streamed: cannot import Mooncake ({err}). {MISSING_LIBRARIES}") from None
    return MooncakeDistributedStore


class Store:
    """One Mooncake client. `segment_bytes`: the memory it lends the store (0: a pure client). Calls are serialised
    and refused after close: the coordinator's HTTP threads share one client, and a call into a closed one crashes
    the process."""

    def __init__(self, stream: StreamSection, local_host: str, segment_bytes: int = 0):
        self.master = stream.master_address()
        self.lock = threading.Lock()
        self.client = import_store()()
        code = self.client.setup(local_host, stream.metadata_url(), segment_bytes, TRANSFER_BUFFER, stream.protocol,
                                 stream.rdma_devices, self.master)
        if code != 0:
            raise Eagle3Error(f"cannot join the Mooncake store: setup returned {code} for master {self.master} "
                              f"(metadata {stream.metadata_url()}); is the master running and reachable from "
                              f"{local_host}? (training.stream.master, metadata_port)")

    @classmethod
    def client(cls, stream: StreamSection) -> Store:
        """A worker's or trainer's client: no memory of its own, on its address toward the coordinator."""
        return cls(stream, reachable_address(stream.host, stream.coordinator_port))

    @contextlib.contextmanager
    def open_client(self):
        with self.lock:
            if self.client is None:
                raise Eagle3Error("the Mooncake client is closed: the stream stopped")
            yield self.client

    def put(self, key: str, features: torch.Tensor) -> None:
        with self.open_client() as client:
            code = client.put_tensor(key, features.contiguous())
        if code != 0:
            raise Eagle3Error(f"putting {key} ({features.numel() * features.element_size():,} bytes) into the "
                              f"Mooncake store failed with code {code}: the master {self.master} is gone or the store "
                              "is full (training.stream.store_gib, high_watermark_gib)")

    def get(self, key: str) -> torch.Tensor | None:
        """The tensor under `key`, or None when the store does not hold it."""
        with self.open_client() as client:
            return client.get_tensor(key)

    def holds(self, keys: list[str]) -> list[bool]:
        with self.open_client() as client:
            return [client.is_exist(key) == 1 for key in keys]

    def remove(self, key: str, wait_s: float = 2.0) -> None:
        """Free `key`; a read's lease (LEASE_MS) may hold it a moment. One already gone is fine."""
        deadline = time.monotonic() + wait_s
        while True:
            with self.open_client() as client:
                if client.remove(key) == 0 or client.is_exist(key) != 1 or time.monotonic() > deadline:
                    return
            time.sleep(LEASE_MS / 4000)

    def close(self) -> None:
        with self.lock:
            if self.client is not None:
                self.client.close()
                self.client = None


def master_binary() -> str:
    """mooncake_master beside this python (a venv's bin), else on PATH."""
    beside = Path(sys.executable).with_name("mooncake_master")
    found = str(beside) if beside.exists() else shutil.which("mooncake_master")
    if found is None:
        raise Eagle3Error(f"training.stream.master start: no mooncake_master beside {sys.executable} or on PATH. "
                          f"{MISSING_LIBRARIES}")
    return found


def master_command(stream: StreamSection) -> list[str]:
    return [master_binary(), f"--rpc_port={stream.master_port}", "--enable_http_metadata_server=true",
            f"--http_metadata_server_port={stream.metadata_port}", f"--default_kv_lease_ttl={LEASE_MS}",
            "--metrics_port=0", "--enable_metric_reporting=false"]  # its admin server on any free port; no log lines


def start_master(stream: StreamSection, log_path: Path) -> subprocess.Popen:
    """Start mooncake_master here and wait until its metadata server answers."""
    with open(log_path, "ab") as out:
        process = subprocess.Popen(master_command(stream), stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True, env=os.environ.copy())
    deadline = time.monotonic() + MASTER_START_S
    while not metadata_answers(stream):
        if process.poll() is not None:
            raise Eagle3Error(f"mooncake_master exited with code {process.returncode} at start (ports "
                              f"{stream.master_port}, {stream.metadata_port} in use? "
                              f"training.stream.master_port, metadata_port); its log: {log_path}")
        if time.monotonic() > deadline:
            process.kill()
            raise Eagle3Error(f"mooncake_master did not answer on {stream.metadata_url()} within {MASTER_START_S:g} "
                              f"s; its log: {log_path}")
        time.sleep(0.1)
    return process


def metadata_answers(stream: StreamSection) -> bool:
    """Whether the master's metadata server answers (any status: 404 for the unknown key says it is up)."""
    try:
        httpx.get(stream.metadata_url(), params={"key": "eagle3-probe"}, timeout=1.0)
    except httpx.TransportError:
        return False
    return True
