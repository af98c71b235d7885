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
from tasks.common import cached, finished, log_to_run


@task(**cached("regenerate"))
def regenerate_answers(config: PipelineConfig) -> dict:
    regenerate(config, log=log_to_run())
    return finished("regenerate", config, {})


@task(**cached("capture"))
def capture_hidden_states(config: PipelineConfig, config_path: str, overrides: list[str], regenerated: dict) -> dict:
    log = log_to_run()
    if config.data.capture_engine == "sglang":
        run_on_node(config, Path(config_path), overrides, log=log)
    else:
        capture(config, log=log)
    dataset = config.stage_dir("data") / HIDDEN_DIR
    create_markdown_artifact(key="data", markdown=data_report(read_manifest(regenerated["path"]), read_manifest(dataset)),
                             description="samples, tokens, bytes and malformed prompt lines")
    return finished("capture", config, {"regenerated": regenerated})
