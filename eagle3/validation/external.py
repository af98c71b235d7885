"""A draft trained elsewhere, judged for serving by one SGLang release on one target: what every kind's importer
records (its steps and validation reports, `Converted`) and refuses with (`ImportRefused`, naming the first problem's
code). Each kind's own conversion is its algorithm's (`DraftAlgorithm.convert_external`); `eagle3 registry import`
stores the result as a version (eagle3/deployment/imports.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from eagle3.contract.problems import Problem, Report
from eagle3.errors import Eagle3Error

Log = Callable[[str], None]


@dataclass(frozen=True)
class Serving:
    """What a draft is judged against: the target, the SGLang release that serves it, the layers the pipeline's
    data are captured at (our numbering), the serving context and drafting steps."""

    family: str | None
    release: str | None
    num_layers: int
    vocab_size: int
    data_layers: list[int]
    context_length: int
    num_steps: int
    target: Path | None = None  # the target's directory, where there is one here (its config is then read)

    def describe(self) -> str:
        target = f"target {self.target}" if self.target else "the configured target"
        return (f"{sglang_where(self.release)}, {target} ({self.family or 'family unknown'}, {self.num_layers} "
                f"layers), data captured at layers {self.data_layers}, context {self.context_length}")


@dataclass
class Converted:
    layout_found: str
    steps: list[str] = field(default_factory=list)  # what was done, in order, as sentences
    validation: dict = field(default_factory=dict)  # {"source": report, "sglang": report} (Report.to_dict)
    draft: dict | None = None  # the draft section its version records, where it is not the importing config's kind


class ImportRefused(Eagle3Error):
    """The draft would be served wrongly: one line naming the first problem by its code."""

    def __init__(self, source: str, problems: list[Problem]):
        first, others = problems[0], sorted({p.code.value for p in problems[1:]} - {problems[0].code.value})
        also = f" (also: {', '.join(others)})" if others else ""
        super().__init__(f"{source}: not imported: {first.code.value}: {first.message} (fix: {first.fix}){also}")
        self.problems = problems


def refuse_on_errors(source: str, report: Report) -> None:
    errors = report.of("error")
    if errors:
        raise ImportRefused(source, errors)


def summary(report: Report) -> str:
    return (f"no errors, {len(report.of('warning'))} warning(s), {len(report.of('unknown'))} check(s) not run "
            f"({', '.join(sorted({p.code.value for p in report.of('unknown')})) or 'none'})")


def sglang_where(release: str | None) -> str:
    return f"SGLang {release}" if release else "SGLang ≤ 0.5.11 (strictest; no release given)"
