"""Render client-side pages (the Prefect UI) in headless Debian chromium and read them back as text.

`rendered_text(url)` starts a fresh chromium with its own profile for each render, lets the page run for a virtual-time
budget (`--virtual-time-budget`: timers advance while the network is idle, so a React page that fetches its data
renders fully in a few seconds of wall time) and returns the text of the resulting DOM. With `expect`, it renders
again until every expected string is there or `timeout_s` is spent: the page's data may still be settling (the UI polls
the API). CI installs chromium (.ci/run); `require_chromium()` skips with the reason on a machine without it, and
fails instead where EAGLE3_REQUIRE_CHROMIUM is set (.ci/run sets it).
"""

from __future__ import annotations

import contextlib
import html
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run", "--disable-dev-shm-usage", "--mute-audio", "--hide-scrollbars",
]


def chromium_path() -> str | None:
    return CHROMIUM if Path(CHROMIUM).is_file() and os.access(CHROMIUM, os.X_OK) else shutil.which("chromium")


def require_chromium() -> str:
    path = chromium_path()
    if path is None:
        reason = f"no chromium at {CHROMIUM} (Debian: apt-get install chromium; .ci/run installs it)"
        if os.environ.get("EAGLE3_REQUIRE_CHROMIUM"):
            pytest.fail(reason)
        pytest.skip(reason)
    return path


def rendered_dom(url: str, budget_ms: int = 15000, timeout_s: float = 60.0) -> str:
    """The DOM after the page ran for `budget_ms` of virtual time (one chromium, one fresh profile)."""
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        command = [require_chromium(), *FLAGS, f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}",
                   "--dump-dom", url]
        # Its own process group: on a timeout the zygote and renderers go with it.
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise AssertionError(f"chromium did not finish rendering {url} in {timeout_s:.0f} s") from None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # anything of the group still alive
    if proc.returncode != 0 or "<html" not in out:
        tail = "\n".join(err.splitlines()[-15:])
        raise AssertionError(f"chromium exited {proc.returncode} rendering {url}; stderr tail:\n{tail}")
    return out


def dom_text(dom: str) -> str:
    """The visible text of a DOM: scripts, styles and tags dropped, entities decoded, white space collapsed."""
    dom = re.sub(r"<(script|style|noscript)\b.*?</\1\s*>", " ", dom, flags=re.DOTALL | re.IGNORECASE)
    text = html.unescape(re.sub(r"<[^>]+>", " ", dom))
    return re.sub(r"\s+", " ", text).strip()


def rendered_text(url: str, timeout_s: float = 60.0, expect: tuple[str, ...] = (), budget_ms: int = 15000) -> str:
    """The rendered page's text; with `expect`, re-rendered until all of those strings appear (AssertionError with
    the last text when `timeout_s` runs out)."""
    return render_until(url, timeout_s, expect, budget_ms)[1]


def render_until(url: str, timeout_s: float = 60.0, expect: tuple[str, ...] = (),
                 budget_ms: int = 15000) -> tuple[str, str]:
    """(dom, text) of the first render whose text holds every string of `expect`."""
    deadline = time.monotonic() + timeout_s
    while True:
        dom = rendered_dom(url, budget_ms, timeout_s=max(deadline - time.monotonic(), 30.0))
        text = dom_text(dom)
        missing = [s for s in expect if s not in text]
        if not missing:
            return dom, text
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} rendered without {missing} within {timeout_s:.0f} s; "
                                 f"page text:\n{text[:3000]}")
        time.sleep(1.0)
