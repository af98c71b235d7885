"""Running a stage, the one way the flow's tasks and the `eagle3` steps run by hand both take: skipped when its output
is finished under the key its inputs give now, else its runner between the in-progress and finished marks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from eagle3 import guard
from eagle3.config import PipelineConfig
from eagle3.errors import Eagle3Error
from eagle3.stages.keys import (IN_PROGRESS, begin, changed_inputs, done, finish, marker, recorded, resume_inputs,
                                stage_fingerprint, stage_key)
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
        guard.require(f"the {stage} stage")
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


class StaleUpstream(Eagle3Error):
    """A step run by hand on an upstream output that is not what this config makes."""


def run_by_hand(stage: str, config: PipelineConfig, resolved: Path | str, log: Callable[[str], None]) -> None:
    """A stage run outside the flow (`eagle3 train`, `eagle3 data capture`, ...) on the upstream outputs on disk,
    marked as the flow marks it: a later flow run with other settings starts it afresh (naming what changed) instead
    of resuming from work made for other inputs, and one with the same settings finds it done. Where an upstream
    output is not here (the runner's own error says so, or it reads it elsewhere) it runs unmarked, and a flow run
    makes it again. One marked for other inputs than this config gives, here or further up, is refused
    (`refuse_stale_upstream`): the flow would make it again first, and a step by hand must not read it as current."""
    sources = STAGES[stage].upstream
    missing = [source for source in sources.values() if not output_of(config, source).exists()]
    if missing:
        STAGES[stage].runner(StageRun(config, Path(resolved), log))
        log(f"{stage}: not marked for `eagle3 run` (no {', '.join(missing)} output in {config.run.dir}): a flow run "
            "makes it again")
        return
    refuse_stale_upstream(stage, config)
    upstream = {name: StageOutput(source, output_of(config, source), stage_fingerprint(config, source))
                for name, source in sources.items()}
    run_stage(stage, config, resolved, upstream, log)


def read_by(stage: str) -> set[str]:
    """The stages whose outputs `stage` reads, directly or through the stages it reads."""
    found: set[str] = set()
    for source in STAGES[stage].upstream.values():
        found |= {source} | read_by(source)
    return found


def refuse_stale_upstream(stage: str, config: PipelineConfig) -> None:
    """Raise StaleUpstream naming the steps to run first (in the table's order) when an output `stage` reads,
    directly or further up, is marked for other inputs than this config gives, or was left unfinished. An unmarked
    output (made outside the steps and the flow) is taken as it is."""
    above = read_by(stage)
    stale = {name: why for name in STAGES if name in above and (why := staleness(name, config))}
    if not stale:
        return
    first, why = next(iter(stale.items()))
    redo = [name for name in STAGES if name in above and (name in stale or read_by(name) & stale.keys())]
    steps = ", then ".join(f"`eagle3 {' '.join(command)}`"  # a step that runs several stages named once
                           for command in dict.fromkeys(STAGES[name].command for name in redo))
    raise StaleUpstream(f"{stage}: {output_of(config, first)} (the {first} stage's output) {why}: run {steps} "
                        f"with these settings first, or `eagle3 run`")


def staleness(stage: str, config: PipelineConfig) -> str | None:
    """Why the stage's marked output is not what this config makes from the outputs on disk; None when it is, or when
    it is unmarked, missing, or made from an upstream output no longer here (the runner's own checks speak then)."""
    key, _, made_for = recorded(config, stage)
    sources = STAGES[stage].upstream.values()
    if key is None or not all(output_of(config, name).exists() for name in (stage, *sources)):
        return None
    upstream = {name: stage_fingerprint(config, source) for name, source in STAGES[stage].upstream.items()}
    if key == stage_key(stage, config, upstream):
        return None
    if key.startswith(IN_PROGRESS):
        return f"was left unfinished (marked in progress in {marker(config, stage)})"
    changed = changed_inputs(made_for, resume_inputs(stage, config, upstream))
    return f"was made for other inputs ({changed or 'settings that refine it: ' + ', '.join(STAGES[stage].refines)})"
