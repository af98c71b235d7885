"""Ports for the servers the tests start: below the kernel's ephemeral range, each pytest-xdist worker its own slice.

A port found with bind(("127.0.0.1", 0)) and closed again is free for anyone to take: a fixture that picks one and
starts its server minutes later can find it held. CI saw that: a micro flow's production port, picked when its
module began, was held for over a minute by some other process (SGLang, for one, takes its torch.distributed
port from the kernel's ephemeral range while the other worker's tests run). The kernel hands out no port below that
range by itself, and the workers' slices do not overlap, so a port from here can only be taken by its own worker's
later tests, which go on up the slice instead of reusing a port just closed. Every port stays below the ephemeral
range, so the ports SGLang derives from its own (its gRPC default is port + 10000) stay under 65536.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

LOWEST = 10000  # below this: ports that services on a developer's machine are more likely to hold
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
IANA_EPHEMERAL_FIRST = 49152  # where the ephemeral range starts without a Linux setting (macOS, the BSDs)


def first_ephemeral_port() -> int:
    return int(EPHEMERAL_RANGE.read_text().split()[0]) if EPHEMERAL_RANGE.exists() else IANA_EPHEMERAL_FIRST


def worker_slice(worker: str, workers: int) -> range:
    """The ports of pytest-xdist worker `worker` ("gw0", "gw1", ...) among `workers`."""
    first_ephemeral = first_ephemeral_port()
    width = (first_ephemeral - LOWEST) // workers
    if width < 100:
        raise RuntimeError(f"the ephemeral port range starts at {first_ephemeral}: too few ports between {LOWEST} "
                           f"and it for {workers} test workers; start it higher ({EPHEMERAL_RANGE}) or run fewer")
    start = LOWEST + int(worker.removeprefix("gw")) * width
    return range(start, start + width)


SLICE = worker_slice(os.environ.get("PYTEST_XDIST_WORKER", "gw0"),
                     int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
_next_candidates = itertools.cycle(SLICE)


def free_port() -> int:
    """The next port of this worker's slice that nothing holds now."""
    for port in itertools.islice(_next_candidates, len(SLICE)):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"every port in {SLICE.start}-{SLICE.stop - 1} is held; is a test leaking servers?")


class AnswersEverything(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        return  # keep the test's output clean


@contextlib.contextmanager
def held_port(port: int) -> Iterator[None]:
    """Another server holding 127.0.0.1:`port` (answering 200 to anything) for the block: a server the pipeline starts
    there must be refused, not mistaken for healthy."""
    squatter = ThreadingHTTPServer(("127.0.0.1", port), AnswersEverything)
    threading.Thread(target=squatter.serve_forever, daemon=True).start()
    try:
        yield
    finally:
        squatter.shutdown()
        squatter.server_close()
