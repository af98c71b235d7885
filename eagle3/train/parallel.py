"""Where a trainer process runs and how its model is spread over the processes.

One device per process, chosen once: `cuda:LOCAL_RANK` whenever CUDA exists (under plain `python` and
under torchrun alike), the CPU otherwise. Every tensor the trainer makes lives there, and collectives
only ever see tensors on it: NCCL has no CPU all_reduce, so a CPU tensor there fails an 8-GPU run at
its first step. Parallelism (none, DDP, FSDP2) stays in `Parallel`, out of the training loop.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

from eagle3.distributed import Dist

FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)
DRAFT_PREFIX = "draft."  # the loss wrapper (LossModule) holds the draft as `draft`
EMBEDDING = "embed_tokens."  # the target's, frozen: never saved with the draft


class Parallel:
    """none (one process), DDP (replicas) or FSDP2 (weights, gradients and AdamW state sharded).

    FSDP2 shards the loss module as one unit: the draft's forward runs through helper methods, so only
    the root's hooks see every call.
    """

    def __init__(self, dist_: Dist, fsdp: bool):
        self.dist = dist_
        self.kind = "none" if dist_.world == 1 else "fsdp" if fsdp else "ddp"

    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        if self.kind == "fsdp":
            fully_shard(module)
            return module
        if self.kind == "ddp":
            device_ids = [self.dist.device.index] if self.dist.device.type == "cuda" else None
            return torch.nn.parallel.DistributedDataParallel(module, device_ids=device_ids)
        return module

    def full_state(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The draft's full tensors on the CPU, by canonical name (a collective under FSDP: every rank calls it)."""
        if self.kind != "fsdp":
            return module.draft.export_state()
        state = get_model_state_dict(module, options=FULL_STATE)
        return {k.removeprefix(DRAFT_PREFIX): v for k, v in state.items() if not k.startswith(DRAFT_PREFIX + EMBEDDING)}

    def optimizer_state(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        if self.kind == "fsdp":
            return get_optimizer_state_dict(module, optimizer, options=FULL_STATE)
        return optimizer.state_dict()

    def load(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor],
             optimizer_state: dict | None) -> None:
        """Load full (canonical, embedding-free) tensors and, when given, the full optimizer state."""
        if self.kind == "fsdp":
            options = StateDictOptions(full_state_dict=True, strict=False)
            set_model_state_dict(module, {DRAFT_PREFIX + k: v for k, v in tensors.items()}, options=options)
            if optimizer_state is not None:
                set_optimizer_state_dict(module, optimizer, optimizer_state, options=options)
            return
        module.draft.load_draft_state(tensors)
        if optimizer_state is not None:
            optimizer.load_state_dict(optimizer_state)

    @contextmanager
    def unsharded(self, module: torch.nn.Module) -> Iterator[None]:
        """Full weights on every rank for direct calls outside the wrapper (evaluation, drafting)."""
        if self.kind != "fsdp":
            yield
            return
        module.unshard()
        try:
            yield
        finally:
            module.reshard()

    @contextmanager
    def gradient_sync(self, module: torch.nn.Module, enabled: bool) -> Iterator[None]:
        """Forward and backward inside: with `enabled` false the ranks keep their gradients to themselves (a
        micro-batch before the last one accumulates locally; the last one's backward reduces the sum once)."""
        if enabled or self.kind == "none":
            yield
        elif self.kind == "ddp":
            with module.no_sync():
                yield
        else:  # FSDP2: unsharded gradients accumulate until a backward with sync on reduce-scatters them
            module.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                module.set_requires_gradient_sync(True)
