"""`python lock_holder.py CONFIG SECONDS [OVERRIDE ...]`: a flow run that takes a registry's lock through the flow's
own code path (tasks/lock.flow_run_lock), prints "holding <flow run id>", holds it SECONDS (0: lets it go at once),
then prints "released". The lock's tests kill it, or run it as the next holder: a full pipeline run would take
minutes. A holder that lost its lock meanwhile prints the guard's refusal and exits 4, as `eagle3 run` does."""

import sys
import time

import flows.entry  # noqa: F401  (Prefect's start-up environment, set before Prefect loads)
from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from eagle3 import guard
from eagle3.resolve import load_config
from tasks.lock import flow_run_lock


@flow(name="lock-holder")
def hold(config: str, overrides: list[str], seconds: float) -> None:
    section = load_config(config, overrides).registry
    log = get_run_logger().info
    with flow_run_lock(section, log):
        print(f"holding {flow_run.id}", flush=True)
        time.sleep(seconds)
        guard.require("the next side effect")  # what a pipeline run does before its next server start or publish
    print("released", flush=True)


if __name__ == "__main__":
    config, seconds, overrides = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
    state = hold(config, overrides, seconds, return_state=True)
    if state.is_failed() and isinstance(lost := state.result(raise_on_failure=False), guard.LockLost):
        print(f"lock-holder: {lost}", flush=True)
        sys.exit(4)
    sys.exit(0 if state.is_completed() else 1)
