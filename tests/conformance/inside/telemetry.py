"""Run a release's own metrics collectors and request-record exporter on one finished speculative request.

Job: {"model_name", "prompt_tokens", "generation_tokens", "verify_calls", "accept_length", "accept_rate",
      "records_dir", "request": {GenerateReqInput fields}, "meta_info": {...}}.
Answer: {"exposition": prometheus_client's rendering of the registry the collectors used, "request_fields": the
release's GenerateReqInput fields, "exporter": how the record was written}.

The collectors get the labels the release's tokenizer manager and scheduler build for a plain server (model_name and
engine_type; the scheduler adds tp_rank, pp_rank, moe_ep_rank; dp_rank only with DP attention); every label a
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


def _exposition(job: dict, server_args) -> str:
    from sglang.srt.observability import metrics_collector as collectors

    for collector in list(REGISTRY._collector_to_names):  # one probe per process, but never a duplicate name
        if type(collector).__module__.startswith("prometheus_client.metrics"):
            REGISTRY.unregister(collector)
    labels = {"model_name": job["model_name"], "engine_type": _engine_type()}
    tokenizer = _call(collectors.TokenizerMetricsCollector, server_args=server_args, labels=labels)
    _call(tokenizer.observe_one_finished_request, labels=labels, prompt_tokens=job["prompt_tokens"],
          generation_tokens=job["generation_tokens"], cached_tokens=0, e2e_latency=1.0, has_grammar=False,
          spec_verify_ct=job["verify_calls"])
    scheduler = _call(collectors.SchedulerMetricsCollector, server_args=server_args,
                      labels={**labels, "tp_rank": 0, "pp_rank": 0, "moe_ep_rank": 0})
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


def run(job: dict) -> dict:
    from sglang.srt.managers.io_struct import GenerateReqInput

    with tempfile.TemporaryDirectory() as directory:  # the release's own ServerArgs for an EAGLE3 server started
        server_args = _server_args(3, directory, enable_metrics=True, export_metrics_to_file=True,  # with telemetry
                                   export_metrics_to_file_dir=job["records_dir"])
    return {"exposition": _exposition(job, server_args), "exporter": _write_record(job, server_args),
            "request_fields": [field.name for field in dataclasses.fields(GenerateReqInput)]}
