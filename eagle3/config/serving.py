"""Serving the draft and measuring it: the export layouts (`export`), the serving engine and drafting shape
(`serving`), the benchmark (`benchmark`, its suites in eagle3.config.suites) and the shape sweep (`sweep`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from packaging.version import InvalidVersion, Version
from pydantic import Field, field_validator, model_validator

from eagle3.config.base import Section, SshArgs
from eagle3.config.data import split_node
from eagle3.config.suites import HELDOUT, SuiteSection, distinct_names, suites_from
from eagle3.contract.problems import ProblemCode
from eagle3.shape import DEFAULT_NUM_STEPS, DraftShape, shape_problem


class ExportSection(Section):
    layouts: list[Literal["sglang", "speculators"]] = Field(default=["sglang"], min_length=1)
    waive: list[ProblemCode] = Field(
        default=[], description="validation problem codes accepted on purpose (e.g. a false positive); each is "
        "logged and recorded in the export's validation.json")
    verifier: str | None = Field(
        default=None, description="the verifier the speculators layout names, e.g. the hub id the target is published "
        "under, where the export is loaded on another machine (None: target.path, resolved)")
    fault: Literal["absolute-d2t"] | None = Field(
        default=None, description="demo and tests only: write the served export's d2t as absolute ids (the bug "
        "the pipeline exists to catch), to exercise the gate; the validator refuses it unless its codes are waived")

    @model_validator(mode="after")
    def _sglang_first(self) -> ExportSection:
        if "sglang" not in self.layouts:
            raise ValueError(f"export.layouts {self.layouts} must include sglang: it is the layout that is served")
        return self


class ServingSection(Section):
    engine: str = Field(default="reference", description="the serving engine, an entry of eagle3.serving "
                        "(docs/serving-and-benchmark.md): checked against the registry by eagle3.resolve")
    release: str | None = Field(default=None, description="SGLang release, e.g. 0.5.13; None = read from the server")
    python: str | None = Field(default=None, description="engine vllm: the interpreter of vLLM's environment (None = "
                               "the one `eagle3 install-vllm` made)")
    launcher: Literal["local", "ssh", "srun"] = "local"
    host: str = "127.0.0.1"
    port: int = Field(default=30000, gt=0, lt=65536)
    nodes: list[str] = Field(
        default=[], description="the nodes the serve and sweep stages' servers spread over, one server on each at a "
        "time, each entry 'host' or 'host:port' (port: serving.port): the candidate and its no-draft baseline on the "
        "first, production's re-measurement on the second, the sweep's no-draft server on every node and each shape "
        "on the next node free, its speedup against its own node's no-draft server. Empty: serving.host alone "
        "(docs/gpu-node.md)")
    tp: int = Field(default=1, ge=1)
    pp: int = Field(default=1, ge=1, description="pipeline-parallel stages of one replica of the target, each on "
                    "serving.tp GPUs (a target too big for one node: TP8 x PP2 spans two 8-GPU nodes). `eagle3 plan` "
                    "sizes every stage that holds the target by tp x pp GPUs; the launchers start tp only and refuse "
                    "more than 1")
    context_length: int = Field(gt=0)
    num_steps: int = Field(default=DEFAULT_NUM_STEPS, ge=1)
    eagle_topk: int = Field(default=1, ge=1)
    num_draft_tokens: int | None = Field(default=None, description="None = num_steps + 1 (chain drafting)")
    extra_args: list[str] = []
    ssh_host: str | None = Field(default=None, description="launcher ssh: the host to ssh to (None = host)")
    ssh_args: SshArgs = Field(
        default=[], description="launcher ssh: options before the host in every ssh it runs (the server, its GPU "
        "query, data.nodes' servers), e.g. [-p, '2222', -i, ~/.ssh/cluster, -o, ProxyJump=login-1]")
    srun_args: list[str] = Field(default=[], description="launcher srun: arguments before the command, e.g. [--nodes=1]")
    health_timeout_s: float = Field(default=1800.0, gt=0.0, description="how long the server may take to become healthy")
    log_dir: Path | None = Field(default=None, description="server logs (None = run.dir/logs)")
    gpu_free_mib: int = Field(default=2048, gt=0, description="after a stop, wait until every GPU uses less than this")
    gpu_free_timeout_s: float = Field(default=600.0, gt=0.0, description="how long to wait for the GPUs' memory")

    @field_validator("release")
    @classmethod
    def _release_is_version(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            Version(value)
        except InvalidVersion:
            raise ValueError(f"'{value}' is not a release number; write it like 0.5.13") from None
        return value

    @model_validator(mode="after")
    def _nodes(self) -> ServingSection:
        endpoints = self.endpoints
        if len(set(endpoints)) < len(endpoints):
            raise ValueError(f"serving.nodes {self.nodes} names an endpoint twice once serving.port {self.port} fills "
                             "in the missing ports: give each server its own host or port")
        here = {self.host, "127.0.0.1", "localhost"}
        elsewhere = [node for node, (host, _) in zip(self.nodes, endpoints) if host not in here]
        if self.launcher == "local" and elsewhere:
            raise ValueError(f"serving.nodes {elsewhere} name other hosts than serving.host {self.host}, where "
                             "serving.launcher local cannot start a server: set launcher ssh or srun, or give ports "
                             f"on this host ({self.host}:30001)")
        return self

    @property
    def endpoints(self) -> list[tuple[str, int]]:
        """(host, port) of each server the serve and sweep stages may start at once: serving.nodes', else serving's
        own."""
        if not self.nodes:
            return [(self.host, self.port)]
        return [(host, port or self.port) for host, port in (split_node(node, "serving.nodes") for node in self.nodes)]

    @model_validator(mode="after")
    def _drafting_shape(self) -> ServingSection:
        self.num_draft_tokens = DraftShape(self.num_steps, self.eagle_topk, self.num_draft_tokens).num_draft_tokens
        return self

    @property
    def shape(self) -> DraftShape:
        return DraftShape(self.num_steps, self.eagle_topk, self.num_draft_tokens)


class BenchmarkSection(Section):
    max_new_tokens: int = Field(gt=0)
    num_prompts: int = Field(gt=0)
    concurrency: list[int] = Field(default=[4], min_length=1, description="requests in flight: one level, or a list "
                                   "the sweep measures at each of; the first is production's")
    temperature: float = Field(default=0.0, ge=0.0, description="production traffic's sampling temperature: the sweep "
                               "measures at it (the acceptance checks, simulated and served, decode greedily)")
    request_timeout_s: float = Field(default=600.0, gt=0.0)
    retries: int = Field(default=2, ge=0)
    baseline: bool = Field(default=True, description="also measure the target without a draft (speedup); on the GPU "
                           "node that is one more server start")
    suites: list[SuiteSection] = Field(default=[SuiteSection(name=HELDOUT)], min_length=1, description="the prompt "
                                       "sets measured, each reported and gated on its own (eagle3/config/suites.py)")

    _suites = field_validator("suites", mode="before")(suites_from)
    _distinct = field_validator("suites")(distinct_names)

    @property
    def gating_suites(self) -> list[str]:
        return [suite.name for suite in self.suites if not suite.informational]

    @field_validator("concurrency", mode="before")
    @classmethod
    def _levels(cls, value: Any) -> Any:
        return [value] if isinstance(value, int) else value

    @field_validator("concurrency")
    @classmethod
    def _positive_levels(cls, value: list[int]) -> list[int]:
        if min(value) < 1 or len(set(value)) != len(value):
            raise ValueError(f"{value}: give distinct levels, each at least 1")
        return value

    @property
    def production_concurrency(self) -> int:
        return self.concurrency[0]


def replay_shape(serving: ServingSection | None) -> DraftShape:
    """The drafting shape replayed over the held-out sequences: serving's, or DraftShape's defaults (no serving
    section)."""
    return serving.shape if serving is not None else DraftShape(DEFAULT_NUM_STEPS)


class SweepSection(Section):
    """After the candidate passes its measurement: serve it under each drafting shape and pick the one with the most
    output tokens/s at the production concurrency (eagle3.deployment.sweep). On the GPU node every point is a server start."""

    enabled: bool = True
    points: list[tuple[int, int, int]] = Field(default=[], description="(num_steps, eagle_topk, num_draft_tokens) "
                                               "to serve, in this order, after the serving section's own shape")
    num_prompts: int | None = Field(default=None, gt=0, description="requests of each benchmark suite per measurement "
                                    "(None: every one): the first ones of each suite")
    budget_s: float = Field(default=7200.0, gt=0.0, description="wall time the sweep may take; points that would "
                            "run past it are skipped, each point's time estimated from the no-draft server's")

    @field_validator("points")
    @classmethod
    def _sglang_shapes(cls, value: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        for i, point in enumerate(value):
            problem = shape_problem(*point)
            if problem:
                raise ValueError(f"points[{i}] {list(point)}: {problem}")
        return value
