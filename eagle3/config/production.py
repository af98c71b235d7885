"""The production endpoint's section (eagle3.deployment.production) and its telemetry, beside the pipeline's own in
sections.py."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from eagle3.config.sections import Section


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
