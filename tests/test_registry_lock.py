"""One run per registry, whatever Prefect API or machine each run is on: the lock kept in the registry's own store.

- the record's rules: a holder is gone when its process on this host is dead, or its record stayed unchanged for its
  whole lease as the waiter's clock counts; two waiters that saw the same gone holder: one takes it over, and the
  history says so (local directory and moto S3, no Prefect);
- a holder whose record was replaced, or whose store stopped answering for most of its lease, has lost the lock:
  the guard refuses its next side effect, naming why;
- flow runs on two temporary Prefect APIs (two PREFECT_HOMEs, as two machines would have) against one local and one
  moto S3 registry: the second waits, says who holds the registry, then finishes; a holder killed with SIGKILL on
  "another machine" (a UTS namespace with its own host name) is taken over once its lease ran out; a holder whose
  lock was freed by hand and taken stops before its next side effect, exit 4 with one line; and `eagle3 run` itself
  in that case: it stops at its next stage, publishes nothing, exit 4, its last line says why.
"""

import os
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from eagle3 import guard
from eagle3.config.deployment import RegistrySection
from eagle3.resolve import load_config
from eagle3.registry.lock import (
    LOCK, LOSS_SHARE, Holder, Lease, acquire, dead_here, lapsed, looks_alive, read_holder, registry_lock, unlock,
)
from eagle3.registry.registry import Registry, open_registry
from eagle3.registry.store import LocalStore
from helpers import PREFIX, TINY, Processes, micro_run_overrides, tail, wait_for, write_checkpoint
from s3_server import new_bucket

ROOT = Path(__file__).resolve().parent.parent
HOLDER = str(Path(__file__).with_name("lock_holder.py"))
START_S = 120.0  # a holder's start: Python, Prefect's temporary API (its database migrated on a first start), the lock


def dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


class FakeClock:
    """The waiter's monotonic clock, advanced by its sleeps."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_holder_is_gone_when_its_process_here_died_or_its_record_stayed_unchanged_for_its_lease():
    holder = Holder.here("run-1", lease_s=60)
    assert dead_here(holder) is None and looks_alive(holder)
    dead = replace(holder, pid=dead_pid())
    assert dead_here(dead) == f"its process {dead.pid} on {dead.host} is dead" and not looks_alive(dead)
    elsewhere = replace(dead, host="another-node")
    assert dead_here(elsewhere) is None  # a process id means nothing on another host
    assert lapsed(elsewhere, 59.0) is None
    assert lapsed(elsewhere, 60.0) == "its record has not changed for 60 s, its whole lease (60 s)"
    later = datetime.fromisoformat(holder.renewed) + timedelta(seconds=61)
    assert not looks_alive(elsewhere, now=later)
    # a record an older eagle3 wrote (no lease of its own, a Prefect lease id) still reads
    old = {"run": "r", "host": "h", "pid": 1, "since": holder.since, "renewed": holder.renewed, "lease": "x"}
    assert Holder.from_record(old).lease_s == 300.0


def test_a_waiter_says_who_holds_and_takes_over_only_once_the_lease_ran_out(section):
    registry = open_registry(section, log=lambda line: None)
    other = Holder(run="run-elsewhere", host="another-node", pid=1, since="2026-12-04T10:00:00+00:00",
                   renewed="2026-12-04T10:00:00+00:00", lease_s=30.0, api="http://node-b:4200/api")
    registry.store.put_if(LOCK, other.encode(), None)
    clock, lines = FakeClock(), []
    waiter = Holder.here("run-here", lease_s=30.0)
    acquire(registry, waiter, lines.append, clock=clock, sleep=clock.sleep)
    assert 30.0 <= clock.now < 30.0 + 5.0  # it waited the holder's lease, as its own clock counts, and no longer
    assert lines[0].startswith(f"registry lock: waiting for {registry.location}, held by flow run run-elsewhere "
                               "(host another-node, pid 1, API http://node-b:4200/api) since 2026-12-04T10:00:00")
    assert lines[-1].startswith(f"registry lock: took over {registry.location} from flow run run-elsewhere")
    assert read_holder(registry.store)[0] == waiter
    entry = registry.history()[-1]
    assert (entry["event"], entry["run"], entry["extra"]["holder"]["run"]) == ("taken-over", "run-here", "run-elsewhere")
    assert "its record has not changed for 30 s" in entry["reasons"][0]


def test_a_renewed_holder_is_never_taken_over(tmp_path):
    registry = Registry(LocalStore(tmp_path / "registry"), log=lambda line: None)
    other = Holder(run="live", host="another-node", pid=1, since="t", renewed="t", lease_s=30.0)
    etag = registry.store.put_if(LOCK, other.encode(), None)
    clock, renewals = FakeClock(), []

    def renewing_sleep(seconds: float) -> None:  # the holder renews for 10 minutes, then dies on another host
        nonlocal etag
        clock.sleep(seconds)
        if clock.now < 600:
            etag = registry.store.put_if(LOCK, replace(other, renewed=str(clock.now)).encode(), etag)
            renewals.append(clock.now)

    acquire(registry, Holder.here("waiter", 30.0), lambda line: None, clock=clock, sleep=renewing_sleep)
    assert renewals[-1] > 590 and renewals[-1] + 30 <= clock.now < renewals[-1] + 30 + 5  # a lease after the last


def test_of_two_waiters_on_one_gone_holder_one_takes_it_the_other_waits_for_it(tmp_path):
    registry = Registry(LocalStore(tmp_path / "registry"), log=lambda line: None)
    registry.store.put_if(LOCK, replace(Holder.here("dead", 30.0), pid=dead_pid()).encode(), None)
    got, lines = [], []

    def wait_for_lock(name: str) -> None:
        with registry_lock(registry, Holder.here(name, lease_s=2.0), lines.append):
            got.append(name)
            time.sleep(0.5)

    waiters = [threading.Thread(target=wait_for_lock, args=(name,)) for name in ("a", "b")]
    for waiter in waiters:
        waiter.start()
    for waiter in waiters:
        waiter.join(timeout=30)
    assert sorted(got) == ["a", "b"]
    taken = [entry for entry in registry.history() if entry["event"] == "taken-over"]
    assert len(taken) == 1 and taken[0]["extra"]["holder"]["run"] == "dead"  # the second one found a live holder
    assert read_holder(registry.store)[0] is None  # both released


def test_a_holder_whose_record_was_replaced_has_lost_the_lock_and_its_next_side_effect_is_refused(section, tmp_path):
    registry = open_registry(section, log=lambda line: None)
    lines = []
    with registry_lock(registry, Holder.here("first", lease_s=1.0), lines.append) as lease:
        guard.require("a server start")  # held: nothing refused
        _, etag = read_holder(registry.store)
        registry.store.put_if(LOCK, Holder.here("second", lease_s=1.0).encode(), etag)  # as a takeover would
        lease.renew()
        with pytest.raises(guard.LockLost, match=r"lost the registry's lock: its record in .* was replaced: the "
                           r"registry is now held by flow run second .*; stopped before publishing version v1"):
            registry.publish("v1", {"sglang": write_checkpoint(tmp_path / "draft", seed=1)}, {})
    assert read_holder(registry.store)[0].run == "second"  # the loser leaves the winner's record alone
    assert any(line.startswith("registry lock: lost: its record") for line in lines)
    guard.require("anything")  # this process holds no lock any more: nothing is refused


def test_a_holder_that_cannot_reach_its_store_for_most_of_its_lease_has_lost_it(moto_s3):
    section = RegistrySection(backend="s3", bucket=new_bucket(moto_s3.url), prefix=PREFIX, endpoint_url=moto_s3.url)
    registry, lines, clock = open_registry(section, log=lambda line: None), [], FakeClock()
    holder = Holder.here("run", lease_s=20.0)
    lease = Lease(registry, holder, acquire(registry, holder, print), lines.append, clock=clock)
    with guard.holding():
        moto_s3.stop()
        clock.sleep(5.0)
        lease.renew()
        assert lease.lost is None and lines[-1].startswith("registry lock: renewal failed, retried in 5 s")
        clock.sleep(LOSS_SHARE * 20.0)
        lease.renew()
        assert lease.lost.startswith("it could not be renewed for 20 s of its 20 s lease")
        with pytest.raises(guard.LockLost, match="stopped before starting the server"):
            guard.require("starting the server")


# --- flow runs on two temporary Prefect APIs ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def homes(tmp_path_factory) -> Path:
    """Two Prefect homes, one per "machine", kept for the module: each database is migrated once (~15-30 s)."""
    return tmp_path_factory.mktemp("prefect-homes")


def holder_env(homes: Path, name: str, marker: str) -> dict[str, str]:
    """A process of its own Prefect home, with no PREFECT_API_URL: its flow runs on a temporary API of its own."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PREFECT_")}
    env.update({"PREFECT_HOME": str(homes / name), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120", "PYTHONPATH": str(ROOT),
                "OMP_NUM_THREADS": "1", "EAGLE3_LOCK_TEST": marker})
    return env


def start_holder(processes: Processes, name: str, seconds: float, overrides: list[str],
                 host: str | None = None) -> tuple[subprocess.Popen, Path]:
    command = [sys.executable, HOLDER, str(TINY), str(seconds), *overrides]
    if host is not None:  # another machine, as far as host names go: a UTS namespace of its own
        command = ["unshare", "--uts", "sh", "-c", f'hostname {host} && exec "$@"', "sh", *command]
    return processes.start(name, command, cwd=ROOT)


def holding_run(log: Path) -> str:
    return next(line.split()[1] for line in log.read_text().splitlines() if line.startswith("holding "))


def lock_overrides(backend: str, tmp_path: Path, request, lease_s: float) -> list[str]:
    if backend == "local":
        return [f"registry.path={tmp_path / 'registry'}", f"registry.lock_lease_s={lease_s}"]
    server = request.getfixturevalue("moto_s3")
    return ["registry.backend=s3", f"registry.bucket={new_bucket(server.url)}", f"registry.prefix={PREFIX}",
            f"registry.endpoint_url={server.url}", f"registry.lock_lease_s={lease_s}"]


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["local", "s3"])
def test_a_run_on_another_prefect_api_waits_for_the_holder_then_finishes(backend, homes, tmp_path, request):
    marker = uuid.uuid4().hex
    overrides = lock_overrides(backend, tmp_path, request, lease_s=8.0)
    first = Processes(holder_env(homes, "a", marker), ("EAGLE3_LOCK_TEST", marker), tmp_path)
    second = Processes(holder_env(homes, "b", marker), ("EAGLE3_LOCK_TEST", marker), tmp_path)
    try:
        holder, log = start_holder(first, "first", 600, overrides)
        wait_for(lambda: "holding " in log.read_text() or holder.poll() is not None, START_S, "lock taken", log)
        held_by = holding_run(log)
        waiter, waiter_log = start_holder(second, "second", 0, overrides)
        wait_for(lambda: "registry lock: waiting for" in waiter_log.read_text(), START_S, "a waiting line", waiter_log)
        assert f"held by flow run {held_by} (host " in waiter_log.read_text(), tail(waiter_log)
        assert ", API http://127.0.0.1:" in waiter_log.read_text(), tail(waiter_log)  # the first's own API
        time.sleep(2 * 8.0)  # two of the holder's leases: it renews, so the waiter keeps waiting
        assert "holding " not in waiter_log.read_text(), tail(waiter_log)
        holder.terminate()  # a stop releases the lock on its way out
        holder.wait(timeout=60)
        assert waiter.wait(timeout=60) == 0, tail(waiter_log)
        assert "holding " in waiter_log.read_text() and "released" in waiter_log.read_text(), tail(waiter_log)
        section = RegistrySection(**dict(override.removeprefix("registry.").split("=", 1) for override in overrides))
        assert [entry["event"] for entry in open_registry(section).history()] == []  # nobody was taken over
    finally:
        first.stop()
        second.stop()


@pytest.mark.e2e
def test_a_holder_killed_on_another_machine_is_taken_over_once_its_lease_ran_out(homes, tmp_path, moto_s3, request):
    marker, lease_s = uuid.uuid4().hex, 10.0
    overrides = lock_overrides("s3", tmp_path, request, lease_s=lease_s)
    processes = Processes(holder_env(homes, "b", marker), ("EAGLE3_LOCK_TEST", marker), tmp_path)
    here = Processes(holder_env(homes, "a", marker), ("EAGLE3_LOCK_TEST", marker), tmp_path)
    try:
        holder, log = start_holder(processes, "holder", 600, overrides, host="node-b")
        wait_for(lambda: "holding " in log.read_text() or holder.poll() is not None, START_S, "lock taken", log)
        killed = holding_run(log)
        holder.kill()  # SIGKILL: no release, the record stays as it was
        holder.wait()
        waiter, waiter_log = start_holder(here, "waiter", 0, overrides)
        assert waiter.wait(timeout=START_S + 3 * lease_s) == 0, tail(waiter_log)
        text = waiter_log.read_text()
        assert f"held by flow run {killed} (host node-b, pid " in text, text  # it waited, saying for whom
        assert "registry lock: took over s3://" in text and f"from flow run {killed}" in text, text
        section = RegistrySection(**dict(override.removeprefix("registry.").split("=", 1) for override in overrides))
        entry = open_registry(section).history()[-1]
        assert (entry["event"], entry["extra"]["holder"]["host"], entry["extra"]["holder"]["run"]) == (
            "taken-over", "node-b", killed)
        assert "its whole lease (10 s)" in entry["reasons"][0]
    finally:
        processes.stop()
        here.stop()


@pytest.mark.e2e
def test_a_run_whose_lock_was_freed_and_taken_stops_before_its_next_side_effect(homes, tmp_path):
    marker = uuid.uuid4().hex
    overrides = [f"registry.path={tmp_path / 'registry'}", "registry.lock_lease_s=4"]
    processes = Processes(holder_env(homes, "a", marker), ("EAGLE3_LOCK_TEST", marker), tmp_path)
    try:
        holder, log = start_holder(processes, "holder", 20, overrides)
        wait_for(lambda: "holding " in log.read_text() or holder.poll() is not None, START_S, "lock taken", log)
        unlock = [sys.executable, "-m", "eagle3.cli", "registry", "unlock", "--config", str(TINY),
                  *[arg for override in overrides for arg in ("--set", override)]]
        env = holder_env(homes, "a", marker)
        refused = subprocess.run(unlock, cwd=ROOT, env=env, text=True, capture_output=True, timeout=120)
        assert refused.returncode == 1 and "which looks alive" in refused.stderr, refused.stderr
        freed = subprocess.run([*unlock, "--force"], cwd=ROOT, env=env, text=True, capture_output=True, timeout=120)
        assert freed.returncode == 0 and "freed the lock of flow run" in freed.stdout, freed.stderr
        registry = open_registry(RegistrySection(path=tmp_path / "registry"))
        taker = Holder.here("the-next-run", lease_s=4.0)
        acquire(registry, taker, print)  # the next run takes the freed lock at once
        assert holder.wait(timeout=60) == 4, tail(log)
        said = [line for line in log.read_text().splitlines() if line.startswith("lock-holder: ")]
        assert len(said) == 1 and said[0].startswith("lock-holder: lost the registry's lock: its record in ") and \
            said[0].endswith("stopped before the next side effect"), tail(log)
        assert read_holder(registry.store)[0] == taker  # the loser left the new holder's record alone
        assert [entry["by"] for entry in registry.history()] == ["eagle3 registry unlock"]
    finally:
        processes.stop()


def test_eagle3_run_that_lost_its_lock_stops_before_its_next_stage_with_exit_4(prefect_api, micro_target, tmp_path,
                                                                                monkeypatch, capsys):
    """The pipeline itself: once an operator freed its lock by hand and another run took it, `eagle3 run` stops at
    its next stage, publishes nothing, leaves the new holder's record, and says why in its last line."""
    from prefect.settings import PREFECT_API_URL

    from flows.run import EXIT_LOCK_LOST, main

    monkeypatch.setenv("PREFECT_API_URL", PREFECT_API_URL.value())  # the session's test server, not one of its own
    overrides = micro_run_overrides(tmp_path / "run", micro_target) + ["registry.lock_lease_s=2"]
    registry = open_registry(load_config(TINY, overrides).registry)
    intruder = Holder.here("intruder", lease_s=60)

    def free_and_take() -> None:
        deadline = time.monotonic() + 120
        while read_holder(registry.store)[0] is None and time.monotonic() < deadline:
            time.sleep(0.05)
        unlock(registry, by="an operator", reason="freed by hand")
        acquire(registry, intruder, print)

    operator = threading.Thread(target=free_and_take)
    operator.start()
    code = main([str(TINY), *[arg for override in overrides for arg in ("--set", override)]])
    operator.join(timeout=10)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == EXIT_LOCK_LOST, last
    assert last.startswith("eagle3 run: lost the registry's lock: its record in ") and "stopped before the " in last
    assert registry.versions() == [] and registry.production_version() is None
    assert read_holder(registry.store)[0] == intruder
