"""The suites stage: the target's greedy continuations of the benchmark suites other than the held-out prompts
(MT-bench, traffic, files of yours), an output of their own under `run.dir/data/suites/`. Only the simulator and the
served benchmark read them; the held-out prompts' continuations, which training replays too, are made with the
training replies (eagle3.data.regenerate). So a suite added to a finished run makes its continuations and the
replays again, and no training (docs/pipeline.md: Caching).
"""

from __future__ import annotations

from pathlib import Path

from eagle3.config.run import RunSection, TargetSection
from eagle3.data.regenerate import (GREEDY_FILE, Continuing, Log, benchmark_questions, continue_benchmark,
                                    kept_continuations, read_greedy, regen_dir)
from eagle3.data.suites import other_suites
from eagle3.runtime.targets import load_tokenizer, target_identity
from eagle3.records.manifest import code_version, write_manifest

SUITES_DIR = "suites"


def suites_dir(run: RunSection) -> Path:
    """The suites stage's output: the other suites' greedy continuations and their manifest."""
    return run.stage_dir("data") / SUITES_DIR


def continue_suites(spec: Continuing, log: Log = print, generator=None) -> Path:
    """Continue every request of the configured suites other than the held-out one (none: an empty file) with
    `generator` (None: one made here, only when some continuation must be made); returns the output directory (with
    its manifest)."""
    out = suites_dir(spec.run)
    out.mkdir(parents=True, exist_ok=True)
    questions = benchmark_questions(spec, held_out=False)
    greedy = continue_benchmark(spec, questions, generator, load_tokenizer(spec.target), out / GREEDY_FILE, log)
    write_manifest(out, kind="suites", fields=suites_fields(spec.target, spec.data.thinking, greedy))
    return out


def continuations_kept(spec: Continuing) -> bool:
    """Whether the suites stage would make nothing: no suite besides the held-out prompts, or their continuations
    made for these questions and lengths already (so that no data.nodes server is started for it)."""
    if not other_suites(spec.benchmark):
        return True
    questions = benchmark_questions(spec, held_out=False)
    return kept_continuations(spec, questions, suites_dir(spec.run) / GREEDY_FILE) is not None


def suites_fields(target: TargetSection, thinking: bool, greedy: dict) -> dict:
    return {"target": target_identity(target), "thinking": thinking, "greedy": greedy, "code_version": code_version()}


def benchmark_requests(run: RunSection) -> list[dict]:
    """Every configured suite's greedy sequences (read_greedy's rows): the held-out suite's, then the others'."""
    return read_greedy(regen_dir(run)) + read_greedy(suites_dir(run))
