"""Wall time of the demo (`make demo` without the install) split by stage, and Prefect's orchestration overhead:
the flow's wall time minus the sum of the stages' own time, as a share of the flow's wall time.

    python benchmarks/demo.py [--set section.field=value ...]

Runs in a fresh run directory and registry under runs/bench-demo/ (removed first) and a throwaway PREFECT_HOME,
so every stage does its work (nothing is cached). The tiny target is built once under runs/targets/tiny and
reused; its build time is reported when it happens.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="eagle3-bench-demo-prefect-")

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    args = parser.parse_args()

    from eagle3.runtime.tiny import TINY, build_tiny_target
    from prefect.client.orchestration import get_client

    from flows.eagle3 import eagle3
    from flows.summary import stage_rows

    start = time.perf_counter()
    build_tiny_target(ROOT / "runs" / "targets" / "tiny", TINY)
    target_s = time.perf_counter() - start
    run_dir = ROOT / "runs" / "bench-demo"
    shutil.rmtree(run_dir, ignore_errors=True)
    config = str(ROOT / "configs" / "tiny-cpu.yaml")
    overrides = [f"run.dir={run_dir}", f"registry.path={run_dir / 'registry'}",
                 f"production.state_dir={run_dir / 'production'}", f"target.path={ROOT / 'runs' / 'targets' / 'tiny'}",
                 *args.overrides]
    start = time.perf_counter()
    with get_client(sync_client=True) as client:  # the first call starts the ephemeral API (and migrates its database)
        client.hello()
    api_s = time.perf_counter() - start
    start = time.perf_counter()
    state = eagle3(config, overrides, return_state=True)
    flow_s = time.perf_counter() - start
    rows = stage_rows(state.state_details.flow_run_id)
    work = sum(seconds for _, _, seconds in rows)
    print(f"{'stage':24s} {'seconds':>8s} {'share':>7s}")
    for name, _, seconds in rows:
        print(f"{name:24s} {seconds:8.1f} {seconds / flow_s:7.1%}")
    print(f"{'sum of stages':24s} {work:8.1f} {work / flow_s:7.1%}")
    print(f"{'flow wall time':24s} {flow_s:8.1f}   final state {state.name}")
    print(f"orchestration overhead: {flow_s - work:.1f} s = {(flow_s - work) / flow_s:.1%} of the flow's wall time")
    print(f"outside the flow: tiny target {target_s:.1f} s (0 when reused), Prefect API start {api_s:.1f} s")
    print(f"demo total (without the install): {target_s + api_s + flow_s:.1f} s")


if __name__ == "__main__":
    main()
