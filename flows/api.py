"""The Prefect API of `eagle3 run` when none is configured: Prefect's ephemeral server, but in a session of its own.

Prefect starts its ephemeral API as a child in the caller's process group, so the SIGINT of a Ctrl-C, or the
SIGTERM a `timeout` wrapper sends to its group, stops the API at the same moment as the run: the run's clean-up
(the registry lock's release, its flow run's final state) then finds no API ("All connection attempts failed") and
the lock's slot stays taken in the database. Started here in a session of its own, the API outlives the run's
clean-up and is stopped last; and it stops itself when the run is gone without a clean-up (SIGKILL:
flows/api_server.py). Same server, same database (PREFECT_HOME's) and same services as Prefect's ephemeral one:
uvicorn on Prefect's app factory in ephemeral mode. Imported before Prefect: PREFECT_API_URL must be set before
Prefect reads its settings.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx

from eagle3.procs import ProcessTree
from eagle3.errors import Eagle3Error

START_TIMEOUT_S = float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120"))
STOP_GRACE_S = 10.0


def free_port() -> int:
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def run_api(log=print) -> Iterator[str | None]:
    """Yield the API URL this process uses: the configured one (None: nothing started), else a temporary server's,
    stopped when the block ends (a stop of this process included)."""
    if os.environ.get("PREFECT_API_URL"):
        yield None
        return
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    command = [sys.executable, "-m", "flows.api_server", str(os.getpid()), str(port)]
    env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    server = subprocess.Popen(command, env=env, start_new_session=True)
    tree = ProcessTree([server])
    try:
        wait_healthy(url, server)
        os.environ["PREFECT_API_URL"] = url
        yield url
    finally:
        send_queued_logs()
        tree.stop(STOP_GRACE_S, log)


def send_queued_logs() -> None:
    """Prefect ships a run's logs from a queue; what is still queued at exit goes to an API that has stopped, and
    the run's output would end in "Error logging to API" after its decision. Sent now, while the API is up."""
    handlers = sys.modules.get("prefect.logging.handlers")  # not loaded: nothing ran on Prefect, nothing queued
    if handlers is not None:
        handlers.APILogHandler().flush()


def wait_healthy(url: str, server: subprocess.Popen) -> None:
    end = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < end:
        if server.poll() is not None:
            raise Eagle3Error(f"the temporary Prefect API server exited with status {server.returncode} before "
                              "answering; its error is above; or set PREFECT_API_URL to a running server")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        time.sleep(0.2)
    raise Eagle3Error(f"the temporary Prefect API server did not answer {url}/health within {START_TIMEOUT_S:.0f} s "
                      "(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS); or set PREFECT_API_URL to a running server")
