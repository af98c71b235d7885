"""The production monitor's section (eagle3.deployment.monitor), beside the pipeline's own in sections.py."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from eagle3.config.sections import Section


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
                              "longer than a retrain on the node (~39 h by eagle3 plan), so a retrain that fails does "
                              "not start another at once")
    keep_windows: int = Field(default=288, ge=1, description="recent windows read for the streak, the plot and the "
                              "tables (288: a day at one window every 5 minutes); older ones stay in the registry")
    timeout_s: float = Field(default=10.0, gt=0.0, description="HTTP timeout of one /metrics or /health request")
