"""One process of a torchrun job: its rank, its device, and the process group when there are several.

One device per process, chosen once: `cuda:LOCAL_RANK` whenever CUDA exists (under plain `python` and under torchrun
alike), the CPU otherwise. Training and the node's capture both run this way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def main(self) -> bool:
        return self.rank == 0

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """All-reduce (sum) in place; the one place the trainer reduces, so the one place to check devices."""
        if tensor.device != self.device:
            raise RuntimeError(
                f"a collective got a tensor on {tensor.device}, this rank runs on {self.device}: make it on the "
                "rank's device (NCCL cannot reduce CPU tensors)"
            )
        if self.world > 1:
            dist.all_reduce(tensor)
        return tensor

    def broadcast(self, obj: object) -> object:
        """Rank 0's `obj` on every rank (a picklable Python object: a capture worker's claim)."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, device=self.device)
        return box[0]

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def setup_distributed() -> Dist:
    """The process's device from LOCAL_RANK, and the process group when torchrun started several."""
    world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world == 1:
        return Dist(device=device)
    dist.init_process_group("nccl" if cuda else "gloo")
    return Dist(rank=dist.get_rank(), world=world, device=device)
