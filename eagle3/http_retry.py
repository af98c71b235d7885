"""HTTP requests retried with backoff, as the serving benchmark and answer regeneration send them to SGLang servers.

A transport error (refused, dropped, timed out) or an HTTP 5xx is retried: the server may be starting, restarting or
overloaded. Any other answer goes back to the caller, which decides what a 4xx means. The wait doubles per attempt,
with jitter, so concurrent requests that failed together do not come back together.
"""

from __future__ import annotations

import asyncio
import random
from typing import Awaitable, Callable, Iterator

import httpx

from eagle3.errors import Eagle3Error

FIRST_RETRIED_STATUS = 500
SHOWN_FAILURES = 3  # the give-up message names the last few attempts: enough to tell a pattern, short enough to read


class RetriesExhausted(Eagle3Error):
    """Every attempt failed in a way that is retried. `failures`: (url, reason) per attempt, oldest first."""

    def __init__(self, failures: list[tuple[str, str]]):
        super().__init__(f"failed {len(failures)} times: "
                         + "; ".join(f"{url}: {reason}" for url, reason in failures[-SHOWN_FAILURES:]))
        self.failures = failures


def backoff_delay(backoff_s: float, attempt: int) -> float:
    """Seconds to wait after failed attempt `attempt` (0 first): backoff_s x 2^attempt x a factor in [0.5, 1.5)."""
    return backoff_s * 2**attempt * (0.5 + random.random())


async def send_with_retries(send: Callable[[str], Awaitable[httpx.Response]], urls: Iterator[str], retries: int,
                            backoff_s: float) -> tuple[str, httpx.Response, int]:
    """Call send(url) with the next of `urls` until an answer below HTTP 500 comes -> (its url, the answer,
    attempts). Up to `retries` retries, each on the next url (one url: itertools.repeat); then RetriesExhausted."""
    failures = []
    for attempt in range(retries + 1):
        url = next(urls)
        try:
            response = await send(url)
        except httpx.TransportError as err:
            failures.append((url, type(err).__name__))
        else:
            if response.status_code < FIRST_RETRIED_STATUS:
                return url, response, attempt + 1
            failures.append((url, f"HTTP {response.status_code}"))
        if attempt < retries:
            await asyncio.sleep(backoff_delay(backoff_s, attempt))
    raise RetriesExhausted(failures)
