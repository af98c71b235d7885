"""training.init_from's resolved copy, as every draft algorithm's trainer finds it.

eagle3.init_draft resolves training.init_from once, before the trainer starts: a registry version or a draft
directory in any layout becomes a native copy under run.dir/train/init/, with a record of where it came from. What
of it carries over into a run's draft is the algorithm's (its `initial_model`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from eagle3.config.run import RunSection
from eagle3.config.training import TrainingSection
from eagle3.errors import Eagle3Error
from eagle3.fsutil import read_json

INIT_DIR, NATIVE_DIR, RECORD_FILE = "init", "native", "source.json"  # run.dir/train/init/{native/, source.json}


@dataclass(frozen=True)
class ResolvedInit:
    path: Path  # the native copy the trainer loads
    record: dict  # where it came from: {init_from, kind, where, layout, sha256}

    def describe(self) -> str:
        r = self.record
        return f"{r['init_from']} ({r['kind']} {r['where']}, {r['layout']} layout, sha256 {r['sha256'][:16]})"


def init_dir(run: RunSection) -> Path:
    return run.stage_dir("train") / INIT_DIR


def resolved_init(run: RunSection, training: TrainingSection) -> ResolvedInit | None:
    """The resolved copy of training.init_from (None when the run trains from scratch); refused when it was not
    resolved for this value."""
    value = training.init_from
    if value is None:
        return None
    record_path = init_dir(run) / RECORD_FILE
    record = read_json(record_path, "missing") if record_path.is_file() else {}
    if record.get("init_from") != value:
        raise Eagle3Error(
            f"training.init_from {value!r} was not resolved for this run ({record_path} "
            f"{'names ' + repr(record.get('init_from')) if record else 'is missing'}): train with `eagle3 train` or "
            "the pipeline's train stage, which fetch and convert it first (eagle3.init_draft.resolve_init_from)")
    return ResolvedInit(init_dir(run) / NATIVE_DIR, record)


def carried_config_problem(init: BaseModel, ours: BaseModel, settable: tuple[str, ...]) -> str | None:
    """Why weights trained under the draft config `init` cannot start a draft of config `ours` (None: they can):
    other target layers (the fc reads other features), or the first other field but those in `settable` (what a run
    sets anew, or trains with its own value and names in the log)."""
    if init.aux_layers != ours.aux_layers:
        return (f"it was trained on the hidden states of target layers {init.aux_layers} (aux_layers), this run's data "
                f"on layers {ours.aux_layers} (data.aux_layers, the data set's manifest): its fc would read other "
                f"features; capture the data at data.aux_layers {init.aux_layers}, or train from scratch (no "
                "training.init_from)")
    for field in type(ours).model_fields:
        if field not in settable and getattr(init, field) != getattr(ours, field):
            return (f"{field} {getattr(init, field)!r} in the init draft, {getattr(ours, field)!r} in this config: the "
                    "same weights would compute something else; set the config's value to the init draft's, or train "
                    "from scratch (no training.init_from)")
    return None
