"""A stopped `eagle3 run` says it was a stop and leaves nothing held; the registry's lock cannot outlive its holder.

- the holder record and the rule that tells a gone holder from a live one (no Prefect);
- `eagle3 run` stopped by SIGTERM to its process group (as `timeout` sends it) during training: last line, exit
  status, no process left, the flow run Crashed with the message; the next run on the registry goes straight to its
  stages and resumes training, and when it is killed with SIGKILL (its process alone) no process of it is left
  within seconds; the run after that frees the killed run's slot, promotes, and its last line is its decision
  (e2e: three flow runs, ~2.5 min);
- a holder killed with SIGKILL, then the Prefect server restarted (its leases are in its memory, the slot count in
  its database): the next holder frees the slot and says whose it was; `eagle3 registry unlock` frees one by hand.
  A real `prefect server start` of its own; the holders are a small flow taking the lock through the same code.
"""

import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path

import httpx
import pytest

from eagle3.config import load_config
from eagle3.registry.lock import LAPSE_S, Holder, clear_holder, holder_gone, read_holder, renew_holder, write_holder
from eagle3.registry.registry import open_registry
from eagle3.registry.store import LocalStore
from eagle3.train.trainer import METRICS_FILE
from helpers import TINY, Processes, micro_run_overrides, tail, wait_healthy
from tasks.run import registry_limit_name
from ports import free_port

ROOT = Path(__file__).resolve().parent.parent
CONFIG = str(TINY)
HOLDER = str(Path(__file__).with_name("lock_holder.py"))
NEXT_RUN_S = 90.0  # the bound on a run's start behind a dead holder: Python, Prefect, the flow run, the lock


def dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_a_holder_holds_until_its_run_ends_its_process_dies_or_its_record_lapses():
    holder = Holder.here("run-1")
    assert holder_gone(holder, "RUNNING") is None
    assert holder_gone(holder, "CRASHED") == "its flow run run-1 is crashed"
    assert "unknown to the Prefect API" in holder_gone(holder, None)
    dead = replace(holder, pid=dead_pid())
    assert holder_gone(dead, "RUNNING") == f"its process {dead.pid} on {dead.host} is dead"
    elsewhere = replace(dead, host="another-node")
    assert holder_gone(elsewhere, "RUNNING") is None  # a process id means nothing on another host
    later = datetime.fromisoformat(holder.renewed) + timedelta(seconds=LAPSE_S + 1)
    assert "has not renewed its record" in holder_gone(elsewhere, "RUNNING", now=later)


def test_of_two_waiters_that_saw_one_dead_holder_only_one_frees_it(tmp_path):
    store = LocalStore(tmp_path / "registry")
    holder = Holder.here("run-1")
    write_holder(store, holder)
    seen, etag = read_holder(store)
    assert seen == holder
    assert clear_holder(store, etag) and not clear_holder(store, etag)  # the second saw a record that is gone
    assert read_holder(store)[0] is None
    assert not renew_holder(store, holder)  # the freed holder's renewal no longer writes its record back


def run_env(tmp_path: Path, marker: str, **extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("PREFECT_")}
    env.update({"PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120", "PYTHONPATH": str(ROOT),
                "OMP_NUM_THREADS": "1", "EAGLE3_STOP_TEST": marker, **extra})
    return env


def wait_for(condition, timeout_s: float, what: str, log: Path) -> float:
    """Seconds until `condition()`; fails with the log's tail after `timeout_s`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"no {what} within {timeout_s:.0f} s:\n{tail(log)}")
        time.sleep(0.3)
    return time.monotonic() - start


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
        # the next run frees the killed run's slot, saying whose it was, resumes and promotes: its last line is its
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
        assert any("registry lock: freed the slot of" in line and "is dead" in line for line in lines), tail(log)
        assert any("train: resumed from" in line for line in lines), tail(log)
        assert not any("Error logging to API" in line for line in lines), tail(log)
        with sqlite3.connect(tmp_path / "prefect-home" / "prefect.db") as db:
            ended = db.execute("select s.type, s.message from flow_run r join flow_run_state s on s.id = r.state_id "
                               "order by r.created").fetchall()
        assert [state for state, _ in ended] == ["CRASHED", "RUNNING", "COMPLETED"]  # nobody told Prefect of the kill
        assert ended[0][1] == "stopped by SIGTERM during train; a re-run resumes"
    finally:
        processes.stop()


def active_slots(api: str, limit: str) -> int:
    return httpx.get(f"{api}/v2/concurrency_limits/{limit}", timeout=30).json()["active_slots"]


def start_holder(processes: Processes, name: str, overrides: list[str]) -> tuple[subprocess.Popen, str]:
    holder, log = processes.start(name, [sys.executable, HOLDER, CONFIG, "600", *overrides], cwd=ROOT)
    wait_for(lambda: "holding " in log.read_text() or holder.poll() is not None, NEXT_RUN_S, "lock taken", log)
    found = [line.split()[1] for line in log.read_text().splitlines() if line.startswith("holding ")]
    assert found, tail(log)
    return holder, found[0]


def test_a_waiting_run_says_who_holds_the_lock_and_the_next_frees_a_killed_holders(prefect_api, tmp_path):
    """The server kept the dead holder's lease: the slot is given back through it, so that the repossessor cannot
    decrement it a second time, under the next holder, when the lease lapses."""
    from prefect.settings import PREFECT_API_URL

    from lock_holder import hold

    marker, api = uuid.uuid4().hex, PREFECT_API_URL.value()
    processes = Processes(run_env(tmp_path, marker, PREFECT_API_URL=api), ("EAGLE3_STOP_TEST", marker), tmp_path)
    overrides = [f"registry.path={tmp_path / 'registry'}"]
    section = load_config(CONFIG, overrides).registry
    try:
        holder, killed = start_holder(processes, "holder", overrides)
        waiter, log = processes.start("waiter", [sys.executable, HOLDER, CONFIG, "0", *overrides], cwd=ROOT)
        wait_for(lambda: "registry lock: waiting for" in log.read_text(), NEXT_RUN_S, "a waiting line", log)
        assert f"held by flow run {killed} (host " in log.read_text(), tail(log)  # and it says so every minute
        for process in (holder, waiter):
            process.kill()
            process.wait()
        assert active_slots(api, registry_limit_name(section)) == 1
        hold(CONFIG, overrides, 0)  # in this process: the same code path as the flow's
        assert active_slots(api, registry_limit_name(section)) == 0
        entry = open_registry(section).history()[-1]
        assert entry["event"] == "unlocked" and entry["extra"]["holder"]["run"] == killed
        assert f"its process {holder.pid} on " in entry["reasons"][0]
    finally:
        processes.stop()


@pytest.mark.e2e
def test_a_killed_holders_lock_is_freed_after_a_server_restart_and_by_hand(tmp_path):
    marker, port = uuid.uuid4().hex, free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = run_env(tmp_path, marker, PREFECT_API_URL=api, PREFECT_SERVER_API_HOST="127.0.0.1",
                  PREFECT_SERVER_API_PORT=str(port), PREFECT_SERVER_UI_ENABLED="false")
    processes = Processes(env, ("EAGLE3_STOP_TEST", marker), tmp_path)
    overrides = [f"registry.path={tmp_path / 'registry'}"]
    section = load_config(CONFIG, overrides).registry
    limit, registry = registry_limit_name(section), open_registry(section)
    prefect = [sys.executable, "-m", "prefect", "server", "start"]
    try:
        server, log = processes.start("server", prefect, cwd=tmp_path)
        wait_healthy(api.removesuffix("/api"), server, log)
        holder, killed = start_holder(processes, "holder", overrides)
        holder.kill()
        holder.wait()
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
        server, log = processes.start("server-again", prefect, cwd=tmp_path)
        wait_healthy(api.removesuffix("/api"), server, log)
        assert active_slots(api, limit) == 1  # the slot outlived its holder and the server's leases

        started = time.monotonic()
        after = subprocess.run([sys.executable, HOLDER, CONFIG, "0", *overrides], cwd=ROOT, env=env, text=True,
                               capture_output=True, timeout=NEXT_RUN_S * 2)
        took, output = time.monotonic() - started, after.stdout + after.stderr
        assert after.returncode == 0 and "holding " in output, output
        assert f"registry lock: freed the slot of flow run {killed} (host" in output, output
        assert f"its process {holder.pid} on " in output, output  # why: its flow run still says Running
        assert took < NEXT_RUN_S, output
        assert active_slots(api, limit) == 0  # and the next holder released its own
        entry = registry.history()[-1]
        assert (entry["event"], entry["by"], entry["extra"]["holder"]["run"]) == ("unlocked", "eagle3 run (waiting)",
                                                                                   killed)

        holder, killed = start_holder(processes, "holder-again", overrides)
        unlock = [sys.executable, "-m", "eagle3.cli", "registry", "unlock", "--config", CONFIG, "--set", overrides[0]]
        refused = subprocess.run(unlock, cwd=ROOT, env=env, text=True, capture_output=True, timeout=120)
        assert refused.returncode == 1 and "which looks alive" in refused.stderr, refused.stderr
        holder.kill()
        holder.wait()
        freed = subprocess.run(unlock, cwd=ROOT, env=env, text=True, capture_output=True, timeout=120)
        assert freed.returncode == 0 and f"freed the slot of flow run {killed}" in freed.stdout, freed.stderr
        assert active_slots(api, limit) == 0
        assert registry.history()[-1]["by"] == "eagle3 registry unlock"
        print(f"the next holder behind a killed one, after a server restart: {took:.1f} s")
    finally:
        processes.stop()
