"""Progress lines for long work: done / total, rate and ETA, at most every few seconds."""

from __future__ import annotations

import time
from typing import Callable


class Progress:
    def __init__(self, what: str, total: int, unit: str, log: Callable[[str], None], done: int = 0, every_s: float = 5.0):
        self.what, self.total, self.unit, self.log, self.every_s = what, total, unit, log, every_s
        self.done, self.start_done, self.tokens = done, done, 0
        self.started = self.last = time.monotonic()

    def advance(self, count: int, tokens: int = 0) -> None:
        self.done += count
        self.tokens += tokens
        now = time.monotonic()
        if now - self.last >= self.every_s or self.done >= self.total:
            self.last = now
            self.log(self.line(now))

    def line(self, now: float) -> str:
        elapsed = max(now - self.started, 1e-9)
        rate = (self.done - self.start_done) / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        share = self.done / self.total if self.total else 1.0
        tokens = f", {self.tokens / elapsed:,.0f} tokens/s" if self.tokens else ""
        return (
            f"{self.what}: {self.done}/{self.total} {self.unit} ({share:.0%}), {rate:.2f} {self.unit}/s{tokens}, "
            f"ETA {format_seconds(eta)}"
        )


def format_seconds(seconds: float) -> str:
    if seconds == float("inf"):
        return "unknown"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"
