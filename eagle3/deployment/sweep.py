"""The serving sweep: the candidate served under each drafting shape (the serving section's own first, then
sweep.points), at every benchmark.concurrency level and at benchmark.temperature, each level against the
no-draft server at the same level. The shape with the largest speedup at the production concurrency (the first
level) is chosen: production serves with it and is re-measured against its numbers.

On the GPU node every point is a server start (one model fits at a time, docs/gpu-node.md). With serving.nodes the
sweep runs on every node at once: each node starts its own no-draft server first, then takes the next shape not
measured yet, so every speedup divides by a server of the node it was measured on. A node's no-draft wall time (start
and every level) estimates its points', and a point that would end past sweep.budget_s is skipped and named. A point
whose server does not start, or that loses requests, is recorded with its error and never chosen; the sweep goes on
with the next point. A node whose no-draft server fails measures no shape; the others go on.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from functools import partial
from operator import itemgetter
from pathlib import Path
from typing import Callable

from eagle3.bench.client import SlicedPrompt
from eagle3.config import PipelineConfig
from eagle3.resolve import derived
from eagle3.config.serving import BenchmarkSection, ServingSection
from eagle3.data.regenerate import simulated_shapes
from eagle3.deployment.promotion import benchmark_on, run_prompt_ids
from eagle3.errors import Eagle3Error
from eagle3.fsutil import atomic_write_json
from eagle3.registry.gate import Decision
from eagle3.serve.launch import launch_and_validate
from eagle3.serve.nodes import endpoint, in_lanes, measuring_specs
from eagle3.serving.base import LaunchSpec, launch_spec
from eagle3.shape import DraftShape

Log = Callable[[str], None]


class SweepError(Eagle3Error):
    """No drafting shape could be measured against the no-draft server."""


def with_shape(config: PipelineConfig, shape: DraftShape) -> PipelineConfig:
    """The config that serves `shape`: one draft's (a run's contenders are served by their own configs, in their own
    shapes)."""
    return derived(config, {**{f"serving.{name}": value for name, value in asdict(shape).items()}, "contenders": None})


def measure_levels(spec: LaunchSpec, benchmark: BenchmarkSection, draft: Path | None, prompts: list[list[int]],
                   log: Log, role: str) -> list[dict]:
    """One server start; the benchmark at every concurrency level, at benchmark.temperature."""
    server = launch_and_validate(spec, spec.target.path, draft, log, role=role)
    try:
        return [benchmark_on(benchmark, server.engine, server.url, prompts, log, level, benchmark.temperature)
                for level in benchmark.concurrency]
    finally:
        server.stop()


def first_of_each_suite(prompts: list[SlicedPrompt], count: int | None) -> list[SlicedPrompt]:
    """The first `count` requests of each suite (None: all), so every suite is measured at every point."""
    taken: dict[str, int] = {}
    kept = []
    for prompt in prompts:
        taken[prompt.suite] = taken.get(prompt.suite, 0) + 1
        if count is None or taken[prompt.suite] <= count:
            kept.append(prompt)
    return kept


def most_per_suite(prompts: list[SlicedPrompt]) -> int:
    """The requests of the largest suite among `prompts`: first_of_each_suite with this count takes `prompts` again."""
    counts: dict[str, int] = {}
    for prompt in prompts:
        counts[prompt.suite] = counts.get(prompt.suite, 0) + 1
    return max(counts.values())


def level_row(level: int, measured: dict, baseline: dict) -> dict:
    tokens_per_s, base = measured.get("output_tokens_per_s"), baseline["output_tokens_per_s"]
    return {"concurrency": level, "accept_length": measured.get("accept_length"),
            "accept_rate": measured.get("accept_rate"), "output_tokens_per_s": tokens_per_s,
            "baseline_output_tokens_per_s": base, "speedup": tokens_per_s / base if tokens_per_s else None,
            "lost_requests": measured["lost_requests"], "suites": measured.get("suites")}


def at_production(point: dict) -> dict | None:
    """The point's row at the production concurrency, when it can be chosen (measured in full, speculating)."""
    if point["error"] or not point["levels"]:
        return None
    row = point["levels"][0]
    return row if not row["lost_requests"] and row["accept_length"] is not None else None


def choose(points: list[dict]) -> dict | None:
    """The point with the largest speedup at the production concurrency: each against its own node's no-draft server,
    so points measured on other nodes compare (on one node: the most output tokens/s)."""
    usable = [(point, at_production(point)) for point in points if at_production(point)]
    if not usable:
        return None
    point, row = max(usable, key=lambda pair: pair[1]["speedup"] or 0.0)
    return {"shape": point["shape"], "label": point["label"], **row}


def run_sweep(config: PipelineConfig, draft: Path, out: Path, log: Log = print, earlier: dict | None = None) -> dict:
    """Measure every shape that fits the budget, on every node of serving.nodes at once; write the result to `out`;
    return it. `earlier`: the no-draft servers' levels on these requests from another draft's sweep this run (its
    result's `baselines`, by node), taken instead of a server start on those nodes, so the drafts' speedups share their
    denominators."""
    started, sweep, b = time.monotonic(), config.sweep, config.benchmark
    prompts = first_of_each_suite(run_prompt_ids(b, config.data, config.run, config.target), sweep.num_prompts)
    # serving's shape, then sweep.points: the shapes the simulator replays
    shapes = simulated_shapes(config.replay_shape, config.sweep)
    nodes = measuring_specs(launch_spec(config))
    log(f"sweep: {len(shapes)} drafting shape(s) x concurrency {b.concurrency} at temperature {b.temperature}, "
        f"{len(prompts)} requests each (at most {most_per_suite(prompts)} per suite), budget {sweep.budget_s:.0f} s"
        + (f", on {len(nodes)} nodes at once (serving.nodes)" if len(nodes) > 1 else ""))
    run = Sweep(b, draft, prompts, nodes, [measuring_specs(launch_spec(with_shape(config, shape))) for shape in shapes],
                ShapeQueue(shapes, sweep.budget_s, started), log)
    measured = [lane[0] for lane in in_lanes([[partial(run.on_node, i, (earlier or {}).get(endpoint(spec)))]
                                               for i, spec in enumerate(nodes)])]
    baselines = {node["node"]: node["baseline"] for node in measured if node["baseline"]}
    if not baselines:
        raise SweepError("no speedup can be measured: " + "; ".join(f"{n['node']}: {n['error']}" for n in measured))
    points = [point for _, point in sorted((pair for node in measured for pair in node["points"]), key=itemgetter(0))]
    skipped = [asdict(shape) for _, shape in run.queue.waiting]
    per_point = min(baseline["wall_s"] for baseline in baselines.values())
    for _, shape in run.queue.waiting:
        log(f"sweep: skipped {shape.label()}: it would end past sweep.budget_s {sweep.budget_s:.0f} s (a point takes "
            f"~{per_point:.0f} s)")
    best = choose(points)
    if best is None:
        raise SweepError("no drafting shape was measured in full: " + "; ".join(
            f"{p['label']}: {p['error'] or 'requests lost or no speculation reported'}" for p in points))
    chosen = {**best, "temperature": b.temperature, "num_prompts": most_per_suite(prompts)}
    result = {"temperature": b.temperature, "concurrency": b.concurrency, "num_prompts": most_per_suite(prompts),
              "budget_s": sweep.budget_s, "wall_s": time.monotonic() - started, "points": points, "skipped": skipped,
              "chosen": chosen, "baselines": baselines,
              "failed_nodes": {node["node"]: node["error"] for node in measured if node["error"]}}
    for line in render_table(result):
        log(line)
    atomic_write_json(out, result)
    return result


class ShapeQueue:
    """The shapes not measured yet, taken in order by the nodes, each while sweep.budget_s allows."""

    def __init__(self, shapes: list[DraftShape], budget_s: float, started: float):
        self.waiting = list(enumerate(shapes))  # (its place in the sweep, the shape)
        self.budget_s, self.started, self.taken = budget_s, started, 0
        self._lock = threading.Lock()

    def take(self, per_point_s: float) -> tuple[int, DraftShape] | None:
        """The next shape, or None when none is left or a point taking `per_point_s` would end past the budget (the
        sweep's first point is always measured)."""
        with self._lock:
            if not self.waiting or (self.taken and time.monotonic() - self.started + per_point_s > self.budget_s):
                return None
            self.taken += 1
            return self.waiting.pop(0)


@dataclass
class Sweep:
    """What every node's lane of a sweep shares: the requests, the draft, each shape's launch spec on each node (a
    node: an entry of serving.nodes, or serving's own endpoint) and the shapes left to measure."""

    benchmark: BenchmarkSection
    draft: Path
    prompts: list[SlicedPrompt]
    nodes: list[LaunchSpec]  # the no-draft server's, a node each
    shaped: list[list[LaunchSpec]]  # by shape, a node each
    queue: ShapeQueue
    log: Log

    def on_node(self, node: int, earlier: dict | None) -> dict:
        """The no-draft server on `node` (or `earlier`: its levels measured already), then shapes from the queue one
        after another, each against that node's no-draft server. A node whose no-draft server fails or loses
        requests measures no shape: {"node", "baseline", "error", "points": [(place, point)]}."""
        spec, b, log = self.nodes[node], self.benchmark, self.log
        where, started = endpoint(spec), time.monotonic()
        if earlier is not None:
            log(f"sweep baseline (no draft) on {where}: as measured for the run's first draft on these requests")
        else:
            try:
                levels = measure_levels(spec, b, None, self.prompts, log, "sweep baseline (no draft)")
            except Eagle3Error as err:
                return self.failed(where, f"the no-draft server did not serve: {err}")
            if lost := [row for row in levels if row["lost_requests"]]:
                return self.failed(where, f"the no-draft server lost requests ({lost[0].get('error')})")
            earlier = {"levels": levels, "wall_s": time.monotonic() - started}
        points = []
        while (taken := self.queue.take(earlier["wall_s"])) is not None:
            place, shape = taken
            point = measure_point(self.shaped[place][node], b, shape, self.draft, self.prompts, earlier["levels"], log)
            points.append((place, {**point, "node": where}))
        return {"node": where, "baseline": earlier, "error": None, "points": points}

    def failed(self, where: str, why: str) -> dict:
        self.log(f"sweep: {where}: {why}; it measures no shape")
        return {"node": where, "baseline": None, "error": why, "points": []}


def measure_point(spec: LaunchSpec, benchmark: BenchmarkSection, shape: DraftShape, draft: Path,
                  prompts: list[list[int]], baseline: list[dict], log: Log) -> dict:
    """`draft` served in `shape` (`spec` serves it so) at every concurrency level, each level against the no-draft
    server's (`baseline`); a shape that fails to serve is recorded with its error."""
    try:
        measured = measure_levels(spec, benchmark, draft, prompts, log, f"sweep {shape.label()}")
    except Eagle3Error as err:  # e.g. an attention backend that cannot draft trees: the next shape may serve
        log(f"sweep: {shape.label()} failed: {err}")
        return {"shape": asdict(shape), "label": shape.label(), "levels": [], "error": str(err)}
    rows = [level_row(level, m, base) for level, m, base in zip(benchmark.concurrency, measured, baseline)]
    return {"shape": asdict(shape), "label": shape.label(), "levels": rows, "error": None}


def choose_serving(config: PipelineConfig, draft: Path, served: dict, acceptance: Decision, out: Path,
                   log: Log = print, baselines: dict | None = None) -> dict:
    """The serving shape production gets ({"chosen", "points"}): the sweep's choice, or the serving section's own
    as the candidate's measurement found it when the sweep is off or when the gate rejects the candidate on
    acceptance already (`acceptance`: its decision without throughput; each point is a server start). A sweep's
    result is written to `out`; `baselines`: run_sweep's `earlier`."""
    if not config.sweep.enabled:
        log("sweep: off (sweep.enabled false): production serves the serving section's shape")
    elif not acceptance.promote:
        log("sweep: skipped, the gate rejects the candidate on acceptance alone: "
            + "; ".join(f"{r.rule}: {r.message}" for r in acceptance.reasons))
    else:
        return run_sweep(config, draft, out, log, baselines)
    return {"chosen": configured_choice(config.serving, served), "points": None}


def configured_choice(serving: ServingSection, served: dict) -> dict:
    """Without a sweep: the serving section's shape as the candidate's greedy measurement found it."""
    shape = serving.shape
    return {"shape": asdict(shape), "label": shape.label(), "concurrency": served["concurrency"],
            "accept_length": served.get("accept_length"), "accept_rate": served.get("accept_rate"),
            "output_tokens_per_s": served.get("output_tokens_per_s"),
            "baseline_output_tokens_per_s": (served.get("baseline") or {}).get("output_tokens_per_s"),
            "speedup": served.get("speedup"), "lost_requests": served.get("lost_requests", 0), "temperature": 0.0,
            # requests per suite, as the sweep records them: production is re-measured on as many of each suite
            "num_prompts": max((f["requests"] for f in (served.get("suites") or {}).values()),
                               default=served.get("num_prompts"))}


def render_table(result: dict) -> list[str]:
    lines = [f"sweep: {len(result['points'])} shape(s) measured in {result['wall_s']:.0f} s, temperature "
             f"{result['temperature']}, at most {result['num_prompts']} requests per suite"]
    several = len(result["baselines"]) > 1
    for point in result["points"]:
        where = f" on {point['node']}" if several else ""
        if point["error"]:
            lines.append(f"  {point['label']}{where}: FAILED {point['error']}")
        for row in point["levels"]:
            accept = "n/a" if row["accept_length"] is None else f"{row['accept_length']:.3f}"
            speedup = "n/a" if row["speedup"] is None else f"{row['speedup']:.2f}x"
            lost = f", {row['lost_requests']} requests LOST" if row["lost_requests"] else ""
            lines.append(f"  {point['label']}{where} @ {row['concurrency']} concurrent: accept length {accept}, "
                         f"{row['output_tokens_per_s'] or 0:.1f} output tokens/s, speedup {speedup}{lost}")
    chosen = result["chosen"]
    lines.append(f"  chosen: {chosen['label']} ({chosen['output_tokens_per_s']:.1f} output tokens/s at "
                 f"{chosen['concurrency']} concurrent, {chosen['speedup']:.2f}x the no-draft server)")
    return lines
