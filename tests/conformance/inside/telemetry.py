"""Run a release's own metrics collectors and request-record exporter on one finished speculative request.

Job: {"model_name", "prompt_tokens", "generation_tokens", "verify_calls", "accept_length", "accept_rate",
      "records_dir", "allowed_custom_labels": [keys], "request": {GenerateReqInput fields}, "meta_info": {...}}.
Answer: {"exposition": prometheus_client's rendering of the registry the collectors used (started with
--tokenizer-metrics-allowed-custom-labels = the job's list), "undeclared": the error the same observation raises on a
server started without the list ("" if none), "merges_custom_labels": whether the release's
TokenizerManager.collect_metrics puts the request's custom_labels into the label set it observes with,
"request_fields": the release's GenerateReqInput fields, "exporter": how the record was written}.

The tokenizer collector gets the labels the release's tokenizer manager builds for a plain server: 0.5.23's own
`tokenizer_metric_labels()`; before, the same dict built inline in the manager's __init__ (model_name, engine_type and
"" per allowed custom label; that __init__ loads a tokenizer and opens sockets, so the dict is rebuilt here from the
release's ServerArgs). The request's custom_labels are merged into it as collect_metrics does (`labels =
dict(self.metrics_collector.labels); labels.update(custom_labels)`; collect_metrics itself needs a live request
state). The scheduler's collector gets tp_rank, pp_rank, moe_ep_rank (dp_rank only with DP attention); every label a
collector adds of its own (is_streaming, ...) comes from its code.
"""

import asyncio
import dataclasses
import inspect
import tempfile

from prometheus_client import REGISTRY, generate_latest

from counting import _server_args


def _call(function, **kwargs):
    """function(**the kwargs its signature takes): the releases' signatures grow keyword by keyword."""
    accepted = inspect.signature(function).parameters
    return function(**{k: v for k, v in kwargs.items() if k in accepted})


def _engine_type() -> str:
    try:
        from sglang.srt.disaggregation.utils import DisaggregationMode
    except ImportError:
        return "unified"
    return DisaggregationMode.to_engine_type("null")


def _tokenizer_labels(job: dict, server_args) -> dict:
    from sglang.srt.observability import metrics_collector as collectors

    if hasattr(collectors, "tokenizer_metric_labels"):  # 0.5.23: reads the published ServerArgs
        return collectors.tokenizer_metric_labels()
    labels = {"model_name": job["model_name"], "engine_type": _engine_type()}
    return labels | dict.fromkeys(server_args.tokenizer_metrics_allowed_custom_labels or (), "")


def _exposition(job: dict, server_args) -> str:
    from sglang.srt.observability import metrics_collector as collectors

    for collector in list(REGISTRY._collector_to_names):  # one probe per process, but never a duplicate name
        if type(collector).__module__.startswith("prometheus_client.metrics"):
            REGISTRY.unregister(collector)
    base = _tokenizer_labels(job, server_args)
    tokenizer = _call(collectors.TokenizerMetricsCollector, server_args=server_args, labels=base)
    labels = dict(tokenizer.labels)  # collect_metrics: the collector's labels, updated with the request's
    labels.update(job["request"].get("custom_labels") or {})
    _call(tokenizer.observe_one_finished_request, labels=labels, prompt_tokens=job["prompt_tokens"],
          generation_tokens=job["generation_tokens"], cached_tokens=0, e2e_latency=1.0, has_grammar=False,
          spec_verify_ct=job["verify_calls"])
    scheduler_labels = {"model_name": base["model_name"], "engine_type": base["engine_type"]}
    scheduler = _call(collectors.SchedulerMetricsCollector, server_args=server_args,
                      labels={**scheduler_labels, "tp_rank": 0, "pp_rank": 0, "moe_ep_rank": 0})
    stats = collectors.SchedulerStats()
    stats.spec_accept_length, stats.spec_accept_rate = job["accept_length"], job["accept_rate"]
    scheduler.log_stats(stats)
    return generate_latest(REGISTRY).decode()


def _write_record(job: dict, server_args) -> str:
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.observability.request_metrics_exporter import FileRequestMetricsExporter

    request = GenerateReqInput(**job["request"])
    request.normalize_batch_and_arguments()  # as the tokenizer manager does first (it assigns the rid)
    exporter = FileRequestMetricsExporter(server_args, set(), set())  # no --log-requests: nothing skipped
    asyncio.run(exporter.write_record(request, {"meta_info": dict(job["meta_info"])}))
    exporter.close()
    return f"{type(exporter).__module__}.{type(exporter).__name__}"


def _telemetry_server_args(job: dict, allowed: list[str] | None):
    """The release's own ServerArgs for an EAGLE3 server started with telemetry (and published, as a server does)."""
    with tempfile.TemporaryDirectory() as directory:
        return _server_args(3, directory, enable_metrics=True, export_metrics_to_file=True,
                            export_metrics_to_file_dir=job["records_dir"], served_model_name=job["model_name"],
                            tokenizer_metrics_allowed_custom_labels=allowed)


def _undeclared(job: dict) -> str:
    """The same observation on a server started without the allowed list: what the tokenizer manager's loop gets."""
    try:
        _exposition(job, _telemetry_server_args(job, None))
    except Exception as err:  # noqa: BLE001 (the answer is whatever the release raises)
        return f"{type(err).__name__}: {err}"
    return ""


def run(job: dict) -> dict:
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    undeclared = _undeclared(job)
    server_args = _telemetry_server_args(job, job["allowed_custom_labels"])
    source = inspect.getsource(TokenizerManager.collect_metrics)
    return {"exposition": _exposition(job, server_args), "exporter": _write_record(job, server_args),
            "undeclared": undeclared,
            "merges_custom_labels": "labels = dict(self.metrics_collector.labels)" in source
            and "labels.update(custom_labels)" in source,
            "request_fields": [field.name for field in dataclasses.fields(GenerateReqInput)]}
