"""What every task shares: the run logger as the library's `log`."""

from __future__ import annotations

from prefect import get_run_logger


def log_to_run():
    """The library's `log(line)` callback, writing into the Prefect run's log."""
    return get_run_logger().info
