"""The table the field publishes: benchmark suites as rows, drafting shapes (steps/topk/draft tokens) as columns
(accept length, accept rate; output tokens/s per served column), for the simulated shapes, the served shape, every
sweep point and production's draft on the same requests. Written to run.dir/bench/suites.json; eagle3/report.py
renders it."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from eagle3.config.serving import BenchmarkSection, ServingSection
from eagle3.fsutil import atomic_write_json



def column(name: str, suites: dict | None, output_tokens_per_s: float | None = None) -> dict:
    return {"name": name, "suites": suites or {}, "output_tokens_per_s": output_tokens_per_s}


def steps_topk_tokens(shape: dict) -> str:
    """A drafting shape as published figures name it: steps/topk/draft tokens, e.g. 3/1/4."""
    return f"{shape['num_steps']}/{shape['eagle_topk']}/{shape['num_draft_tokens']}"


def acceptance_columns(serving: ServingSection, simulated: dict, served: dict) -> list[dict]:
    """Every simulated shape (serving's first), then the served shape."""
    columns = [column(f"{steps_topk_tokens(shape)} simulated", shape["suites"]) for shape in simulated.get("shapes", [])]
    return columns + [column(f"{steps_topk_tokens(asdict(serving.shape))} served", served.get("suites"),
                             served.get("output_tokens_per_s"))]


def suite_columns(serving: ServingSection, simulated: dict, served: dict, swept: dict,
                  production: tuple[str, dict] | None) -> list[dict]:
    """acceptance_columns, each sweep point at the production concurrency, and production's draft (`production`:
    (version, its measurement on these requests))."""
    columns = acceptance_columns(serving, simulated, served)
    sampled = f", temperature {swept['temperature']:g}" if swept.get("temperature") else ""  # the others are greedy
    for point in swept.get("points") or []:
        if point["levels"]:
            row = point["levels"][0]
            columns.append(column(f"{steps_topk_tokens(point['shape'])} served @ {row['concurrency']}{sampled}",
                                  row.get("suites"), row["output_tokens_per_s"]))
    if production is not None:
        version, measured = production
        columns.append(column(f"production {version}", measured.get("suites"), measured.get("output_tokens_per_s")))
    return columns


def production_on_these_requests(served: dict, manifest: dict | None, version: str | None) -> tuple[str, dict] | None:
    """Production's figures on the run's requests: re-measured on them by measure-candidate, or recorded with the
    version when it was measured on the same requests (every suite's sha256 agrees)."""
    here = served.get("production_on_run_prompts") or {}
    if version is not None and here.get("version") == version and here.get("suites"):
        return version, here
    recorded = ((manifest or {}).get("metrics") or {}).get("served") or {}
    mine = {name: f.get("sha256") for name, f in (served.get("suites") or {}).items()}
    theirs = {name: f.get("sha256") for name, f in (recorded.get("suites") or {}).items()}
    return (version, recorded) if version is not None and mine and mine == theirs else None


def write_suites(benchmark: BenchmarkSection, columns: list[dict], out: Path) -> Path:
    atomic_write_json(out, {"max_new_tokens": benchmark.max_new_tokens, "columns": columns})
    return out
