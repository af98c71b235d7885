"""The plan of a streamed run (training.features streamed): how many of the nodes run capture workers, the train
stage's hours when the workers and the trainers are pipelined through the store, and what the store carries (bytes
per token and sample, the samples its watermarks hold, the network each node needs at the planned rate)."""

from __future__ import annotations

from typing import Callable

from eagle3.config.data import DataSection
from eagle3.config.run import TargetSection
from eagle3.config.training import TrainingSection
from eagle3.data.shards import FEATURE_DTYPES
from eagle3.data.storage import DTYPE_NAMES
from eagle3.errors import ConfigError


def choose_capture_nodes(nodes: int, asked: int | None, asked_by: str,
                         train_hours: Callable[[int], float | None]) -> tuple[int, str]:
    """A streamed run's capture nodes of `nodes`, and why: `asked` (named by `asked_by`), else the count whose
    `train_hours` (the first run's train stage with that many capture nodes) are fewest: capture prefill balanced
    against the draft's steps. On one node the workers share it with the trainers (0)."""
    if asked is not None:
        if asked >= nodes:
            raise ConfigError(f"{asked_by} {asked} leaves none of the {nodes} node(s) to the trainers: give 1 to "
                              f"{nodes - 1}, or plan more --nodes")
        return asked, f"{asked} capture node(s) of {nodes} ({asked_by})"
    if nodes == 1:
        return 0, "1 node: the capture workers and the trainers share its GPUs, taking turns"
    hours = {capture: h for capture in range(1, nodes) if (h := train_hours(capture)) is not None}
    if not hours:
        return nodes - 1, f"{nodes - 1} capture node(s) of {nodes}: no split could be timed (the train stage says why)"
    best = min(hours, key=hours.get)  # the fewer capture nodes on a tie
    tried = ", ".join(f"{k}: {h:.2f} h" for k, h in hours.items())
    return best, (f"{best} capture node(s) of {nodes}, chosen: the shortest first-run train stage by capture nodes "
                  f"({tried}); --capture-nodes sets it")


def streamed_parts(trainers: dict[str, float], captured: int, replica: int, node_gpus: int, capture_nodes: int,
                   prefill_h: Callable[[int], float], start_h: float) -> dict[str, float] | str:
    """The train stage's hours by part when capture workers (whole replicas of `replica` GPUs on the capture nodes of
    `node_gpus` each) prefill the `captured` tokens in `prefill_h(GPUs)` hours, beside the trainers' `trainers` hours:
    pipelined through the store on their own nodes (the slower counts), in turn on one shared node (capture_nodes 0).
    A str: why the split cannot run."""
    nodes = capture_nodes or 1
    replicas = nodes * node_gpus // replica
    if not replicas:
        return (f"a replica of the target is {replica} GPUs (serving.tp x serving.pp), more than {nodes} node(s) of "
                f"training.nproc_per_node {node_gpus}: plan more --nodes or --capture-nodes")
    where = f"{replicas} replica(s) of {replica} GPUs on {nodes} node(s)"
    prefill = prefill_h(replicas * replica)
    parts = {f"capture workers: 1 engine start{' on each capture node, at once' if nodes > 1 else ''}": start_h,
             **trainers}
    if not capture_nodes:
        parts[f"capture prefill of the {captured / 1e9:.2f} B tokens on {where}, the trainers' GPUs: in turn with "
              "their steps"] = prefill
        return parts
    beside = round(sum(trainers.values()), 3)
    parts[f"capture prefill of the {captured / 1e9:.2f} B tokens on {where}: {prefill:.2f} h pipelined with the "
          f"trainers' {beside:.2f} h through the store; the part beyond them"] = round(max(prefill - beside, 0.0), 3)
    return parts


def stream_flow(data: DataSection, target: TargetSection, training: TrainingSection, nodes: tuple[int, int],
                rate: tuple[int, float] | None) -> tuple[dict, list[str]]:
    """What streams through the store (exact, from the shapes and training.stream) and, at `rate` (tokens captured,
    hours), the network each of the (all, capture) `nodes` needs (an estimate, from the hours). As figures and
    lines."""
    stream = training.stream
    # the features alone: the token ids stay in the run's data set
    per_token = (len(data.aux_layers) + 1) * target.hidden_size * FEATURE_DTYPES[data.feature_dtype].itemsize
    per_sample = per_token * training.seq_len

    def samples(gib: float) -> int:
        return int(gib * 2**30 // per_sample)

    high = samples(stream.high_watermark_gib)
    figures = {"bytes_per_token": per_token, "bytes_per_sample": per_sample, "store_gib": stream.store_gib,
               "store_samples": samples(stream.store_gib), "high_watermark_samples": high,
               "low_watermark_samples": samples(stream.low_watermark_gib)}
    lines = [f"{per_token:,} B per token through the store ({len(data.aux_layers)} aux + 1 last state x "
             f"{target.hidden_size} x {DTYPE_NAMES[data.feature_dtype]}), {per_sample / 1e6:,.1f} MB per "
             f"sample at training.seq_len {training.seq_len:,} (exact, from the shapes)",
             f"the store (training.stream.store_gib {stream.store_gib:g}) holds {samples(stream.store_gib):,} samples; "
             f"the workers pause at high_watermark_gib {stream.high_watermark_gib:g} ({high:,} samples, "
             f"{high / training.batch_size:.0f} global batches of training.batch_size {training.batch_size}) and go "
             f"on at low_watermark_gib {stream.low_watermark_gib:g} ({samples(stream.low_watermark_gib):,} samples)"]
    total, capture = nodes
    if rate is not None:
        tokens, hours = rate
        per_s, trainers = tokens * per_token / (hours * 3600), total - capture
        figures |= {"store_gb_per_s": round(per_s / 1e9, 2),
                    "capture_node_egress_gb_per_s": round(per_s / capture / 1e9, 2),
                    "trainer_node_ingress_gb_per_s": round(per_s / trainers / 1e9, 2)}
        lines.append(f"at the planned rate ({tokens / 1e9:.2f} B tokens in {hours:.2f} h, an estimate): "
                     f"{per_s / 1e9:.2f} GB/s through the store, {per_s / capture / 1e9:.2f} GB/s out of each of the "
                     f"{capture} capture node(s), {per_s / trainers / 1e9:.2f} GB/s into each of the {trainers} trainer "
                     f"node(s), and {per_s / 1e9:.2f} GB/s both in and out of training.stream.host, whose memory holds "
                     "the store")
    lines.append("regenerate's servers and the capture workers are 2 starts: SGLang's server returns one hidden state "
                 "per token, as JSON lists: the last layer's, or with --enable-return-aux-hidden-states (0.5.23) the "
                 "aux layers' in its place, never both; the workers need both, as tensors, and take them from its "
                 "model runner in a torchrun of their own (read from SGLang 0.5.23's wheel; docs/streamed-features.md)")
    return figures, lines
