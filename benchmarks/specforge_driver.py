"""SpecForge 0.2.0's EAGLE-3, DFlash or DSpark trainer (the job's "strategy"), driven on the CPU for
benchmarks/vs_specforge.py.

Run by that script with the python of SpecForge's own venv (never the project's): it imports only SpecForge, torch
and the standard library, never eagle3. What it runs is SpecForge's own code, assembled as its trainer assembles it
(specforge/training/trainer.py and algorithms/model_providers.py):
- its `Config` schema, every field it does not set at SpecForge's default;
- the draft config generated from the target (`resolve_draft_config`), with the job's overrides;
- EAGLE-3: the draft built by `build_eagle3_draft` (the target's embedding loaded and frozen, the vocab map loaded
  from `model.vocab_mapping_path`), `OnlineEagle3Model` (its TTT loop), `Eagle3TrainStrategy` (its 0.8**k step
  weights);
- DFlash: the draft built by `build_dflash_draft` (`DFlashDraftModel`, the job's layers, block size and target layer
  ids), `build_dflash_model` (`OnlineDFlashModel`: random anchors, a block of the anchor's token and mask tokens, the
  target's embedding and head frozen, cross-entropy on the true tokens weighted exp(-(k-1)/loss_decay_gamma)),
  `DFlashTrainStrategy`;
- DSpark: its provider needs a draft config file (it generates none from the target): DFlash's, generated from the
  target as above, named `DSparkDraftModel` with the job's heads in its `dflash_config` (markov_rank, markov_head_type,
  enable_confidence_head, confidence_head_with_markov), read back through `model.draft_model_config`; the draft built
  by its provider's `build_draft` (`DSparkDraftModel`), `build_training_model` (`OnlineDSparkModel`: DFlash's anchors
  and blocks, every entry predicting x_{a+1+k}, the Markov bias fed the true previous tokens, CE + L1 against the
  target head's distribution at `target_last_hidden_states` + the confidence BCE, weighted exp(-k/loss_decay_gamma)),
  `DSparkTrainStrategy`;
- `TrainerCore` over `FSDPTrainingBackend` with its optimizer factory (`BF16Optimizer`: AdamW on float32 masters,
  clipping, warmup and cosine);
- each step's batch from its offline sample files through its own normalizer and collator for the strategy (DFlash:
  the samples its data filter keeps, those with two adjacent supervised tokens; a step left without one is skipped,
  as its loader never makes such a batch).

Where the CPU needs it, and only there, it differs (each said in the job's output):
- the EAGLE-3 loss: its Triton kernel (`LogSoftmaxLoss`) needs a GPU; the wheel's own torch form of the same loss
  (`specforge.core.loss._compute_loss`, the same value) takes its place;
- the EAGLE-3 target head: `TargetHead.from_pretrained` wants a `*.index.json` and an `lm_head.weight`; SmolLM2's head
  is tied to its embedding in one model.safetensors, so the head is built as that class and given the embedding;
  float32 (it casts to bf16 for the GPU), as the project's teacher on the CPU (DFlash's `TargetEmbeddingsAndHead`
  reads the tied tensor itself);
- attention: sdpa (its DFlash default, flex attention, compiles kernels for a GPU);
- no FSDP wrap (one process; its bf16 mixed precision is a GPU setting): `prepare_model(wrap=False)`.

The draft is saved twice: SpecForge's checkpoint (`training_state.pt` with `draft_state_dict`, as
`TrainerController.save_checkpoint` writes it) and the directory it serves from, from the float32 weights as trained
(its exporters rebuild the draft in bf16 first; float32 keeps precision out of the comparison): EAGLE-3's as its
SGLang exporter writes it (`_serving_state`, `save_pretrained`, `apply_legacy_rope_scaling`), DFlash's as its HF
exporter does (`save_pretrained` of the draft's own tensors: SGLang's `DFlashDraftModel` reads that directory).

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
    """SpecForge's Config: the job's shared settings, and its strategy's own (`model` and `training` fields)."""
    from specforge.config.schema import Config

    return Config.model_validate({
        "model": {"target_model_path": job["target"], "torch_dtype": "float32", **job["model"]},
        "data": {"hidden_states_path": job["samples_dir"], "max_length": job["max_length"]},
        "training": {"strategy": job["strategy"], "max_steps": len(job["steps"]), "batch_size": job["batch_size"],
                     "learning_rate": job["learning_rate"], "warmup_ratio": job["warmup_ratio"],
                     "attention_backend": "sdpa", **job["training"]},
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
    """SpecForge's config, training model, backend, strategy and TrainerCore for the job's strategy."""
    from specforge.training.assembly import _optimizer_factory
    from specforge.training.backend import FSDPTrainingBackend, ParallelConfig
    from specforge.training.controller import TrainerCore

    if job["strategy"] == "dspark":
        job = {**job, "model": {**job["model"], "draft_model_config": dspark_draft_config(job)}}
    cfg = specforge_config(job)
    torch.manual_seed(cfg.training.seed)
    builders = {"dflash": build_dflash, "dspark": build_dspark, "eagle3": build_eagle3}
    model = builders[job["strategy"]](cfg, job)
    backend = FSDPTrainingBackend(ParallelConfig(param_dtype=torch.float32), optimizer_factory=_optimizer_factory(cfg))
    wrapped = backend.prepare_model(model, wrap=False, optimizer_target=model.draft_model)
    strategy = strategy_for(cfg, job, wrapped)
    return cfg, model, backend, strategy, TrainerCore(strategy, backend)


def build_eagle3(cfg, job: dict):
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.algorithms.eagle3.providers import algorithm_providers
    from specforge.algorithms.model_providers import build_eagle3_draft
    from specforge.training.model_loading import resolve_draft_config

    use_torch_loss()
    draft_config = resolve_draft_config(cfg, provider=algorithm_providers().model.draft_config)
    draft_config.draft_vocab_size = job["draft_vocab_size"]  # the shared vocab map's size (its default: 32,000)
    draft = build_eagle3_draft(cfg, draft_config)
    return OnlineEagle3Model(draft, length=cfg.training.ttt_length, attention_backend=cfg.training.attention_backend,
                             lk_loss_type=cfg.training.lk_loss_type, kl_scale=cfg.training.kl_scale,
                             kl_decay=cfg.training.kl_decay).float()


def build_dflash(cfg, job: dict):
    """The DFlash draft at the job's layers, block size and target layer ids (SpecForge's generated default spreads
    the ids over the target; the job's are the layers the shared features were captured at)."""
    from specforge.algorithms.dflash.providers import algorithm_providers
    from specforge.algorithms.model_providers import build_dflash_draft, build_dflash_model
    from specforge.training.model_loading import resolve_draft_config

    draft_config = resolve_draft_config(cfg, provider=algorithm_providers().model.draft_config)
    draft_config.dflash_config = {**draft_config.dflash_config, "target_layer_ids": job["target_layer_ids"]}
    draft = build_dflash_draft(cfg, draft_config, None)
    # the mask token comes from model.mask_token_id before any tokenizer fallback: none is read
    return build_dflash_model(cfg, draft, draft_config, None, None).model.float()


def dspark_draft_config(job: dict) -> str:
    """The DSpark draft config file SpecForge's DSpark provider reads (`model.draft_model_config`; it generates none):
    the DFlash config its DFlash provider generates from the target at the job's layers and block (the same Qwen3
    backbone), as `DSparkDraftModel`, with the job's target layer ids and heads in `dflash_config`."""
    from specforge.algorithms.dflash.providers import algorithm_providers
    from specforge.training.model_loading import resolve_draft_config

    generated = resolve_draft_config(specforge_config(job), provider=algorithm_providers().model.draft_config).to_dict()
    generated["architectures"] = ["DSparkDraftModel"]
    generated["dflash_config"] = {**generated["dflash_config"], "target_layer_ids": job["target_layer_ids"],
                                  **job["dspark_heads"]}
    path = os.path.join(os.path.dirname(job["out"]), "draft_config.json")
    with open(path, "w") as f:
        json.dump(generated, f, indent=2)
    return path


def build_dspark(cfg, job: dict):
    """The DSpark draft and its training model through its algorithm's providers, as its trainer builds them."""
    from specforge.algorithms.dspark.providers import algorithm_providers
    from specforge.training.model_loading import resolve_draft_config

    providers = algorithm_providers().model
    draft_config = resolve_draft_config(cfg, provider=providers.draft_config)
    draft = providers.build_draft(cfg, draft_config)
    heads = {"markov_rank": draft.markov_head.markov_rank, "markov_head_type": draft.markov_head.markov_head_type,
             "enable_confidence_head": draft.confidence_head is not None,
             "confidence_head_with_markov": draft.confidence_head_with_markov}
    if heads != job["dspark_heads"]:  # the config must have reached the model, not SpecForge's defaults
        raise SystemExit(f"specforge: the DSpark draft was built with {heads}, not the job's {job['dspark_heads']}")
    return providers.build_training_model(cfg, draft, draft_config, None, None).model.float()


def strategy_for(cfg, job: dict, wrapped):
    from specforge.training.strategies.base import DFlashTrainStrategy, DSparkTrainStrategy, Eagle3TrainStrategy

    if job["strategy"] == "dflash":
        return DFlashTrainStrategy(wrapped)
    if job["strategy"] == "dspark":
        return DSparkTrainStrategy(wrapped)
    from specforge.algorithms.model_providers import eagle3_strategy_kwargs

    return Eagle3TrainStrategy(wrapped, target_head=tied_target_head(job["target"]),
                               **eagle3_strategy_kwargs(cfg))


def load_batch(files: list[str], job: dict, collate):
    """The step's TrainBatch from its sample files through the strategy's normalizer, or None when SpecForge's data
    filter keeps none of them (DFlash and DSpark: two adjacent supervised tokens)."""
    from specforge.runtime.contracts import TrainBatch
    from specforge.runtime.data_plane.feature_store import load_feature_file

    if job["strategy"] in ("dflash", "dspark"):
        from specforge.algorithms.common import dflash_family_data
        from specforge.data.loss_mask import has_consecutive_supervised_tokens

        normalize_offline_sample = (dflash_family_data.normalize_dspark_offline_sample if job["strategy"] == "dspark"
                                    else dflash_family_data.normalize_offline_sample)
        raw = [load_feature_file(path) for path in files]
        kept = [(path, r) for path, r in zip(files, raw) if has_consecutive_supervised_tokens(r["loss_mask"])]
        metadata = {}
    else:
        from specforge.algorithms.eagle3.data import normalize_offline_sample

        kept = [(path, load_feature_file(path)) for path in files]
        metadata = {"target_repr": "hidden_state"}
    if not kept:
        return None
    rows = [normalize_offline_sample(r, max_len=job["max_length"]) for _, r in kept]
    ids = [os.path.splitext(os.path.basename(path))[0] for path, _ in kept]
    return TrainBatch(sample_ids=ids, strategy=job["strategy"], tensors=collate(rows), metadata=metadata)


def collator(job: dict):
    if job["strategy"] in ("dflash", "dspark"):
        from specforge.algorithms.common import dflash_family_data

        return (dflash_family_data.build_dspark_collator() if job["strategy"] == "dspark"
                else dflash_family_data.build_collator())
    from specforge.data.utils import DataCollatorWithPadding

    return DataCollatorWithPadding()


def train(job: dict, core, log, lockstep: bool) -> list[dict]:
    collate = collator(job)
    records = []
    with open(os.path.join(job["out"], "metrics.jsonl"), "w") as metrics:
        for step, files in enumerate(job["steps"], start=1):
            if lockstep and not sys.stdin.readline():
                raise SystemExit(f"specforge: told to stop before step {step}")
            lr = core.backend.optimizer.get_learning_rate()  # the rate this step uses
            start, cpu = time.perf_counter(), time.process_time()
            batch = load_batch(files, job, collate)
            if batch is None:
                records.append({"step": step, "skipped": "no sample with two adjacent supervised tokens"})
                if lockstep:
                    print(step, flush=True)
                continue
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
    """SpecForge's checkpoint and the directory its draft serves from (float32, as trained)."""
    from specforge.export.checkpoint_io import STATE_FILE, apply_legacy_rope_scaling

    checkpoint = os.path.join(job["out"], "checkpoint")
    os.makedirs(checkpoint, exist_ok=True)
    state = {"draft_state_dict": strategy.checkpoint_state_filter(model.state_dict()), "strategy": strategy.name,
             "global_step": len(job["steps"])}
    torch.save(state, os.path.join(checkpoint, STATE_FILE))
    draft, served = model.draft_model, os.path.join(job["out"], "served")
    if job["strategy"] in ("dflash", "dspark"):
        draft.save_pretrained(served, state_dict=state["draft_state_dict"])  # as export/to_hf.py: no embedding
    else:
        from specforge.export.to_sglang import WEIGHT_MAPS, _serving_state

        full = {k: v for k, v in draft.state_dict().items() if "embed" not in k.lower()}
        draft.save_pretrained(served, state_dict=_serving_state(full, WEIGHT_MAPS[type(draft).__name__]))
    apply_legacy_rope_scaling(served)


def settings(cfg, backend, job: dict) -> dict:
    """What this run trained with, read from SpecForge's objects (its defaults where the job set nothing)."""
    optimizer = backend.optimizer
    group = optimizer.optimizer.param_groups[0]
    scheduler = optimizer.scheduler
    training = type(cfg.training).model_fields
    common = {"learning_rate": cfg.training.learning_rate, "lr_scheduler": cfg.training.lr_scheduler,
              "warmup_steps": scheduler.warmup_epochs,
              "total_steps": scheduler.after_scheduler.T_max + scheduler.warmup_epochs,
              "lr_floor": scheduler.after_scheduler.eta_min, "adam_betas": list(group["betas"]),
              "weight_decay": group["weight_decay"], "max_grad_norm": optimizer.max_grad_norm,
              "attention_backend": cfg.training.attention_backend}
    if job["strategy"] in ("dflash", "dspark"):
        own = {"draft_layers": cfg.model.draft_num_hidden_layers, "block_size": cfg.model.draft_block_size,
               "mask_token_id": cfg.model.mask_token_id, "target_layer_ids": job["target_layer_ids"],
               "num_anchors": cfg.training.num_anchors, "loss_decay_gamma": cfg.training.loss_decay_gamma}
        defaults = ("learning_rate", "warmup_ratio", "max_grad_norm", "num_anchors", "loss_decay_gamma",
                    "attention_backend")
        if job["strategy"] == "dflash":
            own["loss_type"] = cfg.training.loss_type
        else:
            alphas = ("dspark_ce_loss_alpha", "dspark_l1_loss_alpha", "dspark_confidence_head_alpha")
            own |= {**job["dspark_heads"], **{name: getattr(cfg.training, name) for name in alphas}}
            defaults += alphas
    else:
        own = {"ttt_length": cfg.training.ttt_length, "ploss_decay": 0.8}
        defaults = ("learning_rate", "warmup_ratio", "max_grad_norm", "ttt_length", "attention_backend")
    return {**common, **own, "specforge_defaults": {name: training[name].default for name in defaults}}


def cpu_only_changes(job: dict) -> list[str]:
    changes = ["attention: sdpa", "no FSDP wrap (one process)"]
    if job["strategy"] == "eagle3":
        changes += ["loss: torch form of the Triton kernel", "target head: tied embedding, float32"]
    return changes


def main(job_path: str, lockstep: bool) -> int:
    with open(job_path) as f:
        job = json.load(f)
    torch.set_num_threads(1)
    os.makedirs(job["out"], exist_ok=True)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731  (stdout: the lockstep's answers)
    load = os.getloadavg()[0]
    cfg, model, backend, strategy, core = build(job)
    records = train(job, core, log, lockstep)
    save(job, model, strategy)
    ran = [r for r in records if "skipped" not in r]
    timed = ran[WARMUP_STEPS:] or ran
    summary = {"steps": len(ran), "skipped_steps": len(records) - len(ran), "median_step_time_s": statistics.median(r["step_time_s"] for r in timed),
               "median_step_cpu_s": statistics.median(r["step_cpu_s"] for r in timed),
               "median_load_time_s": statistics.median(r["load_time_s"] for r in timed),
               "final": ran[-1], "settings": settings(cfg, backend, job), "torch": torch.__version__,
               "load_average_at_start": load,
               "threads": torch.get_num_threads(), "cpu_only_changes": cpu_only_changes(job)}
    with open(os.path.join(job["out"], "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    log(f"specforge: {len(ran)} steps ({summary['skipped_steps']} skipped), median step "
        f"{summary['median_step_time_s']:.3f} s; draft at {os.path.join(job['out'], 'served')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], "--lockstep" in sys.argv[2:]))
