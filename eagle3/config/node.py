"""The GPU node's section (`node`): what `eagle3 plan` sizes memory and time against. The time figures are assumptions written here, not in code, so a measured one replaces them."""

from __future__ import annotations

from pydantic import Field

from eagle3.config.base import Section


class MfuSection(Section):
    """Assumed model FLOP utilisation (achieved / node.peak_tflops) per kind of work; infra/gpu-smoke/train.sh prints
    the draft training step's measured one (benchmarks/train_throughput.py)."""

    decode: float = Field(default=0.2, gt=0.0, le=1.0, description="generation at data.concurrency / "
                          "benchmark.concurrency (assumption, not measured): decode is usually bound by node.hbm_tbps "
                          "instead, and `eagle3 plan` takes the slower of the two bounds")
    prefill: float = Field(default=0.35, gt=0.0, le=1.0, description="the target's forward over whole sequences: "
                           "prompts, capture, online training's features (assumption, not measured)")
    train: float = Field(default=0.3, gt=0.0, le=1.0, description="the draft's training step, 6 x trainable "
                         "parameters x draft passes per token (assumption: replace it with the MFU "
                         "infra/gpu-smoke/train.sh prints)")


class NodeSection(Section):
    """The GPU machine the stages run on; `eagle3 plan` sizes every stage's memory and hours against it."""

    gpu_memory_gib: float = Field(default=141.0, gt=0.0, description="memory of one GPU (141 for an H200)")
    peak_tflops: float = Field(default=989.0, gt=0.0, description="dense bf16 TFLOP/s of one GPU: 989 for an H200 "
                               "SXM (NVIDIA's H200 datasheet: 1,979 with 2:4 sparsity, half of it dense)")
    hbm_tbps: float = Field(default=4.8, gt=0.0, description="memory bandwidth of one GPU in TB/s: 4.8 for an H200 "
                            "(NVIDIA's H200 datasheet); bounds decode, which reads every weight once per step")
    mfu: MfuSection = MfuSection()
    model_load_min: float = Field(default=10.0, ge=0.0, description="minutes from starting a target server (or "
                                  "engine) to its first request: weights, CUDA graphs. 10: the Kimi config's estimate "
                                  "for Kimi-K2.5 on 8 x H200, not measured")
    retrain_period_h: float = Field(default=168.0, gt=0.0, description="hours between scheduled retrains: 168, "
                                    "prefect.yaml's weekly retrain cron; `eagle3 plan` says whether a retrain fits")
