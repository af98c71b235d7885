"""Render client-side pages (the Prefect UI) in headless Debian chromium and read them back as text.

`rendered_text(url)` starts a fresh chromium with its own profile for each render, lets the page run for a virtual-time
budget (`--virtual-time-budget`: timers advance while the network is idle, so a React page that fetches its data
renders fully in a few seconds of wall time) and returns the text of the resulting DOM. With `expect`, it renders
again until every expected string is there or `timeout_s` is spent: the page's data may still be settling (the UI polls
the API). CI installs chromium (.ci/run); `require_chromium()` skips with the reason on a machine without it, and
fails instead where EAGLE3_REQUIRE_CHROMIUM is set (.ci/run sets it).

`DevTools` drives one chromium over the DevTools protocol for what a text dump cannot show: how the page looks to a
reader, in the colour scheme the reader's system asks for (the Prefect UI follows it), as pixels of a screenshot.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import html
import json
import os
import re
import select
import shutil
import signal
import struct
import subprocess
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
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


class DevTools:
    """One headless chromium (fresh profile) with one tab, driven over the DevTools protocol on a pipe: with
    `--remote-debugging-pipe` chromium reads commands on its fd 3 and writes replies and events on its fd 4, each a
    JSON message ended by a NUL byte. Use it as a context manager; leaving ends chromium's process group."""

    def __init__(self, timeout_s: float = 60.0, viewport: tuple[int, int] = (1280, 1000)) -> None:
        self.timeout_s, self.viewport = timeout_s, viewport

    def __enter__(self) -> DevTools:
        self.scratch = tempfile.TemporaryDirectory(prefix="chromium-")
        self.log = Path(self.scratch.name) / "chromium.log"
        to_chromium, from_chromium = os.pipe(), os.pipe()
        # chromium's ends, numbered above 4 so that putting them on 3 and 4 clobbers neither; posix_spawn's file
        # actions put them there (no Python runs in the child between fork and exec)
        theirs = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 5) for fd in (to_chromium[0], from_chromium[1])]
        path = require_chromium()
        self.pid = os.posix_spawn(
            path, [path, *FLAGS, f"--user-data-dir={self.scratch.name}/profile", "--remote-debugging-pipe"], os.environ,
            file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                          (os.POSIX_SPAWN_OPEN, 1, str(self.log), os.O_WRONLY | os.O_CREAT, 0o600),
                          (os.POSIX_SPAWN_DUP2, 1, 2),
                          (os.POSIX_SPAWN_DUP2, theirs[0], 3), (os.POSIX_SPAWN_DUP2, theirs[1], 4)],
            setsid=True)  # its own process group: leaving ends the zygote and renderers with it
        for fd in (*theirs, to_chromium[0], from_chromium[1]):
            os.close(fd)
        self.commands, self.replies, self.buffer, self.next_id = to_chromium[1], from_chromium[0], b"", 0
        try:
            target = self.call("Target.createTarget", to_browser=True, url="about:blank")["targetId"]
            self.session = self.call("Target.attachToTarget", to_browser=True, targetId=target,
                                     flatten=True)["sessionId"]
            width, height = self.viewport
            self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                      mobile=False)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        os.close(self.commands)
        os.close(self.replies)
        self.scratch.cleanup()

    def log_tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-15:])

    def call(self, method: str, to_browser: bool = False, **params) -> dict:
        """The result of one command, to the tab (or to the browser)."""
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params}
        if not to_browser:
            message["sessionId"] = self.session
        os.write(self.commands, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout_s
        while True:
            while b"\0" not in self.buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self.replies], [], [], left)[0]:
                    raise AssertionError(f"chromium did not answer {method} in {self.timeout_s:.0f} s; its log's "
                                         f"tail:\n{self.log_tail()}")
                chunk = os.read(self.replies, 1 << 20)
                if not chunk:
                    raise AssertionError(f"chromium exited before answering {method}; its log's tail:\n"
                                         f"{self.log_tail()}")
                self.buffer += chunk
            raw, self.buffer = self.buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self.next_id:  # anything else is an event
                if "error" in reply:
                    raise AssertionError(f"chromium refused {method} {params}: {reply['error']}")
                return reply["result"]

    def element_pixels(self, url: str, selector: str, color_scheme: str, pad: int = 16) -> np.ndarray:
        """Pixels (rows, columns, RGB) of the first element matching `selector` on `url`, once it is there (an image:
        loaded), with `pad` pixels of the page around it, as chromium draws it for a reader whose system asks for
        `color_scheme` ("dark" or "light")."""
        self.call("Emulation.setEmulatedMedia", features=[{"name": "prefers-color-scheme", "value": color_scheme}])
        self.evaluate("window.eagle3Left = true")  # the document navigated from: the poll below skips it
        self.call("Page.navigate", url=url)
        where = f"""(() => {{
            if (window.eagle3Left) return null;
            const e = document.querySelector({json.dumps(selector)});
            if (!e || (e.tagName === "IMG" && !(e.complete && e.naturalWidth))) return null;
            e.scrollIntoView({{block: "center"}});
            const r = e.getBoundingClientRect();
            return {{x: r.x + window.scrollX, y: r.y + window.scrollY, width: r.width, height: r.height}};
        }})()"""
        deadline = time.monotonic() + self.timeout_s
        while (box := self.evaluate(where)) is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"no {selector} on {url} within {self.timeout_s:.0f} s")
            time.sleep(0.25)
        # two frames: the scroll and the image painted before the picture is taken
        self.evaluate("new Promise(done => requestAnimationFrame(() => requestAnimationFrame(done)))")
        box = self.evaluate(where)
        clip = {"x": box["x"] - pad, "y": box["y"] - pad, "width": box["width"] + 2 * pad,
                "height": box["height"] + 2 * pad, "scale": 1}
        shot = self.call("Page.captureScreenshot", format="png", clip=clip)
        return png_rgb(base64.b64decode(shot["data"]))

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"the page threw evaluating {expression[:200]}: {result['exceptionDetails']}")
        return result["result"].get("value")


def png_rgb(data: bytes) -> np.ndarray:
    """Pixels (rows, columns, RGB) of an 8-bit, non-interlaced RGB or RGBA PNG, as chromium writes screenshots."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise AssertionError(f"not a PNG: {data[:16]!r}")
    chunks, pos = {}, 8
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunks.setdefault(kind, []).append(data[pos + 8:pos + 8 + length])
        pos += 12 + length
    width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", chunks[b"IHDR"][0])
    if depth != 8 or color not in (2, 6) or interlace:
        raise AssertionError(f"a PNG of bit depth {depth}, colour type {color}, interlace {interlace}: only 8-bit, "
                             "non-interlaced RGB (2) or RGBA (6) is read here")
    channels = 3 if color == 2 else 4
    rows = np.frombuffer(zlib.decompress(b"".join(chunks[b"IDAT"])), np.uint8).reshape(height, 1 + width * channels)
    pixels = np.zeros((height, width * channels), np.int32)
    above = np.zeros(width * channels, np.int32)
    for y in range(height):
        pixels[y] = unfilter(int(rows[y, 0]), rows[y, 1:].astype(np.int32), above, channels)
        above = pixels[y]
    return pixels.reshape(height, width, channels)[:, :, :3].astype(np.uint8)


def unfilter(kind: int, line: np.ndarray, above: np.ndarray, bpp: int) -> np.ndarray:
    """One row of a PNG's pixel bytes from its filtered bytes (PNG spec, section 9: filter types 0-4)."""
    if kind == 0:
        return line
    if kind == 1:  # Sub: a running sum per channel
        return (np.cumsum(line.reshape(-1, bpp), axis=0) % 256).reshape(-1)
    if kind == 2:
        return (line + above) % 256
    if kind not in (3, 4):
        raise AssertionError(f"PNG filter type {kind}: the spec has 0-4")
    row, above = [0] * len(line), above.tolist()
    for i, value in enumerate(line.tolist()):
        left, up, up_left = (row[i - bpp], above[i], above[i - bpp]) if i >= bpp else (0, above[i], 0)
        if kind == 3:
            predicted = (left + up) // 2
        else:  # Paeth: the neighbour nearest left + up - up_left
            p = left + up - up_left
            pa, pb, pc = abs(p - left), abs(p - up), abs(p - up_left)
            predicted = left if pa <= pb and pa <= pc else up if pb <= pc else up_left
        row[i] = (value + predicted) % 256
    return np.array(row, np.int32)
