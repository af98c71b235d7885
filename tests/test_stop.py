"""A stopped `eagle3 run` says it was a stop and leaves nothing held.

`eagle3 run` stopped by SIGTERM to its process group (as `timeout` sends it) during training: last line, exit status,
no process left, the flow run Crashed with the message; the next run on the registry goes straight to its stages and
resumes training, and when it is killed with SIGKILL (its process alone) no process of it is left within seconds; the
run after that takes over the killed run's lock (its process on this host is dead), promotes, and its last line is its
decision (e2e: three flow runs, ~2.5 min). The lock across Prefect APIs and machines: tests/test_registry_lock.py.
"""

import os
import signal
import sqlite3
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from eagle3.resolve import load_config
from eagle3.train.trainer import METRICS_FILE
from helpers import TINY, Processes, micro_run_overrides, tail, wait_for

ROOT = Path(__file__).resolve().parent.parent
CONFIG = str(TINY)


def run_env(tmp_path: Path, marker: str, **extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("PREFECT_")}
    env.update({"PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120", "PYTHONPATH": str(ROOT),
                "OMP_NUM_THREADS": "1", "EAGLE3_STOP_TEST": marker, **extra})
    return env


def metric_lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.e2e
def test_a_stopped_run_says_so_holds_nothing_and_a_killed_one_leaves_no_process(micro_target, tmp_path):
    marker = uuid.uuid4().hex
    env = run_env(tmp_path, marker)
    processes = Processes(env, ("EAGLE3_STOP_TEST", marker), tmp_path)
    # long enough that each stop lands in training (a few steps in), short enough that the last run finishes it
    overrides = micro_run_overrides(tmp_path / "run", micro_target) + ["training.max_steps=60"]
    metrics = load_config(CONFIG, overrides).stage_dir("train") / METRICS_FILE
    command = [sys.executable, "-m", "eagle3.cli", "run", CONFIG, *[arg for o in overrides for arg in ("--set", o)]]

    def run_until_training(attempt: str) -> tuple[subprocess.Popen, Path]:
        before = metric_lines(metrics)
        run, log = processes.start(f"{attempt}-run", command, cwd=ROOT)
        seconds = wait_for(lambda: run.poll() is not None or metric_lines(metrics) > before + 1, 240,
                           "training steps", log)
        print(f"{attempt} run: training after {seconds:.0f} s")
        return run, log

    try:
        run, log = run_until_training("stopped")
        os.killpg(run.pid, signal.SIGTERM)  # the whole group, as `timeout` and a terminal's Ctrl-C do
        assert run.wait(timeout=120) == 128 + signal.SIGTERM, tail(log)
        lines = log.read_text().splitlines()
        assert lines[-1] == "eagle3 run: stopped by SIGTERM during train; a re-run resumes", tail(log)
        assert processes.sweep() == []  # the trainer, the temporary Prefect API: gone with the run
        assert not any("registry lock: waiting" in line for line in lines), tail(log)

        # the run's process alone, as an out-of-memory killer ends it: no clean-up of its own runs, yet its trainer
        # and its temporary Prefect API (which watches it) exit within seconds
        run, log = run_until_training("killed")
        assert any("train: resumed from" in line for line in log.read_text().splitlines()), tail(log)
        run.kill()
        assert run.wait(timeout=10) == -signal.SIGKILL
        gone = wait_for(lambda: not processes.marked(), 20, "exit of the killed run's processes", log)
        print(f"killed run: its processes gone {gone:.1f} s after the kill")
        # the next run takes over the killed run's lock, saying whose it was, resumes and promotes: its last line is its
        # decision (the logs Prefect still had queued were sent before its temporary API stopped)
        run, log = processes.start("finishing-run", command, cwd=ROOT)
        assert run.wait(timeout=600) == 0, tail(log)
        lines = log.read_text().splitlines()
        assert lines[-1].startswith("decision: promoted "), tail(log)
        # the artifacts this run made, read from its flow run: the stages it ran, not the ones the cache skipped
        listed = next(line for line in lines if line.startswith("artifacts ("))
        made = listed.split("(")[1].split(")")[0].split(", ")
        assert {"train-progress", "training", "export-validation", "acceptance", "decision"} <= set(made), made
        assert "data" not in made and "vocab" not in made, made
        # its temporary API is gone with it: the summary says where the artifacts stay and how to open them
        assert "run `prefect server start` and open http://127.0.0.1:4200/v2/runs/flow-run/" in listed, listed
        assert any("registry lock: took over" in line and "is dead" in line for line in lines), tail(log)
        assert any("train: resumed from" in line for line in lines), tail(log)
        assert not any("Error logging to API" in line for line in lines), tail(log)
        with sqlite3.connect(tmp_path / "prefect-home" / "prefect.db") as db:
            ended = db.execute("select s.type, s.message from flow_run r join flow_run_state s on s.id = r.state_id "
                               "order by r.created").fetchall()
        assert [state for state, _ in ended] == ["CRASHED", "RUNNING", "COMPLETED"]  # nobody told Prefect of the kill
        assert ended[0][1] == "stopped by SIGTERM during train; a re-run resumes"
    finally:
        processes.stop()
