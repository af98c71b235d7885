"""Serving benchmark on the tiny (or micro) target, CPU: a draft trained quickly by the pipeline itself
(regenerate, capture, vocab, train, export to SGLang 0.5.13's layout), reference servers in-process (no draft,
and the draft in each drafting shape: chains and trees), the benchmark client against them on the held-out
prompts, greedy and sampled, and the offline simulator. Prints per shape the simulated and served accept
length, decode tokens/s and the speedup over no draft, greedy (outputs identical?) and sampled.

    python benchmarks/serve.py [--target tiny|micro] [--steps 120] [--prompts 16] [--max-new-tokens 64]
                               [--concurrency 4] [--temperature 0.7] [--retrain]

The trained run is kept in runs/bench-serve-<target>/ and reused (pass --retrain to train again). The
reference server recomputes the whole sequence at every forward (no KV cache) and serves one request at a
time, so the speedup measures this CPU setup, not what SGLang will do.
"""

from __future__ import annotations

import argparse
import shutil
import time
from functools import partial
from pathlib import Path

import torch

from eagle3.bench.client import run_benchmark
from eagle3.bench.simulate import replay_of, simulate
from eagle3.resolve import load_config
from eagle3.data.capture import capture
from eagle3.data.continuations import continue_suites
from eagle3.data.regenerate import continuing, regenerate
from eagle3.data.vocab import build_vocab
from eagle3.deployment.promotion import run_prompt_ids
from eagle3.deployment.sweep import with_shape
from eagle3.runtime.tiny import MICRO, TINY, build_tiny_target
from eagle3.algorithms.eagle3.checkpoint import convert
from eagle3.serve.inprocess import serve_in_thread
from eagle3.serve.reference import create_app
from eagle3.shape import DraftShape
from eagle3.stages.table import record_path
from eagle3.train.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
RELEASE = "0.5.13"
SIZES = {"tiny": ["target.hidden_size=128", "target.vocab_size=2048", "vocab.draft_vocab_size=1024"],
         "micro": ["target.hidden_size=64", "target.vocab_size=512", "vocab.draft_vocab_size=128"]}


def trained_draft(config, steps: int, log) -> Path:
    """Export of a draft trained by the pipeline (run.dir/export/sglang), built once and then reused."""
    exported = config.stage_dir("export") / "sglang"
    if exported.is_dir():
        log(f"reusing the trained draft at {exported} (--retrain to train again)")
        return exported
    sections = (config.run, config.data, config.target)
    for stage, function in (("regenerate", partial(regenerate, config)),
                            ("suites", partial(continue_suites, continuing(config))),
                            ("capture", partial(capture, *sections, config.training)),
                            ("vocab", partial(build_vocab, *sections, config.vocab))):
        start = time.perf_counter()
        function(log=lambda line: None)
        log(f"{stage}: {time.perf_counter() - start:.0f} s")
    start = time.perf_counter()
    Trainer(config, log=lambda line: None).run()
    log(f"train: {steps} steps in {time.perf_counter() - start:.0f} s")
    return convert(config.stage_dir("train") / "best", exported, to="sglang", release=RELEASE)


SHAPES = [DraftShape(1), DraftShape(3), DraftShape(3, 4, 8), DraftShape(5, 4, 16)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=("tiny", "micro"), default="tiny")
    parser.add_argument("--steps", type=int, default=120, help="training steps of the quick draft")
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts to benchmark")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.7, help="the sampled run's temperature")
    parser.add_argument("--retrain", action="store_true", help="train the draft again")
    args = parser.parse_args()
    target = build_tiny_target(ROOT / "runs" / "targets" / args.target, MICRO if args.target == "micro" else TINY)
    run_dir = ROOT / "runs" / f"bench-serve-{args.target}"
    if args.retrain:
        shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [f"run.dir={run_dir}", f"target.path={target}", *SIZES[args.target], "data.num_samples=128",
                 "data.max_new_tokens=64", "data.max_length=160", f"training.max_steps={args.steps}",
                 "training.batch_size=8", "training.seq_len=160", "training.warmup_steps=10",
                 f"training.eval_every={max(args.steps // 3, 1)}", "training.save_every=1000",
                 f"benchmark.num_prompts={args.prompts}", f"benchmark.max_new_tokens={args.max_new_tokens}",
                 f"serving.release={RELEASE}",
                 # the held-out greedy continuations run as far past max_new_tokens as the deepest shape drafts
                 f"serving.num_steps={max(shape.num_steps for shape in SHAPES)}"]
    config = load_config(ROOT / "configs" / "tiny-cpu.yaml", overrides)
    draft = trained_draft(config, args.steps, print)
    prompts = run_prompt_ids(config.benchmark, config.data, config.run, config.target)
    print(f"{args.target} target, draft {draft}, {len(prompts)} held-out prompts, max_new_tokens "
          f"{args.max_new_tokens}, {args.concurrency} concurrent, torch threads {torch.get_num_threads()}")
    print(f"{'shape':34} {'sim':>6} {'greedy':>7} {'tok/s':>7} {'speedup':>8} {'same':>5} | "
          f"{'T=' + str(args.temperature):>7} {'tok/s':>7} {'speedup':>8}")
    run = lambda url, base, temperature: run_benchmark(  # noqa: E731
        url, prompts, args.max_new_tokens, args.concurrency, timeout_s=600, retries=2, baseline_url=base,
        log=lambda line: None, temperature=temperature)
    with serve_in_thread(create_app(target)) as (plain, _):
        for shape in SHAPES:
            shaped = with_shape(config, shape)
            simulated = simulate(replay_of(shaped), draft, record_path(shaped, "simulated"), log=lambda line: None)
            with serve_in_thread(create_app(target, draft, shape, RELEASE)) as (url, _):
                greedy, sampled = run(url, plain, 0.0), run(url, plain, args.temperature)
            print(f"{shape.label():34} {simulated.accept_length:6.3f} {greedy['accept_length']:7.3f} "
                  f"{greedy['output_tokens_per_s']:7.1f} {greedy['speedup']:7.2f}x {str(greedy['mismatches'] == 0):>5} | "
                  f"{sampled['accept_length']:7.3f} {sampled['output_tokens_per_s']:7.1f} {sampled['speedup']:7.2f}x")


if __name__ == "__main__":
    main()
