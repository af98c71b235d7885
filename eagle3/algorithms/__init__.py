"""The draft algorithms, by `draft.algorithm` (docs/algorithms.md: what an entry gives, and adding one)."""

from __future__ import annotations

from pathlib import Path

from eagle3.algorithms.base import DraftAlgorithm
from eagle3.algorithms.dflash import DFLASH
from eagle3.algorithms.dspark import DSPARK
from eagle3.algorithms.eagle3 import EAGLE3
from eagle3.draft.files import CONFIG_FILE
from eagle3.errors import Eagle3Error, UnreadableInput
from eagle3.fsutil import read_json

ALGORITHMS: dict[str, DraftAlgorithm] = {entry.name: entry for entry in (EAGLE3, DFLASH, DSPARK)}


def require_deployable(name: str, by: str) -> None:
    """The whole pipeline exports, serves and gates the draft: an algorithm whose entry cannot is refused before any
    stage, not where serving starts after hours of training (the hand steps still run it)."""
    if not algorithm(name).deployable:
        raise Eagle3Error(f"{by}: draft.algorithm {name} is trained, replayed and exported here, but its serving and "
                          "gate are not built yet (docs/algorithms.md): run `eagle3 data regenerate`, `eagle3 data "
                          "capture`, `eagle3 vocab build`, `eagle3 train` and `eagle3 export` by hand")


def algorithm(name: str) -> DraftAlgorithm:
    """The entry registered as `name` (a config's draft.algorithm)."""
    if name not in ALGORITHMS:
        raise Eagle3Error(f"draft.algorithm {name!r} is no registered draft algorithm (registered: "
                          f"{', '.join(ALGORITHMS)}); see docs/algorithms.md")
    return ALGORITHMS[name]


def draft_algorithm(path: Path) -> DraftAlgorithm:
    """The entry whose draft the directory `path` holds, in any layout (its config.json says): what serves, validates
    and replays it, whatever the run's own draft.algorithm (production may serve an earlier run's version). A config
    no other entry reads is EAGLE-3's, whose readers name what they cannot read."""
    if not Path(path).is_dir():
        raise UnreadableInput(f"{path}: no such draft directory")
    config = read_json(Path(path) / CONFIG_FILE, "missing (a draft checkpoint needs config.json)")
    if not isinstance(config, dict):
        return EAGLE3
    return next((entry for entry in ALGORITHMS.values() if entry is not EAGLE3 and entry.reads(config)), EAGLE3)
