"""The reference server: the subset of SGLang's HTTP API the pipeline uses, with real chain speculative
decoding on a transformers target (DESIGN §4), counted the way SGLang counts (DESIGN §3).

Per request: the prefill forward gives the first completion token (no verify step). Each verify step:
the draft proposes S tokens with `draft_chain` from the target's aux features of the verified prefix;
the target runs ONE forward over prefix + drafts; the longest agreeing prefix of drafts is accepted,
plus the target's own next token (the bonus). The request grows, finishes and counts as the release it
stands for does (`eagle3.bench.counting`, proven against SGLang's own code). The target recomputes the
whole sequence each forward (no KV cache): slow, but nothing to get wrong. Greedy only.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from eagle3.bench.counting import SpecRequest, server_accept_length
from eagle3.model.draft import Eagle3Draft
from eagle3.model.ttt import draft_chain
from eagle3.model.weights import draft_as_served, target_head

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
DEFAULT_TEMPERATURE = 1.0  # SGLang's default: a request that names no temperature samples there


class BadRequest(ValueError):
    """A request SGLang would take but this server cannot serve, or one SGLang would refuse too."""


@dataclass
class Served:
    target: torch.nn.Module
    tokenizer: object
    eos_ids: frozenset[int]
    draft: Eagle3Draft | None
    num_steps: int
    release: str | None  # the SGLang release whose finish rule and meta_info keys this server follows
    totals: list[int] = field(default_factory=lambda: [0, 0])  # [Σ correct drafts, Σ verify_ct] with a draft
    lock: threading.Lock = field(default_factory=threading.Lock)


@torch.no_grad()
def target_forward(served: Served, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ids [T] -> (greedy next token after each position [T], aux features [T, n_aux * H] or None)."""
    layers = served.draft.config.aux_layers if served.draft is not None else None
    out = served.target(torch.tensor([ids]), output_hidden_states=layers is not None)
    aux = torch.cat([out.hidden_states[k + 1][0] for k in layers], dim=-1).float() if layers else None
    return out.logits[0].argmax(-1), aux


def decode(served: Served, prompt: list[int], max_new_tokens: int) -> SpecRequest:
    """Greedy (speculative when a draft is loaded) decoding of one request, grown and counted as SGLang does."""
    request = SpecRequest(max_new_tokens, served.eos_ids, served.release)
    vocab = served.target.config.vocab_size
    greedy, aux = target_forward(served, prompt)  # prefill: [P], aux [P, n_aux * H]
    request.add_token(int(greedy[-1]))
    while request.finish is None:
        seq = prompt + request.output  # the verified tokens
        if served.draft is None:
            request.add_token(int(target_forward(served, seq)[0][-1]))
            continue
        drafts = draft_chain(served.draft, aux, torch.tensor(seq), served.num_steps)  # x_{P+1} .. x_{P+S}
        valid = next((i for i, t in enumerate(drafts) if not 0 <= t < vocab), len(drafts))  # out of vocab: never right
        greedy, aux = target_forward(served, seq + drafts[:valid])  # ONE verify forward over prefix + drafts
        proposals = greedy[len(seq) - 1 :].tolist()  # [valid + 1] the target's token after x_P, x_P + d_1, ...
        accepted = 0
        while accepted < valid and drafts[accepted] == proposals[accepted]:
            accepted += 1
        request.add_verify(proposals[: accepted + 1])  # accepted drafts + bonus
        # features of the verified prefix x_0 .. x_{P'-1} (causal: the drafts after it don't matter)
        aux = aux[: len(seq) + accepted]
    return request


def parse_request(served: Served, body: dict) -> tuple[list[int], int]:
    """The prompt ids and max_new_tokens of a /generate body; BadRequest names the field at fault."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    params = body.get("sampling_params") or {}
    temperature = params.get("temperature", DEFAULT_TEMPERATURE)
    if not isinstance(temperature, (int, float)) or temperature != 0:
        raise BadRequest(f"sampling_params.temperature={temperature!r}: the reference server decodes greedily only; "
                         f"send temperature 0 (SGLang's default, when it is missing, is {DEFAULT_TEMPERATURE})")
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
    return ids, max_new_tokens


def generate(served: Served, body: dict, count: bool = True) -> dict:
    start = time.perf_counter()  # end to end, as SGLang measures it: waiting for the lock included
    ids, max_new_tokens = parse_request(served, body)
    with served.lock:  # one model on the CPU: one request at a time
        request = decode(served, ids, max_new_tokens)
        if served.draft is not None and count:  # health checks stay out of avg_spec_accept_length
            served.totals = [served.totals[0] + request.correct, served.totals[1] + request.verify_ct]
    meta = {"prompt_tokens": len(ids), "completion_tokens": len(request.output), "finish_reason": request.finish,
            "e2e_latency": time.perf_counter() - start, **request.meta_info(served.num_steps)}
    text = served.tokenizer.decode(request.output, skip_special_tokens=True)
    return {"text": text, "output_ids": request.output, "meta_info": meta}


def load(target_dir: Path, draft_dir: Path | None, num_steps: int, engine_release: str | None) -> Served:
    from transformers import AutoModelForCausalLM

    from eagle3.data.targets import eos_ids_of, load_tokenizer

    if num_steps < 1:
        raise ValueError(f"num_steps={num_steps}: chain drafting needs at least one step")
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    draft = None
    if draft_dir is not None:
        draft = draft_as_served(Path(draft_dir), engine_release, target_head(Path(target_dir))["embed"]).eval()
    return Served(target, load_tokenizer(str(target_dir)), eos_ids_of(target), draft, num_steps, engine_release)


def create_app(target_dir, draft_dir=None, num_steps: int = 3, engine_release: str | None = None) -> FastAPI:
    served = load(Path(target_dir), draft_dir, num_steps, engine_release)
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
        return {"version": engine_release or "reference", "internal_states": [state], "speculative_num_steps": num_steps}

    return app
