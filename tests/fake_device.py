"""A fake accelerator on a CPU-only machine, for the GPU-only paths (docs/conformance.md; tests marked fake_cuda).

Inside `fake_accelerator()` the host is real and the accelerator is fake: tensors on FAKE_DEVICE have a
shape, a dtype and a device but no data (torch's FakeTensorMode), every CPU tensor stays a real one,
and a CPU tensor meeting an accelerator tensor raises FakeTensorDeviceMismatchError, the error a CUDA
kernel or NCCL would give on the node. The code under test runs unchanged: the trainer's device is
FAKE_DEVICE instead of cuda:N.

Why "meta" and not "cuda": on a CPU-only torch build, fake tensors on device cuda cannot be sliced, moved
with .to() or differentiated; each of those needs CUDA's device guard, which such a build lacks
(measured with torch 2.13: `x[1:]` raises "PyTorch is not linked with support for cuda devices", and
autograd through them aborts the process). Fake tensors on "meta" are checked the same way and support
the whole training step.

Two edges a data-less device cannot cross are bridged, and nothing else:
- moving a tensor between the host and the accelerator makes a data-less tensor on the other side;
- reading a number back from the accelerator (`.item()`, `float()`, `.tolist()`) gives 1.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

FAKE_DEVICE = torch.device("meta")
TRANSFERS = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu}


class _RealHost(TorchFunctionMode):
    """Calls that touch no accelerator tensor run for real on the host; transfers make fake copies."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        values, _ = tree_flatten((args, kwargs))
        if func in TRANSFERS:
            moved = transfer(args[0], func, args[1:], kwargs)
            if moved is not None:
                return moved
        if any(_on_accelerator(v) for v in values):
            return func(*args, **kwargs)
        with unset_fake_temporarily():
            return func(*args, **kwargs)


def _on_accelerator(value) -> bool:
    """A fake tensor, a tensor or a device naming the accelerator (meta factories can give plain meta tensors)."""
    if isinstance(value, torch.Tensor):
        return isinstance(value, FakeTensor) or value.device.type == FAKE_DEVICE.type
    if isinstance(value, str):
        return value.split(":")[0] == FAKE_DEVICE.type
    return isinstance(value, torch.device) and value.type == FAKE_DEVICE.type


def transfer(tensor: torch.Tensor, func, args, kwargs) -> torch.Tensor | None:
    """A tensor moved between host and accelerator: a data-less tensor on the other side (None: not a move)."""
    target = torch.device("cpu") if func is torch.Tensor.cpu else kwargs.get("device")
    dtype = kwargs.get("dtype")
    for arg in args:
        if isinstance(arg, (str, torch.device)):
            target = torch.device(arg)
        elif isinstance(arg, torch.dtype):
            dtype = arg
    if func is torch.Tensor.cuda:
        target = FAKE_DEVICE
    if target is None or torch.device(target).type == tensor.device.type:
        return None
    return torch.empty(tensor.shape, dtype=dtype or tensor.dtype, device=torch.device(target).type)


class _NumbersReadBack(TorchDispatchMode):
    """The accelerator holds no data: a number read back from it is 1."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and _on_accelerator(args[0]):
            tensor = args[0]
            return True if tensor.dtype == torch.bool else 1.0 if tensor.is_floating_point() else 1
        return func(*args, **(kwargs or {}))


@contextmanager
def fake_accelerator() -> Iterator[torch.device]:
    with FakeTensorMode(allow_non_fake_inputs=True), _NumbersReadBack(), _RealHost():
        yield FAKE_DEVICE
