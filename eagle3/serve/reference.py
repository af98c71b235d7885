"""The reference server: the subset of SGLang's HTTP API the pipeline uses, with real speculative decoding
(chains and trees, greedy and sampled) on a transformers target (docs/gpu-node.md), counted the way SGLang counts
(docs/contracts.md).

Per request: the prefill forward gives the first completion token (no verify step). Each verify step:
the draft proposes a tree from the target's aux features of the verified prefix, as its algorithm's server worker
drafts (the entry's drafter: EAGLE-3's tree drafting, a chain with eagle_topk 1; a block draft's
block of num_draft_tokens, a chain); the target scores every node in ONE forward over prefix + nodes with a tree
attention mask; the longest path that passes (greedy: the target's argmax; temperature > 0: SGLang's
target-only speculative sampling) is accepted, plus the target's own next token (the bonus). The request
grows, finishes and counts as the release it stands for does (`eagle3.bench.counting`, proven against
SGLang's own code). The target recomputes the whole sequence each forward (no KV cache): slow, but nothing
to get wrong.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

from eagle3.algorithms import EAGLE3, draft_algorithm
from eagle3.algorithms.base import DraftAlgorithm, DraftModel, Drafter
from eagle3.bench.counting import SpecRequest, server_accept_length
from eagle3.model.aux_states import aux_states
from eagle3.model.tree import ROOT, DraftTree, tree_attention, walk_greedy, walk_sampled
from eagle3.serve.telemetry import Telemetry
from eagle3.serving.sglang import sglang_method
from eagle3.shape import DraftShape

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
DEFAULT_TEMPERATURE = 1.0  # SGLang's default: a request that names no temperature samples there
GREEDY_BELOW = 1e-6  # SGLang decodes greedily (top_k 1) under this temperature
SAMPLING_DEFAULTS = {"top_p": 1.0, "top_k": -1, "min_p": 0.0}  # what this server samples with: SGLang's defaults


class BadRequest(ValueError):
    """A request SGLang would take but this server cannot serve, or one SGLang would refuse too."""


@dataclass
class Served:
    target: torch.nn.Module
    tokenizer: object
    eos_ids: frozenset[int]
    draft: DraftModel | None
    algorithm: DraftAlgorithm  # the draft's (eagle3.algorithms.draft_algorithm): how it drafts and is counted
    shape: DraftShape
    release: str | None  # the SGLang release whose finish rule and meta_info keys this server follows
    generator: torch.Generator  # the coins of sampled requests, seeded at start: a rerun answers alike
    totals: list[int] = field(default_factory=lambda: [0, 0])  # [Σ correct drafts, Σ verify_ct] with a draft
    telemetry: Telemetry | None = None  # /metrics and request records, when the server is started with them
    lock: threading.Lock = field(default_factory=threading.Lock)


@torch.no_grad()
def target_forward(served: Served, ids: list[int], tree: DraftTree | None = None):
    """ids [T] (+ the tree's nodes, each seeing the prefix and its ancestors) -> (logits [T + N, V] float32,
    aux features [T + N, n_aux * H] or None)."""
    layers = served.draft.config.aux_layers if served.draft is not None else None
    extra = {}
    if tree is not None and tree.tokens:
        positions, visible = tree_attention(len(ids), tree)
        extra = {"position_ids": positions[None], "attention_mask": verify_masks(served.target, positions, visible)}
        ids = ids + tree.tokens
    out = served.target(torch.tensor([ids]), output_hidden_states=layers is not None, **extra)
    aux = aux_states(out.hidden_states, layers)[0].float() if layers else None
    return out.logits[0].float(), aux


def verify_masks(target, positions: torch.Tensor, visible: torch.Tensor):
    """The additive mask [1, 1, T + N, T + N] for `visible` [T + N, T + N], which transformers applies as given. An
    explicit mask replaces the one transformers would build, sliding window included: a target with sliding-window
    layers (Gemma 3; Qwen2 with use_sliding_window) gets a mask per layer type, those layers seeing only the keys less
    than sliding_window positions back, as its own masks do."""
    dtype = target.dtype  # the mask is added to the scores, in the target's precision

    def additive(seen: torch.Tensor) -> torch.Tensor:
        return torch.zeros(seen.shape, dtype=dtype).masked_fill(~seen, torch.finfo(dtype).min)[None, None]

    layer_types = set(getattr(target.config, "layer_types", None) or ())
    if "sliding_attention" not in layer_types:
        return additive(visible)
    within = positions[:, None] - positions[None, :] < target.config.sliding_window  # [T + N, T + N]
    return {"full_attention": additive(visible), "sliding_attention": additive(visible & within)}


def next_token(served: Served, logits: torch.Tensor, temperature: float) -> int:
    """Plain decoding of one token from logits [V]: argmax, or a sample at the temperature."""
    if temperature < GREEDY_BELOW:
        return int(logits.argmax())
    return int(torch.multinomial((logits / temperature).softmax(-1), 1, generator=served.generator))


def verify(served: Served, seq: list[int], aux: torch.Tensor, temperature: float,
           drafter: Drafter) -> tuple[list[int], torch.Tensor]:
    """One verify step after the verified `seq` (aux [len(seq) - 1, n_aux * H]; `drafter` the request's): the run it
    yields (accepted drafts + the bonus token) and the aux features of the verified prefix after it. Sampled requests
    follow SGLang's target-only rule, which its block drafts' worker applies to a chain alike."""
    tree = drafter(aux, torch.tensor(seq)).pruned(served.target.config.vocab_size)
    logits, aux = target_forward(served, seq, tree)  # ONE verify forward: [len(seq) + N, V]
    row = lambda node: logits[len(seq) - 1 if node == ROOT else len(seq) + node]  # noqa: E731 (after `node`)
    if temperature < GREEDY_BELOW:
        path = walk_greedy(tree, lambda node: int(row(node).argmax()), served.shape.num_steps)
        bonus = int(row(path[-1] if path else ROOT).argmax())
    else:
        path, bonus = walk_sampled(tree, lambda node: (row(node) / temperature).softmax(-1), served.generator,
                                   served.shape.num_steps)
    # features of the verified prefix: x_0 .. x_{P-1} and the accepted nodes (causal: the others don't matter)
    return [tree.tokens[n] for n in path] + [bonus], torch.cat([aux[: len(seq)], aux[[len(seq) + n for n in path]]])


def decode(served: Served, prompt: list[int], max_new_tokens: int, temperature: float = 0.0) -> SpecRequest:
    """Decoding of one request (speculative when a draft is loaded), grown and counted as SGLang does."""
    request = SpecRequest(max_new_tokens, served.eos_ids, served.release, sglang_method(served.algorithm))
    logits, aux = target_forward(served, prompt)  # prefill: [P, V], aux [P, n_aux * H]
    request.add_token(next_token(served, logits[-1], temperature))
    drafter = served.algorithm.drafter(served.draft, served.shape) if served.draft is not None else None
    while request.finish is None:
        seq = prompt + request.output  # the verified tokens
        if served.draft is None:
            request.add_token(next_token(served, target_forward(served, seq)[0][-1], temperature))
            continue
        run, aux = verify(served, seq, aux, temperature, drafter)
        request.add_verify(run)
    return request


def parse_request(served: Served, body: dict) -> tuple[list[int], int, float]:
    """The prompt ids, max_new_tokens and temperature of a /generate body; BadRequest names the field at fault."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    labels = body.get("custom_labels")
    if labels is not None and not (isinstance(labels, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in labels.items())):
        raise BadRequest(f"custom_labels={labels!r}: give an object of string keys and string values")
    refused = served.telemetry.undeclared(labels) if served.telemetry is not None else None
    if refused:  # production cannot take it: never accept here what SGLang would crash on
        raise BadRequest(refused)
    if body.get("rid") is not None and not isinstance(body["rid"], str):
        raise BadRequest(f"rid={body['rid']!r}: give one string (the request's id); batches are not served")
    params = body.get("sampling_params") or {}
    temperature = params.get("temperature", DEFAULT_TEMPERATURE)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0:
        raise BadRequest(f"sampling_params.temperature={temperature!r}: give a number >= 0 (0 decodes greedily)")
    for name, default in SAMPLING_DEFAULTS.items():
        if params.get(name, default) != default:
            raise BadRequest(f"sampling_params.{name}={params[name]!r}: the reference server samples with the "
                             f"temperature alone; leave {name} at SGLang's default {default}")
    max_new_tokens = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise BadRequest(f"sampling_params.max_new_tokens={max_new_tokens!r}: give a positive integer")
    if isinstance(body.get("input_ids"), list) and body["input_ids"] and all(type(t) is int for t in body["input_ids"]):
        ids = body["input_ids"]
    elif isinstance(body.get("text"), str) and body["text"]:
        ids = served.tokenizer(body["text"])["input_ids"]  # the tokenizer's defaults, as SGLang encodes text
    else:
        raise BadRequest("give `text` (one string) or `input_ids` (one non-empty list of token ids); batches are not served")
    if not ids or not all(0 <= t < served.target.config.vocab_size for t in ids):
        raise BadRequest(f"input_ids: give at least one id, each in [0, {served.target.config.vocab_size})")
    return ids, max_new_tokens, float(temperature)


def generate(served: Served, body: dict, count: bool = True) -> dict:
    start = time.perf_counter()  # end to end, as SGLang measures it: waiting for the lock included
    ids, max_new_tokens, temperature = parse_request(served, body)
    with served.lock:  # one model on the CPU: one request at a time
        request = decode(served, ids, max_new_tokens, temperature)
        if served.draft is not None and count:  # health checks stay out of avg_spec_accept_length
            served.totals = [served.totals[0] + request.correct, served.totals[1] + request.verify_ct]
    meta = {"prompt_tokens": len(ids), "completion_tokens": len(request.output), "finish_reason": request.finish,
            "e2e_latency": time.perf_counter() - start, **request.meta_info(served.shape.drafts_per_step)}
    meta["response_sent_to_client_ts"] = time.time()  # every release read stamps each finished response
    if served.telemetry is not None and count:  # health checks are no traffic: never counted nor recorded
        served.telemetry.observe(body, meta, request.correct, served.shape.drafts_per_step)
    text = served.tokenizer.decode(request.output, skip_special_tokens=True)
    return {"text": text, "output_ids": request.output, "meta_info": meta}


def load(target_dir: Path, draft_dir: Path | None, shape: DraftShape, release: str | None,
         seed: int = 0, trust_remote_code: bool = False, dtype: str = "auto") -> Served:
    from eagle3.runtime.targets import eos_ids_of, load_target_model, load_tokenizer

    # the precision the data stage generated the held-out continuations in, so the replay is what is served
    target = load_target_model(target_dir, trust_remote_code, dtype)
    draft, entry = None, EAGLE3
    if draft_dir is not None:
        entry = draft_algorithm(Path(draft_dir))
        if problem := entry.shape_problem(Path(draft_dir), shape):
            raise ValueError(f"draft {draft_dir} ({entry.name}): {problem}")
        draft = entry.served_model(Path(draft_dir), release, Path(target_dir), "").eval()
    return Served(target, load_tokenizer(target_dir, trust_remote_code), eos_ids_of(target), draft, entry, shape,
                  release, torch.Generator().manual_seed(seed))


def create_app(target_dir, draft_dir=None, shape: DraftShape = DraftShape(3), release: str | None = None,
               seed: int = 0, trust_remote_code: bool = False, dtype: str = "auto", metrics: bool = False,
               records_dir: Path | None = None, custom_labels: tuple[str, ...] = ()) -> FastAPI:
    """metrics: serve /metrics (--enable-metrics); records_dir: write request records there (--export-metrics-to-file
    --export-metrics-to-file-dir); custom_labels: the declared custom-label keys
    (--tokenizer-metrics-allowed-custom-labels)."""
    served = load(Path(target_dir), draft_dir, shape, release, seed, trust_remote_code, dtype)
    if metrics or records_dir is not None:
        # served_model_name defaults to the model path in SGLang
        served.telemetry = Telemetry(str(target_dir), release, metrics, records_dir, speculative=draft_dir is not None,
                                     custom_labels=tuple(custom_labels))
    app = FastAPI(title="eagle3 reference server")

    @app.post("/generate")
    async def generate_route(request: Request):
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"error": {"message": "the body is not JSON"}}, status_code=400)
        try:  # decoding runs in a worker thread, so /health answers while a request decodes
            return await run_in_threadpool(generate, served, body)
        except BadRequest as err:
            return JSONResponse({"error": {"message": str(err)}}, status_code=400)

    if metrics:
        @app.get("/metrics")
        def metrics_route():
            return Response(served.telemetry.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    def health():
        return JSONResponse({})

    @app.get("/health_generate")
    def health_generate():
        generate(served, {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}, count=False)
        return JSONResponse({})

    @app.get("/get_model_info")
    def model_info():
        return {"model_path": str(target_dir), "is_generation": True,
                "draft_model_path": None if draft_dir is None else str(draft_dir)}

    @app.get("/server_info")
    def server_info():
        correct, verify_ct = served.totals
        state = {"avg_spec_accept_length": server_accept_length(correct, verify_ct)} if verify_ct else {}
        speculative = {} if draft_dir is None else {
            "speculative_num_steps": shape.num_steps, "speculative_eagle_topk": shape.eagle_topk,
            "speculative_num_draft_tokens": shape.num_draft_tokens}
        return {"version": release or "reference", "internal_states": [state], **speculative}

    return app
