"""The trainers' feature backend for training.features streamed: the features of each micro-batch come from the
Mooncake store, captured by workers outside the training world.

The trainer says which rows it will read (`expect`: this rank's rows of each coming micro-batch, in order); the
backend keeps the coordinator told of the next LOOKAHEAD of them, so the workers capture ahead (up to the watermarks)
in the order the sampler draws. `features` takes a micro-batch: it waits until the coordinator says all of its
samples are in the store, reads them, and reports them consumed (the store frees them)."""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch

from eagle3.config.stream import StreamSection
from eagle3.errors import Eagle3Error
from eagle3.runtime.features import FeatureBackend, Features, TokenBatch, empty_features
from eagle3.stream.coordinator import CoordinatorClient
from eagle3.stream.store import Store, content_key

Log = Callable[[str], None]
SampleRef = Any  # a sample of the data set: its .id and .length (eagle3.train.data.SampleRef)
Tokens = Callable[[list[SampleRef]], TokenBatch]
LOOKAHEAD = 64  # micro-batches announced ahead of the one being read
WAIT_NOTE_S = 60.0  # a trainer waiting this long for its batch says so


@dataclass
class Expected:
    priority: int  # 0: evaluation's, read before training's (1)
    rows: list[SampleRef]
    announced: bool = False


class StreamedFeatures(FeatureBackend):
    name = "streamed"
    release = None  # the capture workers' engine; none of it runs in the trainer

    def __init__(self, stream: StreamSection, tokens: Tokens, settings: str, aux_width: int, hidden: int,
                 device: torch.device, log: Log):
        """`tokens`: the token rows of samples (the data set's); `settings`: the feature settings the content keys
        hash (eagle3.stream.store.feature_settings); `aux_width` / `hidden`: n_aux x H and H, to split a stored row."""
        self.tokens, self.settings, self.device, self.log = tokens, settings, device, log
        self.aux_width, self.hidden = aux_width, hidden
        self.client = CoordinatorClient(stream)
        self.store = Store.client(stream)
        self.queue: deque[Expected] = deque()  # this rank's coming micro-batches, in read order
        self.position = 0  # the order the next announced sample takes

    def expect(self, parts: list[list[SampleRef]], first: bool = False) -> None:
        """This rank's rows of the coming micro-batches, in order. `first`: read before what was expected already
        (evaluation between training steps); its samples go before training's at the workers too."""
        if first:
            self.queue.extendleft(Expected(0, part) for part in reversed(parts))
        else:
            self.queue.extend(Expected(1, part) for part in parts)
        self.announce()

    def announce(self) -> None:
        """Tell the coordinator of the next LOOKAHEAD micro-batches not told yet."""
        for expected in itertools.islice(self.queue, LOOKAHEAD):
            if not expected.announced and expected.rows:
                self.client.call("want", items=self.items(expected.rows), priority=expected.priority,
                                 first_position=self.position, token_bytes=(self.aux_width + self.hidden) * 4)
                self.position += len(expected.rows)
            expected.announced = True

    def items(self, refs: list[SampleRef]) -> list[dict]:
        tokens = self.tokens(refs)
        return [{"key": content_key(self.settings, tokens.input_ids[i, : ref.length]), "sample_id": ref.id,
                 "length": ref.length} for i, ref in enumerate(refs)]

    def features(self, batch: TokenBatch, rows: slice = slice(None)) -> Features:
        mine = batch.select(rows)
        if self.queue and [ref.id for ref in self.queue[0].rows] == mine.sample_ids:
            self.queue.popleft()
            self.announce()
        if not len(mine.sample_ids):
            return empty_features(self.aux_width, self.hidden, self.device)
        lengths = mine.lengths.tolist()
        items = [{"key": content_key(self.settings, mine.input_ids[i, :n]), "sample_id": sample_id, "length": n}
                 for i, (sample_id, n) in enumerate(zip(mine.sample_ids, lengths))]
        stored = self.take(items)
        width = mine.input_ids.shape[1]
        dtype = stored[0].dtype
        aux = torch.zeros(len(items), width, self.aux_width, dtype=dtype)  # [b, T, n_aux * H]
        last = torch.zeros(len(items), width, self.hidden, dtype=dtype)  # [b, T, H]
        for row, (tensor, n) in enumerate(zip(stored, lengths)):
            aux[row, :n], last[row, :n] = tensor[:, : self.aux_width], tensor[:, self.aux_width :]
        self.client.call("consumed", keys=[item["key"] for item in items])
        return Features(aux.to(self.device, non_blocking=True), last.to(self.device, non_blocking=True))

    def take(self, items: list[dict]) -> list[torch.Tensor]:
        """The stored rows [T, (n_aux + 1) * H] of `items`, once every one of them is in the store."""
        started, noted = time.monotonic(), time.monotonic()
        while True:
            reply = self.client.call("take", items=items)
            if "error" in reply:
                raise Eagle3Error(f"streamed features: {reply['error']}")
            if reply["ready"]:
                stored = [self.store.get(key) for key in reply["store_keys"]]
                missing = [item["key"] for item, tensor in zip(items, stored) if tensor is None]
                if not missing:
                    return [self.checked(item, tensor) for item, tensor in zip(items, stored)]
                self.client.call("lost", keys=missing)
            if time.monotonic() - noted > WAIT_NOTE_S:
                noted = time.monotonic()
                self.log(f"train: waiting {noted - started:.0f} s for the capture workers (a micro-batch of "
                         f"{len(items)} sample(s))")

    def checked(self, item: dict, tensor: torch.Tensor) -> torch.Tensor:
        expected = (item["length"], self.aux_width + self.hidden)
        if tuple(tensor.shape) != expected:
            raise Eagle3Error(f"sample {item['sample_id']}: the store holds features of shape {list(tensor.shape)} "
                              f"under its key, not {list(expected)} (tokens x (aux + last) width): another target "
                              "or layer set wrote it; start the stream's master afresh")
        return tensor

    def close(self) -> None:
        self.client.close()
        self.store.close()
