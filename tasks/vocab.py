"""Vocabulary stage: the draft's d2t / t2d from the regenerated training split."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact

from eagle3.config import PipelineConfig
from eagle3.data.vocab import build_vocab
from eagle3.formats.inspect import inspect_path
from eagle3.formats.manifest import read_manifest
from eagle3.report import vocab_report
from tasks.common import cached, log_to_run, run_stage


@task(**cached("vocab"))
def build_draft_vocab(config: PipelineConfig, regenerated: dict) -> dict:
    def work() -> None:
        out = build_vocab(config, log=log_to_run())
        create_markdown_artifact(key="vocab", markdown=vocab_report(read_manifest(out)["stats"], inspect_path(out)),
                                 description="draft-vocabulary coverage and the d2t diagnosis")

    return run_stage("vocab", config, {"regenerated": regenerated}, work)
