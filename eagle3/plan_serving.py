"""The serve and sweep stages' hours (eagle3/plan_time.py): the measuring servers' starts, one after another on a
node, and their benchmarks; with serving.nodes the nodes measure at once, as eagle3.deployment.promotion and
eagle3.deployment.sweep run them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from eagle3.config.data import DataSection
from eagle3.config.deployment import RegistrySection
from eagle3.config.serving import BenchmarkSection, ServingSection, SweepSection
from eagle3.plan_clock import Clock, Scenario, StageTime, as_hours, unknown_stage


def benchmark_s(b: BenchmarkSection, serving: ServingSection, clock: Clock, prompts: int,
                levels: list[int]) -> tuple[float, str]:
    """One no-draft measurement at each concurrency level (a draft only shortens it): seconds, and the last bound."""
    gpus = serving.tp * serving.pp
    total, bound = 0.0, ""
    for level in levels:
        in_flight = min(level, prompts)
        seconds, bound = clock.decode(prompts * b.max_new_tokens, in_flight, b.max_new_tokens / 2, gpus)
        total += seconds
    return total, bound


def serve_time(b: BenchmarkSection, serving: ServingSection, data: DataSection, registry: RegistrySection | None,
               clock: Clock, scenario: Scenario, lanes: int, baseline: bool = True) -> StageTime:
    """The candidate (and the no-draft baseline and production on new prompts, unless another draft of the run
    measured them) measured at the production concurrency, one server start each: production beside the other two when
    `lanes` (serving_lanes) give it a node of its own (eagle3.deployment.promotion.measure_candidate)."""
    if clock.target is None:
        return unknown_stage("serve")
    # production is re-measured on this run's prompts when they differ from its own: new traffic prompts
    remeasured = scenario.retrain and data.traffic is not None and registry is not None and baseline
    roles = ["candidate"] + ["benchmark.baseline"] * (b.baseline and baseline)
    beside = remeasured and lanes > 1
    if remeasured and not beside:
        roles.append("production on data.traffic prompts")
    starts = len(roles)
    seconds, bound = benchmark_s(b, serving, clock, b.num_prompts, [b.production_concurrency])
    where = ", production on data.traffic prompts beside them on a second node (serving.nodes)" if beside else ""
    return StageTime("serve", {f"{starts} server start(s) ({', '.join(roles)}){where}": as_hours(clock.loads_s(starts)),
                               f"benchmark.num_prompts {b.num_prompts} x max_new_tokens {b.max_new_tokens} at "
                               f"concurrency {b.production_concurrency}, each, {bound}": as_hours(starts * seconds)},
                     servers=starts)


def sweep_time(sweep: SweepSection, b: BenchmarkSection, serving: ServingSection, clock: Clock, shapes: int,
               lanes: int, baseline: bool = True) -> StageTime:
    """The no-draft server (unless another draft of the run's sweep measured it) then each of the `shapes` drafting
    shapes the simulator replays, a server start each at every benchmark.concurrency level; a shape that would end past
    sweep.budget_s is skipped (the first is always measured), as eagle3.deployment.sweep does. On `lanes` nodes at once
    (serving_lanes): each its own no-draft server, then the shapes shared out."""
    if not sweep.enabled:
        return StageTime("sweep", {"sweep.enabled false": 0.0})
    if clock.target is None:
        return unknown_stage("sweep")
    prompts = min(sweep.num_prompts or b.num_prompts, b.num_prompts)
    measure, bound = benchmark_s(b, serving, clock, prompts, b.concurrency)
    point = clock.loads_s(1) + measure
    measured = max(1, min(shapes, lanes * (int(sweep.budget_s // point) - 1)))
    rounds = baseline + math.ceil(measured / lanes)  # the starts one after another on the busiest node
    if lanes > 1:
        starts = (f"{baseline * lanes + measured} server starts on {lanes} nodes at once (serving.nodes), {rounds} one "
                  f"after another: {'no draft on each + ' * baseline}")
    else:
        starts = f"{rounds} server starts: {'no draft + ' * baseline}"
    loads = as_hours(rounds * clock.loads_s(1))
    return StageTime("sweep", {
        f"{starts}{measured} of {shapes} shape(s) within sweep.budget_s {sweep.budget_s:g}": loads,
        f"{prompts} prompts x benchmark.max_new_tokens {b.max_new_tokens} at concurrency {b.concurrency}, each, "
        f"{bound}": as_hours(rounds * measure)}, servers=rounds)


def serving_lanes(serving: ServingSection, nodes: int) -> int:
    """The measuring servers that run at once: serving.nodes' entries, as many as the planned nodes hold replicas."""
    return max(1, min(len(serving.endpoints), nodes // serving.pp))


@dataclass(frozen=True)
class Measuring:
    """What the serve and sweep stages' hours read of a config (the run's or a contender's): the sections, and the
    drafting shapes the sweep measures."""

    benchmark: BenchmarkSection
    serving: ServingSection
    data: DataSection
    registry: RegistrySection | None
    sweep: SweepSection
    shapes: int

    def stages(self, clock: Clock, scenario: Scenario, lanes: int, baseline: bool = True) -> list[StageTime]:
        """The serve and sweep stages with the measuring servers on `lanes` nodes at once (a contender's: `baseline`
        False, the run's no-draft servers taken)."""
        return [serve_time(self.benchmark, self.serving, self.data, self.registry, clock, scenario, lanes, baseline),
                sweep_time(self.sweep, self.benchmark, self.serving, clock, self.shapes, lanes, baseline)]

    def spreading_note(self, clock: Clock, scenario: Scenario, stages: list[StageTime]) -> list[str]:
        """What serving.nodes would save where the planned nodes could measure at once and the config keeps its
        measuring servers on one: the serve and sweep stages' hours as they are and spread."""
        lanes = scenario.nodes // self.serving.pp
        if lanes < 2 or serving_lanes(self.serving, lanes) > 1:
            return []
        serial = [stage for stage in stages if stage.name in ("serve", "sweep")]
        spread = self.stages(clock, scenario, lanes)
        if None in [stage.hours for stage in serial + spread]:
            return []
        before, after = sum(stage.hours for stage in serial), sum(stage.hours for stage in spread)
        if after >= before:  # e.g. one shape to sweep: the starts one after another are as many
            return []
        return [f"the serve and sweep stages' {sum(stage.servers for stage in serial)} server starts run one after "
                f"another on serving.host: {before:.2f} h; serving.nodes listing {lanes} nodes measures on them at "
                f"once: {after:.2f} h"]
