"""The registry's lock: a Prefect global concurrency limit of one slot, taken strictly, with its holder recorded
in the registry (eagle3/registry/lock.py) so that a holder that died is recognised and its slot freed.

What Prefect 3.9 does underneath, and why this module exists: `concurrency()` increments the limit's active slots
in the database and creates a lease (300 s, renewed by a thread) in the server's memory; the release decrements the
slots and revokes the lease. The repossessor service frees the slots of a lease that lapsed - but the lease lives
in the server's memory: a server restart, or an ephemeral API that stopped before the release, loses it while the
slot count stays in the database, taken for good. A waiting run then blocks without a word. Here a waiting run
says who holds the registry every WAIT_REPORT_S, and frees the slot of a holder that is gone.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from uuid import UUID

import httpx

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitUpdate
from prefect.concurrency.asyncio import AcquireConcurrencySlotTimeoutError
from prefect.concurrency.context import ConcurrencyContext
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectNotFound
from prefect.runtime import flow_run

from eagle3.registry.lock import (
    RENEW_S, Holder, clear_holder, holder_gone, read_holder, record_unlock, renew_holder, write_holder,
)
from eagle3.registry.registry import Registry

WAIT_REPORT_S = 60.0  # a waiting run says who holds the registry this often
LEASE_CHECK_S = 60.0  # renewing a dead holder's lease (Prefect's least) tells whether the server still has it


def run_state(run_id: str) -> str | None:
    """The flow run's state type ("RUNNING", "CRASHED", ...), None when the API knows no such run."""
    with get_client(sync_client=True) as client:
        try:
            state = client.read_flow_run(UUID(run_id)).state
        except (ObjectNotFound, ValueError):
            return None
    return state.type.value if state else None


def taken_slots(limit: str) -> int:
    with get_client(sync_client=True) as client:
        return client.read_global_concurrency_limit_by_name(limit).active_slots


def free_slot(limit: str, holder: Holder | None) -> None:
    """Give back the dead holder's slot. Through its lease while the server still has it: reset by hand, the slot
    would be decremented once more when the repossessor revokes that lease, under the next holder. A lease the server
    lost (a restart) answers a renewal 410 Gone - its release would answer 204 and change nothing - and then the
    count is reset, which only this lock's single holder can have taken."""
    with get_client(sync_client=True) as client:
        if holder and holder.lease:
            try:
                client.renew_concurrency_lease(UUID(holder.lease), lease_duration=LEASE_CHECK_S)
            except httpx.HTTPStatusError as err:
                if err.response.status_code != 410:
                    raise
            else:
                client.release_concurrency_slots_with_lease(UUID(holder.lease))
                return
        client.update_global_concurrency_limit(limit, GlobalConcurrencyLimitUpdate(active_slots=0))


def unlock(registry: Registry, limit: str, log: Callable[[str], None], by: str, reason: str | None = None,
           run: str | None = None) -> bool:
    """Free the slot of the recorded holder when it is gone (or, with `reason`, whatever it is, by hand); record it
    in the registry's history. False when the holder is alive (or another waiter freed it first)."""
    holder, etag = read_holder(registry.store)
    if reason is None:
        if holder is None:
            return False  # nobody recorded: a holder between its acquisition and its record, or an older eagle3
        reason = holder_gone(holder, run_state(holder.run))
        if reason is None:
            return False
    if holder is not None and not clear_holder(registry.store, etag):
        return False  # someone else freed it (or took it) first
    try:
        free_slot(limit, holder)
    except Exception:
        if holder is not None:
            write_holder(registry.store, holder)  # the record stays until its slot is free: the next waiter retries
        raise
    record_unlock(registry, holder, reason, by=by, run=run)
    log(f"registry lock: freed the slot of {holder.describe() if holder else 'no recorded holder'}: {reason}")
    return True


def say_who_waits(registry: Registry, limit: str, log: Callable[[str], None]) -> None:
    """While the slot is taken: free it when its recorded holder is gone, else say who holds it."""
    if taken_slots(limit) < 1 or unlock(registry, limit, log, by="eagle3 run (waiting)", run=flow_run.id):
        return
    holder, _ = read_holder(registry.store)
    who = (holder.describe() if holder
           else "a run that recorded no holder (`eagle3 registry unlock --config CONFIG` frees it)")
    log(f"registry lock: waiting for {registry.location}, held by {who}")


@contextlib.contextmanager
def registry_lock(registry: Registry, limit: str, log: Callable[[str], None]) -> Iterator[None]:
    """Hold the registry's slot while the block runs, with this flow run recorded as its holder. Prefect waits for
    the slot WAIT_REPORT_S at a time; between two waits, `say_who_waits`. The record is cleared only once Prefect
    has released the slot: a release that failed leaves the record, by which the next run frees the slot."""
    while True:
        say_who_waits(registry, limit, log)
        holder, failure = None, None
        try:
            with concurrency(limit, occupy=1, strict=True, timeout_seconds=WAIT_REPORT_S):
                holder = Holder.here(str(flow_run.id), granted_lease())
                write_holder(registry.store, holder)
                stop = threading.Event()
                renewer = threading.Thread(target=keep_renewed, args=(registry, holder, stop, log), daemon=True)
                renewer.start()
                try:
                    yield
                except BaseException as err:
                    failure = err
                    raise
                finally:
                    stop.set()
                    renewer.join()
        except AcquireConcurrencySlotTimeoutError:
            if holder is None:  # our wait's, not the block's own
                continue
            raise
        except BaseException as err:
            if err is failure:  # the block's own error: Prefect released the slot on its way out
                forget(registry, holder)
            raise
        forget(registry, holder)
        return


def forget(registry: Registry, holder: Holder) -> None:
    """Clear the lock's record once the slot is released, unless someone else's is there by now."""
    current, etag = read_holder(registry.store)
    if current is not None and current.run == holder.run:
        clear_holder(registry.store, etag)


def granted_lease() -> str | None:
    """The lease Prefect just granted: the flow engine's concurrency context notes each one for its clean-up. Not a
    public API: pyproject.toml pins the Prefect minor release this is tested on (tests/test_stop.py)."""
    context = ConcurrencyContext.get()
    return str(context.cleanup_lease_ids[-1]) if context and context.cleanup_lease_ids else None


def keep_renewed(registry: Registry, holder: Holder, stop: threading.Event, log: Callable[[str], None]) -> None:
    while not stop.wait(RENEW_S):
        if not renew_holder(registry.store, holder):
            log(f"registry lock: the record of this run's lock in {registry.location} was freed by someone else "
                "(see `eagle3 registry history`); another run may now use the registry")
            return
