"""data.traffic: production's own requests as a prompt source (docs/production-loop.md), off unless the section is given - the
request records hold the operator's users' text."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class TrafficSection(BaseModel):
    model_config = ConfigDict(extra="forbid")  # as every section (eagle3.config.sections.Section)

    records: str = Field(
        min_length=1, description="where production's request records are: the directory SGLang writes them to "
        "(production.telemetry.records_dir, --export-metrics-to-file-dir) or an s3://bucket/prefix of such files")
    hours: float = Field(
        default=24.0, gt=0.0, description="the window: requests answered in the last `hours` before the run first "
        "reads them (a run keeps what it read, data/traffic.json; a retrain runs in a fresh directory and reads anew)")
    share: float = Field(
        default=0.5, gt=0.0, le=1.0, description="the share of data.num_samples (and of the held-out benchmark "
        "prompts) taken from traffic; data.prompts gives the rest, and whichever source runs short is filled from "
        "the other")
    max_prompts: int = Field(default=10_000, gt=0, description="traffic prompts kept at most (after removing "
                             "duplicates), taken round-robin over the slices, newest first")
    max_per_slice: int = Field(
        default=2_000, gt=0, description="traffic prompts kept at most per slice (the request's custom label "
        "production.telemetry.slice_label), newest first, so one chatty client cannot own the data")

    @model_validator(mode="after")
    def _consistent(self) -> TrafficSection:
        if self.records.startswith("s3://") and not self.records.removeprefix("s3://").split("/")[0]:
            raise ValueError(f"data.traffic.records {self.records!r}: give s3://bucket/prefix")
        if self.max_per_slice > self.max_prompts:
            raise ValueError(f"data.traffic.max_per_slice ({self.max_per_slice}) exceeds data.traffic.max_prompts "
                             f"({self.max_prompts}): lower max_per_slice or raise max_prompts")
        return self
