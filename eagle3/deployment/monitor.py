"""Production's acceptance on live traffic (docs/contracts.md, Acceptance; docs/production-loop.md): one observation window at a time, judged
against what the production version measured at its promotion, with a history kept in the registry's store.

A window's accept length is Σ completion_tokens / Σ spec_verify_ct over the users' request records sent in it (the
pipeline's own requests, labelled eagle3=benchmark, left out; per traffic slice too), or Δ generation tokens / Δ verify
calls of /metrics since the previous window's sample. Verdicts:
- ok / low: enough verify steps; low = below the promotion's accept length × (1 - monitor.tolerance);
- insufficient: fewer than monitor.min_verify_steps verify steps (or nothing to compare with): never counts;
- unavailable: production does not answer (a retrain holds the node) or there is no production version: logged only.
`monitor.consecutive` low windows of one production version in a row (insufficient and unavailable ones skipped) raise
an alarm, unless the last alarm is less than monitor.cooldown_s old: then the window says the alarm was suppressed.
The streak restarts after each alarm, raised or suppressed.

Store keys (beside the registry's `history/`): `monitor/windows/<UTC time>-<id>.json` one per window,
`monitor/alarms/<UTC time>-<id>.json` one per alarm raised.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

import httpx

from eagle3.bench.counting import accept_length
from eagle3.config.deployment import MonitorSection, ProductionSection
from eagle3.config.serving import ServingSection
from eagle3.errors import ConfigError
from eagle3.records.telemetry import metric_total, parse_metrics, read_request_records
from eagle3.serving import serving_engine
from eagle3.serving.base import ServingEngine

WINDOWS, ALARMS = "monitor/windows/", "monitor/alarms/"
SUFFICIENT = ("ok", "low")
Log = Callable[[str], None]


@dataclass(frozen=True)
class Observation:
    """What production did in one window (None: not observed)."""

    source: str
    span_s: float
    completion_tokens: int = 0
    verify_steps: int = 0
    requests: int | None = None
    slices: dict | None = None
    counters: dict | None = None  # the /metrics sample the next window's deltas start from
    note: str = ""


def source_of(monitor: MonitorSection, production: ProductionSection) -> str:
    telemetry, wanted = production.telemetry, monitor.source
    if wanted == "auto":
        wanted = "records" if telemetry.records_dir is not None else "metrics"
    if wanted == "records" and telemetry.records_dir is None:
        raise ConfigError("monitor.source records needs production.telemetry.records_dir (SGLang's "
                          "--export-metrics-to-file-dir): set it, or monitor.source metrics")
    if wanted == "metrics" and not telemetry.metrics:
        raise ConfigError("the monitor reads production's /metrics, but production.telemetry.metrics is false: set it "
                          "true (SGLang's --enable-metrics), or production.telemetry.records_dir for the request records")
    return wanted


def production_url(production: ProductionSection) -> str:
    return f"http://{production.host}:{production.port}"


def from_records(monitor: MonitorSection, production: ProductionSection, now: float) -> Observation:
    """The users' requests sent in [now - window_s, now), in total and per slice."""
    window, key = monitor.window_s, production.telemetry.slice_label
    slices: dict[str, dict] = {}
    for record in read_request_records(production.telemetry.records_dir, now - window, now):
        if record.from_pipeline:
            continue
        part = slices.setdefault(record.slice_of(key), {"requests": 0, "completion_tokens": 0,
                                                                    "verify_steps": 0})
        part["requests"] += 1
        part["completion_tokens"] += record.completion_tokens
        part["verify_steps"] += record.spec_verify_ct
    for part in slices.values():
        part["accept_length"] = accept_length(part["completion_tokens"], part["verify_steps"])
    return Observation("records", window, sum(p["completion_tokens"] for p in slices.values()),
                       sum(p["verify_steps"] for p in slices.values()), sum(p["requests"] for p in slices.values()),
                       dict(sorted(slices.items())))


def scrape(url: str, timeout_s: float, now: float, engine: ServingEngine) -> dict:
    """production's counters now, by `engine`'s metric names; httpx.HTTPError when it does not answer, ValueError when
    it reports no verify steps (an SGLang release before 0.5.13, or a server without a draft)."""
    response = httpx.get(f"{url}/metrics", timeout=timeout_s)
    response.raise_for_status()
    samples = parse_metrics(response.text)
    names = {"generation_tokens": engine.generation_tokens_metric, "verify_calls": engine.verify_steps_metric}
    counters = {"time": now, **{key: metric_total(samples, name) for key, name in names.items()}}
    missing = [name for key, name in names.items() if counters[key] is None]
    if missing:
        raise ValueError(f"{url}/metrics reports no {', '.join(missing)} ({engine.title} reports them "
                         f"{engine.verify_steps_reported})")
    return counters


def from_counters(now: dict, before: dict | None) -> Observation:
    """The deltas since the previous sample. A counter below its previous value means the server restarted: the
    window then counts from zero (Prometheus' rule), over the time since the previous sample."""
    if before is None:
        return Observation("metrics", 0.0, counters=now, note="first /metrics sample: the next window counts from it")
    reset = any(now[key] < before[key] for key in ("generation_tokens", "verify_calls"))
    start = {"generation_tokens": 0.0, "verify_calls": 0.0} if reset else before
    return Observation("metrics", now["time"] - before["time"], int(now["generation_tokens"] - start["generation_tokens"]),
                       int(now["verify_calls"] - start["verify_calls"]), counters=now,
                       note="counters reset (the server restarted): counted from zero" if reset else "")


def serving(url: str, timeout_s: float) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def observe(monitor: MonitorSection, production: ProductionSection, engine: ServingEngine, previous: dict | None,
            now: float) -> Observation | str:
    """One window of production served by `engine`, or why it could not be observed (production unavailable)."""
    url, timeout = production_url(production), monitor.timeout_s
    if source_of(monitor, production) == "records":
        if not serving(url, timeout):
            return f"production at {url} does not answer /health (stopped, e.g. by a retrain on the node)"
        return from_records(monitor, production, now)
    try:
        counters = scrape(url, timeout, now, engine)
    except httpx.HTTPError as err:
        return f"production at {url} does not serve /metrics ({type(err).__name__}: {err})"
    # deltas only against a sample of the same server's counters: the last window that read /metrics
    before = (previous or {}).get("counters")
    return from_counters(counters, before)


def baseline_of(manifest: dict) -> dict:
    """What the version measured at its promotion: the served accept length, and the chosen shape's throughput."""
    metrics = manifest.get("metrics") or {}
    served, production = metrics.get("served") or {}, metrics.get("production") or {}
    return {"accept_length": production.get("accept_length") or served.get("accept_length"),
            "output_tokens_per_s": production.get("output_tokens_per_s") or served.get("output_tokens_per_s"),
            "no_draft_output_tokens_per_s": production.get("baseline_output_tokens_per_s"),
            "speedup": production.get("speedup")}


def judge(observation: Observation, baseline: dict, monitor: MonitorSection) -> tuple[str, str, float | None]:
    """(verdict, reason, threshold) of one observed window."""
    measured = accept_length(observation.completion_tokens, observation.verify_steps)
    if baseline.get("accept_length") is None:
        return "insufficient", "the production version recorded no accept length at its promotion", None
    threshold = baseline["accept_length"] * (1 - monitor.tolerance)
    if observation.verify_steps < monitor.min_verify_steps:
        return ("insufficient", f"{observation.verify_steps} verify steps, fewer than monitor.min_verify_steps "
                f"({monitor.min_verify_steps})" + (f"; {observation.note}" if observation.note else ""), threshold)
    if measured < threshold:
        return "low", (f"accept length {measured:.3f} < {threshold:.3f} (promotion's {baseline['accept_length']:.3f} "
                       f"× (1 - {monitor.tolerance:g}))"), threshold
    return "ok", f"accept length {measured:.3f} ≥ {threshold:.3f}", threshold


class Monitor:
    """The windows of one registry's production, kept in the registry's store; production is observed as
    `production` (its endpoint and telemetry) and `serving` (its engine) say, and judged by `monitor`."""

    def __init__(self, monitor: MonitorSection, production: ProductionSection, serving: ServingSection, registry,
                 log: Log = print):
        self.monitor, self.production, self.serving = monitor, production, serving
        self.registry, self.store, self.log = registry, registry.store, log

    def windows(self, limit: int | None = None) -> list[dict]:
        """The most recent windows (all with limit None), oldest first."""
        return self._read(WINDOWS, limit or None)

    def alarms(self, limit: int | None = None) -> list[dict]:
        return self._read(ALARMS, limit or None)

    def _read(self, prefix: str, limit: int | None) -> list[dict]:
        keys = self.store.list(prefix)  # time-stamped keys: sorted by key is sorted by time
        entries = []
        for key in keys[-limit:] if limit else keys:
            data, _ = self.store.read(key)
            if data is not None:
                entries.append(json.loads(data))
        return entries

    def _write(self, prefix: str, entry: dict) -> None:
        stamp = datetime.fromtimestamp(entry["t"], timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
        self.store.put_bytes(f"{prefix}{stamp}-{uuid.uuid4().hex[:12]}.json",
                             (json.dumps(entry, indent=2, sort_keys=True) + "\n").encode())

    def run_window(self, now: float | None = None) -> dict:
        """Observe, judge and record one window; the entry's `alarm` holds the alarm's figures when one is raised."""
        now = time.time() if now is None else now
        recent = self.windows(self.monitor.keep_windows)
        version = self.registry.production_version()
        entry = {"t": now, "time": datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds"),
                 "version": version, "registry": self.registry.location}
        observed = (observe(self.monitor, self.production, serving_engine(self.serving.engine),
                            last_with_counters(recent), now) if version
                    else "the registry has no production version")
        if isinstance(observed, str):
            entry.update(verdict="unavailable", reason=observed)
        else:
            baseline = baseline_of(self.registry.manifest(version))
            verdict, reason, threshold = judge(observed, baseline, self.monitor)
            entry.update(verdict=verdict, reason=reason, source=observed.source, span_s=observed.span_s,
                         accept_length=accept_length(observed.completion_tokens, observed.verify_steps),
                         output_tokens_per_s=observed.completion_tokens / observed.span_s if observed.span_s else None,
                         verify_steps=observed.verify_steps, completion_tokens=observed.completion_tokens,
                         requests=observed.requests, slices=observed.slices, counters=observed.counters,
                         baseline=baseline, threshold=threshold)
            if verdict == "low":
                self._alarm(entry, recent)
        self.log(f"monitor: {entry['verdict']} (version {version}): {entry['reason']}"
                 + (f"; alarm {entry['alarm']['state']}" if entry.get("alarm") else ""))
        self._write(WINDOWS, entry)
        return entry

    def _alarm(self, entry: dict, recent: list[dict]) -> None:
        """Raise (or suppress, in the cool-down) the alarm when this low window completes a streak."""
        monitor = self.monitor
        last = self.alarms(1)
        since = last[0]["t"] if last else float("-inf")
        # a streak counts from the last one that completed, whether it raised the alarm or was suppressed
        start = max([since] + [w["t"] for w in recent if (w.get("alarm") or {}).get("state") == "suppressed"])
        streak = [w for w in recent if w["t"] > start and w.get("version") == entry["version"]
                  and w["verdict"] in SUFFICIENT] + [entry]
        streak = streak[-monitor.consecutive:]
        if len(streak) < monitor.consecutive or any(w["verdict"] != "low" for w in streak):
            return
        figures = alarm_figures(entry, streak, monitor)
        if entry["t"] - since < monitor.cooldown_s:
            figures.update(state="suppressed", note=(
                f"the last alarm was {entry['t'] - since:.0f} s ago, within monitor.cooldown_s "
                f"({monitor.cooldown_s:g} s): no second alarm"))
        else:
            figures["state"] = "raised"
            self._write(ALARMS, {"t": entry["t"], "time": entry["time"], **figures})
        entry["alarm"] = figures


def last_with_counters(recent: list[dict]) -> dict | None:
    return next((w for w in reversed(recent) if w.get("counters")), None)


def alarm_figures(entry: dict, streak: list[dict], monitor) -> dict:
    return {"version": entry["version"], "registry": entry["registry"], "baseline": entry["baseline"],
            "threshold": entry["threshold"], "tolerance": monitor.tolerance, "consecutive": monitor.consecutive,
            "windows": [{key: w.get(key) for key in ("time", "accept_length", "output_tokens_per_s", "verify_steps",
                                                      "requests")} for w in streak],
            "slices": entry.get("slices")}
