"""Export stage: every configured layout, the served one validated before any server starts."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact

from eagle3.config import PipelineConfig
from eagle3.export import VALIDATION_FILE, export_draft
from eagle3.fsutil import read_json
from eagle3.report import validation_report
from eagle3.stages import export_dirs
from tasks.common import cached, log_to_run, run_stage


@task(**cached("export"))
def export_and_validate(config: PipelineConfig, trained: dict) -> dict:
    def work() -> None:
        try:
            export_draft(config, log=log_to_run())
        finally:  # the checklist is published whether the export passed or not
            validation = config.stage_dir("export") / VALIDATION_FILE
            if validation.is_file():
                create_markdown_artifact(key="export-validation", markdown=validation_report(read_json(validation, "")),
                                         description="what SGLang will do with the served export")

    return run_stage("export", config, {"trained": trained}, work,
                     lambda: {"dirs": {layout: str(path) for layout, path in export_dirs(config).items()}})
