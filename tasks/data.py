"""Data stage: the target regenerates the answers, then its hidden states are captured."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact

from eagle3.config import PipelineConfig
from eagle3.data.capture import HIDDEN_DIR, capture
from eagle3.data.regenerate import regenerate
from eagle3.engines.sglang_capture import run_on_node
from eagle3.formats.manifest import read_manifest
from eagle3.report import data_report
from tasks.common import cached, log_to_run, run_stage


@task(**cached("regenerate"))
def regenerate_answers(config: PipelineConfig) -> dict:
    def work() -> None:
        regenerate(config, log=log_to_run())

    return run_stage("regenerate", config, {}, work)


@task(**cached("capture"))
def capture_hidden_states(config: PipelineConfig, config_path: str, overrides: list[str], regenerated: dict) -> dict:
    def work() -> None:
        log = log_to_run()
        if config.data.capture_engine == "sglang":
            run_on_node(config, Path(config_path), overrides, log=log)
        else:
            capture(config, log=log)
        dataset = read_manifest(config.stage_dir("data") / HIDDEN_DIR)
        create_markdown_artifact(key="data", markdown=data_report(read_manifest(regenerated["path"]), dataset),
                                 description="samples, tokens, bytes and malformed prompt lines")

    return run_stage("capture", config, {"regenerated": regenerated}, work)
