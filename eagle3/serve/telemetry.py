"""The reference server's telemetry, as the SGLang release it stands for reports it (docs/production-loop.md).

- `/metrics` (`--enable-metrics`): the four metrics the monitor reads, with SGLang's names and label names, rendered
  by prometheus_client as SGLang renders them. The tokenizer manager's collector labels with model_name and
  engine_type (the counters; `generation_tokens_total` adds is_streaming from 0.5.17, `spec_verify_calls_total`
  exists from 0.5.13); the scheduler's adds tp_rank, pp_rank and moe_ep_rank (the gauges, which cover the
  scheduler's last decode-log window: here the last request, as this server decodes one at a time; 0 without a
  draft, as SGLang's scheduler logs them). The tokenizer manager's collector also carries one label per key
  declared with --tokenizer-metrics-allowed-custom-labels ("" unless the request's custom_labels sets it); a request
  naming a key not declared makes SGLang's collector raise inside the manager's loop and the server die, so with
  metrics on this server refuses it.
- Request records (`--export-metrics-to-file --export-metrics-to-file-dir DIR`): one JSON line per finished request
  in DIR/sglang-request-metrics-YYYYmmdd_HH.log (local hour), as `FileRequestMetricsExporter` writes them: the
  request's GenerateReqInput fields that are not None as a JSON string, beside its meta_info (which every release
  read stamps with `response_sent_to_client_ts` before exporting).

Both are proven per release against SGLang's own collector and exporter in tests/conformance/test_telemetry.py.
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from datetime import datetime
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from eagle3.contract.releases import release_or_newest
from eagle3.records.telemetry import ACCEPT_LENGTH, ACCEPT_RATE, GENERATION_TOKENS, RECORD_HOUR, VERIFY_CALLS

SPEC_VERIFY_CALLS_FROM = (0, 5, 13)
IS_STREAMING_FROM = (0, 5, 17)
ENGINE_TYPE = "unified"  # DisaggregationMode.to_engine_type of a server without prefill/decode disaggregation
SCHEDULER_RANKS = {"tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}  # one scheduler: every rank 0
# GenerateReqInput fields a /generate body may hold that this server takes (the rest it refuses or ignores); the
# record holds those the request set, plus the rid SGLang assigns when the request names none.
RECORDED_FIELDS = ("text", "input_ids", "sampling_params", "rid", "custom_labels")


def _name(metric: str) -> str:
    return metric.removesuffix("_total")  # prometheus_client adds the suffix to a counter's samples


class Telemetry:
    """What one reference server reports; `observe` each finished /generate request (never a health check)."""

    def __init__(self, model_name: str, release: str | None, metrics: bool, records_dir: Path | None,
                 speculative: bool, custom_labels: tuple[str, ...] = ()):
        self.speculative = speculative  # SGLang's scheduler reports accept length and rate 0 without a draft
        self.registry = CollectorRegistry() if metrics else None
        self.records_dir = None if records_dir is None else Path(records_dir)
        self.lock = threading.Lock()  # one line per request, never two interleaved, in the file of its hour
        version = release_or_newest(release)
        self.labels = {"model_name": model_name, "engine_type": ENGINE_TYPE}
        self.custom = dict.fromkeys(custom_labels, "")  # the tokenizer manager's labels: declared keys start empty
        self.streaming = {"is_streaming": "false"} if version >= IS_STREAMING_FROM else {}
        if self.registry is not None:
            scheduler = [*self.labels, *SCHEDULER_RANKS]
            self.tokens = Counter(_name(GENERATION_TOKENS), "Number of generation tokens processed.",
                                  [*self.labels, *self.custom, *self.streaming], registry=self.registry)
            self.verify_calls = (Counter(_name(VERIFY_CALLS), "Number of speculative decoding verification calls.",
                                         [*self.labels, *self.custom], registry=self.registry)
                                 if version >= SPEC_VERIFY_CALLS_FROM else None)
            self.accept_length = Gauge(ACCEPT_LENGTH, "The average acceptance length of speculative decoding.",
                                       scheduler, registry=self.registry)
            self.accept_rate = Gauge(ACCEPT_RATE, "The average acceptance rate of speculative decoding "
                                     "(`accepted tokens / total draft tokens` in batch).", scheduler,
                                     registry=self.registry)
        if self.records_dir is not None:
            self.records_dir.mkdir(parents=True, exist_ok=True)

    def exposition(self) -> bytes | None:
        """The /metrics body; None when metrics are off (SGLang then serves no /metrics)."""
        return None if self.registry is None else generate_latest(self.registry)

    def undeclared(self, custom_labels: dict | None) -> str | None:
        """Why SGLang would fail on a request with these custom_labels (a key its collector was not started
        with, metrics on), or None."""
        unknown = sorted(set(custom_labels or {}) - set(self.custom))
        if self.registry is None or not unknown:
            return None
        return (f"custom_labels key(s) {unknown} are not declared: SGLang with --enable-metrics would fail on this "
                f"request (its metrics collector raises on an unknown label name and the server goes down); declare "
                f"them in --tokenizer-metrics-allowed-custom-labels (declared: {sorted(self.custom)})")

    def observe(self, body: dict, meta: dict, correct: int, drafts_per_step: int) -> None:
        """Count one finished request (`meta`: its meta_info; `correct`: its accepted drafts) and record it."""
        if self.registry is not None:
            labels = {**self.labels, **self.custom, **(body.get("custom_labels") or {})}  # as collect_metrics merges
            self.tokens.labels(**labels, **self.streaming).inc(meta["completion_tokens"])
            verify_ct = meta.get("spec_verify_ct", 0)
            if verify_ct and self.verify_calls is not None:  # SGLang counts only requests with a verify step
                self.verify_calls.labels(**labels).inc(verify_ct)
            if verify_ct or not self.speculative:  # the scheduler's decode-log window; 0 and 0 without a draft
                self.accept_length.labels(**self.labels, **SCHEDULER_RANKS).set(
                    (correct + verify_ct) / verify_ct if verify_ct else 0.0)  # tokens per verify step
                self.accept_rate.labels(**self.labels, **SCHEDULER_RANKS).set(  # accepted share of the drafts
                    correct / (verify_ct * drafts_per_step) if verify_ct and drafts_per_step else 0.0)
        if self.records_dir is not None:
            self.write_record(body, meta)

    def write_record(self, body: dict, meta: dict) -> None:
        fields = {"rid": uuid.uuid4().hex} | {k: body[k] for k in RECORDED_FIELDS if body.get(k) is not None}
        line = json.dumps({"request_parameters": json.dumps(fields), **meta}) + "\n"
        with self.lock:
            path = self.records_dir / f"sglang-request-metrics-{datetime.now().strftime(RECORD_HOUR)}.log"
            with open(path, "a", encoding="utf-8") as f:  # appended whole and flushed: readers see whole lines
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
