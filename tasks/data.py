"""Data stage: the target regenerates the answers (or the rows of data.import_path are imported), then the training
data set is made (hidden states captured, or token shards only when training computes the features online) with the
held-out features the simulator replays."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact

from eagle3.config import PipelineConfig
from eagle3.data.importer import make_samples
from eagle3.data.node_capture import capture_with_engine
from eagle3.data.quality import DataQualityError
from eagle3.formats.manifest import read_manifest
from eagle3.report import data_report, quality_section
from eagle3.stages import output_of
from tasks.common import cached, log_to_run, run_stage


@task(**cached("regenerate"))
def regenerate_answers(config: PipelineConfig) -> dict:
    def work() -> None:
        try:
            make_samples(config, log=log_to_run())
        except DataQualityError:  # the data artifact shows why before the run fails
            quality = read_manifest(output_of(config, "regenerate"))["quality"]
            failed = ", ".join(p["code"] for p in quality["problems"] if not p["waived"])
            create_markdown_artifact(key="data", markdown="# Data\n\n" + quality_section(quality),
                                     description=f"data quality check failed: {failed}")
            raise

    return run_stage("regenerate", config, {}, work)


@task(**cached("capture"))
def capture_hidden_states(config: PipelineConfig, resolved: str, regenerated: dict) -> dict:
    def work() -> None:
        dataset = read_manifest(capture_with_engine(config, resolved, log=log_to_run()))
        create_markdown_artifact(key="data", markdown=data_report(read_manifest(regenerated["path"]), dataset),
                                 description="samples, tokens, bytes and malformed prompt lines")

    return run_stage("capture", config, {"regenerated": regenerated}, work)
