"""Memory of one training step, measured by running the trainer's own step on tensors without storage.

torch's FakeTensorMode gives tensors shapes, dtypes and devices but no data, so the real teacher, the draft's
forward, loss and backward run at full size (a Kimi-sized draft at 4,096 tokens) in seconds on any
machine, and every allocation they make is counted here. bf16 autocast stands in for the GPU's (the
trainer's policy: bf16 matmuls, float32 norms and softmaxes); attention takes the fused path, which
keeps no score matrix, as CUDA's kernels do. Parameters and inputs are made before counting starts:
the plan adds them itself.
"""

from __future__ import annotations

import functools
import json
import weakref
from collections import Counter

import torch
from pydantic import BaseModel
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from eagle3.algorithms import DraftAlgorithm, algorithm
from eagle3.config.draft import DraftSection
from eagle3.model.teacher import TeacherHead
from eagle3.resolve import resolved_draft


class AllocationPeak(TorchDispatchMode):
    """Counts the bytes of every storage an op creates while they are alive; keeps the peak, and what was alive at
    it by the (aten) op that made it."""

    def __init__(self):
        super().__init__()
        self.seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.current = self.peak = 0
        self.by_op: Counter[str] = Counter()  # bytes alive now
        self.peak_by_op: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for tensor in tree_flatten((args, kwargs))[0]:
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage() not in self.seen:
                self.seen[tensor.untyped_storage()] = 0  # made before counting began (weights, inputs): not ours
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self.count(tensor.untyped_storage(), func.overloadpacket.__name__)
        return out

    def count(self, storage, op: str) -> None:
        """A storage first seen as an op's output is new (a view of an earlier one shares its storage)."""
        if storage in self.seen:
            return
        size = storage.nbytes()
        self.seen[storage] = size
        self.current += size
        self.by_op[op] += size
        if self.current > self.peak:
            self.peak, self.peak_by_op = self.current, {name: n for name, n in self.by_op.items() if n}
        weakref.finalize(storage, self.release, size, op)

    def release(self, size: int, op: str) -> None:
        self.current -= size
        self.by_op[op] -= size


def trainable_parameters(entry: DraftAlgorithm, cfg: BaseModel) -> int:
    """Counted on a draft built on the meta device: exact, and nothing allocated."""
    with torch.device("meta"):
        model = entry.new_model(cfg, torch.empty(cfg.vocab_size, cfg.hidden_size))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def training_step_peak_bytes(entry: DraftAlgorithm, cfg: BaseModel, draft: DraftSection, sequences: int,
                              seq_len: int, predictions: int, pre_norm: bool, recompute: bool) -> int:
    """Peak bytes one rank allocates during a step on `sequences` x `seq_len` tokens: teacher outputs,
    draft activations, loss, gradients, and the transients between them (not the weights or the batch), with the
    backward recomputing the norms and the SwiGLU product or not (training.recompute).
    Measured once per shape in a process (seconds at Kimi's size, and the config check, `eagle3 plan` and the
    flow's load-config each ask)."""
    return _measured_peak(entry.name, cfg.model_dump_json(), draft.model_dump_json(), sequences, seq_len, predictions,
                          pre_norm, recompute)[0]


def training_step_peak_by_op(entry: DraftAlgorithm, cfg: BaseModel, draft: DraftSection, sequences: int,
                             seq_len: int, predictions: int, pre_norm: bool, recompute: bool) -> dict[str, int]:
    """What `training_step_peak_bytes` counts, by the aten op that made each tensor alive at the peak (largest first):
    where a step's memory goes (`_to_copy`: dtype casts, `mm`: matmul outputs, ...)."""
    by_op = _measured_peak(entry.name, cfg.model_dump_json(), draft.model_dump_json(), sequences, seq_len, predictions,
                           pre_norm, recompute)[1]
    return dict(sorted(by_op.items(), key=lambda item: -item[1]))


@functools.lru_cache(maxsize=16)
def _measured_peak(algorithm_name: str, cfg_json: str, draft_json: str, sequences: int, seq_len: int, predictions: int,
                   pre_norm: bool, recompute: bool) -> tuple[int, dict[str, int]]:
    entry = algorithm(algorithm_name)
    cfg, draft = entry.config_type.model_validate_json(cfg_json), resolved_draft(json.loads(draft_json))
    # every token generated (the most the loss reads); the rows are made on the host, as the trainer makes them
    rows = entry.loss_rows(torch.ones(sequences, seq_len, dtype=torch.long), predictions, draft)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = entry.new_model(cfg, torch.empty(cfg.vocab_size, cfg.hidden_size))
        model.set_recompute(recompute)
        hot = torch.arange(cfg.draft_vocab_size)
        norm = torch.empty(cfg.hidden_size) if pre_norm else None
        teacher_head = TeacherHead(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=torch.bfloat16), hot, norm)
        aux = torch.empty(sequences, seq_len, len(cfg.aux_layers) * cfg.target_hidden_size)
        last = torch.empty(sequences, seq_len, cfg.target_hidden_size)
        ids = torch.zeros(sequences, seq_len, dtype=torch.long)
        with AllocationPeak() as tracker:
            teacher = teacher_head(last, rows.teacher)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                stats = entry.training_module(model)(aux, ids, teacher, rows)
            stats[0].sum().backward()
    return tracker.peak, tracker.peak_by_op
