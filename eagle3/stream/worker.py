"""A capture worker: `python -m eagle3.stream.worker --config C --name N`, one per target replica, started by the train
stage (here, or through ssh on training.stream.capture_hosts). It claims samples from the coordinator, prefills them
with data.feature_backend's target (the local engine here; SGLang's runner on the node, tensor-parallel over the
replica's GPUs) and puts each sample's features into the store under its content key. The token rows come from the
run's data set (a shared run directory, as multi-node training already reads it)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from eagle3.config.stream import StreamSection
from eagle3.data.capture import capture_settings, dataset_dir
from eagle3.data.shards import ShardReader
from eagle3.errors import Eagle3Error
from eagle3.resolve import load_config
from eagle3.distributed import Dist, setup_distributed
from eagle3.runtime.backends import target_backend
from eagle3.runtime.features import FeatureBackend, pad_rows
from eagle3.stream.coordinator import CoordinatorClient
from eagle3.stream.ledger import Claim
from eagle3.stream.store import Store, content_key, feature_settings

IDLE_S = 0.05  # after a claim that found nothing (paused, or the trainers announced nothing yet)


class TokenRows:
    """The data set's token rows by sample id."""

    def __init__(self, directory: Path):
        readers = [ShardReader(p) for p in sorted(directory.glob("shard-?????.safetensors"))]
        if not readers:
            raise Eagle3Error(f"{directory}: no data set here; run `eagle3 data capture` first")
        self.where = {reader.ids[i]: (reader, i) for reader in readers for i in range(len(reader))}

    def row(self, item: Claim) -> list[int]:
        reader, index = self.where[item.sample_id]
        return reader.sample(index, ("input_ids", "loss_mask")).input_ids[: item.length].tolist()


class CaptureWorker:
    """One target replica. Its rank 0 talks to the coordinator and the store; every rank of a tensor-parallel replica
    runs each forward (`dist`: the replica's ranks)."""

    def __init__(self, stream: StreamSection, name: str, rows: TokenRows, settings: str, backend: FeatureBackend,
                 dist: Dist):
        """`settings`: what the content keys hash beside the tokens (eagle3.stream.store.feature_settings)."""
        self.stream, self.name, self.rows, self.settings, self.backend, self.dist = (stream, name, rows, settings,
                                                                                     backend, dist)
        if dist.main:
            self.store = Store.client(self.stream)
            self.client = CoordinatorClient(self.stream)

    def run(self) -> str:
        """Capture until the coordinator says stop; returns why it did."""
        while True:
            reply = self.dist.broadcast(self.claim() if self.dist.main else None)
            if "stop" in reply:
                return reply["stop"]
            if reply["items"]:
                self.capture([Claim(**item) for item in reply["items"]])

    def claim(self) -> dict:
        reply = self.client.call("claim", worker=self.name, limit=self.stream.capture_batch)
        if not reply.get("items") and "stop" not in reply:
            time.sleep(IDLE_S)
        return reply

    def capture(self, items: list[Claim]) -> None:
        """One forward over the claimed samples; rank 0 puts each one's features and reports it."""
        rows = [self.rows.row(item) for item in items]
        batch = pad_rows(rows, [item.sample_id for item in items])
        with torch.no_grad():
            features = self.backend.features(batch)
        if not self.dist.main:
            return
        for i, item in enumerate(items):
            key = content_key(self.settings, batch.input_ids[i, : item.length])
            if key != item.key:
                raise Eagle3Error(f"sample {item.sample_id}: its token row in the data set is not the one the "
                                  "trainer announced (the data set changed under a running stream); run the train "
                                  "stage again")
            # [T, (n_aux + 1) * H]: aux states, then the last hidden state
            tensor = torch.cat([features.aux[i, : item.length], features.last[i, : item.length]], dim=-1).cpu()
            self.store.put(item.store_key, tensor)
            self.client.call("captured", worker=self.name, key=item.key, size=tensor.numel() * tensor.element_size(),
                             length=item.length)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3.stream.worker", description=__doc__)
    parser.add_argument("--config", required=True, help="the run's resolved config (run.dir/config.resolved.yaml)")
    parser.add_argument("--name", required=True, help="the worker's name in the ledger and the log")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
        dist = setup_distributed()  # a tensor-parallel replica's ranks, under torchrun
        started = time.monotonic()
        backend = target_backend(config.data, config.target, dist.device, dist.rank, dist.world)
        if dist.main:  # a Kimi replica loads for minutes: the log says when it captures
            print(f"capture {args.name}: data.feature_backend {config.data.feature_backend} "
                  f"({type(backend).__name__}) ready in {time.monotonic() - started:.1f} s", flush=True)
        rows = TokenRows(dataset_dir(config.run, config.training))
        settings = feature_settings(capture_settings(config.data, config.target))
        why = CaptureWorker(config.training.stream, args.name, rows, settings, backend, dist).run()
        if dist.main:
            print(f"capture {args.name}: stopped ({why})", flush=True)
        if dist.world > 1:
            torch.distributed.destroy_process_group()
        return 0
    except Eagle3Error as err:
        print(f"capture {args.name}: {err}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
