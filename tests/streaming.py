"""What the streamed-feature tests share (tests/test_streamed.py, tests/conformance/test_stream_worker.py): the
overrides of a streamed run on this machine (free ports, a store and watermarks a few micro samples wide), the train
stage as the flow runs it, and what a trained run directory holds."""

from __future__ import annotations

from safetensors.torch import load_file

from eagle3.config import resolved_config_file
from eagle3.resolve import load_config
from eagle3.train.launch import train
from helpers import TINY, metrics
from ports import free_port

# a few of the micro samples (~1 KB a token: 3 aux layers and the last state, 64 wide, float32): the workers pause
HIGH_GIB, LOW_GIB = 0.0002, 0.0001


def streamed(workers: int = 2, *extra: str) -> list[str]:
    return ["training.features=streamed", f"training.stream.master_port={free_port()}",
            f"training.stream.metadata_port={free_port()}", f"training.stream.coordinator_port={free_port()}",
            f"training.stream.workers_per_host={workers}", "training.stream.store_gib=0.25",
            f"training.stream.high_watermark_gib={HIGH_GIB}", f"training.stream.low_watermark_gib={LOW_GIB}", *extra]


def trained(overrides, lines=None, on_metrics=None):
    config = load_config(TINY, overrides)
    log = (lines.append if lines is not None else lambda line: None)
    return train(config.run, config.data, config.training, config.serving, resolved_config_file(config), log,
                 on_metrics)


def losses(run_dir):
    return [r["loss"] for r in metrics(run_dir) if "loss" in r]


def final_weights(run_dir):
    return load_file(run_dir / "train" / "final" / "model.safetensors")
