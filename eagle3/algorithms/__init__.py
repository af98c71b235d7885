"""The draft algorithms, by `draft.algorithm` (docs/algorithms.md: what an entry gives, and adding one)."""

from __future__ import annotations

from eagle3.algorithms.base import DraftAlgorithm
from eagle3.algorithms.eagle3 import EAGLE3
from eagle3.errors import Eagle3Error

ALGORITHMS: dict[str, DraftAlgorithm] = {entry.name: entry for entry in (EAGLE3,)}


def algorithm(name: str) -> DraftAlgorithm:
    """The entry registered as `name` (a config's draft.algorithm)."""
    if name not in ALGORITHMS:
        raise Eagle3Error(f"draft.algorithm {name!r} is no registered draft algorithm (registered: "
                          f"{', '.join(ALGORITHMS)}); see docs/algorithms.md")
    return ALGORITHMS[name]
