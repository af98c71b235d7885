"""S3 over real HTTP on 127.0.0.1 for the tests: moto in server mode, and a proxy that misbehaves on purpose.

- `MotoServer`: moto's S3 (the same app `moto.server.ThreadedMotoServer` serves), stoppable and restartable on
  the same port mid-test. moto keeps its buckets in this process, so a restarted server still has them.
- `S3Proxy`: a plain HTTP hop in front of it that can drop If-Match / If-None-Match (a store without
  conditional writes) or flip a byte of uploaded bodies (a corrupting network or store).
- `serve_moto_s3`: the body of a fixture: fake credentials in the environment and a started server.
"""

from __future__ import annotations

import socket
import threading
import uuid
import weakref
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import boto3
import httpx
import pytest
from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)
from werkzeug.serving import ThreadedWSGIServer

HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade",
              "content-length"}
CONDITIONS = {"if-match", "if-none-match"}


class _TrackingServer(ThreadedWSGIServer):
    """Remembers its client connections so that stop() can cut keep-alive ones, as a crashed server would."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.connections: weakref.WeakSet[socket.socket] = weakref.WeakSet()

    def get_request(self):
        connection, address = super().get_request()
        self.connections.add(connection)
        return connection, address


class _Serialized:
    """One request at a time. moto checks If-Match / If-None-Match and then writes, without a lock; AWS does
    both atomically. Serializing requests gives the concurrency tests S3's guarantee, not moto's race."""

    def __init__(self, app):
        self.app, self.lock = app, threading.Lock()

    def __call__(self, environ, start_response):
        with self.lock:
            return self.app(environ, start_response)


class MotoServer:
    def __init__(self, port: int = 0):
        self.port = port
        self._server: _TrackingServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> MotoServer:
        app = _Serialized(DomainDispatcherApplication(create_backend_app))
        self._server = _TrackingServer("127.0.0.1", self.port, app, handler=MotoRequestHandler)
        self.port = self._server.server_port  # the free port the OS chose, kept for a restart
        # a short poll interval: stop() waits for the serve loop to notice, up to one interval
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()  # werkzeug's serve_forever closes the listening socket on its way out
        self._thread.join()
        for connection in list(self._server.connections):
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                continue  # already closed by its handler
        self._server = None

    @property
    def running(self) -> bool:
        return self._server is not None


class S3Proxy:
    """Forwards every request to `upstream` with httpx, after the changes asked for."""

    def __init__(self, upstream: str, strip_conditions: bool = False, corrupt_path_prefix: str | None = None):
        self.upstream, self.strip_conditions, self.corrupt_path_prefix = upstream, strip_conditions, corrupt_path_prefix
        self.client = httpx.Client(timeout=30)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}"

    def start(self) -> S3Proxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        self.client.close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {name: value for name, value in self.headers.items()
                           if name.lower() not in HOP_BY_HOP
                           and not (proxy.strip_conditions and name.lower() in CONDITIONS)}
                if (self.command == "PUT" and body and proxy.corrupt_path_prefix
                        and self.path.startswith(proxy.corrupt_path_prefix)):
                    body = bytes([body[0] ^ 0xFF]) + body[1:]
                with proxy.client.stream(self.command, proxy.upstream + self.path, headers=headers,
                                         content=body) as response:
                    payload = b"".join(response.iter_raw())
                    self.send_response(response.status_code)
                    for name, value in response.headers.multi_items():
                        if name.lower() not in HOP_BY_HOP:
                            self.send_header(name, value)
                    # HEAD: the size of the object, with no body; otherwise the body we relay
                    length = response.headers.get("content-length", "0") if self.command == "HEAD" else len(payload)
                    self.send_header("Content-Length", str(length))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(payload)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = forward

            def log_message(self, format: str, *args) -> None:
                return  # the tests read results, not access logs

        return Handler


def new_bucket(server_url: str) -> str:
    """A fresh bucket (moto's state is per process, shared by all the tests)."""
    bucket = f"eagle3-registry-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=server_url).create_bucket(Bucket=bucket)
    return bucket


def serve_moto_s3(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[MotoServer]:
    """The body of a fixture (`yield from serve_moto_s3(monkeypatch, tmp_path)`): a moto S3 server on a free
    port, with fake credentials that reach boto3 only through the standard chain (environment variables)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    # no config or credentials file from the machine running the tests
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    server = MotoServer().start()
    yield server
    if server.running:
        server.stop()
