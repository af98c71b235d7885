"""The serving sweep: the candidate served under each drafting shape (the serving section's own first, then
sweep.points), at every benchmark.concurrency level and at benchmark.temperature, each level against the
no-draft server at the same level. The shape with the most output tokens/s at the production concurrency (the
first level) is chosen: production serves with it and is re-measured against its numbers.

On the GPU node every point is a server start (one model fits at a time, docs/gpu-node.md). The no-draft server goes
first; its wall time (start and every level) estimates a point's, and a point that would end past
sweep.budget_s is skipped and named. A point whose server does not start, or that loses requests, is recorded
with its error and never chosen; the sweep goes on with the next point.
"""

from __future__ import annotations

import time
from dataclasses import asdict
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
    usable = [(point, at_production(point)) for point in points if at_production(point)]
    if not usable:
        return None
    point, row = max(usable, key=lambda pair: pair[1]["output_tokens_per_s"])
    return {"shape": point["shape"], "label": point["label"], **row}


def run_sweep(config: PipelineConfig, draft: Path, out: Path, log: Log = print, earlier: dict | None = None) -> dict:
    """Measure every shape that fits the budget; write the result to `out`; return it. `earlier`: the no-draft
    server's levels on these requests from another draft's sweep this run (its result's `baseline`), taken instead of
    a server start, so the drafts' speedups share one denominator."""
    started, sweep, b = time.monotonic(), config.sweep, config.benchmark
    prompts = first_of_each_suite(run_prompt_ids(b, config.data, config.run, config.target), sweep.num_prompts)
    # serving's shape, then sweep.points: the shapes the simulator replays
    shapes = simulated_shapes(config.replay_shape, config.sweep)
    log(f"sweep: {len(shapes)} drafting shape(s) x concurrency {b.concurrency} at temperature {b.temperature}, "
        f"{len(prompts)} requests each (at most {most_per_suite(prompts)} per suite), budget {sweep.budget_s:.0f} s")
    if earlier is None:
        levels = measure_levels(launch_spec(config), b, None, prompts, log, "sweep baseline (no draft)")
        lost = [row for row in levels if row["lost_requests"]]
        if lost:
            raise SweepError(f"the no-draft server lost requests ({lost[0].get('error')}): no speedup can be measured")
        earlier = {"levels": levels, "wall_s": time.monotonic() - started}
    else:
        log("sweep baseline (no draft): as measured for the run's first draft on these requests")
    baseline, per_point = earlier["levels"], earlier["wall_s"]
    points, skipped = [], []
    for shape in shapes:
        if points and time.monotonic() - started + per_point > sweep.budget_s:
            skipped.append(asdict(shape))
            log(f"sweep: skipped {shape.label()}: it would end past sweep.budget_s {sweep.budget_s:.0f} s "
                f"(a point takes ~{per_point:.0f} s)")
            continue
        shaped = with_shape(config, shape)
        points.append(measure_point(launch_spec(shaped), shaped.benchmark, shape, draft, prompts, baseline, log))
    best = choose(points)
    if best is None:
        raise SweepError("no drafting shape was measured in full: " + "; ".join(
            f"{p['label']}: {p['error'] or 'requests lost or no speculation reported'}" for p in points))
    chosen = {**best, "temperature": b.temperature, "num_prompts": most_per_suite(prompts)}
    result = {"temperature": b.temperature, "concurrency": b.concurrency, "num_prompts": most_per_suite(prompts),
              "budget_s": sweep.budget_s, "wall_s": time.monotonic() - started, "points": points, "skipped": skipped,
              "chosen": chosen, "baseline": earlier}
    for line in render_table(result):
        log(line)
    atomic_write_json(out, result)
    return result


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
                   log: Log = print, baseline: dict | None = None) -> dict:
    """The serving shape production gets ({"chosen", "points"}): the sweep's choice, or the serving section's own
    as the candidate's measurement found it when the sweep is off or when the gate rejects the candidate on
    acceptance already (`acceptance`: its decision without throughput; each point is a server start). A sweep's
    result is written to `out`; `baseline`: run_sweep's `earlier`."""
    if not config.sweep.enabled:
        log("sweep: off (sweep.enabled false): production serves the serving section's shape")
    elif not acceptance.promote:
        log("sweep: skipped, the gate rejects the candidate on acceptance alone: "
            + "; ".join(f"{r.rule}: {r.message}" for r in acceptance.reasons))
    else:
        return run_sweep(config, draft, out, log, baseline)
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
    for point in result["points"]:
        if point["error"]:
            lines.append(f"  {point['label']}: FAILED {point['error']}")
        for row in point["levels"]:
            accept = "n/a" if row["accept_length"] is None else f"{row['accept_length']:.3f}"
            speedup = "n/a" if row["speedup"] is None else f"{row['speedup']:.2f}x"
            lost = f", {row['lost_requests']} requests LOST" if row["lost_requests"] else ""
            lines.append(f"  {point['label']} @ {row['concurrency']} concurrent: accept length {accept}, "
                         f"{row['output_tokens_per_s'] or 0:.1f} output tokens/s, speedup {speedup}{lost}")
    chosen = result["chosen"]
    lines.append(f"  chosen: {chosen['label']} ({chosen['output_tokens_per_s']:.1f} output tokens/s at "
                 f"{chosen['concurrency']} concurrent, {chosen['speedup']:.2f}x the no-draft server)")
    return lines
