"""Target features: what the draft reads from the target, for a batch of token rows, as tensors on the caller's device.

    aux   [B, T, n_aux * H]  outputs of the decoder layers `aux_layers` (id k = output of layer k, HF
                             hidden_states[k + 1]), concatenated in layer order
    last  [B, T, H]          the target's last hidden state, before (`pre_norm`) or after (`post_norm`) its final norm

Backends, one interface:
- `transformers`: the target through transformers with forward hooks on the captured layers and the final norm
  (the tiny target, CPU tests, small targets on a GPU);
- `sglang`: SGLang's model runner built inside each torchrun rank, the target tensor-parallel over the ranks
  (eagle3/runtime/sglang_features.py, run in the node's SGLang environment);
- `shards`: features stored by an offline capture (eagle3/data/shards.py), read back by sample id;
- `streamed`: features capture workers outside the training world put into a Mooncake store (eagle3/stream/).

A batch is the same on every rank of a tensor-parallel group; `rows` picks the rows a rank keeps. Features never
pass through Python lists: a float row turned into Python numbers costs ~15 ms per token at Kimi's width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from eagle3.config.run import TargetSection
from eagle3.runtime.targets import load_target_model


@dataclass
class TokenBatch:
    input_ids: torch.Tensor  # [B, T] int64, right-padded (padding is never read back)
    lengths: torch.Tensor  # [B] int64 on the CPU: the real tokens of each row
    sample_ids: list[str]  # which samples the rows are (the shards backend reads by id)

    def select(self, rows: slice) -> TokenBatch:
        lengths = self.lengths[rows]
        width = int(lengths.max()) if len(lengths) else 0
        return TokenBatch(self.input_ids[rows, :width], lengths, self.sample_ids[rows])


@dataclass
class Features:
    aux: torch.Tensor  # [B, T, n_aux * H]
    last: torch.Tensor  # [B, T, H]


class FeatureBackend(Protocol):
    name: str
    release: str | None  # the engine release that computed the features (None: not an SGLang engine)

    def features(self, batch: TokenBatch, rows: slice = slice(None)) -> Features:
        """Features of batch rows `rows`, on the caller's device; positions past a row's length are unspecified.
        No rows selected: empty [0, 0, width] tensors (a tensor-parallel backend still joins the batch's forward)."""

    def close(self) -> None:
        """Free the target (its GPU memory above all)."""

    def expect(self, parts: list, first: bool = False) -> None:
        """The rows this rank will ask for, per coming forward, in order (`first`: before those expected already).
        A backend that computes or reads features when asked has nothing to prepare; the streamed one has them
        captured ahead (eagle3/stream/features.py)."""
        return None


def empty_features(aux_width: int, hidden: int, device: torch.device) -> Features:
    """What a rank gets when a batch has no rows for it (a last batch smaller than the ranks)."""
    return Features(torch.zeros(0, 0, aux_width, device=device), torch.zeros(0, 0, hidden, device=device))


def pad_rows(rows: list[list[int]], sample_ids: list[str]) -> TokenBatch:
    """Token rows (ids are integers: lists are fine here) as a right-padded batch."""
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    ids = torch.zeros(len(rows), int(lengths.max()), dtype=torch.long)  # [B, T]
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return TokenBatch(ids, lengths, list(sample_ids))


class TransformersFeatures(FeatureBackend):
    """The target through transformers; hooks record the captured layers' outputs and the final norm's input and
    output, so one forward gives both kinds and no other layer's states are kept (output_hidden_states would hold
    all of them). bf16 on a GPU; on the CPU the target's one precision (target.dtype), as the data stage generated."""

    name = "transformers"
    release = None

    def __init__(self, target: TargetSection | str, aux_layers: list[int], last_hidden: str, device: torch.device,
                 trust_remote_code: bool = False):
        """`trust_remote_code` for a target given by path (a TargetSection brings its own)."""
        dtype = "bfloat16" if device.type == "cuda" else None
        self.model = load_target_model(target, trust_remote_code, dtype).to(device)
        self.device, self.aux_layers, self.last_hidden = device, list(aux_layers), last_hidden
        inner = self.model.model
        self._seen: dict[str, torch.Tensor] = {}
        self._hooks = [inner.layers[k].register_forward_hook(self._recorder(f"aux{k}")) for k in self.aux_layers]
        self._hooks.append(inner.norm.register_forward_hook(self._record_norm))

    def _recorder(self, key: str):
        def record(module, inputs, output) -> None:
            self._seen[key] = output[0] if isinstance(output, tuple) else output

        return record

    def _record_norm(self, module, inputs, output) -> None:
        self._seen["pre_norm"], self._seen["post_norm"] = inputs[0], output

    @torch.no_grad()
    def features(self, batch: TokenBatch, rows: slice = slice(None)) -> Features:
        """Right padding: causal attention keeps every real position independent of the padding after it."""
        mine = batch.select(rows)
        if not len(mine.sample_ids):
            return empty_features(len(self.aux_layers) * self.model.config.hidden_size, self.model.config.hidden_size, self.device)
        ids = mine.input_ids.to(self.device)  # [b, T]
        positions = torch.arange(ids.shape[1], device=self.device)
        attention = (positions[None, :] < mine.lengths.to(self.device)[:, None]).long()
        self._seen.clear()
        self.model.model(input_ids=ids, attention_mask=attention, use_cache=False)  # the head is never run
        aux = torch.cat([self._seen[f"aux{k}"] for k in self.aux_layers], dim=-1)  # [b, T, n_aux * H]
        return Features(aux=aux, last=self._seen[self.last_hidden])

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        del self.model
