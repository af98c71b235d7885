"""Online vs offline training on the tiny target: tokens/s and hidden-state bytes written per token.

Offline = capture (the target's features of every sample, streamed into bf16 shards) + training reading them back.
Online  = token shards + training that runs the target's forward for each batch. Both end with the same number of
training steps over the same regenerated data; the held-out features the simulator needs are made in both and are
not counted here. One torch thread (docs/pipeline.md: a second thread only waits on a shared 2-core machine).

    python benchmarks/features.py [--target runs/targets/tiny] [--steps 60] [--samples 256]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from eagle3.resolve import load_config
from eagle3.data.capture import capture, dataset_dir
from eagle3.data.regenerate import regenerate
from eagle3.data.vocab import build_vocab
from eagle3.runtime.tiny import TINY, build_tiny_target
from eagle3.records.manifest import read_manifest
from eagle3.train.trainer import Trainer

CONFIG = Path(__file__).parent.parent / "configs" / "tiny-cpu.yaml"
QUIET = lambda line: None  # noqa: E731


def bytes_under(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*.safetensors")) if directory.exists() else 0


def measure(mode: str, base: list[str], regen_from: Path, run_dir: Path) -> dict:
    """Capture and train one mode in `run_dir`, the regenerated answers copied in (regeneration is not timed)."""
    shutil.copytree(regen_from / "data", run_dir / "data")
    config = load_config(CONFIG, base + [f"run.dir={run_dir}", f"training.features={mode}"])
    build_vocab(config.run, config.data, config.target, config.vocab, log=QUIET)
    started = time.perf_counter()
    capture(config.run, config.data, config.target, config.training, log=QUIET)
    captured = time.perf_counter()
    trainer = Trainer(config, log=QUIET)
    trainer.run()
    trained = time.perf_counter()
    manifest = read_manifest(dataset_dir(config.run, config.training))
    hidden = bytes_under(config.stage_dir("data") / "hidden")
    return {"mode": mode, "capture_s": captured - started, "train_s": trained - captured,
            "tokens": stepped_tokens(trainer, config.training.max_steps), "hidden_bytes": hidden,
            "hidden_bytes_per_token": hidden / manifest["tokens"], "data_tokens": manifest["tokens"]}


def stepped_tokens(trainer: Trainer, steps: int) -> int:
    """The real tokens of the batches the trainer stepped over, in its own order."""
    total, epoch = 0, 0
    while steps > 0:
        batches = trainer.data.batches(epoch, trainer.config.training.batch_size, trainer.config.training.seed)[:steps]
        total += sum(ref.length for batch in batches for ref in batch)
        steps, epoch = steps - len(batches), epoch + 1
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="runs/targets/tiny")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--samples", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not (Path(args.target) / "config.json").is_file():
        build_tiny_target(args.target, TINY)
    work = Path(tempfile.mkdtemp(prefix="eagle3-features-"))
    base = [f"target.path={args.target}", f"data.num_samples={args.samples}", f"training.max_steps={args.steps}",
            "training.eval_every=100000", "training.save_every=100000", "benchmark.num_prompts=8"]
    try:
        regen = work / "regen"
        regenerate(load_config(CONFIG, base + [f"run.dir={regen}"]), log=QUIET)
        results = [measure(mode, base, regen, work / mode) for mode in ("offline", "online")]
    finally:
        shutil.rmtree(work)
    print(f"tiny target ({args.target}), {args.samples} samples, {args.steps} training steps, one torch thread")
    for r in results:
        total = r["capture_s"] + r["train_s"]
        print(f"  {r['mode']:<8} capture {r['capture_s']:6.2f} s  train {r['train_s']:6.2f} s  "
              f"{r['tokens'] / total:8.0f} trained tokens/s (capture + train)  hidden states written: "
              f"{r['hidden_bytes']:,} bytes ({r['hidden_bytes_per_token']:.0f} per token of {r['data_tokens']:,})")
    offline, online = results
    ratio = (online["capture_s"] + online["train_s"]) / (offline["capture_s"] + offline["train_s"])
    print(f"  online / offline wall time (capture + train): {ratio:.2f}x")


if __name__ == "__main__":
    main()
