"""What the launcher and the benchmark client ask of a serving engine: one `ServingEngine` entry per engine
(eagle3.serving). The defaults are SGLang's HTTP API, which the reference server speaks too."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from eagle3.algorithms import DraftAlgorithm
from eagle3.config import PipelineConfig
from eagle3.config.deployment import TelemetrySection
from eagle3.config.draft import DraftSection
from eagle3.config.run import TargetSection
from eagle3.config.serving import ServingSection, SweepSection
from eagle3.procs import LaunchError
from eagle3.records.telemetry import GENERATION_TOKENS, VERIFY_CALLS


@dataclass(frozen=True)
class LaunchSpec:
    """What launching a server reads of a run's config (eagle3.serve.launch: server_for, launch_and_validate; each
    engine's `command`)."""

    serving: ServingSection
    target: TargetSection
    draft: DraftSection  # its algorithm's flags serve a draft given without its own; vLLM's check reads its attention
    sglang_python: str  # data.sglang_python: SGLang's interpreter on the node
    cpu_threads: int | None  # run.cpu_threads: the reference server's threads
    log_dir: Path  # the server's log: serving.log_dir, else run.dir/logs
    warm_start: bool  # run.warm_start: a local reference server may be forked from the warm process
    served_dir: Path  # run.dir/served: a draft converted to the layout the engine loads, when that is not SGLang's
    waive: tuple[str, ...]  # export.waive: the validation codes a launch accepts (the export stage logged them)


def refuse_pipeline_parallel(serving: ServingSection) -> None:
    """serving.pp sizes a replica for the plan only: every launcher starts one node's server at serving.tp."""
    if serving.pp > 1:
        raise LaunchError(f"serving.pp {serving.pp}: the launchers start a server at serving.tp {serving.tp} GPUs on "
                          "one node; a pipeline-parallel replica is planned (`eagle3 plan`), not started: set "
                          "serving.pp 1")


def launch_spec(config: PipelineConfig) -> LaunchSpec:
    """The launch spec of a config with a serving section."""
    return LaunchSpec(config.serving, config.target, config.draft, config.data.sglang_python, config.run.cpu_threads,
                      config.serving.log_dir or config.run.dir / "logs", config.run.warm_start,
                      config.run.dir / "served", tuple(config.export.waive))


class ServingEngine(ABC):
    name: str  # its serving.engine value
    title: str  # how messages name it
    forks_warm = False  # a local server of this engine may be forked from the warm process (eagle3/warm.py)
    health_path: str  # answers 200 once the server can generate
    served_layout = "sglang"  # the draft layout it loads (eagle3/algorithms/eagle3/layouts); another is converted at launch
    info_path = "/server_info"  # GET: the server's settings, read once before a benchmark
    generate_path = "/generate"  # POST: one request, answered whole
    # The Prometheus counters (on /metrics) whose deltas give production's accept length over any window: tokens
    # generated (the prefill's included) and verify steps; and when the engine reports the second.
    generation_tokens_metric = GENERATION_TOKENS
    verify_steps_metric = VERIFY_CALLS
    verify_steps_reported = "from 0.5.13, and only with a draft"

    @abstractmethod
    def reported_release(self, url: str, timeout_s: float) -> str:
        """The release the healthy server at `url` reports; an httpx.HTTPError or a ValueError naming what it answered
        when it reports none."""

    @abstractmethod
    def command(self, spec: LaunchSpec, target, draft, telemetry: TelemetrySection | None = None,
                entry: DraftAlgorithm | None = None) -> list[str]:
        """The command that serves `target`, drafting with `draft` (None: no draft) by its algorithm `entry`'s flags
        (None: the spec's draft.algorithm), with production's `telemetry` (candidates and baselines: None).
        Refuses, with a LaunchError, serving flags that would contradict the ones it sets."""

    def check(self, spec: LaunchSpec, telemetry: TelemetrySection, sweep: SweepSection) -> None:
        """What `command` would refuse at a run's first launch (production's with its `telemetry`), refused now
        (`eagle3 config`); `sweep`: the shapes later launches serve."""
        refuse_pipeline_parallel(spec.serving)
        self.command(spec, "TARGET", "DRAFT", telemetry)

    @abstractmethod
    def served_release(self, reported: str, configured: str | None) -> str | None:
        """The release whose loader rules validate the draft, from what the healthy server reports and
        serving.release; None: rules that hold for every release (the strictest, for SGLang's layout)."""

    def counting_release(self, configured: str | None) -> str | None:
        """The SGLang release whose finish and counting rules (eagle3/bench/counting.py) this engine's counts follow,
        from serving.release (None: the newest's)."""
        return configured

    def memory_left_unused(self, serving: ServingSection, gpu_memory_gib: float) -> dict[str, float]:
        """GiB of each GPU the engine leaves to others whatever it serves ({}: it may use all of it), for the plan's
        serve stage."""
        return {}

    def request_body(self, prompt: list[int] | str, max_new_tokens: int, temperature: float,
                     labels: dict[str, str], ignore_eos: bool = False) -> dict:
        """The generate request for `prompt` (token ids, or text the server tokenizes), with the custom `labels`
        production's request records filter on (none: {}); `ignore_eos`: always max_new_tokens tokens."""
        sampling = {"max_new_tokens": max_new_tokens, "temperature": temperature}
        body = {"text" if isinstance(prompt, str) else "input_ids": prompt,
                "sampling_params": sampling | ({"ignore_eos": True} if ignore_eos else {})}
        return body | ({"custom_labels": labels} if labels else {})

    def answer(self, raw: object) -> dict:
        """`raw` (a generate answer's JSON) read by `read_answer`, with its `output_ids` and integer
        `meta_info.completion_tokens`; a ValueError naming the engine and showing the answer otherwise."""
        try:
            answer = self.read_answer(raw)
            if not isinstance(answer["output_ids"], list) or type(answer["meta_info"]["completion_tokens"]) is not int:
                raise ValueError("no output_ids list or no integer meta_info.completion_tokens")
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"not a {self.title} answer ({type(err).__name__}: {err}): {str(raw)[:200]}") from None
        return answer

    def read_answer(self, answer: dict) -> dict:
        """A generate answer as SGLang's /generate gives it: `output_ids` and `meta_info` with completion_tokens,
        finish_reason ({"type": "stop" | "length", ...}) and, where the request was drafted, the spec_* counts
        (eagle3/bench/counting.py)."""
        return answer

    def read_info(self, info: dict) -> dict:
        """The settings answer as SGLang's /server_info names them (`version`, speculative_*)."""
        return info


def flag_of(arg: str) -> str:
    """`--some_flag=x` -> `--some-flag`."""
    return arg.split("=", 1)[0].replace("_", "-")


def launcher_flag_for(arg: str, flags: dict[str, tuple[str, ...]]) -> str | None:
    """The launcher's flag (a key of `flags`, each with every spelling the engine's parser accepts) that `arg` would
    set: one of its spellings, or an abbreviation of one (argparse accepts any unambiguous prefix of a long option, so
    `--tp` or `--context-len` set the same field)."""
    flag = flag_of(arg)
    for canonical, spellings in flags.items():
        if any(spelling.startswith(flag) for spelling in spellings):
            return canonical
    return None
