"""The serving sweep on the micro target: real reference servers on 127.0.0.1, one start per drafting shape, every
concurrency level against the no-draft server; the fastest shape is chosen, the budget skips what would run past
it, and a version records how production serves it."""

import json

import pytest

from drafts import write_draft
from eagle3.resolve import load_config
from eagle3.deployment.production import Production
from eagle3.deployment.promotion import PROMPTS_LAYOUT, benchmark_prompts_file, prompt_set_fields
from eagle3.deployment.sweep import run_sweep
from eagle3.stages.table import record_path
from eagle3.registry.registry import metrics_of, open_registry
from helpers import MICRO_DRAFT, RELEASE, TINY, micro_overrides, write_heldout
from ports import free_port


@pytest.fixture
def sweep_config(tmp_path, micro_target):
    def config(*overrides):
        return load_config(TINY, micro_overrides(tmp_path / "run", micro_target) + [
            f"serving.port={free_port()}", f"serving.log_dir={tmp_path / 'logs'}", "serving.context_length=512",
            f"registry.path={tmp_path / 'registry'}", f"production.state_dir={tmp_path / 'production'}",
            "benchmark.num_prompts=2", "benchmark.max_new_tokens=8", "benchmark.concurrency=[2, 1]",
            "sweep.points=[[2, 2, 4]]", *overrides])

    write_heldout(config())
    return config, write_draft(tmp_path / "export" / "sglang", layout="sglang", release=RELEASE, **MICRO_DRAFT)


def test_the_fastest_shape_at_the_production_concurrency_is_chosen(sweep_config):
    make, draft = sweep_config
    config, lines = make(), []
    result = run_sweep(config, draft, record_path(config, "sweep"), log=lines.append)
    assert [p["label"] for p in result["points"]] == ["steps 3, topk 1, draft tokens 4", "steps 2, topk 2, draft tokens 4"]
    for point in result["points"]:
        assert point["error"] is None and [row["concurrency"] for row in point["levels"]] == [2, 1]
        for row in point["levels"]:
            assert row["speedup"] == row["output_tokens_per_s"] / row["baseline_output_tokens_per_s"]
            assert row["accept_length"] > 1.0 and row["lost_requests"] == 0
    fastest = max(result["points"], key=lambda p: p["levels"][0]["output_tokens_per_s"])
    chosen = result["chosen"]
    assert chosen["label"] == fastest["label"] and chosen["concurrency"] == 2 and chosen["num_prompts"] == 2
    assert json.loads(record_path(config, "sweep").read_text()) == result
    assert any(line.startswith("  chosen: ") for line in lines)


def test_points_past_the_budget_are_skipped_and_named_but_the_serving_shape_is_measured(sweep_config):
    make, draft = sweep_config
    lines = []
    config = make("sweep.budget_s=0.5", "benchmark.concurrency=1")
    result = run_sweep(config, draft, record_path(config, "sweep"), log=lines.append)
    assert [p["label"] for p in result["points"]] == ["steps 3, topk 1, draft tokens 4"]
    assert result["skipped"] == [{"num_steps": 2, "eagle_topk": 2, "num_draft_tokens": 4}]
    assert any("skipped steps 2, topk 2, draft tokens 4" in line and "sweep.budget_s" in line for line in lines)


def test_production_serves_and_remeasures_a_version_as_it_was_chosen(sweep_config):
    """The version's `serving` and `metrics.production`, as eagle3.deployment.promotion.version_fields records the sweep's choice."""
    make, draft = sweep_config
    config = make()
    registry = open_registry(config.registry, log=lambda line: None)
    serving = {"num_steps": 2, "eagle_topk": 2, "num_draft_tokens": 4, "temperature": 0.7, "concurrency": 1,
               "num_prompts": 1}
    production = {"accept_length": 1.9, "speedup": 1.5, "concurrency": 1, "temperature": 0.7,
                  "output_tokens_per_s": 30.0, "baseline_output_tokens_per_s": 20.0}
    prompts = benchmark_prompts_file(config.benchmark, config.run).parent
    registry.publish("v1", {"sglang": draft, PROMPTS_LAYOUT: prompts},
                     {"serving": serving, "benchmark": prompt_set_fields(config.benchmark, config.run),
                      "metrics": {"served": {"accept_length": 2.3}, "production": production}})
    prod = Production(config, registry, lambda line: None)
    served_config, prompts, temperature = prod.measurement("v1")
    assert served_config.serving.shape.label() == "steps 2, topk 2, draft tokens 4" and temperature == 0.7
    assert served_config.benchmark.production_concurrency == 1 and len(prompts) == 1
    # compared with the chosen shape's numbers, not the candidate's greedy chain measurement (2.3)
    assert prod.check("v1", {"accept_length": 1.88}, 0.05) is None
    assert "SHORTFALL" in prod.check("v1", {"accept_length": 1.7}, 0.05)
    assert metrics_of(registry.manifest("v1")).speedup == 1.5
