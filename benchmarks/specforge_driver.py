"""SpecForge 0.2.0's EAGLE-3 trainer, driven on the CPU for benchmarks/vs_specforge.py.

Run by that script with the python of SpecForge's own venv (never the project's): it imports only SpecForge, torch
and the standard library, never eagle3. What it runs is SpecForge's own code, assembled as its trainer assembles it
(specforge/training/trainer.py and algorithms/model_providers.py):
- its `Config` schema, every field it does not set at SpecForge's default;
- the draft config generated from the target (`resolve_draft_config`), the draft built by `build_eagle3_draft` (the
  target's embedding loaded and frozen, the vocab map loaded from `model.vocab_mapping_path`);
- `OnlineEagle3Model` (its TTT loop), `Eagle3TrainStrategy` (its 0.8**k step weights), `TrainerCore` over
  `FSDPTrainingBackend` with its optimizer factory (`BF16Optimizer`: AdamW on float32 masters, clipping, warmup
  and cosine);
- each step's batch from its offline sample files through its own `normalize_offline_sample` and
  `DataCollatorWithPadding`.

Where the CPU needs it, and only there, it differs (each said in the job's output):
- the loss: its Triton kernel (`LogSoftmaxLoss`) needs a GPU; the wheel's own torch form of the same loss
  (`specforge.core.loss._compute_loss`, the same value) takes its place;
- the target head: `TargetHead.from_pretrained` wants a `*.index.json` and an `lm_head.weight`; SmolLM2's head is
  tied to its embedding in one model.safetensors, so the head is built as that class and given the embedding;
  float32 (it casts to bf16 for the GPU), as the project's teacher on the CPU;
- no FSDP wrap (one process; its bf16 mixed precision is a GPU setting): `prepare_model(wrap=False)`.

The draft is saved twice: SpecForge's checkpoint (`training_state.pt` with `draft_state_dict`, as
`TrainerController.save_checkpoint` writes it) and the serving directory its SGLang exporter writes (`_serving_state`,
`save_pretrained`, `apply_legacy_rope_scaling`) from the float32 weights as trained (its exporter rebuilds the draft
in bf16 first; float32 keeps precision out of the comparison).

    <specforge-venv>/bin/python benchmarks/specforge_driver.py JOB.json [--lockstep]

With --lockstep each step waits for a line on stdin and answers one on stdout when done (its log goes to stderr):
vs_specforge.py runs it a step after each of its own trainer's, so a drift of the machine's speed falls on both.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

WARMUP_STEPS = 5  # left out of the median step time (first calls, allocator growth)


def specforge_config(job: dict):
    from specforge.config.schema import Config

    return Config.model_validate({
        "model": {"target_model_path": job["target"], "vocab_mapping_path": job["vocab_mapping"],
                  "torch_dtype": "float32"},
        "data": {"hidden_states_path": job["samples_dir"], "max_length": job["max_length"]},
        "training": {"max_steps": len(job["steps"]), "batch_size": job["batch_size"],
                     "learning_rate": job["learning_rate"], "warmup_ratio": job["warmup_ratio"],
                     "ttt_length": job["ttt_length"], "attention_backend": "sdpa",
                     **job.get("training_overrides", {})},
        "output_dir": job["out"],
    })


def tied_target_head(target: str):
    """SpecForge's TargetHead holding the target's tied head (its embedding), float32."""
    from safetensors import safe_open
    from specforge.modeling.target.target_head import TargetHead

    head = TargetHead(target)
    with safe_open(os.path.join(target, "model.safetensors"), framework="pt") as weights:
        head.fc.weight.data.copy_(weights.get_tensor("model.embed_tokens.weight"))
    head.freeze_weights()
    return head.eval().float()


def use_torch_loss() -> None:
    """The wheel's torch form of its loss in place of the Triton kernel (no GPU here)."""
    import specforge.algorithms.eagle3.model as eagle3_model
    from specforge.core.loss import _compute_loss

    class TorchLogSoftmaxLoss:
        apply = staticmethod(_compute_loss)  # -(mask * p * log_softmax(z)).sum(-1).mean() over B x T, as the kernel

    eagle3_model.LogSoftmaxLoss = TorchLogSoftmaxLoss


def build(job: dict):
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.algorithms.eagle3.providers import algorithm_providers
    from specforge.algorithms.model_providers import build_eagle3_draft, eagle3_strategy_kwargs
    from specforge.training.assembly import _optimizer_factory
    from specforge.training.backend import FSDPTrainingBackend, ParallelConfig
    from specforge.training.controller import TrainerCore
    from specforge.training.model_loading import resolve_draft_config
    from specforge.training.strategies.base import Eagle3TrainStrategy

    cfg = specforge_config(job)
    torch.manual_seed(cfg.training.seed)
    draft_config = resolve_draft_config(cfg, provider=algorithm_providers().model.draft_config)
    draft_config.draft_vocab_size = job["draft_vocab_size"]  # the shared vocab map's size (its default: 32,000)
    draft = build_eagle3_draft(cfg, draft_config)
    model = OnlineEagle3Model(draft, length=cfg.training.ttt_length, attention_backend=cfg.training.attention_backend,
                              lk_loss_type=cfg.training.lk_loss_type, kl_scale=cfg.training.kl_scale,
                              kl_decay=cfg.training.kl_decay).float()
    backend = FSDPTrainingBackend(ParallelConfig(param_dtype=torch.float32), optimizer_factory=_optimizer_factory(cfg))
    wrapped = backend.prepare_model(model, wrap=False, optimizer_target=model.draft_model)
    strategy = Eagle3TrainStrategy(wrapped, target_head=tied_target_head(job["target"]), **eagle3_strategy_kwargs(cfg))
    return cfg, model, backend, strategy, TrainerCore(strategy, backend)


def load_batch(files: list[str], max_length: int, collate):
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.runtime.contracts import TrainBatch
    from specforge.runtime.data_plane.feature_store import load_feature_file

    rows = [normalize_offline_sample(load_feature_file(path), max_len=max_length) for path in files]
    ids = [os.path.splitext(os.path.basename(path))[0] for path in files]
    return TrainBatch(sample_ids=ids, strategy="eagle3", tensors=collate(rows), metadata={"target_repr": "hidden_state"})


def train(job: dict, core, log, lockstep: bool) -> list[dict]:
    from specforge.data.utils import DataCollatorWithPadding

    collate = DataCollatorWithPadding()
    records = []
    with open(os.path.join(job["out"], "metrics.jsonl"), "w") as metrics:
        for step, files in enumerate(job["steps"], start=1):
            if lockstep and not sys.stdin.readline():
                raise SystemExit(f"specforge: told to stop before step {step}")
            lr = core.backend.optimizer.get_learning_rate()  # the rate this step uses
            start, cpu = time.perf_counter(), time.process_time()
            batch = load_batch(files, job["max_length"], collate)
            loaded = time.perf_counter()
            result = core.train_step(batch)
            done, cpu = time.perf_counter(), time.process_time() - cpu
            record = {"step": step, "step_time_s": round(done - start, 4), "step_cpu_s": round(cpu, 4),
                      "load_time_s": round(loaded - start, 4), "lr": lr,
                      **{k: round(float(v), 5) for k, v in result.metrics.items() if isinstance(v, (int, float))}}
            metrics.write(json.dumps(record) + "\n")
            records.append(record)
            if lockstep:
                print(step, flush=True)
            if step == 1 or step % 25 == 0 or step == len(job["steps"]):
                log(f"specforge: step {step}/{len(job['steps'])} {json.dumps(record)}")
    return records


def save(job: dict, model, strategy) -> None:
    """SpecForge's checkpoint and its SGLang serving directory (float32, as trained)."""
    from specforge.export.checkpoint_io import STATE_FILE, apply_legacy_rope_scaling
    from specforge.export.to_sglang import WEIGHT_MAPS, _serving_state

    checkpoint = os.path.join(job["out"], "checkpoint")
    os.makedirs(checkpoint, exist_ok=True)
    state = {"draft_state_dict": strategy.checkpoint_state_filter(model.state_dict()), "strategy": strategy.name,
             "global_step": len(job["steps"])}
    torch.save(state, os.path.join(checkpoint, STATE_FILE))
    draft = model.draft_model
    full = {k: v for k, v in draft.state_dict().items() if "embed" not in k.lower()}
    serving = _serving_state(full, WEIGHT_MAPS[type(draft).__name__])
    draft.save_pretrained(os.path.join(job["out"], "sglang"), state_dict=serving)
    apply_legacy_rope_scaling(os.path.join(job["out"], "sglang"))


def settings(cfg, backend) -> dict:
    """What this run trained with, read from SpecForge's objects (its defaults where the job set nothing)."""
    optimizer = backend.optimizer
    group = optimizer.optimizer.param_groups[0]
    scheduler = optimizer.scheduler
    return {"learning_rate": cfg.training.learning_rate, "lr_scheduler": cfg.training.lr_scheduler,
            "warmup_steps": scheduler.warmup_epochs, "total_steps": scheduler.after_scheduler.T_max + scheduler.warmup_epochs,
            "lr_floor": scheduler.after_scheduler.eta_min, "adam_betas": list(group["betas"]),
            "weight_decay": group["weight_decay"], "max_grad_norm": optimizer.max_grad_norm,
            "ttt_length": cfg.training.ttt_length, "ploss_decay": 0.8, "attention_backend": cfg.training.attention_backend,
            "specforge_defaults": {"learning_rate": type(cfg.training).model_fields["learning_rate"].default,
                                   "warmup_ratio": type(cfg.training).model_fields["warmup_ratio"].default,
                                   "max_grad_norm": type(cfg.training).model_fields["max_grad_norm"].default,
                                   "ttt_length": type(cfg.training).model_fields["ttt_length"].default,
                                   "attention_backend": type(cfg.training).model_fields["attention_backend"].default}}


def main(job_path: str, lockstep: bool) -> int:
    with open(job_path) as f:
        job = json.load(f)
    torch.set_num_threads(1)
    os.makedirs(job["out"], exist_ok=True)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731  (stdout: the lockstep's answers)
    use_torch_loss()
    load = os.getloadavg()[0]
    cfg, model, backend, strategy, core = build(job)
    records = train(job, core, log, lockstep)
    save(job, model, strategy)
    timed = records[WARMUP_STEPS:] or records
    summary = {"steps": len(records), "median_step_time_s": statistics.median(r["step_time_s"] for r in timed),
               "median_step_cpu_s": statistics.median(r["step_cpu_s"] for r in timed),
               "median_load_time_s": statistics.median(r["load_time_s"] for r in timed),
               "final": records[-1], "settings": settings(cfg, backend), "torch": torch.__version__,
               "load_average_at_start": load,
               "threads": torch.get_num_threads(), "cpu_only_changes": ["loss: torch form of the Triton kernel",
               "target head: tied embedding, float32", "no FSDP wrap (one process)"]}
    with open(os.path.join(job["out"], "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    log(f"specforge: {len(records)} steps, median step {summary['median_step_time_s']:.3f} s; draft at "
        f"{os.path.join(job['out'], 'sglang')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], "--lockstep" in sys.argv[2:]))
