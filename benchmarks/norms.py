"""Accept length with and without each EAGLE 3.1 norm (draft.fc_norm, draft.norm_before_fc, draft.norm_output), on
the same rows, vocab map and steps.

    python benchmarks/norms.py [--config configs/tiny-cpu.yaml] [--steps 400] [--samples 512]
                               [--variants plain,fc_norm,...] [--run-dir runs/norms-tiny]

The data stage runs once (cached on re-runs, as in benchmarks/vs_specforge.py, whose helpers this uses): features
stored, so every variant trains on the very same batches. Each variant trains from scratch with one thread, then its
final draft is exported to the sglang layout for the config's serving.release and replayed by the simulator over the
config's benchmark suites, at serving's shape and the sweep's points. Prints accept length per suite and shape per
variant, its ratio to the plain draft, and the median step time. Figures: RUN_DIR/results.json; docs/training.md.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch loads

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_specforge import ROOT, export_draft, prepare_data, score, train_ours, training_plan  # noqa: E402

VARIANTS = {
    "plain": [],
    "fc_norm": ["draft.fc_norm=true"],
    "norm_before_fc": ["draft.norm_before_fc=true"],
    "norm_output": ["draft.norm_output=true"],
    "all": ["draft.fc_norm=true", "draft.norm_before_fc=true", "draft.norm_output=true"],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "tiny-cpu.yaml")
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps, every variant")
    parser.add_argument("--samples", type=int, default=None, help="data.num_samples (default: the config's)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"a comma list of {', '.join(VARIANTS)}")
    parser.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "norms-tiny")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = args.variants.split(",")
    if unknown := [name for name in names if name not in VARIANTS]:
        parser.error(f"--variants: unknown {', '.join(unknown)} (known: {', '.join(VARIANTS)})")
    shared = config_for(args, [])
    prepare_data(shared)
    plan = training_plan(shared)
    results = {"config": str(args.config), "steps": args.steps, "batch_size": shared.training.batch_size,
               "seq_len": shared.training.seq_len, "release": shared.serving.release, "variants": {}}
    for name in names:
        config = config_for(args, VARIANTS[name], variant=name)
        print(f"norms: training {name} ({' '.join(VARIANTS[name]) or 'no norm'}), {args.steps} steps")
        trained = train_ours(config, plan, None)
        draft = export_draft(config, trained["final"], args.run_dir / "drafts" / name)
        results["variants"][name] = {"overrides": VARIANTS[name], "median_step_time_s": trained["median_step_time_s"],
                                     "final_step": trained["final_step"], "accept_length": score(config, draft)}
        (args.run_dir / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    for line in table(results):
        print(line)
    print(f"norms: figures in {args.run_dir / 'results.json'}")
    return 0


def config_for(args: argparse.Namespace, norms: list[str], variant: str | None = None):
    """The config at this comparison's size; a variant trains in its own run directory beside the shared data."""
    from eagle3.resolve import load_config

    run = args.run_dir / "run"
    overrides = [f"run.dir={run}", "training.features=offline", f"training.max_steps={args.steps}",
                 f"training.eval_every={args.steps}", f"training.save_every={args.steps}", "training.best_by=step_acc"]
    if args.samples:
        overrides.append(f"data.num_samples={args.samples}")
    if variant is not None:
        own = args.run_dir / variant
        own.mkdir(parents=True, exist_ok=True)
        for stage in ("data", "vocab"):
            link = own / stage
            if not link.exists():
                link.symlink_to((run / stage).resolve())
        shutil.rmtree(own / "train", ignore_errors=True)
        overrides.append(f"run.dir={own}")
    return load_config(args.config, [*overrides, *args.overrides, *norms])


def table(results: dict) -> list[str]:
    variants = results["variants"]
    plain = variants.get("plain", {}).get("accept_length")
    lines = [f"accept length, simulated ({results['steps']} steps of {results['batch_size']} x {results['seq_len']} "
             f"tokens, SGLang {results['release']})",
             f"  {'variant':15} {'shape':8} {'suite':9} {'accept':>7} {'vs plain':>9} {'step s':>7}"]
    for name, figures in variants.items():
        for shape, suites in figures["accept_length"].items():
            for suite, row in suites.items():
                ratio = f"{row['accept_length'] / plain[shape][suite]['accept_length']:8.3f}x" if plain else ""
                lines.append(f"  {name:15} {shape:8} {suite:9} {row['accept_length']:7.3f} {ratio:>9} "
                             f"{figures['median_step_time_s']:7.3f}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
