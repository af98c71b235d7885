"""A draft other than the run's own, judged on the run's data: `eagle3 simulate --draft DIR` replays it offline over
the simulate stage's inputs (the held-out suites' stored continuations and features, in serving's shape and each
sweep point's) and `eagle3 diagnose --draft DIR` runs the train-serve checklist on it.

- DIR is any layout the importer reads (SGLang's or SpecForge's EAGLE-3 layout, speculators', this project's
  native one): it is validated for the config's target, release and data layers and converted to the sglang layout
  exactly as `eagle3 registry import` does it (the algorithm's `convert_external`), so what is replayed is
  what SGLang would serve, and a draft it would serve wrongly is refused by its problem code before any replay.
- Its figures go to run.dir/bench/drafts/<DIR's name>/ (`simulated.json`, the converted `sglang/`): never the simulate
  stage's output or its marker, so the stage stays finished under its key and a later `eagle3 simulate` keeps it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from eagle3.algorithms import draft_algorithm
from eagle3.bench.simulate import AcceptanceResult, heldout_samples, replay_of, simulate
from eagle3.config import PipelineConfig
from eagle3.data.regenerate import greedy_length
from eagle3.deployment.imports import config_for, file_digests, serving_of
from eagle3.deployment.suites import column, steps_topk_tokens
from eagle3.errors import Eagle3Error, UnreadableInput
from eagle3.fsutil import read_json
from eagle3.report import suites_text
from eagle3.stages.table import record_path
from eagle3.validation.external import ImportRefused

Log = Callable[[str], None]
DRAFTS_DIR = "drafts"  # under the run's bench directory, beside its records
SERVED_LAYOUT = "sglang"  # the converted draft: what is replayed and checked
SIMULATED_FILE, SERVED_FILE = "simulated.json", "served.json"


class DraftRefused(Eagle3Error):
    """The draft would be served wrongly: replaying it would describe a draft SGLang never serves."""


def draft_records(config: PipelineConfig, source: Path) -> Path:
    """run.dir/bench/drafts/<name>/, named after the draft's directory (the characters a file name keeps)."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(source).resolve().name).strip("._") or "draft"
    return record_path(config, "simulated").parent / DRAFTS_DIR / name


def simulate_draft(config: PipelineConfig, source: Path, log: Log = print) -> AcceptanceResult:
    """Validate and convert the draft at `source` as the importer does, replay it over the run's held-out suites
    (`eagle3.bench.simulate.simulate`: the per-suite table is logged) and write its figures to its own records."""
    source = Path(source)
    check_upstream(config)  # before anything is converted or written
    out = draft_records(config, source)
    try:
        serving = serving_of(config.target, config.serving, config.data.aux_layers)
        converted = draft_algorithm(source).convert_external(source, out / SERVED_LAYOUT, serving, log)
    except ImportRefused as refused:
        first, others = refused.problems[0], len(refused.problems) - 1
        also = f"; {others} more problem(s): `eagle3 validate` lists them" if others else ""
        raise DraftRefused(f"{source}: not replayed, SGLang would serve it wrongly: {first.code.value}: "
                           f"{first.message} (fix: {first.fix}){also}") from None
    draft = {"source": str(source.resolve()), "layout_found": converted.layout_found, "files": file_digests(source)}
    result = simulate(replay_of(config_for(config, converted)), out / SERVED_LAYOUT, out / SIMULATED_FILE, log,
                      {"draft": draft})
    shapes = read_json(out / SIMULATED_FILE, "not written")["shapes"]
    for line in suites_text([column(f"{steps_topk_tokens(shape)} simulated", shape["suites"]) for shape in shapes]):
        log(line)  # the suites table the run's figures are published as, a column per simulated shape
    return result


def check_upstream(config: PipelineConfig) -> None:
    """What the replay reads besides the draft, each refused naming the step that makes it: the target's files (its
    embedding, which the draft shares, and its end tokens) and the held-out suites' continuations with their
    features, made for this config's suites and lengths."""
    target = Path(config.target.path)
    if not (target / "config.json").is_file():
        raise UnreadableInput(f"target.path {target}: no target model here (config.json): the replay reads its "
                              "embedding and end tokens; build it (`eagle3 make-tiny-target`, `eagle3 make-target`) "
                              "or set target.path to its directory")
    heldout_samples(config.run, greedy_length(config), tuple(suite.name for suite in config.benchmark.suites))


def draft_figures(config: PipelineConfig, source: Path) -> tuple[Path, dict, dict | None]:
    """What `eagle3 diagnose --draft` reads: the draft as SGLang serves it (the directory itself in the sglang layout,
    else the converted copy), its simulated record (refused when missing, or made from other files) and its served
    record where one was measured (None)."""
    source, out = Path(source), draft_records(config, source)
    simulated = read_json(out / SIMULATED_FILE, f"missing: run `eagle3 simulate --draft {source}` first")
    draft = simulated.get("draft") or {}
    if draft.get("source") != str(source.resolve()) or draft.get("files") != file_digests(source):
        raise UnreadableInput(f"{out / SIMULATED_FILE}: made from {draft.get('source') or 'another draft'}, not the "
                              f"files now in {source}: run `eagle3 simulate --draft {source}` again")
    served_form = source if draft.get("layout_found") == SERVED_LAYOUT else out / SERVED_LAYOUT
    served = read_json(out / SERVED_FILE, "unreadable") if (out / SERVED_FILE).is_file() else None
    return served_form, simulated, served
