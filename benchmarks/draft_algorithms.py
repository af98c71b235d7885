"""EAGLE-3 against DFlash on one run's data: each trained by the real trainer for the same steps on the same
regenerated and captured samples, then replayed over the same held-out greedy sequences by the trainer's evaluation.

Per variant: trainable parameters, seconds per training step, the best evaluation accept length (completion tokens /
verify steps, as the served release counts them), the draft forwards one verify step costs (EAGLE-3: one per chained
step; DFlash: one per block) and the tokens each draft forward yields (accept length / forwards).

    python benchmarks/draft_algorithms.py RUN_DIR [--config configs/tiny-cpu.yaml] [--steps 400] [--only NAME ...]

RUN_DIR holds a finished data stage and vocab map for the config (`eagle3 run`, or `eagle3 data regenerate`, `data
capture`, `vocab build`); each variant trains in RUN_DIR/algorithms/NAME, which links them.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from eagle3.resolve import load_config
from eagle3.train.trainer import Trainer

PAD = 5  # the tiny target's <|pad|>: never generated
DFLASH = ["draft.algorithm=dflash", f"draft.dflash.mask_token_id={PAD}", "sweep.points=[]"]  # its shapes: chains
# name -> (overrides, draft forwards per verify step)
VARIANTS = {
    "eagle3-chain3": ([], 3),
    "dflash5-block4": (DFLASH + ["draft.dflash.block_size=4"], 1),
    "dflash1-block4": (DFLASH + ["draft.dflash.block_size=4", "draft.dflash.num_layers=1"], 1),
    "dflash2-block4": (DFLASH + ["draft.dflash.block_size=4", "draft.dflash.num_layers=2"], 1),
    "eagle3-chain7": (["training.ttt_steps=7", "serving.num_steps=7", "serving.num_draft_tokens=8",
                       "benchmark.max_new_tokens=56"], 7),
    "dflash5-block8": (DFLASH + ["draft.dflash.block_size=8", "serving.num_steps=7", "serving.num_draft_tokens=8",
                                 "benchmark.max_new_tokens=56"], 1),
}


def train_variant(config_path: str, run_dir: Path, name: str, overrides: list[str], steps: int) -> dict:
    directory = run_dir / "algorithms" / name
    directory.mkdir(parents=True, exist_ok=True)
    for stage in ("data", "vocab"):
        if not (directory / stage).exists():
            os.symlink(run_dir / stage, directory / stage)
    config = load_config(config_path, overrides + [f"run.dir={directory}", f"training.max_steps={steps}",
                                                   f"training.eval_every={max(1, steps // 4)}"])
    trainer = Trainer(config, log=lambda line: None)
    params = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    started = time.perf_counter()
    trainer.run()
    seconds = time.perf_counter() - started
    rows = [json.loads(line) for line in (directory / "train" / "metrics.jsonl").read_text().splitlines()]
    step_time = [row["step_time_s"] for row in rows if "step_time_s" in row]
    evals = [row["eval_accept_length"] for row in rows if "eval_accept_length" in row]
    return {"params": params, "seconds": seconds, "step_s": sum(step_time) / len(step_time), "accept": max(evals)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--config", default="configs/tiny-cpu.yaml")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--only", nargs="*", choices=list(VARIANTS), default=list(VARIANTS))
    args = parser.parse_args()
    print(f"{'variant':16} {'params':>8} {'s/step':>7} {'train s':>8} {'accept length':>14} {'forwards/verify':>16} "
          f"{'tokens/forward':>15}")
    for name in args.only:
        overrides, forwards = VARIANTS[name]
        figures = train_variant(args.config, args.run_dir.resolve(), name, overrides, args.steps)
        print(f"{name:16} {figures['params'] / 1e6:7.2f}M {figures['step_s']:7.3f} {figures['seconds']:8.0f} "
              f"{figures['accept']:14.3f} "
              f"{forwards:16d} {figures['accept'] / forwards:15.3f}", flush=True)


if __name__ == "__main__":
    main()
