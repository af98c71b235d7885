"""Export stage: the trained draft (run.dir/train/best) written in every configured layout, and the served
(sglang) layout validated against what SGLang will do with it - the target, the layers the data captured, the
release and the context length - before any server starts; a speculators layout is validated against speculators'
loader too. Problems fail the stage by name, except codes the config waives on purpose (`export.waive`), which are
logged and recorded.

Writes run.dir/export/<layout>/ and run.dir/export/validation.json (the speculators report under "speculators").
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from eagle3.algorithms import algorithm
from eagle3.algorithms.base import export_target
from eagle3.config.draft import DraftSection
from eagle3.config.run import RunSection, TargetSection
from eagle3.config.serving import ExportSection, ServingSection
from eagle3.config.training import TrainingSection
from eagle3.data.capture import dataset_dir
from eagle3.errors import Eagle3Error
from eagle3.draft.files import WEIGHTS_FILE
from eagle3.records.manifest import MANIFEST_FILE, read_manifest, write_manifest
from eagle3.contract.problems import Report
from eagle3.fsutil import atomic_write_json
from eagle3.model.weights import target_verifier
from eagle3.train.trainer import best_draft

Log = Callable[[str], None]
VALIDATION_FILE = "validation.json"


class ExportInvalid(Eagle3Error):
    """The served export has validation errors: SGLang would serve it wrongly."""

    def __init__(self, message: str, problems: list[dict]):
        super().__init__(message)
        self.problems = problems


def export_dirs(run: RunSection, export: ExportSection) -> dict[str, Path]:
    """Every export layout's directory; the served one (sglang) is the export stage's output."""
    return {layout: run.stage_dir("export") / layout for layout in export.layouts}



def export_draft(run: RunSection, draft: DraftSection, target: TargetSection, training: TrainingSection,
                 export: ExportSection, serving: ServingSection, log: Log = print) -> dict:
    """Export the run's best draft (of draft.algorithm) for `serving` and validate it; return {dirs: {layout: path},
    validation: the report with `waived` problems}."""
    source = best_draft(run)
    out = run.stage_dir("export")
    (out / VALIDATION_FILE).unlink(missing_ok=True)  # never report an earlier export's checklist as this one's
    target_dir = Path(target.path)
    # the speculators layout names the target as its verifier and ships the target's embedding
    verifier = (target_verifier(target_dir, target.weight_prefix, export.verifier)
                if "speculators" in export.layouts else None)
    entry = algorithm(draft.algorithm)
    written_for = export_target(target, serving, verifier)
    dirs = {}
    for layout, directory in export_dirs(run, export).items():
        dirs[layout] = entry.export(source, directory, layout, written_for, log)
        engine = f"SGLang {serving.release or '(release unknown)'}" if layout == "sglang" else layout
        log(f"export: {layout} layout for {engine} -> {dirs[layout]}")
    if export.fault == "absolute-d2t":
        log("export: WARNING: export.fault=absolute-d2t: writing the served d2t as absolute ids (demo of the gate)")
        make_d2t_absolute(dirs["sglang"])
    checks = dict(target_dir=target_dir if target_dir.is_dir() else None,
                  data_manifest=dataset_dir(run, training) / MANIFEST_FILE,
                  context_length=serving.context_length)
    reports = {layout: entry.validate(dirs[layout], layout, serving.release if layout == "sglang" else None,
                                      **checks) for layout in dirs}
    validation = with_waivers(reports["sglang"], export.waive, log)
    if "speculators" in reports:
        validation["speculators"] = with_waivers(reports["speculators"], export.waive, log)
    atomic_write_json(out / VALIDATION_FILE, validation)  # the checklist is kept whether the export passed or not
    for layout, report in reports.items():
        engine = f"{'SGLang' if layout == 'sglang' else layout} {report.engine_release or '(strictest rules)'}"
        errors = [asdict(p) for p in report.errors(export.waive)]
        if errors:
            listed = "\n".join(f"  {p['code']}: {p['message']} (fix: {p['fix']})" for p in errors)
            raise ExportInvalid(f"the export {report.path} would be {'served' if layout == 'sglang' else 'loaded'} "
                                f"wrongly by {engine}; no server was started:\n{listed}", errors)
        log(f"export: {report.path} valid for {engine} ({len(report.of('warning'))} warning(s), "
            f"{len(report.of('unknown'))} check(s) not run)")
    return {"dirs": {layout: str(path) for layout, path in dirs.items()}, "validation": validation}


def with_waivers(report: Report, waive: list[str], log: Log) -> dict:
    """The report as a dict, with the errors `export.waive` names moved to `waived` (and logged)."""
    result = report.to_dict()
    kept = report.errors(waive)
    result["waived"] = [asdict(p) for p in report.of("error") if p not in kept]
    result["problems"] = [p for p in result["problems"] if p not in result["waived"]]
    result["ok"] = not kept
    for problem in result["waived"]:
        log(f"export: WARNING: waived by export.waive: {problem['code']}: {problem['message']}")
    return result


def make_d2t_absolute(directory: Path) -> None:
    """Rewrite d2t from offsets to absolute target ids (d2t[i] + i), keeping the manifest's hashes true."""
    weights = directory / WEIGHTS_FILE
    tensors = load_file(weights)
    d2t = tensors["d2t"]  # [draft_vocab] offsets: target id = i + d2t[i]
    tensors["d2t"] = d2t + torch.arange(d2t.numel(), dtype=d2t.dtype)
    save_file(tensors, weights, metadata={"format": "pt"})
    manifest = read_manifest(directory)
    write_manifest(directory, kind=manifest["kind"],
                   fields={k: manifest[k] for k in ("layout", "source", "engine_release")} | {"fault": "absolute-d2t"})
