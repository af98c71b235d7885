"""Streamed features' section (`training.stream`): capture workers put each sample's target features into a Mooncake
store, the trainers take them by key (docs/streamed-features.md). Sizes are GiB of the store, which lives in the
coordinator's process on `stream.host`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from eagle3.config.base import Section
from eagle3.config.data import split_node


class StreamSection(Section):
    host: str = Field(
        default="127.0.0.1", min_length=1, description="where the pipeline runs the stream's coordinator (its ledger "
        "and the store's memory) and, with master start, the Mooncake master: an address every capture and training "
        "node reaches")
    master: str = Field(
        default="start", min_length=1, description="start: the pipeline starts mooncake_master on stream.host and stops "
        "it at the end; host:port: a running master's RPC address (its HTTP metadata server at "
        "host:stream.metadata_port)")
    master_port: int = Field(default=50051, gt=0, lt=65536, description="master start: the master's RPC port")
    metadata_port: int = Field(default=8080, gt=0, lt=65536, description="the master's HTTP metadata server port")
    coordinator_port: int = Field(default=50070, gt=0, lt=65536, description="the coordinator's HTTP port on "
                                  "stream.host (workers claim samples there, trainers take them)")
    capture_hosts: list[str] = Field(
        default=[], description="one entry per capture node, each starting workers_per_host capture workers through "
        "ssh (training.ssh_args, training.python); empty: the workers run here")
    workers_per_host: int = Field(default=1, ge=1, description="capture workers per capture node (per host here): one "
                                  "per target replica, each a tensor-parallel group of the node's GPUs")
    replica_ranks: int | None = Field(
        default=None, ge=1, description="processes (GPUs) of one capture worker, a tensor-parallel group of the "
        "target: None - serving.tp with data.feature_backend sglang, else 1. A worker of several runs under torchrun; "
        "its rank 0 claims and puts, every rank prefills")
    store_gib: float = Field(default=4.0, ge=1 / 64, description="memory the store holds samples in (mounted by the "
                             "coordinator; Mooncake refuses a segment under 16 MiB); the master evicts above 90 % of "
                             "it, so high_watermark_gib stays below")
    high_watermark_gib: float = Field(default=2.0, gt=0.0, description="the workers pause once the captured, not yet "
                                      "consumed samples reach this")
    low_watermark_gib: float = Field(default=1.0, ge=0.0, description="paused workers go on once the store is down to "
                                     "this")
    capture_batch: int = Field(default=4, gt=0, description="samples a worker claims and prefills at once")
    lease_s: float = Field(default=300.0, gt=0.0, description="a claim a worker has not delivered after this goes to "
                           "another worker (a worker that died is noticed at once when the pipeline started it)")
    protocol: Literal["tcp", "rdma"] = Field(default="tcp", description="Mooncake's transfer protocol")
    rdma_devices: str = Field(default="", description="protocol rdma: the NICs, e.g. mlx5_0,mlx5_1")

    @field_validator("capture_hosts")
    @classmethod
    def _hosts(cls, hosts: list[str]) -> list[str]:
        for host in hosts:
            if split_node(host)[1] is not None:
                raise ValueError(f"training.stream.capture_hosts entry {host!r} is a host, not host:port: workers "
                                 "listen on no port")
        if len(set(hosts)) < len(hosts):
            raise ValueError(f"training.stream.capture_hosts {hosts} names a host twice: raise workers_per_host instead")
        return hosts

    @field_validator("master")
    @classmethod
    def _master(cls, master: str) -> str:
        if master != "start":
            host, port = split_node(master)
            if port is None:
                raise ValueError(f"training.stream.master {master!r}: write start, or a running master's host:port "
                                 "(e.g. node-1:50051)")
        return master

    @model_validator(mode="after")
    def _watermarks(self) -> StreamSection:
        if not self.low_watermark_gib < self.high_watermark_gib:
            raise ValueError(f"training.stream.low_watermark_gib {self.low_watermark_gib} must be below "
                             f"high_watermark_gib {self.high_watermark_gib}")
        if self.high_watermark_gib > 0.85 * self.store_gib:
            raise ValueError(f"training.stream.high_watermark_gib {self.high_watermark_gib} is above 85 % of store_gib "
                             f"{self.store_gib}: Mooncake's master evicts objects from 90 %, which would drop features "
                             f"no trainer has read; set it to {0.85 * self.store_gib:.2f} or less")
        return self

    @property
    def capture_nodes(self) -> int:
        return max(len(self.capture_hosts), 1)

    @property
    def workers(self) -> int:
        return self.capture_nodes * self.workers_per_host

    def master_address(self) -> str:
        return f"{self.host}:{self.master_port}" if self.master == "start" else self.master

    def metadata_url(self) -> str:
        host = self.host if self.master == "start" else split_node(self.master)[0]
        return f"http://{host}:{self.metadata_port}/metadata"
