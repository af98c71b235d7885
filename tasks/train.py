"""Training stage: torchrun in its own process groups; its log streams here, its metrics drive a progress artifact."""

from __future__ import annotations

import json

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact

from eagle3.config import PipelineConfig
from eagle3.init_draft import resolve_init_from
from eagle3.report import training_report
from eagle3.procs import terminate_on_sigterm
from eagle3.train.launch import train
from eagle3.train.trainer import METRICS_FILE
from tasks.common import cached, log_to_run, run_stage


@task(**cached("train"))
def train_draft(config: PipelineConfig, resolved: str, dataset: dict, vocab: dict) -> dict:
    def work() -> None:
        progress = create_progress_artifact(0.0, key="training-progress", description="training steps done (%)")

        def on_metrics(record: dict) -> None:
            if "loss" in record:
                update_progress_artifact(progress, 100.0 * record["step"] / config.training.max_steps)

        resolve_init_from(config, log_to_run())  # training.init_from fetched and converted once, for every rank
        with terminate_on_sigterm():  # a cancelled flow run takes the trainers' process groups with it
            out = train(config, resolved, log=log_to_run(), on_metrics=on_metrics)
        records = [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines() if line.strip()]
        markdown = training_report(records, config.training.best_by)
        create_markdown_artifact(key="training", markdown=markdown, description="loss and per-position accuracy by "
                                 "step; step and evaluation times; evaluation")

    return run_stage("train", config, {"dataset": dataset, "vocab": vocab}, work)
