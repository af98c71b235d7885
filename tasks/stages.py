"""The cached stages as Prefect tasks, one per entry of eagle3.stages.table: each runs the library's `run_stage`
(logging into the run, progress as an artifact), publishes what its output shows as a markdown artifact, and is
cached on the stage's content-hash key."""

from __future__ import annotations

import json
from collections.abc import Callable

from prefect import Task, task
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact

from eagle3.config import PipelineConfig
from eagle3.data.quality import DataQualityError
from eagle3.export import VALIDATION_FILE
from eagle3.algorithms.eagle3.inspect import inspect_path
from eagle3.records.manifest import read_manifest
from eagle3.fsutil import read_json
from eagle3.procs import terminate_on_sigterm
from eagle3.report import data_report, quality_section, training_report, validation_report, vocab_report
from eagle3.stages.keys import cache_key
from eagle3.stages.run import StageOutput, run_stage
from eagle3.stages.table import STAGES, output_of
from eagle3.train.trainer import METRICS_FILE
from tasks.common import log_to_run


def publish_quality(config: PipelineConfig, failure: BaseException | None) -> None:
    if isinstance(failure, DataQualityError):  # the data artifact shows why before the run fails
        quality = read_manifest(output_of(config, "regenerate"))["quality"]
        failed = ", ".join(p["code"] for p in quality["problems"] if not p["waived"])
        create_markdown_artifact(key="data", markdown="# Data\n\n" + quality_section(quality),
                                 description=f"data quality check failed: {failed}")


def publish_data(config: PipelineConfig, failure: BaseException | None) -> None:
    if failure is None:
        create_markdown_artifact(key="data", markdown=data_report(read_manifest(output_of(config, "regenerate")),
                                                                  read_manifest(output_of(config, "capture"))),
                                 description="samples, tokens, bytes and malformed prompt lines")


def publish_vocab(config: PipelineConfig, failure: BaseException | None) -> None:
    if failure is None:
        out = output_of(config, "vocab")
        create_markdown_artifact(key="vocab", markdown=vocab_report(read_manifest(out)["stats"], inspect_path(out)),
                                 description="draft-vocabulary coverage and the d2t diagnosis")


def publish_training(config: PipelineConfig, failure: BaseException | None) -> None:
    metrics = config.stage_dir("train") / METRICS_FILE
    if failure is None and metrics.is_file():
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        create_markdown_artifact(key="training", markdown=training_report(records, config.training.best_by),
                                 description="loss and per-position accuracy by step; step and evaluation times; "
                                 "evaluation")


def publish_validation(config: PipelineConfig, failure: BaseException | None) -> None:
    validation = config.stage_dir("export") / VALIDATION_FILE  # whether the export passed or not
    if validation.is_file():
        create_markdown_artifact(key="export-validation", markdown=validation_report(read_json(validation, "")),
                                 description="what SGLang will do with the served export")


# stage -> its artifact, published after it ran (`failure`: the error it raised, or None)
PUBLISH: dict[str, Callable[[PipelineConfig, BaseException | None], None]] = {
    "regenerate": publish_quality, "capture": publish_data, "vocab": publish_vocab, "train": publish_training,
    "export": publish_validation}


def progress_artifact(stage: str) -> Callable[[float], None]:
    """`progress(fraction)` shown as the run's `<stage>-progress` artifact, made at the first report."""
    artifact = None

    def progress(fraction: float) -> None:
        nonlocal artifact
        if artifact is None:
            artifact = create_progress_artifact(0.0, key=f"{stage}-progress", description=f"{stage}: done (%)")
        update_progress_artifact(artifact, 100.0 * fraction)

    return progress


def stage_task(stage: str) -> Task:
    def key(context, parameters: dict) -> str | None:
        fingerprints = {name: output.fingerprint for name, output in parameters["upstream"].items()}
        return cache_key(stage, parameters["config"], fingerprints)

    def run(config: PipelineConfig, resolved: str, upstream: dict[str, StageOutput]) -> StageOutput:
        publish = PUBLISH.get(stage, lambda config, failure: None)
        try:
            with terminate_on_sigterm():  # a cancelled flow run takes the stage's process groups with it
                made = run_stage(stage, config, resolved, upstream, log_to_run(), progress_artifact(stage))
        except Exception as failure:
            publish(config, failure)
            raise
        publish(config, None)
        return made

    return task(run, name=stage, cache_key_fn=key, persist_result=True)


STAGE_TASKS = {name: stage_task(name) for name in STAGES}
