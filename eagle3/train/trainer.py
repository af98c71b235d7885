"""The draft trainer: one loop under plain `python` and under `torchrun` (DDP; gloo on CPU, nccl on GPU).

Loss normalisation (docs/contracts.md): per prediction (a draft step, or a block entry), the sum over valid positions divided by the global batch's count of
positions with a loss-masked target (every rank reads every row's mask: known before any forward), steps weighted
decay**k. DDP averages gradients over ranks, so each rank's loss is scaled by the world size; the micro-batches of a
step (training.micro_batch_size) add up their gradients. 1 rank and N ranks, one batch or N micro-batches: the same
global batch gives the same update.
"""

from __future__ import annotations

import contextlib
import json
import signal
from pathlib import Path
from typing import Callable

import torch

from eagle3.bench.simulate import counting_release, replay_stored
from eagle3.config import PipelineConfig
from eagle3.config.run import RunSection
from eagle3.config.training import batch_split_problem
from eagle3.data.regenerate import greedy_length
from eagle3.distributed import Dist, setup_distributed
from eagle3.errors import Eagle3Error
from eagle3.fsutil import atomic_directory
from eagle3.model.blocks import StepStats
from eagle3.train.augment import noisy_features
from eagle3.train.data import SampleRef, micro_batches
from eagle3.train.parallel import Parallel
from eagle3.train.parts import TrainingParts, training_parts
from eagle3.train.schedule import optimizer_and_schedule
from eagle3.train.timing import Throughput, timed

Log = Callable[[str], None]
STATE_FILE = "trainer_state.pt"
METRICS_FILE = "metrics.jsonl"
BEST_DIR = "best"  # the draft scoring best on the eval split, what the export stage reads
# training.best_by -> the eval record's key that scores it, and whether lower is better
BEST_BY = {"accept_length": ("eval_accept_length", False), "step_acc": ("eval_weighted_acc", False),
           "eval_loss": ("eval_loss", True)}


def autocast(device: torch.device):
    """bf16 matmuls on a GPU; float32 on the CPU (runs here, tests)."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


class Trainer:
    """`dist` defaults to this process's device and process group (tests pass their own device)."""

    def __init__(self, config: PipelineConfig, log: Log = print, dist: Dist | None = None,
                 parts: TrainingParts | None = None):
        """`parts` defaults to those `training_parts` builds for this config."""
        self.config = config
        self.dist = dist or setup_distributed()
        self.log = log if self.dist.main else (lambda line: None)  # one voice, not one per rank
        train = config.training
        problem = batch_split_problem(train.batch_size, train.micro_batch_size, self.dist.world, "processes running")
        if problem:
            raise Eagle3Error(problem)
        self.per_forward = train.sequences_per_forward(self.dist.world)  # this rank's rows per forward
        self.every_position = train.loss_positions == "all"  # training steps only: evaluation scores the generated
        parts = parts or training_parts(config.run, config.data, config.target, train, config.draft, config.vocab,
                                        greedy_length(config), self.dist, self.log)
        self.algorithm, self.data, self.features, self.heldout = parts.algorithm, parts.data, parts.features, parts.heldout
        self.eos_ids, self.init, self.model, self.teacher = parts.eos_ids, parts.init, parts.model, parts.teacher
        self.predictions = self.algorithm.predictions(config.draft, train)  # K: the per-prediction sums' length
        self.module = self.algorithm.training_module(self.model)
        self.parallel = Parallel(self.dist, train.fsdp)
        self.wrapped = self.parallel.wrap(self.module)
        self.step_weights = train.ttt_step_decay ** torch.arange(self.predictions, dtype=torch.float32, device=self.dist.device)
        self.optimizer, self.scheduler = optimizer_and_schedule(self.model, train)
        self.out = config.stage_dir("train")
        self.stop_requested = False
        self.stopped = False  # True when SIGTERM ended the run before max_steps
        self.step, self.epoch, self.batch_in_epoch = 0, 0, 0
        self.best: float | None = None
        warm = self.init is not None
        self.budget = train.step_budget(warm)  # the steps this run trains at most
        self.patience = train.patience if train.stops_on_patience(warm) else None
        self.gained: float | None = None  # the best_by score at the last gain (warm_steps auto)
        self.evals_without_gain = 0

    def my_rows(self) -> slice:
        return slice(self.dist.rank, None, self.dist.world)

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> Path:
        try:
            return self.train_loop()
        finally:
            self.features.close()  # the online target's memory, before the next stage needs the GPUs

    def train_loop(self) -> Path:
        self.log(f"train: {self.dist.world} process(es), rank 0 on {self.dist.device} ({self.parallel.kind})")
        self.resume()
        signal.signal(signal.SIGTERM, self._on_sigterm)
        train = self.config.training
        throughput = Throughput()  # eval and checkpoints stay out of the rate
        while self.more_steps():
            batches = self.data.batches(self.epoch, train.batch_size, train.seed)
            if not batches:
                raise Eagle3Error(f"the dataset has {len(self.data.train)} training samples, fewer than one batch "
                                  f"({train.batch_size}); {self.data.without_loss} left out: {self.data.left_out_why}")
            self.features.expect(self.my_parts(batches[self.batch_in_epoch : self.batch_in_epoch + self.budget - self.step]))
            while self.batch_in_epoch < len(batches) and self.more_steps():
                lr = self.scheduler.get_last_lr()[0]  # the rate this step uses
                sums, seconds = timed(self.train_step, batches[self.batch_in_epoch], device=self.dist.device)
                metrics = self.step_metrics(sums)
                self.step += 1
                self.batch_in_epoch += 1
                rate = throughput.add(metrics.pop("tokens"), seconds)
                metrics.update(step_time_s=seconds, tokens_per_s=rate, lr=lr)
                self.record({"step": self.step, **metrics})
                if self.step % train.eval_every == 0 or self.step == self.budget:
                    self.evaluate()
                if self.step % train.save_every == 0 or not self.more_steps():  # the budget's end, or patience's
                    self.save_checkpoint()
                if self.stop_everywhere():
                    self.save_checkpoint()
                    self.log(f"train: stopped by SIGTERM at step {self.step}; resume continues from here")
                    self.stopped = True
                    return self.latest_checkpoint()
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        return self.save_final()

    def my_parts(self, batches: list[list[SampleRef]]) -> list[list[SampleRef]]:
        """This rank's rows of each micro-batch of `batches`, in the order the steps read them."""
        return [part[self.my_rows()] for batch in batches
                for part in micro_batches(batch, self.dist.world, self.per_forward)]

    def more_steps(self) -> bool:
        """Whether to train another step: below the budget, and (warm_steps auto) patience left."""
        return self.step < self.budget and (self.patience is None or self.evals_without_gain < self.patience)

    def step_stats(self, refs: list[SampleRef], train: bool):
        """Per-step sums for this rank's rows of a global batch, on the device. Every rank calls this for every
        global batch (a tensor-parallel target computes features for all rows together). Evaluation calls the
        draft directly: no wrapper hooks, no collectives in the draft."""
        tokens, loss_mask = self.data.tokens(refs, every_position=train and self.every_position)
        features = self.features.features(tokens, self.my_rows())  # this rank's rows, on the device
        mine = tokens.select(self.my_rows())
        ids = mine.input_ids.to(self.dist.device, non_blocking=True)  # [b, T]
        # where the loss reads (generated tokens), from the host's mask: the teacher and the head score only there
        host_rows = self.algorithm.loss_rows(loss_mask[self.my_rows(), : ids.shape[1]], self.predictions,
                                               self.config.draft)
        rows = host_rows.to(self.dist.device)
        if not len(mine.sample_ids):  # a last eval batch smaller than the ranks: nothing of it is this rank's
            return StepStats(*torch.zeros(3, self.predictions, device=self.dist.device))
        teacher = self.teacher.at(features.last, mine, host_rows.teacher)
        with autocast(self.dist.device):
            if train:
                aux = features.aux
                if self.config.training.feature_noise:  # training steps only: never evaluation or the replay
                    aux = noisy_features(aux, self.config.training.feature_noise, len(self.config.data.aux_layers))
                loss_sum, correct, count = self.wrapped(aux, ids, teacher, rows)
                return StepStats(loss_sum, correct.detach(), count.detach())
            return self.algorithm.loss(self.model, features.aux, ids, teacher, rows)

    def train_step(self, refs: list[SampleRef]) -> torch.Tensor:
        """One optimizer step on a global batch. Returns the global sums [loss sum, correct, tokens, valid
        positions] x [K] on the device."""
        sums = self.accumulate_gradients(refs)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.training.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return sums

    def accumulate_gradients(self, refs: list[SampleRef]) -> torch.Tensor:
        """The global batch's gradients, a global micro-batch at a time (every rank joins each: an online target
        computes a micro-batch's features for all its rows together), the ranks syncing gradients once, on the last.
        Each loss is divided by the whole batch's normaliser, so the micro-batches sum to the loss of one batch."""
        self.wrapped.train()
        steps, device = self.predictions, self.dist.device
        loss_mask = self.data.tokens(refs, self.every_position)[1]
        positions = self.algorithm.normaliser(loss_mask, steps, self.config.draft).to(device)  # every row's: the global count
        scale = self.dist.world * self.step_weights / positions.clamp_min(1)  # DDP/FSDP average over the ranks
        totals = torch.zeros(3, steps, device=device)
        parts = micro_batches(refs, self.dist.world, self.per_forward)
        for i, part in enumerate(parts):
            with self.parallel.gradient_sync(self.wrapped, enabled=i == len(parts) - 1):
                stats = self.step_stats(part, train=True)
                (scale * stats.loss_sum).sum().backward()
            totals += torch.stack([stats.loss_sum.detach(), stats.correct, stats.count])
        loss_sum, correct, count = totals
        tokens = torch.full_like(count, float(sum(ref.length for ref in refs[self.my_rows()])))
        return self.dist.sum(torch.stack([loss_sum, correct, tokens, count]))

    def step_metrics(self, sums: torch.Tensor) -> dict:
        """The step's numbers on the host (one device-to-host copy)."""
        loss_sum, correct, tokens, counts = sums.cpu()
        step_loss = loss_sum / counts.clamp_min(1)
        return {
            "loss": float((self.step_weights.cpu() * step_loss).sum()),
            "step_loss": [round(float(x), 5) for x in step_loss],
            "step_acc": [round(float(x), 5) for x in correct / counts.clamp_min(1)],
            "tokens": int(tokens[0]),  # every rank's tokens
        }

    def evaluate(self) -> None:
        """The eval split's loss and per-step accuracy, and, for training.best_by accept_length, the accept length
        replayed over the held-out greedy sequences; each part timed apart. best/ keeps the best draft by the rule."""
        self.wrapped.eval()
        record: dict = {"step": self.step}
        seconds = {}
        with self.parallel.unsharded(self.module):  # every rank, once: the direct calls see full weights
            if self.data.eval:  # .cpu() waits for the device: the times are the work's
                totals, seconds["eval_loss_time_s"] = timed(lambda: self.dist.sum(self.loss_sums()).cpu())
                record.update(self.loss_metrics(totals))
            if self.heldout is not None:
                counts, seconds["eval_replay_time_s"] = timed(lambda: self.dist.sum(self.replay_counts()).cpu())
                record["eval_accept_length"] = float(counts[0] / counts[1]) if counts[1] > 0 else 1.0
        record.update(eval_time_s=round(sum(seconds.values()), 4), **seconds)
        key, lower_wins = BEST_BY[self.config.training.best_by]
        score = record[key]
        record["new_best"] = self.best is None or (score < self.best if lower_wins else score > self.best)
        self.record(record)
        self.count_gain(score, lower_wins)
        if record["new_best"]:
            self.best = score
            self.write_checkpoint(self.out / BEST_DIR, with_state=False)

    def count_gain(self, score: float, lower_wins: bool) -> None:
        """Patience: evaluations since the last gain (is_gain)."""
        gain = is_gain(score, self.gained, self.config.training.min_gain, lower_wins)
        self.gained = score if gain else self.gained
        self.evals_without_gain = 0 if gain else self.evals_without_gain + 1

    def loss_metrics(self, totals: torch.Tensor) -> dict:
        """The eval split's numbers from the global [loss sum, correct, count] x [K] (host)."""
        counts = totals[2].clamp_min(1)
        step_acc = totals[1] / counts
        weights = self.step_weights.cpu()
        return {"eval_loss": float((weights * totals[0] / counts).sum()),
                "eval_step_acc": [round(float(x), 5) for x in step_acc],
                "eval_weighted_acc": round(float((weights * step_acc).sum() / weights.sum()), 5)}

    @torch.no_grad()
    def loss_sums(self) -> torch.Tensor:
        """This rank's [loss sum, correct, count] x [K] over its rows of the global eval batches (one forward's
        rows each), on the device."""
        batch_size = self.dist.world * self.per_forward
        totals = torch.zeros(3, self.predictions, device=self.dist.device)
        batches = [self.data.eval[start : start + batch_size] for start in range(0, len(self.data.eval), batch_size)]
        self.features.expect([refs[self.my_rows()] for refs in batches], first=True)
        for refs in batches:
            stats = self.step_stats(refs, train=False)
            totals += torch.stack([stats.loss_sum, stats.correct, stats.count])
        return totals

    @torch.no_grad()
    def replay_counts(self) -> torch.Tensor:
        """[completion tokens, verify steps] of drafting (serving's chain or tree, or DraftShape's defaults in a
        training-only config) replayed over this rank's held-out greedy sequences, counted as the simulator and the
        server count them."""
        completion, verify_ct = 0, 0
        config = self.config
        max_new_tokens = config.training.replay_max_new_tokens or config.heldout_set[1]
        release = counting_release(config.serving)
        for ref in self.heldout[self.my_rows()]:
            result = replay_stored(self.algorithm, self.model, ref.load(), config.replay_shape, max_new_tokens,
                                   self.eos_ids, release)
            completion, verify_ct = completion + result.completion_tokens, verify_ct + result.verify_ct
        return torch.tensor([completion, verify_ct], dtype=torch.float32, device=self.dist.device)

    # -- checkpoints ----------------------------------------------------------------------------

    def checkpoint_dir(self, step: int) -> Path:
        return self.out / "checkpoints" / f"step-{step:07d}"

    def write_checkpoint(self, path: Path, with_state: bool = True) -> None:
        """Every rank gathers, rank 0 writes atomically: the native draft (its manifest names the init draft, if
        any), plus optimizer/scheduler/data position/RNG."""
        tensors = self.parallel.full_state(self.module)
        state = self.trainer_state() if with_state else None
        if self.dist.main:
            with atomic_directory(path, overwrite=True) as tmp:
                self.algorithm.write_draft(self.model.config, tensors, tmp,
                                           manifest_fields={"init_from": self.init.record if self.init else None})
                if state is not None:
                    torch.save(state, tmp / STATE_FILE)
        self.dist.barrier()

    def trainer_state(self) -> dict:
        return {
            "step": self.step,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "best": self.best,
            "best_by": self.config.training.best_by,
            "gained": self.gained,
            "evals_without_gain": self.evals_without_gain,
            "optimizer": self.parallel.optimizer_state(self.module, self.optimizer),
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
        tensors = self.algorithm.read_draft(latest)
        state = torch.load(latest / STATE_FILE, map_location="cpu", weights_only=True)
        self.parallel.load(self.module, self.optimizer, tensors, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        self.step, self.epoch, self.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        # a best score under another rule (or none recorded) does not compare: the next evaluation sets it
        self.best = state["best"] if state.get("best_by") == self.config.training.best_by else None
        if self.best is not None:
            self.gained, self.evals_without_gain = state.get("gained"), state.get("evals_without_gain", 0)
        if self.dist.main:
            self.truncate_metrics()
        self.log(f"train: resumed from {latest} at step {self.step}")

    def save_final(self) -> Path:
        final = self.out / "final"
        self.write_checkpoint(final, with_state=False)
        rule = self.config.training.best_by
        if self.step < self.budget:
            self.log(f"train: warm start stopped at step {self.step} of at most {self.budget}: {BEST_BY[rule][0]} "
                     f"gained no more than {self.config.training.min_gain:g} for {self.patience} evaluations in a row "
                     "(training.warm_steps auto, patience, min_gain)")
        self.log(f"train: {self.step} steps done; final draft at {final}, best by {rule} ({BEST_BY[rule][0]} "
                 f"{self.best}) at {self.out / 'best'}")
        return final

    # -- metrics and signals --------------------------------------------------------------------

    def record(self, metrics: dict) -> None:
        if not self.dist.main:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        with open(self.out / METRICS_FILE, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if "eval_time_s" in metrics or metrics["step"] % 10 == 0 or metrics["step"] == 1:
            self.log("train: " + json.dumps(metrics))

    def truncate_metrics(self) -> None:
        """Drop lines written after the checkpoint we resume from, so the curve has no duplicates."""
        path = self.out / METRICS_FILE
        if path.exists():
            lines = [line for line in path.read_text().splitlines() if _step_of(line) <= self.step]
            path.write_text("".join(line + "\n" for line in lines))

    def _on_sigterm(self, signum, frame) -> None:
        self.stop_requested = True

    def stop_everywhere(self) -> bool:
        """Whether any rank got SIGTERM (every rank calls this each step, so all stop at the same step)."""
        flag = torch.tensor([1.0 if self.stop_requested else 0.0], device=self.dist.device)
        return bool(self.dist.sum(flag).item() > 0)


def is_gain(score: float, gained: float | None, min_gain: float, lower_wins: bool) -> bool:
    """Whether `score` beats the score at the last gain by more than `min_gain` (the first score always does)."""
    return gained is None or (score < gained - min_gain if lower_wins else score > gained + min_gain)


def _step_of(line: str) -> float:
    """The step of a metrics line; a line torn by a crash counts as past every checkpoint."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")


def best_draft(run: RunSection) -> Path:
    """The train stage's output: the checkpoint scoring best on the eval split."""
    return run.stage_dir("train") / BEST_DIR
