"""Who holds a registry's lock, kept where the registry is, so a holder that died can be told from a live one.

The lock itself is the orchestrator's (a Prefect global concurrency limit of one slot per registry, tasks/lock.py).
Its slot count outlives the process that took it: a run killed with SIGKILL, or whose API server went away first,
leaves the slot taken. So the holder writes `lock.json` next to `production` (through the registry's store, local
or S3): its flow run, host, process id, since when, and a renewal time it rewrites every RENEW_S while it runs.
A waiting run reads it, says who holds the registry, and frees the slot of a holder that is gone (`holder_gone`).
Freeing replaces the record by an empty one through a conditional write: of two waiters that saw the same dead
holder, only one frees its slot.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta

from eagle3.procs import process_table, alive
from eagle3.registry.registry import Registry, utc_now
from eagle3.registry.store import PointerConflict, Store

LOCK = "lock.json"
RENEW_S = 60.0  # how often a holder rewrites its record
LAPSE_S = 300.0  # a record not renewed for this long is a holder that stopped without saying so
FINAL_STATES = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")  # a flow run in one of these holds nothing


@dataclass
class Holder:
    run: str  # the flow run id
    host: str
    pid: int
    since: str  # ISO time, UTC
    renewed: str
    lease: str | None = None  # the orchestrator's lease on the slot, when it said which
    extra: dict = field(default_factory=dict)

    @classmethod
    def here(cls, run: str, lease: str | None = None) -> Holder:
        now = utc_now().isoformat(timespec="seconds")
        return cls(run=run, host=socket.gethostname(), pid=os.getpid(), since=now, renewed=now, lease=lease)

    def describe(self) -> str:
        return f"flow run {self.run} (host {self.host}, pid {self.pid}) since {self.since}"


def read_holder(store: Store) -> tuple[Holder | None, str | None]:
    """The recorded holder (None: none recorded, or freed) and the record's etag for a conditional rewrite."""
    data, etag = store.read(LOCK)
    if data is None:
        return None, None
    record = json.loads(data)
    return (Holder(**record) if record else None), etag


def write_holder(store: Store, holder: Holder) -> None:
    """Taken the slot: say so, whatever an earlier holder left (the slot is ours, so its record is stale)."""
    store.put_bytes(LOCK, (json.dumps(asdict(holder), indent=2, sort_keys=True) + "\n").encode())


def renew_holder(store: Store, holder: Holder) -> bool:
    """Rewrite our record with a new renewal time; False when the record is no longer ours (it was freed)."""
    current, etag = read_holder(store)
    if current is None or current.run != holder.run:
        return False
    holder.renewed = utc_now().isoformat(timespec="seconds")
    try:
        store.put_if(LOCK, (json.dumps(asdict(holder), indent=2, sort_keys=True) + "\n").encode(), etag)
    except PointerConflict:
        return False
    return True


def clear_holder(store: Store, etag: str | None) -> bool:
    """Replace the holder's record (read with `etag`) by an empty one; False when someone else changed it first."""
    try:
        store.put_if(LOCK, b"{}\n", etag)
    except PointerConflict:
        return False
    return True


def pid_alive(pid: int) -> bool:
    """Whether process `pid` lives on this host (a zombie does not: it holds nothing)."""
    entry = process_table().get(pid)
    return entry is not None and alive(entry[0])


def holder_gone(holder: Holder, run_state: str | None, now: datetime | None = None,
                host: str | None = None, is_alive: Callable[[int], bool] = pid_alive) -> str | None:
    """Why `holder` no longer holds the registry, or None while it may still. `run_state`: its flow run's state
    type as the orchestrator says it ("RUNNING", "CRASHED", ...), None when the orchestrator knows no such run."""
    if run_state is None:
        return f"its flow run {holder.run} is unknown to the Prefect API (the run or its database is gone)"
    if run_state in FINAL_STATES:
        return f"its flow run {holder.run} is {run_state.lower()}"
    if holder.host == (host or socket.gethostname()) and not is_alive(holder.pid):
        return f"its process {holder.pid} on {holder.host} is dead"
    lapsed = (now or utc_now()) - datetime.fromisoformat(holder.renewed)
    if lapsed > timedelta(seconds=LAPSE_S):
        return f"it has not renewed its record for {lapsed.total_seconds():.0f} s (more than {LAPSE_S:.0f} s)"
    return None


def record_unlock(registry: Registry, holder: Holder | None, reason: str, by: str, run: str | None = None) -> dict:
    """The history entry of a freed lock: whose it was, and why it was freed."""
    was = holder.describe() if holder else "no recorded holder"
    return registry.record("unlocked", None, [f"freed the lock of {was}: {reason}"], by=by, run=run,
                           extra={"holder": asdict(holder) if holder else None})
