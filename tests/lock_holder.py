"""`python lock_holder.py CONFIG SECONDS [OVERRIDE ...]`: a flow run that takes a registry's lock through the flow's
own code path (tasks/lock.registry_lock), prints "holding <flow run id>" and holds it SECONDS (0: lets it go at
once). The lock's tests kill it, or run it as the next holder: a full pipeline run would take minutes."""

import sys
import time

import flows.entry  # noqa: F401  (Prefect's start-up environment, set before Prefect loads)
from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from eagle3.config import load_config
from eagle3.registry.registry import open_registry
from tasks.lock import registry_lock
from tasks.run import ensure_registry_limit, registry_limit_name


@flow(name="lock-holder")
def hold(config: str, overrides: list[str], seconds: float) -> None:
    section = load_config(config, overrides).registry
    log = get_run_logger().info
    with registry_lock(open_registry(section, log=log), registry_limit_name(section), log):
        print(f"holding {flow_run.id}", flush=True)
        time.sleep(seconds)


if __name__ == "__main__":
    config, seconds, overrides = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
    ensure_registry_limit(config, overrides)
    hold(config, overrides, seconds)
