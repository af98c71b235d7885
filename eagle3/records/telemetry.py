"""What SGLang reports about a running server (docs/production-loop.md), read the way SGLang writes it.

- `/metrics` (`--enable-metrics`): Prometheus text. Counters `sglang:generation_tokens_total` and (from 0.5.13)
  `sglang:spec_verify_calls_total` give the accept length over any window as Δ generation tokens / Δ verify calls;
  gauges `sglang:spec_accept_length` / `sglang:spec_accept_rate` cover only the scheduler's last decode-log window.
- Request records (`--export-metrics-to-file --export-metrics-to-file-dir DIR`): one JSON object a line in hourly
  files `sglang-request-metrics-YYYYmmdd_HH.log`, holding `request_parameters` (the request's own fields as a JSON
  string: text or input_ids, sampling_params, custom_labels, ...) beside the request's meta_info (completion_tokens,
  spec_verify_ct, ...). The spec_* keys are absent when the server has no draft.

Which release has which name and field is proven against each release's own collector and exporter in
tests/conformance; this module only reads.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Iterator

from eagle3.errors import UnreadableInput

GENERATION_TOKENS = "sglang:generation_tokens_total"
VERIFY_CALLS = "sglang:spec_verify_calls_total"
ACCEPT_LENGTH = "sglang:spec_accept_length"
ACCEPT_RATE = "sglang:spec_accept_rate"
RECORD_FILE = re.compile(r"sglang-request-metrics-(\d{8}_\d{2})\.log$")
RECORD_HOUR = "%Y%m%d_%H"  # the server's local time, as the exporter names its files
MAX_UTC_OFFSET_S = 14 * 3600
SAMPLE_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$")
LABEL = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?')
# The pipeline's own requests (benchmark, health checks of a measurement) carry this custom label, so the monitor and
# the traffic prompt source never take them for users' traffic.
PIPELINE_LABEL = ("eagle3", "benchmark")
UNLABELLED = "(unlabelled)"  # the traffic slice of a request without the operator's slice label


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse_metrics(text: str) -> list[Sample]:
    """Prometheus text exposition -> its samples (comments and blank lines skipped); ValueError names a bad line."""
    samples = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = SAMPLE_LINE.match(line)
        if match is None:
            raise ValueError(f"/metrics line {number} is not a Prometheus sample: {line[:120]!r}")
        name, labels, value = match.groups()
        samples.append(Sample(name, _labels(labels or "", number), float(value)))
    return samples


def _labels(text: str, number: int) -> dict[str, str]:
    labels, position = {}, 0
    while position < len(text):
        match = LABEL.match(text, position)
        if match is None:
            raise ValueError(f"/metrics line {number}: cannot read the labels {text!r}")
        labels[match.group(1)] = bytes(match.group(2), "utf-8").decode("unicode_escape")
        position = match.end()
    return labels


def metric_total(samples: list[Sample], name: str) -> float | None:
    """The sum of `name` over every label set (one server reports one model; several label sets are its parts), or
    None when the server does not report it."""
    values = [s.value for s in samples if s.name == name]
    return math.fsum(values) if values else None


@dataclass(frozen=True)
class RequestRecord:
    time: float  # unix seconds the response was sent (the start of its file's hour where the record has no time)
    parameters: dict  # the request's own fields
    completion_tokens: int
    spec_verify_ct: int  # 0 without a draft (SGLang then omits every spec_* key)
    where: str  # file:line, for messages
    meta: dict = field(repr=False, default_factory=dict)

    @property
    def text(self) -> str | None:
        text = self.parameters.get("text")
        return text if isinstance(text, str) and text else None

    @property
    def input_ids(self) -> list[int] | None:
        ids = self.parameters.get("input_ids")
        return ids if isinstance(ids, list) and ids and all(type(t) is int for t in ids) else None

    @property
    def from_pipeline(self) -> bool:
        return self.label(PIPELINE_LABEL[0]) == PIPELINE_LABEL[1]

    def slice_of(self, key: str) -> str:
        """The traffic slice the request belongs to: its custom label `key`, or UNLABELLED."""
        return self.label(key) or UNLABELLED

    def label(self, key: str) -> str | None:
        """The request's custom label `key` (SGLang's `custom_labels`), if it names one."""
        labels = self.parameters.get("custom_labels")
        value = labels.get(key) if isinstance(labels, dict) else None
        return None if value is None else str(value)


def read_request_records(location: str | Path, since: float | None = None,
                         until: float | None = None) -> Iterator[RequestRecord]:
    """The records of a record directory (or an s3://bucket/prefix of such files) sent in [since, until), oldest
    file first. Files wholly outside the window are not opened; a malformed line raises UnreadableInput naming it."""
    for name, lines in _record_files(str(location), since, until):
        hour = datetime.strptime(RECORD_FILE.search(name).group(1), RECORD_HOUR).timestamp()
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            record = parse_record(line, hour, f"{name}:{number}")
            if (since is None or record.time >= since) and (until is None or record.time < until):
                yield record


def parse_record(line: str, hour: float, where: str) -> RequestRecord:
    try:
        entry = json.loads(line)
        parameters = json.loads(entry.get("request_parameters") or "{}")
    except (json.JSONDecodeError, TypeError, AttributeError) as err:
        raise UnreadableInput(f"{where}: not an SGLang request record ({err})") from None
    if not isinstance(parameters, dict) or not isinstance(entry.get("completion_tokens"), int):
        raise UnreadableInput(f"{where}: not an SGLang request record (no request_parameters object or no "
                              "integer completion_tokens)")
    sent = entry.get("response_sent_to_client_ts")
    return RequestRecord(time=float(sent) if isinstance(sent, (int, float)) else hour, parameters=parameters,
                         completion_tokens=entry["completion_tokens"],
                         spec_verify_ct=int(entry.get("spec_verify_ct") or 0), where=where, meta=entry)


def _in_window(name: str, modified: float, since: float | None, until: float | None) -> bool:
    """Whether a record file may hold responses sent in [since, until). Its name gives the hour in the SERVER's local
    time, which the reader cannot know: the start of the window is judged by when the file was last written to
    (records are appended in order), the end by its hour give or take the widest time-zone offset."""
    hour = datetime.strptime(RECORD_FILE.search(name).group(1), RECORD_HOUR).timestamp()
    return (since is None or modified >= since) and (until is None or hour < until + MAX_UTC_OFFSET_S)


def _record_files(location: str, since: float | None, until: float | None) -> Iterator[tuple[str, Iterator[str]]]:
    if location.startswith("s3://"):
        yield from _s3_record_files(location, since, until)
        return
    directory = Path(location)
    if not directory.is_dir():
        raise UnreadableInput(f"{directory}: no such request-record directory (SGLang's --export-metrics-to-file-dir)")
    for path in sorted(directory.iterdir()):
        if RECORD_FILE.search(path.name) and _in_window(path.name, path.stat().st_mtime, since, until):
            yield str(path), _file_lines(path)


def _file_lines(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        yield from f


def _s3_record_files(uri: str, since: float | None, until: float | None) -> Iterator[tuple[str, Iterator[str]]]:
    import boto3
    import botocore.exceptions

    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    if not bucket:
        raise UnreadableInput(f"{uri}: expected s3://bucket/prefix")
    client = boto3.client("s3")  # endpoint and credentials from the standard AWS chain
    try:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        objects = sorted((o["Key"], o["LastModified"].timestamp()) for page in pages for o in page.get("Contents", []))
        for key, modified in objects:
            if RECORD_FILE.search(key) and _in_window(key, modified, since, until):
                body = client.get_object(Bucket=bucket, Key=key)["Body"]
                yield f"s3://{bucket}/{key}", (raw.decode("utf-8") for raw in body.iter_lines(keepends=True))
    except botocore.exceptions.ClientError as err:
        raise UnreadableInput(f"{uri}: {err.response['Error'].get('Message') or err}") from None
