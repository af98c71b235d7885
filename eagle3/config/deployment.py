"""After the measurement: the gate (`gate`), the registry versions are published to (`registry`), the production
endpoint and its telemetry (`production`, eagle3.deployment.production) and the monitor of its acceptance
(`monitor`, eagle3.deployment.monitor)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from eagle3.config.base import Section


class GateSection(Section):
    min_accept_rate: float = Field(default=0.25, ge=0.0, le=1.0)
    min_speedup: float = Field(default=1.0, ge=0.0, description="reject a candidate whose output tokens/s over the "
                               "no-draft server at the production concurrency is below this (0: no throughput rule)")
    production_tolerance: float = Field(default=0.05, ge=0.0, lt=1.0, description="per suite: a candidate below "
                                        "production's accept length x (1 - this) on any gating suite is rejected")
    min_verify_steps: int = Field(default=20, ge=1, description="a gating suite measured over fewer verify steps "
                                  "cannot be judged: the candidate is rejected, naming it")
    sim_serve_tolerance: float = Field(default=0.10, ge=0.0, lt=1.0)


class RegistrySection(Section):
    backend: Literal["local", "s3"] = "local"
    path: Path | None = Field(default=None, description="registry directory (backend local)")
    bucket: str | None = None
    prefix: str = ""
    endpoint_url: str | None = None
    lock_lease_s: float = Field(default=300.0, ge=1.0, description="the lease of a run's lock on the registry: its "
                                "holder renews it every quarter of this; a holder whose record stays unchanged this "
                                "long is taken over by a waiting run (docs/registry-and-gate.md)")

    @model_validator(mode="after")
    def _backend_location(self) -> RegistrySection:
        if self.backend == "local" and self.path is None:
            raise ValueError("backend 'local' needs registry.path")
        if self.backend == "s3" and not self.bucket:
            raise ValueError("backend 's3' needs registry.bucket")
        return self


class TelemetrySection(Section):
    """What the production server reports about its own traffic (docs/production-loop.md): SGLang's flags, off by default - the
    request records hold the operator's users' text."""

    metrics: bool = Field(default=False, description="--enable-metrics: Prometheus /metrics (accept length over any "
                          "window from the generation-token and verify-call counters)")
    records_dir: Path | None = Field(
        default=None, description="--export-metrics-to-file --export-metrics-to-file-dir DIR: one JSON record per "
        "finished request (its text or input_ids, custom_labels and meta_info) in hourly files")
    slice_label: str = Field(
        default="app", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="the key of a request's custom_labels that "
        "names its traffic slice: acceptance is reported per slice in the monitor and the benchmark; the launcher "
        "declares it (with eagle3, the benchmark's) in --tokenizer-metrics-allowed-custom-labels, so it becomes a "
        "Prometheus label name")


class ProductionSection(Section):
    """The production endpoint (docs/gpu-node.md): `managed` - the pipeline restarts it with the promoted draft (or, on
    rollback, the previous one) and re-measures it; `external` - the pipeline moves the registry pointer and
    reports, someone else restarts the server."""

    mode: Literal["managed", "external"] = "managed"
    host: str = "127.0.0.1"
    port: int = Field(default=30001, gt=0, lt=65536)
    keep_serving: bool = Field(
        default=True, description="leave the managed production server running after the run (false: stop it "
        "once re-measured, as the CPU demo does)")
    state_dir: Path = Field(default=Path("runs/production"), description="managed: the server's pid file and logs")
    supervisor: Literal["auto", "systemd", "none"] = Field(
        default="auto", description="managed, kept serving: systemd - the server runs in a transient systemd scope "
        "(eagle3-production-PORT.scope), so restarting the worker leaves it running (not root: the user's systemd "
        "manager); none - it lives in the worker's process group and a worker restart stops it; auto - systemd when "
        "it runs here, else none")
    telemetry: TelemetrySection = TelemetrySection()


class MonitorSection(Section):
    """Production's acceptance on live traffic, one window at a time (eagle3.deployment.monitor), against what the
    production version measured at its promotion. Needs production.telemetry: /metrics or the request records."""

    window_s: float = Field(default=300.0, gt=0.0, description="the observation window: the request records of the "
                            "last window_s seconds (source records; the eagle3/monitor deployment runs every 300 s); "
                            "/metrics deltas span the time since the previous window")
    source: Literal["auto", "metrics", "records"] = Field(
        default="auto", description="records: production.telemetry.records_dir (per slice, the pipeline's own requests "
        "left out); metrics: Δ sglang:generation_tokens_total / Δ sglang:spec_verify_calls_total on /metrics; auto: "
        "records when records_dir is set, else metrics")
    tolerance: float = Field(default=0.15, gt=0.0, lt=1.0, description="a window is low when its accept length is "
                             "below the promotion's × (1 - tolerance)")
    consecutive: int = Field(default=3, ge=1, description="low windows in a row (of one production version, windows "
                             "with too few verify steps not counted) that raise the alarm")
    min_verify_steps: int = Field(default=2000, ge=1, description="a window with fewer verify steps is insufficient: "
                                  "reported, never counted toward an alarm (about 30 s of one busy H200 stream)")
    cooldown_s: float = Field(default=172800.0, ge=0.0, description="no second alarm within this long of the last: "
                              "longer than a retrain on the node (~10 h by eagle3 plan, 39 h a first run), so a retrain "
                              "that fails does not start another at once")
    keep_windows: int = Field(default=288, ge=1, description="recent windows read for the streak, the plot and the "
                              "tables (288: a day at one window every 5 minutes); older ones stay in the registry")
    timeout_s: float = Field(default=10.0, gt=0.0, description="HTTP timeout of one /metrics or /health request")
