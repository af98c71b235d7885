"""The stream's ledger: one row per sample key, in SQLite under the run's train/stream/ (only the coordinator writes
it). A sample moves wanted → claimed (by a worker) → captured (its features in the store) → consumed (a trainer read
them; the store's copy is freed), and back to wanted when a trainer needs it again (the next epoch, or the steps after
a resumed checkpoint). Counters say how often each happened, so a test or a person can check that nothing was
captured twice for one use and nothing was skipped.

A claim whose worker died or whose lease ran out goes back to wanted; a captured sample whose store copy is gone (the
store stopped with an earlier run, or a trainer found it missing) is `dropped` back to wanted and counted.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS samples (
    key TEXT PRIMARY KEY,
    sample_id TEXT NOT NULL,
    length INTEGER NOT NULL,
    state TEXT NOT NULL,              -- wanted | claimed | captured | consumed
    priority INTEGER NOT NULL,        -- 0 before 1: evaluation's samples go before training's
    position INTEGER NOT NULL,        -- the order trainers announced
    demanded INTEGER NOT NULL DEFAULT 0,  -- a trainer waits for it: captured whatever the watermarks say
    worker TEXT,
    claimed_at REAL,
    bytes INTEGER NOT NULL DEFAULT 0,
    captures INTEGER NOT NULL DEFAULT 0,
    consumptions INTEGER NOT NULL DEFAULT 0,
    dropped INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS queue ON samples (state, demanded, priority, position);
"""


@dataclass(frozen=True)
class Wanted:
    key: str
    sample_id: str
    length: int


@dataclass(frozen=True)
class Claim:
    key: str
    sample_id: str
    length: int
    store_key: str  # where this capture goes: the key and its capture count, so a late free of an earlier
    #                 capture never removes this one


def store_key(key: str, capture: int) -> str:
    return f"{key}.{capture}"


@dataclass(frozen=True)
class Totals:
    samples: int
    captures: int
    consumptions: int
    dropped: int
    stored_bytes: int  # captured, not yet consumed
    claimed_tokens: int  # claimed, not yet captured: what the store is about to take


class Ledger:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.lock = threading.Lock()  # the coordinator's HTTP threads share one connection
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        with self.lock:
            self.db.close()

    def _write(self, sql: str, rows: list[tuple]) -> None:
        with self.lock:
            self.db.execute("BEGIN IMMEDIATE")
            self.db.executemany(sql, rows)
            self.db.execute("COMMIT")

    def want(self, items: list[Wanted], priority: int, first_position: int) -> None:
        """Trainers will read `items` in this order: new ones and consumed ones are wanted again; one already on
        its way keeps its state and takes the earlier place."""
        rows = [(item.key, item.sample_id, item.length, priority, first_position + i) for i, item in enumerate(items)]
        self._write("INSERT INTO samples (key, sample_id, length, state, priority, position) "
                    "VALUES (?, ?, ?, 'wanted', ?, ?) ON CONFLICT (key) DO UPDATE SET "
                    "state = CASE WHEN state = 'consumed' THEN 'wanted' ELSE state END, "
                    "priority = CASE WHEN state = 'consumed' THEN excluded.priority "
                    "ELSE min(priority, excluded.priority) END, "
                    "position = CASE WHEN state = 'consumed' THEN excluded.position "
                    "ELSE min(position, excluded.position) END", rows)

    def claim(self, worker: str, limit: int, budget_tokens: int) -> list[Claim]:
        """Up to `limit` wanted samples for `worker`: those a trainer waits for first, whatever their size, then in the
        trainers' order as long as their tokens stay within `budget_tokens` (what the watermark leaves)."""
        with self.lock:
            self.db.execute("BEGIN IMMEDIATE")
            rows = self.db.execute("SELECT key, sample_id, length, demanded, captures FROM samples WHERE state = "
                                   "'wanted' ORDER BY demanded DESC, priority, position LIMIT ?", (limit,)).fetchall()
            chosen, tokens = [], 0
            for key, sample_id, length, demanded, captures in rows:
                if not demanded and tokens + length > budget_tokens:
                    break
                tokens += length
                chosen.append(Claim(key, sample_id, length, store_key(key, captures)))
            self.db.executemany("UPDATE samples SET state = 'claimed', worker = ?, claimed_at = ? WHERE key = ?",
                                [(worker, time.time(), item.key) for item in chosen])
            self.db.execute("COMMIT")
        return chosen

    def captured(self, key: str, size: int) -> None:
        self._write("UPDATE samples SET state = 'captured', bytes = ?, captures = captures + 1, worker = NULL "
                    "WHERE key = ? AND state IN ('wanted', 'claimed')", [(size, key)])

    def demand(self, items: list[Wanted]) -> dict[str, str]:
        """Mark `items` as waited for (wanting any the ledger does not hold); their states by key."""
        self.want(items, priority=0, first_position=-1)
        self._write("UPDATE samples SET demanded = 1 WHERE key = ? AND state != 'captured'",
                    [(item.key,) for item in items])
        return self.states([item.key for item in items])

    def states(self, keys: list[str]) -> dict[str, str]:
        with self.lock:
            marks = ",".join("?" * len(keys))
            return dict(self.db.execute(f"SELECT key, state FROM samples WHERE key IN ({marks})", keys).fetchall())

    def consumed(self, keys: list[str]) -> None:
        self._write("UPDATE samples SET state = 'consumed', bytes = 0, demanded = 0, "
                    "consumptions = consumptions + 1 WHERE key = ? AND state = 'captured'", [(k,) for k in keys])

    def drop(self, keys: list[str]) -> None:
        """Captured samples whose store copy is gone: wanted again."""
        self._write("UPDATE samples SET state = 'wanted', bytes = 0, dropped = dropped + 1 "
                    "WHERE key = ? AND state = 'captured'", [(k,) for k in keys])

    def release(self, worker: str | None = None, older_than: float | None = None) -> int:
        """Claims back to wanted: a worker's (it died), those claimed before `older_than` (their lease ran out), or
        every claim (a new session: the workers that held them are gone). Returns how many."""
        where, args = "state = 'claimed'", []
        if worker is not None:
            where, args = where + " AND worker = ?", [worker]
        if older_than is not None:
            where, args = where + " AND claimed_at < ?", [*args, older_than]
        with self.lock:
            return self.db.execute(f"UPDATE samples SET state = 'wanted', worker = NULL WHERE {where}", args).rowcount

    def stored(self, keys: list[str] | None = None) -> dict[str, str]:
        """Captured samples (of `keys`, or all) -> the store key their capture went to."""
        query, args = "SELECT key, captures FROM samples WHERE state = 'captured'", []
        if keys is not None:
            query, args = query + f" AND key IN ({','.join('?' * len(keys))})", keys
        with self.lock:
            return {key: store_key(key, captures - 1) for key, captures in self.db.execute(query, args)}

    def totals(self) -> Totals:
        with self.lock:
            row = self.db.execute(
                "SELECT count(*), coalesce(sum(captures), 0), coalesce(sum(consumptions), 0), "
                "coalesce(sum(dropped), 0), coalesce(sum(bytes), 0), "
                "coalesce(sum(CASE WHEN state = 'claimed' THEN length ELSE 0 END), 0) FROM samples").fetchone()
        return Totals(*row)
