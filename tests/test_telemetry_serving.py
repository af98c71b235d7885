"""The reference server's telemetry as SGLang reports it (docs/production-loop.md): /metrics counters equal the served requests'
completion tokens and verify steps (health checks left out), request records read back by the monitor's reader, the
release's own metric names, the declared custom labels on the counters and an undeclared one refused (SGLang would
crash on it); and the launcher gives SGLang's flags to the production server only."""

import time

import pytest

from eagle3.records.telemetry import (
    ACCEPT_LENGTH, ACCEPT_RATE, GENERATION_TOKENS, VERIFY_CALLS, metric_total, parse_metrics, read_request_records,
)
from eagle3.config.deployment import TelemetrySection
from eagle3.deployment.production import Production
from eagle3.registry.registry import open_registry
from eagle3.serving.reference import REFERENCE
from eagle3.serving.sglang import SGLANG
from eagle3.serve.launch import LaunchError, server_for
from eagle3.shape import DraftShape
from eagle3.serving.base import launch_spec
from helpers import STEPS, generate, serving

pytestmark = pytest.mark.usefixtures("one_thread")




def serve_traffic(client, micro, labels=("code", "chat", "code")) -> list[dict]:
    """Three labelled requests and a health check; the meta_info of the three."""
    metas = [generate(client, input_ids=micro["prompts"][i % len(micro["prompts"])], custom_labels={"app": app},
                      rid=f"r{i}")["meta_info"] for i, app in enumerate(labels)]
    assert client.get("/health_generate").status_code == 200
    return metas


def test_metrics_and_records_of_a_speculative_server(micro, drafts, tmp_path):
    since = time.time()
    with serving(micro["path"], drafts["good"], shape=DraftShape(STEPS), release="0.5.13", metrics=True,
                 records_dir=tmp_path / "records", custom_labels=("eagle3", "app")) as client:
        metas = serve_traffic(client, micro)
        exposition = client.get("/metrics")
    samples = parse_metrics(exposition.text)
    assert exposition.headers["content-type"].startswith("text/plain")
    assert metric_total(samples, GENERATION_TOKENS) == sum(m["completion_tokens"] for m in metas)
    assert metric_total(samples, VERIFY_CALLS) == sum(m["spec_verify_ct"] for m in metas) > 0
    assert metric_total(samples, ACCEPT_LENGTH) >= 1 and 0 <= metric_total(samples, ACCEPT_RATE) <= 1
    tokens = {s.labels["app"]: s for s in samples if s.name == GENERATION_TOKENS}  # one series per slice
    assert tokens["chat"].labels == {"model_name": str(micro["path"]), "engine_type": "unified", "eagle3": "",
                                     "app": "chat"}  # 0.5.13: no is_streaming; an unset declared label is ""
    assert (tokens["code"].value, tokens["chat"].value) == (metas[0]["completion_tokens"] + metas[2]["completion_tokens"],
                                                            metas[1]["completion_tokens"])
    records = list(read_request_records(tmp_path / "records", since=since))
    assert [r.label("app") for r in records] == ["code", "chat", "code"]  # the health check is no traffic
    assert [(r.completion_tokens, r.spec_verify_ct) for r in records] == [
        (m["completion_tokens"], m["spec_verify_ct"]) for m in metas]
    assert [r.parameters["rid"] for r in records] == ["r0", "r1", "r2"] and records[0].input_ids == micro["prompts"][0]
    assert records[0].meta["response_sent_to_client_ts"] == metas[0]["response_sent_to_client_ts"]
    assert set(records[0].parameters) == {"input_ids", "sampling_params", "custom_labels", "rid"}
    assert list(read_request_records(tmp_path / "records", since=time.time() + 1)) == []  # the window excludes them
    assert len(list(read_request_records(tmp_path / "records", until=records[1].time))) == 1


def test_a_plain_server_counts_tokens_and_records_no_spec_keys(micro, tmp_path):
    with serving(micro["path"], release="0.5.23", metrics=True, records_dir=tmp_path, custom_labels=("app",)) as client:
        metas = serve_traffic(client, micro, labels=("chat",))
        samples = parse_metrics(client.get("/metrics").text)
    assert metric_total(samples, GENERATION_TOKENS) == metas[0]["completion_tokens"]
    (tokens,) = [s for s in samples if s.name == GENERATION_TOKENS]
    assert tokens.labels["is_streaming"] == "false"  # 0.5.17 on
    # declared but never observed: no samples, as SGLang's collector without a verify step; the gauges are 0
    assert metric_total(samples, VERIFY_CALLS) is None
    assert metric_total(samples, ACCEPT_LENGTH) == metric_total(samples, ACCEPT_RATE) == 0
    (record,) = read_request_records(tmp_path)
    assert record.spec_verify_ct == 0 and not any(key.startswith("spec_") for key in record.meta)


def test_releases_before_0_5_13_have_no_verify_call_counter(micro, drafts):
    with serving(micro["path"], drafts["good"], shape=DraftShape(STEPS), release="0.5.12", metrics=True,
                 custom_labels=("app",)) as client:
        serve_traffic(client, micro, labels=("chat",))
        text = client.get("/metrics").text
    assert VERIFY_CALLS.removesuffix("_total") not in text and metric_total(parse_metrics(text), GENERATION_TOKENS) > 0


def test_without_telemetry_there_is_no_metrics_route_and_bad_fields_are_refused(micro, drafts, tmp_path):
    with serving(micro["path"], drafts["good"], shape=DraftShape(STEPS), release="0.5.13") as client:
        assert client.get("/metrics").status_code == 404
        prompt = micro["prompts"][0]
        for body, field in (({"custom_labels": {"app": 3}}, "custom_labels"),
                            ({"custom_labels": ["a"]}, "custom_labels"), ({"rid": ["a", "b"]}, "rid")):
            refused = client.post("/generate", json={"input_ids": prompt, **body})
            assert refused.status_code == 400 and refused.json()["error"]["message"].startswith(field), body


def test_an_undeclared_custom_label_is_refused_with_metrics_on(micro, tmp_path):
    """SGLang's collector raises on a label name it was not started with, inside the tokenizer manager's loop (the
    server goes down): with metrics on, the reference server refuses such a request before decoding it."""
    prompt = micro["prompts"][0]
    with serving(micro["path"], release="0.5.23", metrics=True, records_dir=tmp_path / "on",
                 custom_labels=("eagle3",)) as client:
        refused = client.post("/generate", json={"input_ids": prompt, "custom_labels": {"eagle3": "benchmark",
                                                                                         "team": "search"}})
        generate(client, input_ids=prompt, custom_labels={"eagle3": "benchmark"})  # declared: served
        samples = parse_metrics(client.get("/metrics").text)
    message = refused.json()["error"]["message"]
    assert refused.status_code == 400 and "['team']" in message and "--tokenizer-metrics-allowed-custom-labels" in message
    assert "SGLang" in message and "'eagle3'" not in message.split("declared:")[0]
    assert [s.labels["eagle3"] for s in samples if s.name == GENERATION_TOKENS] == ["benchmark"]
    assert len(list(read_request_records(tmp_path / "on"))) == 1  # the refused request was never served
    with serving(micro["path"], release="0.5.23", records_dir=tmp_path / "off") as client:  # no metrics: SGLang
        generate(client, input_ids=prompt, custom_labels={"team": "search"})  # uses custom_labels nowhere that fails
    assert [r.label("team") for r in read_request_records(tmp_path / "off")] == ["search"]


def test_records_need_their_directory(micro, tmp_path):
    from eagle3.cli import main

    args = ["serve", "--target", str(micro["path"]), "--port", "30124", "--export-metrics-to-file"]
    assert main(args) == 2  # SGLang refuses it too: the directory is required


def test_only_the_production_command_gets_the_telemetry_flags(production_config, tmp_path):
    records = tmp_path / "records"
    config = production_config(f"production.telemetry.records_dir={records}", "production.telemetry.metrics=true",
                               "production.keep_serving=false", "production.supervisor=none")
    telemetry = config.production.telemetry
    flags = ["--enable-metrics", "--export-metrics-to-file", "--export-metrics-to-file-dir", str(records),
             "--tokenizer-metrics-allowed-custom-labels", "eagle3", "app"]  # the benchmark's key, the slice key
    for build in (SGLANG.command, REFERENCE.command):
        assert build(launch_spec(config), "/models/t", "/drafts/d", telemetry)[-7:] == flags
        assert not set(flags[:3]) & set(build(launch_spec(config), "/models/t", "/drafts/d"))
    assert not set(flags[:3]) & set(server_for(launch_spec(config), "/models/t", "/drafts/d").command)  # candidate, baseline
    serving = config.serving.model_copy(update={"extra_args": ["--enable-metrics"]})
    clash = config.model_copy(update={"serving": serving})
    with pytest.raises(LaunchError, match="--enable-metrics"):
        SGLANG.command(launch_spec(clash), "/models/t", None, TelemetrySection(metrics=True))
    by_hand = config.serving.model_copy(update={"extra_args": ["--tokenizer-metrics-allowed-custom-labels", "app"]})
    with pytest.raises(LaunchError, match="--tokenizer-metrics-allowed-custom-labels"):
        SGLANG.command(launch_spec(config.model_copy(update={"serving": by_hand})), "/models/t", None)
    records_only = TelemetrySection(records_dir=records, slice_label="team")  # the OpenAI routes need the list too
    assert SGLANG.command(launch_spec(config), "/models/t", None, records_only)[-3:] == [
        "--tokenizer-metrics-allowed-custom-labels", "eagle3", "team"]
    assert "--tokenizer-metrics-allowed-custom-labels" not in SGLANG.command(launch_spec(config), "/models/t", None, TelemetrySection())
    lines = []
    started = time.time()
    Production(config, open_registry(config.registry, log=lambda line: None), lines.append).serve("v1", "test")
    assert any(f"telemetry: /metrics on, request records to {records}" in line for line in lines)
    measured = list(read_request_records(records, since=started))  # the re-measure's own requests, recorded
    assert len(measured) == config.benchmark.num_prompts and all(r.spec_verify_ct > 0 for r in measured)


def test_concurrent_requests_each_leave_one_whole_record(micro, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    with serving(micro["path"], metrics=True, records_dir=tmp_path) as client:  # unlabelled requests: none declared
        with ThreadPoolExecutor(6) as pool:
            metas = list(pool.map(lambda i: generate(client, max_new_tokens=2, input_ids=micro["prompts"][0],
                                                     rid=f"r{i}")["meta_info"], range(6)))
        total = metric_total(parse_metrics(client.get("/metrics").text), GENERATION_TOKENS)
    records = list(read_request_records(tmp_path))
    assert sorted(r.parameters["rid"] for r in records) == [f"r{i}" for i in range(6)]
    assert total == sum(r.completion_tokens for r in records) == sum(m["completion_tokens"] for m in metas)
