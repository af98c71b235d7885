"""SGLang's release numbers as comparable values, and the ranges of releases the contract's rules cover
(eagle3/contract/engines.py, and the draft algorithms' own: eagle3/algorithms/<name>/)."""

from __future__ import annotations

from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

Release = tuple[int, int, int]


def parse_release(text: str) -> Release:
    """'0.5.13.post1' -> (0, 5, 13): post releases are fixes of the same release."""
    try:
        parts = Version(text).release
    except InvalidVersion:
        raise ValueError(f"'{text}' is not an SGLang release number (write it like 0.5.13)") from None
    return tuple((parts + (0, 0, 0))[:3])


def release_or_newest(text: str | None) -> Release:
    """A release, or for an unknown one (None) a number above every release read: the newest rules apply."""
    return parse_release(text) if text else (9999, 0, 0)


@dataclass(frozen=True)
class ReleaseRange:
    first: str
    last: str  # inclusive

    def __contains__(self, release: Release) -> bool:
        return parse_release(self.first) <= release <= parse_release(self.last)

    def __str__(self) -> str:
        return self.first if self.first == self.last else f"{self.first}–{self.last}"

SPECULATORS_RELEASE = "0.9.0"  # speculators' release whose loader reads what our speculators exports write
