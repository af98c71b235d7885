"""The side effects a pipeline run may take only while it holds its registry's lock.

A run holds the lock of its registry (eagle3/registry/lock.py) from start to end. Should it lose the lock (its
lease was taken over by another run after renewals failed, or someone freed it by hand), another run may now own
the node's GPUs and the registry: this run must not start a server or a trainer, publish, or move the production
pointer. The holder's renewal thread calls `lose`; the places that start such side effects call `require` first,
which raises LockLost naming the action and why. A process that holds no lock (a step run by hand, a test) is
never refused.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from eagle3.errors import Eagle3Error

_state = {"held": 0, "lost": None}  # how many locks this process holds; why the last one was lost
_guard = threading.Lock()


class LockLost(Eagle3Error):
    """This run no longer holds its registry's lock: it stops before its next side effect."""


@contextlib.contextmanager
def holding() -> Iterator[None]:
    """Mark this process as a lock holder while the block runs; a loss recorded inside it is forgotten after."""
    with _guard:
        _state["held"] += 1
    try:
        yield
    finally:
        with _guard:
            _state["held"] -= 1
            if _state["held"] == 0:
                _state["lost"] = None


def lose(reason: str) -> None:
    """The lock is gone: every later `require` raises, with `reason`."""
    with _guard:
        if _state["held"]:
            _state["lost"] = reason


def lost() -> str | None:
    with _guard:
        return _state["lost"]


def require(action: str) -> None:
    """Raise LockLost when this process held a registry lock and lost it; `action` names what was about to happen."""
    reason = lost()
    if reason is not None:
        raise LockLost(f"lost the registry's lock: {reason}; stopped before {action}")
