"""The production telemetry the monitor reads, per release, against SGLang's own code: its metrics collectors render
the four metrics (names, label names, totals) that eagle3.records.telemetry parses and that the reference server,
standing for that release, exposes alike; its FileRequestMetricsExporter writes the request record that
read_request_records reads, with the same record keys as the reference server's and request parameters that are
fields of the release's GenerateReqInput. The custom labels: started with --tokenizer-metrics-allowed-custom-labels
(the launcher's eagle3 and slice label), the release's tokenizer collector takes a request labelled with them and
carries them on its counters, as the reference server does; without the list the same observation raises (in
SGLang's tokenizer manager loop: the server goes down), which is why the launcher declares them and the reference
server refuses an undeclared key."""

from __future__ import annotations

import json

import httpx
import pytest

from eagle3.records.telemetry import (
    ACCEPT_LENGTH, ACCEPT_RATE, GENERATION_TOKENS, VERIFY_CALLS, metric_total, parse_metrics, read_request_records,
)
from eagle3.config.deployment import TelemetrySection
from eagle3.serve.inprocess import serve_in_thread
from eagle3.serving.sglang import custom_label_keys
from eagle3.serve.reference import create_app
from eagle3.shape import DraftShape
from helpers import STEPS
from releases import RELEASES


MONITORED = (GENERATION_TOKENS, VERIFY_CALLS, ACCEPT_LENGTH, ACCEPT_RATE)
ALLOWED = custom_label_keys(TelemetrySection())  # what the launcher declares by default: ["eagle3", "app"]
REQUEST = {"text": "import os\n", "custom_labels": {"eagle3": "benchmark", "app": "code"},
           "sampling_params": {"max_new_tokens": 16, "temperature": 0}}


@pytest.fixture(scope="module", params=RELEASES)
def served(request, micro, drafts, tmp_path_factory, run_sglang):
    """(release, the reference server's meta_info, /metrics and record, SGLang's answer and record directory) for
    one request, served by the reference server standing for the release and replayed through SGLang's own code."""
    release, root = request.param, tmp_path_factory.mktemp(f"telemetry-{request.param}")
    app = create_app(micro["path"], drafts["good"], shape=DraftShape(STEPS), release=release, metrics=True,
                     records_dir=root / "reference", custom_labels=tuple(ALLOWED))
    with serve_in_thread(app) as (url, _), httpx.Client(base_url=url, timeout=120) as client:
        meta = client.post("/generate", json=REQUEST).raise_for_status().json()["meta_info"]
        exposition = client.get("/metrics").text
    reference = parse_metrics(exposition)
    job = {"model_name": str(micro["path"]), "prompt_tokens": meta["prompt_tokens"],
           "generation_tokens": meta["completion_tokens"], "verify_calls": meta["spec_verify_ct"],
           "accept_length": metric_total(reference, ACCEPT_LENGTH), "accept_rate": metric_total(reference, ACCEPT_RATE),
           "records_dir": str(root / "sglang"), "allowed_custom_labels": ALLOWED, "request": REQUEST, "meta_info": meta}
    (record,) = read_request_records(root / "reference")
    return release, meta, reference, record, run_sglang(release, "telemetry", job), root / "sglang"


def label_names(samples) -> dict[str, set[str]]:
    return {s.name: set(s.labels) for s in samples if s.name in MONITORED}


def test_sglangs_exposition_reads_back_to_the_request(served):
    release, meta, reference, _, answer, _ = served
    samples = parse_metrics(answer["exposition"])
    assert metric_total(samples, GENERATION_TOKENS) == meta["completion_tokens"]
    assert metric_total(samples, VERIFY_CALLS) == (meta["spec_verify_ct"] if VERIFY_CALLS in label_names(samples)
                                                   else None)
    assert metric_total(samples, ACCEPT_LENGTH) == pytest.approx(metric_total(reference, ACCEPT_LENGTH))
    assert metric_total(samples, ACCEPT_RATE) == pytest.approx(metric_total(reference, ACCEPT_RATE))


def test_the_reference_server_exposes_the_releases_names_and_label_names(served):
    release, _, reference, _, answer, _ = served
    sglang = label_names(parse_metrics(answer["exposition"]))
    assert label_names(reference) == sglang, f"SGLang {release}"


def test_declared_custom_labels_label_the_counters_and_an_undeclared_one_raises(served):
    release, _, reference, _, answer, _ = served
    assert ALLOWED == ["eagle3", "app"]
    assert answer["merges_custom_labels"], f"SGLang {release}: collect_metrics no longer merges custom_labels"
    tokens = [s for s in parse_metrics(answer["exposition"]) if s.name == GENERATION_TOKENS]
    assert [(s.labels["eagle3"], s.labels["app"]) for s in tokens] == [("benchmark", "code")], f"SGLang {release}"
    ours = [s for s in reference if s.name == GENERATION_TOKENS]
    assert [s.labels for s in ours] == [s.labels for s in tokens], f"SGLang {release}: label values"
    assert answer["undeclared"].startswith("ValueError") and "label names" in answer["undeclared"], (
        f"SGLang {release} without --tokenizer-metrics-allowed-custom-labels: {answer['undeclared']!r}")


def test_sglangs_request_record_reads_back_and_matches_the_reference_servers(served):
    release, meta, _, ours, answer, directory = served
    (record,) = read_request_records(directory)
    assert (record.text, record.label("app"), record.completion_tokens, record.spec_verify_ct) == (
        REQUEST["text"], "code", meta["completion_tokens"], meta["spec_verify_ct"])
    assert record.time == meta["response_sent_to_client_ts"]
    assert set(record.meta) == set(ours.meta), f"SGLang {release}: record keys"
    assert set(ours.parameters) <= set(answer["request_fields"]), f"SGLang {release}: not GenerateReqInput fields"
    assert {k: ours.parameters[k] for k in REQUEST} == {k: record.parameters[k] for k in REQUEST}
    assert json.loads(json.dumps(record.parameters["sampling_params"])) == REQUEST["sampling_params"]
