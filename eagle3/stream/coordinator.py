"""The stream's coordinator: hands wanted samples to capture workers in the trainers' order, pauses them between the
watermarks, and frees each sample's store copy once a trainer consumed it. It runs in the train stage's process, the
one that started the workers and the trainers, and answers them over HTTP (JSON bodies, POST /<call>):

    want      {items, priority, first_position, token_bytes}
                                                  trainers: the samples they will read, in order
    claim     {worker, limit} -> {items, paused}  workers: what to capture next, each with the store key its capture
                                                  goes to ({stop: why} ends a worker)
    captured  {worker, key, size, length}         workers: a sample's features are in the store
    take      {items} -> {ready, store_keys} or {error}
                                                  trainers: wait for a micro-batch (asked again until ready)
    consumed  {keys}                              trainers: read; the store's copy is freed
    lost      {keys}                              trainers: the store had no copy; captured again

Memory: captured and not consumed, plus the claims in flight (at the bytes per token seen so far), is the store's
load. At training.stream.high_watermark_gib the workers pause and take only samples a trainer waits for (without
them training could not go on); at low_watermark_gib they go on.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

import httpx

from eagle3.config.stream import StreamSection
from eagle3.errors import Eagle3Error
from eagle3.stream.ledger import Ledger, Wanted
from eagle3.stream.store import GIB, Store

Log = Callable[[str], None]
TAKE_WAIT_S = 1.0  # a take answers within this: the trainer asks again, so a stop is never held up for long
POLL_S = 0.02


class Coordinator:
    def __init__(self, ledger: Ledger, store: Store, stream: StreamSection, log: Log):
        self.ledger, self.store, self.log = ledger, store, log
        self.high, self.low = int(stream.high_watermark_gib * GIB), int(stream.low_watermark_gib * GIB)
        self.lease_s = stream.lease_s
        self.paused = False
        # sizes the claims in flight: the trainers' bound (float32) until a capture measures it
        self.bytes_per_token, self.measured = 0.0, False
        self.peak_bytes = 0
        self.failure: str | None = None  # why the stream cannot go on: the trainers raise it
        self.ended = False  # the session is stopping: workers asking for more stop
        self.workers: dict[str, str | None] = {}  # name -> why it stopped (None: alive)
        self.lock = threading.Lock()
        self.to_free: queue.Queue[str] = queue.Queue()
        self.freeing = threading.Thread(target=self.free_consumed, name="stream-free", daemon=True)
        self.freeing.start()

    def resume(self) -> None:
        """A new session over an earlier run's ledger: the claims died with that run's workers, and what it captured
        is kept only where the store still holds it."""
        released = self.ledger.release()
        captured = self.ledger.stored()
        gone = [key for key, held in zip(captured, self.store.holds(list(captured.values()))) if not held]
        self.ledger.drop(gone)
        if released or captured:
            self.log(f"stream: ledger {self.ledger.path}: {len(captured) - len(gone)} captured sample(s) still in the "
                     f"store, {len(gone)} gone with the last run's store (captured again), {released} claim(s) of "
                     "its workers released")

    # -- the calls --------------------------------------------------------------------------------

    def want(self, items: list[dict], priority: int, first_position: int, token_bytes: int) -> dict:
        """`token_bytes`: a token's features at float32 (the widest dtype a target computes them in)."""
        with self.lock:
            self.bytes_per_token = self.bytes_per_token if self.measured else float(token_bytes)
        self.ledger.want([Wanted(**item) for item in items], priority, first_position)
        return {}

    def claim(self, worker: str, limit: int) -> dict:
        if self.failure or self.ended:
            return {"stop": self.failure or "training ended"}
        self.ledger.release(older_than=time.time() - self.lease_s)
        with self.lock:  # one watermark decision at a time
            load = self.load()
            self.paused = load >= self.high or (self.paused and load > self.low)
            budget = 0 if self.paused or not self.bytes_per_token else int((self.high - load) / self.bytes_per_token)
            items = self.ledger.claim(worker, limit, budget)
        return {"items": [asdict(item) for item in items], "paused": self.paused}

    def captured(self, worker: str, key: str, size: int, length: int) -> dict:
        self.ledger.captured(key, size)
        with self.lock:
            self.bytes_per_token, self.measured = size / max(length, 1), True
            self.peak_bytes = max(self.peak_bytes, self.ledger.totals().stored_bytes)
        return {}

    def take(self, items: list[dict]) -> dict:
        wanted = [Wanted(**item) for item in items]
        keys = [item.key for item in wanted]
        states = self.ledger.demand(wanted)
        deadline = time.monotonic() + TAKE_WAIT_S
        while True:
            if self.failure:
                return {"error": self.failure}
            if all(states.get(key) == "captured" for key in keys):
                stored = self.ledger.stored(keys)
                return {"ready": True, "store_keys": [stored[key] for key in keys]}
            if not self.alive():
                return {"error": "no capture worker is alive: " + "; ".join(
                    f"{name}: {why}" for name, why in self.workers.items())}
            if time.monotonic() > deadline:
                return {"ready": False}
            time.sleep(POLL_S)
            states = self.ledger.states(keys)

    def consumed(self, keys: list[str]) -> dict:
        """Recorded at once; the store's copies are freed by the freeing thread (a remove waits out a read's lease, and
        hangs while a dead master's RPC times out: no trainer waits on either)."""
        stored = self.ledger.stored(keys)
        self.ledger.consumed(keys)
        for key in stored.values():
            self.to_free.put(key)
        return {}

    def free_consumed(self) -> None:
        """The freeing thread: removes consumed samples from the store until the stream fails or ends."""
        while not (self.failure or self.ended):
            try:
                key = self.to_free.get(timeout=TAKE_WAIT_S)
            except queue.Empty:
                continue
            if self.failure or self.ended:
                return  # the session closes the store next: what is left goes with it
            try:
                self.store.remove(key)
            except Eagle3Error:
                if self.failure or self.ended:
                    return  # the store closed under the remove: the stream is over
                raise

    def lost(self, keys: list[str]) -> dict:
        self.log(f"stream: {len(keys)} sample(s) missing from the store when a trainer read them: captured again")
        self.ledger.drop(keys)
        return {}

    # -- the session's reports ------------------------------------------------------------------

    def load(self) -> int:
        """Bytes the store holds or is about to: captured and unconsumed, plus the claims in flight."""
        totals = self.ledger.totals()
        return totals.stored_bytes + int(totals.claimed_tokens * self.bytes_per_token)

    def alive(self) -> list[str]:
        return [name for name, why in self.workers.items() if why is None]

    def worker_started(self, name: str) -> None:
        self.workers[name] = None

    def worker_gone(self, name: str, why: str) -> None:
        self.workers[name] = why
        released = self.ledger.release(worker=name)
        self.log(f"stream: capture worker {name} {why}; its {released} claimed sample(s) go to the others "
                 f"({len(self.alive())} alive)")

    def fail(self, why: str) -> None:
        self.failure = why


CALLS = ("want", "claim", "captured", "take", "consumed", "lost")


def serve(coordinator: Coordinator, host: str, port: int) -> ThreadingHTTPServer:
    """The coordinator's HTTP server on host:port, answering in threads of its own."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            call = self.path.strip("/")
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            if call not in CALLS:
                self.send_error(404, f"no call {call}")
                return
            reply = json.dumps(getattr(coordinator, call)(**body)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args) -> None:  # one line per call would drown the train log
            return

    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except OSError as err:
        raise Eagle3Error(f"the stream's coordinator cannot listen on {host}:{port} ({err.strerror}): set "
                          "training.stream.coordinator_port to a free port") from None
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="stream-coordinator", daemon=True).start()
    return server


def coordinator_url(stream: StreamSection) -> str:
    return f"http://{stream.host}:{stream.coordinator_port}"


class CoordinatorClient:
    """The workers' and trainers' side of the calls."""

    def __init__(self, stream: StreamSection):
        self.url = coordinator_url(stream)
        self.http = httpx.Client(base_url=self.url, timeout=TAKE_WAIT_S + 60.0)

    def call(self, name: str, **payload) -> dict:
        try:
            response = self.http.post(f"/{name}", json=payload)
        except httpx.TransportError as err:
            raise Eagle3Error(f"the stream's coordinator at {self.url} does not answer ({err}): the train stage that "
                              "runs it stopped, or training.stream.host / coordinator_port is not reachable from here")
        response.raise_for_status()
        return response.json()

    def close(self) -> None:
        self.http.close()
