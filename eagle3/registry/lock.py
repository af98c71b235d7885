"""The registry's lock: one pipeline run per registry, whatever Prefect API or machine each run is on.

The lock is a record in the registry's own store, `lock.json` beside the production pointer: its holder's flow run,
host, process id, Prefect API, since when and its lease. Every change to it is a conditional write through the
store's compare-and-swap (`put_if`: S3 If-None-Match / If-Match; a local directory compares under flock and renames),
so of two runs that read the same record only one changes it:
- take: create the record when there is none, or replace a freed one (`{}`);
- renew: the holder rewrites its record every lease / RENEWALS_PER_LEASE;
- take over: a waiter replaces a holder's record that has not changed for the holder's whole lease, as the waiter's
  own clock counts (machines need not agree on the time), or at once when the holder's process on this host is
  dead; the history records it (`taken-over`);
- release: the holder replaces its own record by `{}`.
A holder whose record was replaced, or that could not renew it for LOSS_SHARE of its lease (a waiter may take it
over at the end of the lease), has lost the lock: eagle3.guard then stops the run before its next side effect.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timedelta

from eagle3 import guard
from eagle3.procs import alive, process_table
from eagle3.registry.registry import Registry, utc_now
from eagle3.registry.store import PointerConflict, RegistryError, Store

LOCK = "lock.json"
FREE = b"{}\n"
RENEWALS_PER_LEASE = 4
LOSS_SHARE = 0.75  # unrenewed for this share of its lease, a holder counts its lock as lost
WAIT_REPORT_S = 60.0  # a waiting run says who holds the registry this often
MAX_POLL_S = 5.0

Log = Callable[[str], None]


@dataclass
class Holder:
    run: str  # the flow run id (or the command that holds it)
    host: str
    pid: int
    since: str  # ISO time, UTC, by the holder's clock
    renewed: str
    lease_s: float
    api: str | None = None  # the Prefect API the flow run lives on, when known
    token: str = field(default_factory=lambda: uuid.uuid4().hex)  # this acquisition, apart from any other

    @classmethod
    def here(cls, run: str, lease_s: float, api: str | None = None) -> Holder:
        now = utc_now().isoformat(timespec="seconds")
        return cls(run=run, host=socket.gethostname(), pid=os.getpid(), since=now, renewed=now, lease_s=lease_s,
                   api=api)

    @classmethod
    def from_record(cls, record: dict) -> Holder:
        """A record as stored; one an older eagle3 wrote (no lease of its own) gets the default lease."""
        known = {f.name for f in fields(cls)}
        return cls(**{"lease_s": 300.0, **{key: value for key, value in record.items() if key in known}})

    def describe(self) -> str:
        api = f", API {self.api}" if self.api else ""
        return f"flow run {self.run} (host {self.host}, pid {self.pid}{api}) since {self.since}"

    def encode(self) -> bytes:
        return (json.dumps(asdict(self), indent=2, sort_keys=True) + "\n").encode()


def read_holder(store: Store) -> tuple[Holder | None, str | None]:
    """The recorded holder (None: none, or freed) and the record's etag (None: no record at all)."""
    data, etag = store.read(LOCK)
    if data is None:
        return None, None
    record = json.loads(data)
    return (Holder.from_record(record) if record else None), etag


def pid_alive(pid: int) -> bool:
    """Whether process `pid` lives on this host (a zombie does not: it holds nothing)."""
    entry = process_table().get(pid)
    return entry is not None and alive(entry[0])


def dead_here(holder: Holder, is_alive: Callable[[int], bool] = pid_alive) -> str | None:
    """Why `holder` is gone for sure: its process on this very host is dead. A process id means nothing elsewhere."""
    if holder.host == socket.gethostname() and not is_alive(holder.pid):
        return f"its process {holder.pid} on {holder.host} is dead"
    return None


def lapsed(holder: Holder, unchanged_s: float) -> str | None:
    """Why `holder` is gone: its record has not changed for its whole lease, as the waiter's clock counts."""
    if unchanged_s >= holder.lease_s:
        return f"its record has not changed for {unchanged_s:.0f} s, its whole lease ({holder.lease_s:.0f} s)"
    return None


def looks_alive(holder: Holder, now: datetime | None = None) -> bool:
    """For a person deciding by hand: its process is not known dead and its renewal time is within its lease."""
    age = (now or utc_now()) - datetime.fromisoformat(holder.renewed)
    return dead_here(holder) is None and age <= timedelta(seconds=holder.lease_s)


def record_freed(registry: Registry, event: str, holder: Holder | None, reason: str, by: str,
                 run: str | None = None) -> dict:
    """The history entry of a lock taken from its holder: whose it was, and why."""
    was = holder.describe() if holder else "no recorded holder"
    return registry.record(event, None, [f"{'took over' if event == 'taken-over' else 'freed'} the lock of {was}: "
                                         f"{reason}"], by=by, run=run,
                           extra={"holder": asdict(holder) if holder else None})


def acquire(registry: Registry, holder: Holder, log: Log, clock: Callable[[], float] = time.monotonic,
            sleep: Callable[[float], None] = time.sleep) -> str:
    """Take the registry's lock for `holder`, waiting while another holds it; the record's etag."""
    store, seen, seen_at, reported_at = registry.store, None, 0.0, None
    while True:
        current, etag = read_holder(store)
        if current is None:
            with contextlib.suppress(PointerConflict):  # another waiter took it first: read again
                return store.put_if(LOCK, holder.encode(), etag)
            continue
        if etag != seen:
            seen, seen_at = etag, clock()
        gone = dead_here(current) or lapsed(current, clock() - seen_at)
        if gone:
            with contextlib.suppress(PointerConflict):
                taken = store.put_if(LOCK, holder.encode(), etag)
                record_freed(registry, "taken-over", current, gone, by=f"eagle3 run (flow run {holder.run})",
                             run=holder.run)
                log(f"registry lock: took over {registry.location} from {current.describe()}: {gone}")
                return taken
            continue
        if reported_at is None or clock() - reported_at >= WAIT_REPORT_S:
            reported_at = clock()
            log(f"registry lock: waiting for {registry.location}, held by {current.describe()}; taken over if its "
                f"record stays unchanged for its {current.lease_s:.0f} s lease")
        sleep(min(MAX_POLL_S, current.lease_s / 10))


class Lease:
    """A held lock, renewed by a thread until `close`; a loss is reported to eagle3.guard and logged once."""

    def __init__(self, registry: Registry, holder: Holder, etag: str, log: Log,
                 clock: Callable[[], float] = time.monotonic):
        self.registry, self.holder, self.etag, self.log, self.clock = registry, holder, etag, log, clock
        self.renewed_at = clock()
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep_renewed, name="registry-lease", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _keep_renewed(self) -> None:
        while self.lost is None and not self._stop.wait(self.holder.lease_s / RENEWALS_PER_LEASE):
            self.renew()

    def renew(self) -> None:
        self.holder.renewed = utc_now().isoformat(timespec="seconds")
        try:
            self.etag = self.registry.store.put_if(LOCK, self.holder.encode(), self.etag)
            self.renewed_at = self.clock()
        except PointerConflict:
            now, _ = read_holder(self.registry.store)
            self.lose(f"its record in {self.registry.location} was replaced: the registry is now "
                      f"{'held by ' + now.describe() if now else 'free'} (see `eagle3 registry history`)")
        except RegistryError as err:
            unrenewed = self.clock() - self.renewed_at
            if unrenewed >= LOSS_SHARE * self.holder.lease_s:
                self.lose(f"it could not be renewed for {unrenewed:.0f} s of its {self.holder.lease_s:.0f} s lease "
                          f"({err}); another run may take it over")
            else:
                self.log(f"registry lock: renewal failed, retried in {self.holder.lease_s / RENEWALS_PER_LEASE:.0f} "
                         f"s: {err}")

    def lose(self, reason: str) -> None:
        self.lost = reason
        guard.lose(reason)
        self.log(f"registry lock: lost: {reason}; this run stops before its next side effect")

    def close(self) -> None:
        """Stop renewing, then free the record unless it is someone else's by now."""
        self._stop.set()
        self._thread.join()
        if self.lost is not None:
            return
        try:
            self.registry.store.put_if(LOCK, FREE, self.etag)
        except PointerConflict:
            self.log(f"registry lock: at release, the record in {self.registry.location} was no longer this run's")
        except RegistryError as err:  # the record stays: the next run takes it over once its lease runs out
            self.log(f"registry lock: could not free it ({err}); the next run takes it over after "
                     f"{self.holder.lease_s:.0f} s")


@contextlib.contextmanager
def registry_lock(registry: Registry, holder: Holder, log: Log) -> Iterator[Lease]:
    """Hold the registry's lock while the block runs (waiting for it first); eagle3.guard refuses side effects
    once it is lost."""
    lease = Lease(registry, holder, acquire(registry, holder, log), log)
    log(f"registry lock: {registry.location} held by {holder.describe()}, lease {holder.lease_s:.0f} s")
    with guard.holding():
        lease.start()
        try:
            yield lease
        finally:
            lease.close()


def unlock(registry: Registry, by: str, reason: str) -> Holder | None:
    """Free the lock by hand, whoever holds it; the history records whose it was. Raises PointerConflict when the
    record changed meanwhile."""
    holder, etag = read_holder(registry.store)
    if holder is None:
        return None
    registry.store.put_if(LOCK, FREE, etag)
    record_freed(registry, "unlocked", holder, reason, by=by)
    return holder
