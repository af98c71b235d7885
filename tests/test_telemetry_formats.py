"""eagle3.records.telemetry's readers: SGLang's /metrics text and its request-record files (a directory or an S3
prefix), the time window, and errors that name the file and line."""

import json
import os
import time
from datetime import datetime

import boto3
import pytest

from eagle3.errors import UnreadableInput
from eagle3.records.telemetry import (
    GENERATION_TOKENS, RECORD_HOUR, VERIFY_CALLS, metric_total, parse_metrics, read_request_records,
)
from s3_server import new_bucket, serve_moto_s3

EXPOSITION = """# HELP sglang:generation_tokens_total Number of generation tokens processed.
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{engine_type="unified",is_streaming="false",model_name="/m"} 120.0
sglang:generation_tokens_total{engine_type="unified",is_streaming="true",model_name="/m"} 30.0
sglang:generation_tokens_created{engine_type="unified",is_streaming="false",model_name="/m"} 1.7e+09
sglang:spec_accept_length{model_name="a \\"quoted\\" name"} 2.5
"""


def test_metrics_are_summed_over_label_sets_and_absent_ones_are_none():
    samples = parse_metrics(EXPOSITION)
    assert metric_total(samples, GENERATION_TOKENS) == 150.0 and metric_total(samples, VERIFY_CALLS) is None
    assert samples[-1].labels == {"model_name": 'a "quoted" name'}
    with pytest.raises(ValueError, match="line 2 is not a Prometheus sample"):
        parse_metrics("sglang:ok 1\nnot a sample at all\n")


def record(sent: float, text: str, completion_tokens: int = 8, **meta) -> str:
    parameters = {"text": text, "custom_labels": {"app": "code"}, "rid": text}
    return json.dumps({"request_parameters": json.dumps(parameters), "completion_tokens": completion_tokens,
                       "response_sent_to_client_ts": sent, **meta}) + "\n"


HOUR = datetime(2026, 12, 1, 10).timestamp()  # local time, as the exporter names its files


def files() -> dict[str, str]:
    """Two hours of records: 10:00 (two requests) and 11:00 (one, without a draft)."""
    name = lambda hour: f"sglang-request-metrics-{datetime.fromtimestamp(hour).strftime(RECORD_HOUR)}.log"  # noqa: E731
    return {name(HOUR): record(HOUR + 60, "a", spec_verify_ct=4) + "\n" + record(HOUR + 3599, "b", spec_verify_ct=2),
            name(HOUR + 3600): record(HOUR + 3700, "c"), "other.log": "not a record\n"}


def test_records_of_a_directory_in_a_window(tmp_path):
    for name, text in files().items():
        (tmp_path / name).write_text(text)
    every = list(read_request_records(tmp_path))
    assert [(r.text, r.spec_verify_ct, r.label("app")) for r in every] == [("a", 4, "code"), ("b", 2, "code"),
                                                                           ("c", 0, "code")]
    assert [r.text for r in read_request_records(tmp_path, since=HOUR + 61)] == ["b", "c"]  # b sent late in its hour
    assert [r.text for r in read_request_records(tmp_path, since=HOUR, until=HOUR + 3599)] == ["a"]
    assert every[2].where.endswith(":1") and not every[0].from_pipeline


def test_file_hours_in_the_servers_time_zone_never_hide_a_window(tmp_path):
    """A file's name is the server's local hour, unknown to the reader: a file last written before the window is not
    opened at all, and one written in it is read whatever hour its name gives."""
    now = time.time()
    ahead = datetime.fromtimestamp(now + 5 * 3600).strftime(RECORD_HOUR)  # a server five hours east of the reader
    (tmp_path / f"sglang-request-metrics-{ahead}.log").write_text(record(now - 30, "fresh", spec_verify_ct=3))
    stale = tmp_path / f"sglang-request-metrics-{datetime.fromtimestamp(now - 7200).strftime(RECORD_HOUR)}.log"
    stale.write_text("not a record: never opened\n")
    os.utime(stale, (now - 7000, now - 7000))
    assert [r.text for r in read_request_records(tmp_path, since=now - 300, until=now)] == ["fresh"]


def test_a_bad_record_names_its_file_and_line(tmp_path):
    name = f"sglang-request-metrics-{datetime.fromtimestamp(HOUR).strftime(RECORD_HOUR)}.log"
    (tmp_path / name).write_text(record(HOUR, "a") + '{"request_parameters": "{}"}\n')
    with pytest.raises(UnreadableInput, match=f"{name}:2: not an SGLang request record"):
        list(read_request_records(tmp_path))
    with pytest.raises(UnreadableInput, match="no such request-record directory"):
        list(read_request_records(tmp_path / "missing"))


@pytest.fixture
def moto_s3(monkeypatch, tmp_path):
    yield from serve_moto_s3(monkeypatch, tmp_path)


def test_records_under_an_s3_prefix(moto_s3, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_s3.url)  # the standard chain's endpoint, as the reader takes it
    bucket = new_bucket(moto_s3.url)
    s3 = boto3.client("s3", endpoint_url=moto_s3.url)
    for name, text in files().items():
        s3.put_object(Bucket=bucket, Key=f"prod/records/{name}", Body=text.encode())
    s3.put_object(Bucket=bucket, Key=f"elsewhere/{next(iter(files()))}", Body=record(HOUR, "z").encode())
    texts = [r.text for r in read_request_records(f"s3://{bucket}/prod/records/", since=HOUR + 61)]
    assert texts == ["b", "c"]
