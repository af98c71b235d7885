"""Running a stage, the one way the flow's tasks and the `eagle3` steps run by hand both take: skipped when its output
is finished under the key its inputs give now, else its runner between the in-progress and finished marks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from eagle3.config import PipelineConfig
from eagle3.stages.keys import begin, done, finish, marker, stage_fingerprint
from eagle3.stages.table import STAGES, StageRun, output_of


@dataclass(frozen=True)
class StageOutput:
    """What a stage hands the stages after it: where its output is and its content hash (their key's input)."""
    stage: str
    path: Path
    fingerprint: str


def run_stage(stage: str, config: PipelineConfig, resolved: Path | str, upstream: dict[str, StageOutput],
              log: Callable[[str], None], progress: Callable[[float], None] = lambda fraction: None) -> StageOutput:
    """Run `stage` on the outputs of the stages it reads ({the table's upstream name: output}), unless its output is
    finished under this very key already (which Prefect's result store may have forgotten)."""
    if set(upstream) != set(STAGES[stage].upstream):
        raise ValueError(f"the {stage} stage reads {sorted(STAGES[stage].upstream)}, given {sorted(upstream)}")
    fingerprints = {name: output.fingerprint for name, output in upstream.items()}
    if done(stage, config, fingerprints):
        log(f"{stage}: {output_of(config, stage)} was finished under this very key ({marker(config, stage)}): kept, "
            "not made again")
    else:
        run_marked(stage, config, fingerprints, lambda: STAGES[stage].runner(StageRun(config, Path(resolved), log,
                                                                                        progress)), log)
    return StageOutput(stage, output_of(config, stage), stage_fingerprint(config, stage))


def run_marked(stage: str, config: PipelineConfig, upstream: dict[str, str], work: Callable[[], None],
               log: Callable[[str], None]) -> None:
    """`work` between the stage's in-progress and finished marks. A stage refused before it made anything leaves no
    mark either."""
    begin(stage, config, upstream, log)
    try:
        work()
    except BaseException:
        if not output_of(config, stage).exists():
            marker(config, stage).unlink(missing_ok=True)
        raise
    finish(stage, config, upstream)


def run_by_hand(stage: str, config: PipelineConfig, resolved: Path | str, log: Callable[[str], None]) -> None:
    """A stage run outside the flow (`eagle3 train`, `eagle3 data capture`, ...) on the upstream outputs on disk,
    marked as the flow marks it: a later flow run with other settings starts it afresh (naming what changed) instead
    of resuming from work made for other inputs, and one with the same settings finds it done. Where an upstream
    output is not here (the runner's own error says so, or it reads it elsewhere) it runs unmarked, and a flow run
    makes it again."""
    sources = STAGES[stage].upstream
    missing = [source for source in sources.values() if not output_of(config, source).exists()]
    if missing:
        STAGES[stage].runner(StageRun(config, Path(resolved), log))
        log(f"{stage}: not marked for `eagle3 run` (no {', '.join(missing)} output in {config.run.dir}): a flow run "
            "makes it again")
        return
    upstream = {name: StageOutput(source, output_of(config, source), stage_fingerprint(config, source))
                for name, source in sources.items()}
    run_stage(stage, config, resolved, upstream, log)
