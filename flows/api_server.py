"""The temporary Prefect API's process (flows/api.py): uvicorn on Prefect's app factory in ephemeral mode, stopping as
on a SIGTERM once the `eagle3 run` that started it is gone, a SIGKILL of it (an out-of-memory killer's) included.
Without that, a killed run's API would keep its port, its memory and the SQLite database the next run's API opens.

    python -m flows.api_server PARENT_PID PORT
"""

from __future__ import annotations

import os
import signal
import sys

import uvicorn

from eagle3.procs import on_parent_exit


def main(argv: list[str] | None = None) -> None:
    parent, port = (int(arg) for arg in (sys.argv[1:] if argv is None else argv))
    on_parent_exit(parent, lambda: os.kill(os.getpid(), signal.SIGTERM))  # uvicorn's graceful shutdown
    uvicorn.run("prefect.server.api.server:create_app", factory=True, host="127.0.0.1", port=port,
                log_level="error", lifespan="on")


if __name__ == "__main__":
    main()
