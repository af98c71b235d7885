"""The draft trainer: one loop under plain `python` and under `torchrun` (DDP; gloo on CPU, nccl on GPU).

Loss normalisation (DESIGN §3): per TTT step, the sum over valid positions divided by the global
count of valid positions (all-reduced), steps weighted decay**k. DDP averages gradients over ranks,
so each rank's loss is scaled by the world size: 1 rank and N ranks on the same global batch give
the same loss and the same update.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

from eagle3.config import PipelineConfig
from eagle3.data.capture import HIDDEN_DIR, check_dataset
from eagle3.errors import Eagle3Error
from eagle3.formats.checkpoint import DraftConfig, NativeDraft, load_native, write_draft_files
from eagle3.formats.manifest import MANIFEST_FILE, read_manifest
from eagle3.formats.target import read_target_info
from eagle3.formats.vocab_map import load_vocab_map
from eagle3.fsutil import atomic_directory
from eagle3.model.draft import Eagle3Draft, init_weights
from eagle3.bench.simulate import replay
from eagle3.model.ttt import TTTModel, draft_chain, ttt_forward, ttt_stats
from eagle3.model.weights import target_head
from eagle3.train.data import TrainingData

Log = Callable[[str], None]
STATE_FILE = "trainer_state.pt"
FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)
METRICS_FILE = "metrics.jsonl"


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(tensor)
        return tensor

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def setup_distributed() -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return Dist(rank=dist.get_rank(), world=world, device=device)


def draft_config(config: PipelineConfig) -> DraftConfig:
    target, draft = config.target, config.draft
    return DraftConfig(
        hidden_size=target.hidden_size,  # SGLang swaps in the target's embedding: sizes must match
        target_hidden_size=target.hidden_size,
        intermediate_size=draft.intermediate_size,
        num_attention_heads=draft.num_attention_heads,
        num_key_value_heads=draft.num_key_value_heads,
        head_dim=target.hidden_size // draft.num_attention_heads,
        rms_norm_eps=draft.rms_norm_eps,
        rope_theta=draft.rope_theta,
        max_position_embeddings=draft.max_position_embeddings,
        vocab_size=target.vocab_size,
        draft_vocab_size=config.vocab.draft_vocab_size,
        torch_dtype=draft.torch_dtype,
        aux_layers=list(config.data.aux_layers),
        target_num_hidden_layers=target.num_hidden_layers,
        target_family=target.family,
    )


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warmup, then cosine decay to 10 % of the peak."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


class Trainer:
    def __init__(self, config: PipelineConfig, log: Log = print):
        self.config = config
        self.dist = setup_distributed()
        self.log = log if self.dist.main else (lambda line: None)  # one voice, not one per rank
        train = config.training
        if train.batch_size % self.dist.world:
            raise Eagle3Error(f"training.batch_size {train.batch_size} must be a multiple of the {self.dist.world} ranks")
        dataset = config.stage_dir("data") / HIDDEN_DIR
        if not (dataset / MANIFEST_FILE).exists():
            raise Eagle3Error(f"{dataset}: no captured dataset here; run `eagle3 data capture` first")
        check_dataset(config, read_manifest(dataset))
        self.data = TrainingData(dataset, train.seq_len, train.eval_fraction)
        self.head = target_head(Path(config.target.path), config.target.weight_prefix)  # CPU; logits use copies on device
        self.target_norm = self.head["norm"].to(self.dist.device)
        self.target_eps = read_target_info(Path(config.target.path)).rms_norm_eps
        self.target_lm_head = self.head["lm_head"].to(self.dist.device)  # [V, H]
        self.model = self.build_model()
        self.ttt = TTTModel(self.model, train.ttt_steps).to(self.dist.device)
        self.fsdp = train.fsdp and self.dist.world > 1
        self.wrapped = self.distribute(self.ttt)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=train.learning_rate, betas=(0.9, 0.95), weight_decay=0.0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, train.warmup_steps, train.max_steps)
        )
        self.out = config.stage_dir("train")
        self.stop_requested = False
        self.stopped = False  # True when SIGTERM ended the run before max_steps
        self.step, self.epoch, self.batch_in_epoch = 0, 0, 0
        self.best: float | None = None

    # -- set-up ---------------------------------------------------------------------------------

    def build_model(self) -> Eagle3Draft:
        cfg = draft_config(self.config)
        vocab_map = load_vocab_map(self.config.stage_dir("vocab"))
        if (vocab_map.draft_vocab_size, vocab_map.target_vocab_size) != (cfg.draft_vocab_size, cfg.vocab_size):
            raise Eagle3Error(
                f"the vocab map in {self.config.stage_dir('vocab')} is {vocab_map.draft_vocab_size} of "
                f"{vocab_map.target_vocab_size} ids; the config asks for {cfg.draft_vocab_size} of {cfg.vocab_size}: "
                "run `eagle3 vocab build` again"
            )
        model = Eagle3Draft(cfg, self.head["embed"])
        init_weights(model, self.config.training.seed)
        with torch.no_grad():
            model.d2t.copy_(vocab_map.d2t)
            model.t2d.copy_(vocab_map.t2d)
            model.lm_head.weight.copy_(self.head["lm_head"][model.hot_token_ids()])  # the target's rows
        if self.config.training.init_from is not None:
            self.warm_start(model, Path(self.config.training.init_from))
        return model

    def warm_start(self, model: Eagle3Draft, path: Path) -> None:
        previous = load_native(path)
        for name in ("d2t", "t2d"):
            if not torch.equal(previous.tensors[name], getattr(model, name)):
                raise Eagle3Error(
                    f"cannot warm start from {path}: its vocab map differs from this run's ({name}); "
                    "rebuild the vocab map from the same data or train from scratch"
                )
        if previous.config.model_copy(update={"target_family": None}) != model.config.model_copy(update={"target_family": None}):
            raise Eagle3Error(f"cannot warm start from {path}: its architecture differs from draft/target in the config")
        model.load_state_dict({**previous.tensors, "embed_tokens.weight": model.embed_tokens.weight}, strict=True)
        self.log(f"train: warm start from {path}")

    def distribute(self, module: TTTModel) -> torch.nn.Module:
        """DDP replicates; FSDP2 shards the draft as one unit (its forward runs through helper methods,
        so only the root's hooks see every call) — grads and AdamW state are sharded across ranks."""
        if self.dist.world == 1:
            return module
        if self.fsdp:
            fully_shard(module)
            return module
        return torch.nn.parallel.DistributedDataParallel(module)

    def model_state(self) -> dict[str, torch.Tensor]:
        """Full canonical tensors (a collective under FSDP: every rank calls it)."""
        if not self.fsdp:
            return self.model.export_state()
        full = get_model_state_dict(self.ttt, options=FULL_STATE)
        return {k.removeprefix("draft."): v for k, v in full.items() if not k.startswith("draft.embed_tokens")}

    def optimizer_state(self) -> dict:
        return get_optimizer_state_dict(self.ttt, self.optimizer, options=FULL_STATE) if self.fsdp else self.optimizer.state_dict()

    def load_states(self, tensors: dict[str, torch.Tensor], optimizer: dict | None) -> None:
        if self.fsdp:
            options = StateDictOptions(full_state_dict=True, strict=False)
            set_model_state_dict(self.ttt, {f"draft.{k}": v for k, v in tensors.items()}, options=options)
            if optimizer is not None:
                set_optimizer_state_dict(self.ttt, self.optimizer, optimizer, options=options)
            return
        self.model.load_state_dict({**tensors, "embed_tokens.weight": self.model.embed_tokens.weight}, strict=True)
        if optimizer is not None:
            self.optimizer.load_state_dict(optimizer)

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> Path:
        self.resume()
        signal.signal(signal.SIGTERM, self._on_sigterm)
        train = self.config.training
        started, tokens = time.monotonic(), 0
        while self.step < train.max_steps:
            batches = self.data.batches(self.epoch, train.batch_size, train.seed)
            if not batches:
                raise Eagle3Error(f"the dataset has fewer training samples than one batch ({train.batch_size})")
            while self.batch_in_epoch < len(batches) and self.step < train.max_steps:
                refs = batches[self.batch_in_epoch][self.dist.rank :: self.dist.world]
                lr = self.scheduler.get_last_lr()[0]  # the rate this step uses
                metrics = self.train_step(refs)
                self.step += 1
                self.batch_in_epoch += 1
                tokens += metrics.pop("tokens")
                metrics.update(tokens_per_s=tokens / (time.monotonic() - started), lr=lr)
                self.record({"step": self.step, **metrics})
                if self.step % train.eval_every == 0 or self.step == train.max_steps:
                    self.evaluate()
                if self.step % train.save_every == 0 or self.step == train.max_steps:
                    self.save_checkpoint()
                if self._stop_everywhere():
                    self.save_checkpoint()
                    self.log(f"train: stopped by SIGTERM at step {self.step}; resume continues from here")
                    self.stopped = True
                    return self.latest_checkpoint()
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        return self.save_final()

    def target_logits(self, last: torch.Tensor) -> torch.Tensor:
        """[B, T, V] from the stored last hidden state (post-norm, or pre-norm through the target's norm)."""
        if self.config.data.last_hidden == "pre_norm":
            last = last * torch.rsqrt(last.pow(2).mean(-1, keepdim=True) + self.target_eps) * self.target_norm
        return last @ self.target_lm_head.T

    def step_stats(self, batch: dict[str, torch.Tensor], train: bool):
        """Per-step sums for a local batch. Evaluation calls the draft directly: no wrapper hooks, no
        collectives, so ranks with different numbers of eval batches cannot deadlock."""
        batch = {k: v.to(self.dist.device) for k, v in batch.items()}
        cuda = self.dist.device.type == "cuda"
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):  # bf16 matmuls on GPU; fp32 on CPU
            if train:
                step_logits = self.wrapped(batch["aux"], batch["input_ids"])
            else:
                step_logits = ttt_forward(self.model, batch["aux"], batch["input_ids"], self.config.training.ttt_steps)
        return ttt_stats(step_logits, self.target_logits(batch["last"]), batch["input_ids"], batch["loss_mask"], self.model)

    def step_weights(self) -> torch.Tensor:
        return self.config.training.ttt_step_decay ** torch.arange(self.config.training.ttt_steps, dtype=torch.float32)

    def train_step(self, refs) -> dict:
        self.wrapped.train()
        batch = self.data.collate(refs)
        stats = self.step_stats(batch, train=True)
        counts = self.dist.sum(stats.count.detach().clone()).clamp_min(1)  # global valid positions per step
        loss = (self.step_weights() * stats.loss_sum / counts).sum()
        (loss * self.dist.world).backward()  # DDP/FSDP average over ranks; the loss is already global
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.training.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        local_tokens = torch.full_like(stats.correct, float(batch["loss_mask"].numel()))
        sums = self.dist.sum(torch.stack([stats.loss_sum.detach(), stats.correct, local_tokens]))
        step_loss = sums[0] / counts
        return {
            "loss": float((self.step_weights() * step_loss).sum()),
            "step_loss": [round(float(x), 5) for x in step_loss],
            "step_acc": [round(float(x), 5) for x in sums[1] / counts],
            "tokens": int(sums[2][0]),  # every rank's tokens
        }

    @torch.no_grad()
    def evaluate(self) -> None:
        """Held-out loss, per-step accuracy and simulated accept length; the best draft by accept length is kept."""
        if not self.data.eval:
            return
        refs = self.data.eval[self.dist.rank :: self.dist.world]
        self.wrapped.eval()
        if self.fsdp:
            self.ttt.unshard()  # every rank, once: the direct calls below see full weights
        try:
            totals = torch.zeros(3, self.config.training.ttt_steps)  # loss sum, correct, count
            for start in range(0, len(refs), self.config.training.batch_size):
                stats = self.step_stats(self.data.collate(refs[start : start + self.config.training.batch_size]), train=False)
                totals += torch.stack([stats.loss_sum, stats.correct, stats.count]).cpu()
            accept = self.replay_counts(self.data.eval[: self.config.benchmark.num_prompts][self.dist.rank :: self.dist.world])
        finally:
            if self.fsdp:
                self.ttt.reshard()
        totals, accept = self.dist.sum(totals), self.dist.sum(accept)
        counts = totals[2].clamp_min(1)
        accept_length = float(accept[0] / accept[1]) if accept[1] > 0 else 1.0
        step_acc = totals[1] / counts
        self.record({"step": self.step, "eval_loss": float((self.step_weights() * totals[0] / counts).sum()),
                     "eval_step_acc": [round(float(x), 5) for x in step_acc], "eval_accept_length": accept_length})
        # Replaying stored replies measures acceptance only when they are the target's greedy choice;
        # for sampled data the weighted per-step accuracy decides instead.
        score = accept_length if self.config.data.temperature == 0 else float((self.step_weights() * step_acc).sum())
        if self.best is None or score > self.best:
            self.best = score
            self.write_checkpoint(self.out / "best", with_state=False)

    def replay_counts(self, refs) -> torch.Tensor:
        """[completion tokens, verify steps] of chain drafting replayed over each eval sample's first
        reply with its stored target features: for greedy data (temperature 0) the stored reply is the
        target's own greedy continuation."""
        counts = torch.zeros(2)
        steps = self.config.serving.num_steps
        for ref in refs:
            sample = self.data.readers[ref.shard].sample(ref.index)
            mask = sample.loss_mask[: ref.length].tolist()
            if 1 not in mask:
                continue
            start = mask.index(1)
            end = mask.index(0, start) if 0 in mask[start:] else len(mask)
            seq = sample.input_ids[:end].long()
            aux = sample.aux_hidden[:end].float().to(self.dist.device)
            result = replay(seq.tolist(), start, lambda p: draft_chain(self.model, aux[:p], seq[: p + 1], steps), steps)
            counts += torch.tensor([result.completion_tokens, result.verify_ct], dtype=torch.float32)
        return counts

    # -- checkpoints ----------------------------------------------------------------------------

    def checkpoint_dir(self, step: int) -> Path:
        return self.out / "checkpoints" / f"step-{step:07d}"

    def write_checkpoint(self, path: Path, with_state: bool = True) -> None:
        """Every rank gathers, rank 0 writes atomically: the native draft, plus optimizer/scheduler/data
        position/RNG."""
        tensors = self.model_state()
        state = self.trainer_state() if with_state else None
        if self.dist.main:
            with atomic_directory(path, overwrite=True) as tmp:
                write_draft_files(NativeDraft(self.model.config, tensors), tmp, "native")
                if state is not None:
                    torch.save(state, tmp / STATE_FILE)
        self.dist.barrier()

    def trainer_state(self) -> dict:
        return {
            "step": self.step,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "best": self.best,
            "optimizer": self.optimizer_state(),
            "scheduler": self.scheduler.state_dict(),
            "rng": torch.get_rng_state(),
        }

    def save_checkpoint(self) -> None:
        self.write_checkpoint(self.checkpoint_dir(self.step))
        if self.dist.main:
            for old in sorted((self.out / "checkpoints").glob("step-*"))[: -self.config.training.keep_last]:
                for file in old.iterdir():
                    file.unlink()
                old.rmdir()

    def latest_checkpoint(self) -> Path | None:
        found = sorted((self.out / "checkpoints").glob("step-*"))
        return found[-1] if found else None

    def resume(self) -> None:
        latest = self.latest_checkpoint()
        if latest is None:
            return
        draft = load_native(latest)
        state = torch.load(latest / STATE_FILE, map_location="cpu", weights_only=True)
        self.load_states(draft.tensors, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        self.step, self.epoch, self.batch_in_epoch, self.best = state["step"], state["epoch"], state["batch_in_epoch"], state["best"]
        if self.dist.main:
            self.truncate_metrics()
        self.log(f"train: resumed from {latest} at step {self.step}")

    def save_final(self) -> Path:
        final = self.out / "final"
        self.write_checkpoint(final, with_state=False)
        self.log(f"train: {self.step} steps done; final draft at {final}, best (simulated accept length {self.best}) at {self.out / 'best'}")
        return final

    # -- metrics and signals --------------------------------------------------------------------

    def record(self, metrics: dict) -> None:
        if not self.dist.main:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        with open(self.out / METRICS_FILE, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if "eval_loss" in metrics or metrics["step"] % 10 == 0 or metrics["step"] == 1:
            self.log("train: " + json.dumps(metrics))

    def truncate_metrics(self) -> None:
        """Drop lines written after the checkpoint we resume from, so the curve has no duplicates."""
        path = self.out / METRICS_FILE
        if path.exists():
            lines = [line for line in path.read_text().splitlines() if _step_of(line) <= self.step]
            path.write_text("".join(line + "\n" for line in lines))

    def _on_sigterm(self, signum, frame) -> None:
        self.stop_requested = True

    def _stop_everywhere(self) -> bool:
        flag = self.dist.sum(torch.tensor([1.0 if self.stop_requested else 0.0]))
        return bool(flag.item() > 0)


def _step_of(line: str) -> float:
    """The step of a metrics line; a line torn by a crash counts as past every checkpoint."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")
