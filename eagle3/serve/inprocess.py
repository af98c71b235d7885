"""An ASGI app served by uvicorn in a background thread of this process, on a free 127.0.0.1 port:
for benchmarks and tests that need a real HTTP server without a subprocess."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Iterator

import uvicorn


@contextlib.contextmanager
def serve_in_thread(app, start_timeout_s: float = 30.0) -> Iterator[tuple[str, uvicorn.Server]]:
    """Yield (base url, uvicorn server); `server.should_exit = True` stops it early."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    if not server.started:
        raise RuntimeError("uvicorn did not start")
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", server
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
