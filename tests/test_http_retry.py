"""Retries with backoff (eagle3.http_retry) against real HTTP servers on 127.0.0.1: what is retried, what is
handed back, which server each attempt goes to, the backoff schedule and the message on giving up."""

import asyncio
import itertools
import time

import httpx
import pytest

from eagle3.http_retry import RetriesExhausted, backoff_delay, send_with_retries
from fake_sglang import FakeSGLang

BODY = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 4}}
UNREACHABLE = "http://127.0.0.1:9"  # the discard port: nothing listens there


def post(urls, retries: int, backoff_s: float = 0.001, timeout_s: float = 5.0):
    """send_with_retries of one /generate POST -> (url, status, attempts), or the RetriesExhausted it raised."""
    async def run():
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            send = lambda url: client.post(f"{url}/generate", json=BODY)  # noqa: E731
            url, response, attempts = await send_with_retries(send, urls, retries, backoff_s)
            return url, response.status_code, attempts

    return asyncio.run(run())


def test_transport_errors_timeouts_and_5xx_are_retried_until_an_answer():
    with FakeSGLang() as server:
        server.slow_s = 1.0
        server.faults = ["500", "drop", "slow", "ok"]
        assert post(itertools.repeat(server.url), retries=3, timeout_s=0.3) == (server.url, 200, 4)
        assert server.requests == 4


def test_a_client_error_is_handed_back_at_once():
    with FakeSGLang() as server:
        server.faults = ["400"]
        assert post(itertools.repeat(server.url), retries=3) == (server.url, 400, 1)
        assert server.requests == 1


def test_each_attempt_goes_to_the_next_url():
    with FakeSGLang() as first, FakeSGLang() as second:
        first.faults = ["500", "500"]
        second.faults = ["drop"]
        urls = itertools.cycle([first.url, second.url])
        assert post(urls, retries=3) == (second.url, 200, 4)  # first 500, second drops, first 500, second answers
        assert (first.requests, second.requests) == (2, 2)


def test_giving_up_names_every_attempt_and_the_last_three():
    with FakeSGLang() as server:
        server.fail_after = 0  # HTTP 500 for good
        urls = itertools.cycle([server.url, UNREACHABLE])
        with pytest.raises(RetriesExhausted) as caught:
            post(urls, retries=3)
    assert caught.value.failures == [(server.url, "HTTP 500"), (UNREACHABLE, "ConnectError")] * 2
    assert str(caught.value) == (f"failed 4 times: {UNREACHABLE}: ConnectError; {server.url}: HTTP 500; "
                                 f"{UNREACHABLE}: ConnectError")


def test_backoff_doubles_per_attempt_with_jitter(monkeypatch):
    for jitter, factor in ((0.0, 0.5), (0.5, 1.0), (0.999, 1.499)):
        monkeypatch.setattr("eagle3.http_retry.random.random", lambda: jitter)  # noqa: B023
        assert [backoff_delay(0.5, attempt) for attempt in range(4)] == pytest.approx(
            [0.5 * factor, 1.0 * factor, 2.0 * factor, 4.0 * factor])


def test_the_waits_come_between_attempts_only(monkeypatch):
    monkeypatch.setattr("eagle3.http_retry.random.random", lambda: 0.5)  # no jitter: waits of 0.3 s then 0.6 s
    with FakeSGLang() as server:
        server.fail_after = 0
        start = time.perf_counter()
        with pytest.raises(RetriesExhausted):
            post(itertools.repeat(server.url), retries=2, backoff_s=0.3)
        assert 0.9 <= time.perf_counter() - start < 2.1  # a wait after the last attempt would add 1.2 s
        assert server.requests == 3
