"""What the launcher asks of a serving engine: one `ServingEngine` entry per engine (eagle3.serving)."""

from __future__ import annotations

from abc import ABC, abstractmethod

from eagle3.algorithms import DraftAlgorithm
from eagle3.config import PipelineConfig
from eagle3.config.deployment import TelemetrySection


class ServingEngine(ABC):
    name: str  # its serving.engine value
    forks_warm = False  # a local server of this engine may be forked from the warm process (eagle3/warm.py)
    health_path: str  # answers 200 once the server can generate

    @abstractmethod
    def reported_release(self, url: str, timeout_s: float) -> str:
        """The release the healthy server at `url` reports; an httpx.HTTPError or a ValueError naming what it answered
        when it reports none."""

    @abstractmethod
    def command(self, config: PipelineConfig, target, draft, telemetry: TelemetrySection | None = None,
                entry: DraftAlgorithm | None = None) -> list[str]:
        """The command that serves `target`, drafting with `draft` (None: no draft) by its algorithm `entry`'s flags
        (None: the config's draft.algorithm), with production's `telemetry` (candidates and baselines: None).
        Refuses, with a LaunchError, serving flags that would contradict the ones it sets."""

    def check(self, config: PipelineConfig) -> None:
        """What `command` would refuse at a run's first launch, refused now (`eagle3 config`)."""
        self.command(config, "TARGET", "DRAFT", config.production.telemetry)

    @abstractmethod
    def served_release(self, reported: str, configured: str | None) -> str | None:
        """The release whose loader rules validate the draft, from what the healthy server reports and
        serving.release."""
