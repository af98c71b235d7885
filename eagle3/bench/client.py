"""Serving benchmark: SGLang's `/generate`, or another engine's generate request read as its answer
(eagle3.serving: vLLM's completions with per-request speculative counts), token ids in, greedy unless a temperature
is given, over a prompt set with bounded concurrency, counted exactly as docs/contracts.md and the simulator count, so
served and simulated numbers compare.

Every request is retried with backoff on connection errors, timeouts and 5xx; a request still failing after
its retries (or a server that dies mid-run) raises BenchmarkError naming the lost prompt indices: there is
never an average over fewer prompts than asked for. Result (JSON-ready dict):

    url, server_version                  the server and its /server_info `version` (vLLM: /version)
    num_prompts, max_new_tokens, concurrency, temperature
    draft_tokens_per_step                 accept-rate denominator per verify step: /server_info
                                          speculative_num_draft_tokens - 1, else speculative_num_steps, else the
                                          answers' own (vLLM's num_spec_tokens), else None
    prompt_tokens, completion_tokens      Σ over prompts
    verify_ct, correct_drafts             Σ spec_verify_ct, Σ spec_num_correct_drafts (pre-0.5.12: spec_accepted_drafts)
    accept_length                         Σ completion_tokens / Σ verify_ct; None without a draft (no spec_* keys)
    accept_rate                           Σ correct / (Σ verify_ct × draft_tokens_per_step), else Σ(spec_accept_rate
                                          × verify_ct) / Σ verify_ct; None without a draft
    histogram                             Σ spec_correct_drafts_histogram (pre-0.5.12: spec_accept_histogram) or None
    wall_s, output_tokens_per_s           first request sent .. last answer; Σ completion_tokens / wall_s
    latency_s                             {p50, p90, p99, mean, max}: end to end, client-measured, retries included
    retried_requests                      requests that needed more than one attempt (each counted once)
    prompts                               [{index, suite, slice, prompt_tokens, completion_tokens, verify_ct,
                                            correct_drafts, accept_length, latency_s, attempts}] in prompt order
    suites                                {suite: {requests, completion_tokens, verify_ct, correct_drafts,
                                            accept_length, accept_rate, slices: {slice: the same}}}: a prompt's suite
                                          and slice (SlicedPrompt: a benchmark suite, a traffic slice or an MT-bench
                                          category), "heldout" and "base" for a plain prompt
    baseline                              None, or {url, server_version, wall_s, output_tokens_per_s, latency_s,
                                            completion_tokens} of the same prompts on the no-draft server
    speedup                               output_tokens_per_s / the baseline's (None without a baseline)
    mismatches, mismatched_prompts        prompts whose outputs differ from the baseline's (None without one, and
                                          when sampling: sampled outputs differ by design)

Prompt files (`load_prompt_file`): every record the data loader reads (eagle3.data.prompts: JSONL or a JSON array,
a local path or pkg:NAME), each one of
    {"input_ids": [1, 2, ...]}            sent as is
    {"text": "..."}                       sent as `text` (the server tokenizes it)
    {"messages": [...]} or {"conversations": [...]}
                                          OpenAI or ShareGPT: its system and user turns, rendered with the chat
                                          template as the held-out prompts are (needs a tokenizer)

Every request to SGLang or the reference server carries `custom_labels` {"eagle3": "benchmark"} (PIPELINE_LABEL; vLLM
takes none and writes no records): production's request records
then never take the pipeline's measurements for users' traffic.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import time
from functools import partial
from pathlib import Path
from typing import Callable

import httpx
import numpy as np

from eagle3.bench.counting import accept_length, accept_rate, by_suite, correct_drafts_of, histogram_of, sum_histograms
from eagle3.config.suites import HELDOUT
from eagle3.data.conversation import prompt_ids
from eagle3.data.prompts import BASE_SLICE, decoded, file_records, parse_line, source_path
from eagle3.errors import Eagle3Error, UnreadableInput
from eagle3.records.telemetry import PIPELINE_LABEL
from eagle3.http_retry import SHOWN_FAILURES, RetriesExhausted, send_with_retries
from eagle3.progress import Progress
from eagle3.serving.base import ServingEngine
from eagle3.serving.sglang import SGLANG

Log = Callable[[str], None]
Prompt = list[int] | str
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default


class SlicedPrompt(list):
    """Token ids, sent as they are, that name the benchmark suite and the slice inside it their request belongs to:
    acceptance is reported per suite and per slice, so a drop on one of them is not averaged away."""

    def __init__(self, ids: list[int], slice_name: str, suite: str = HELDOUT):
        super().__init__(ids)
        self.slice, self.suite = slice_name, suite


def label_of(prompt: Prompt) -> tuple[str, str]:
    """(suite, slice) of a prompt."""
    return getattr(prompt, "suite", HELDOUT), getattr(prompt, "slice", BASE_SLICE)


def suite_digests(prompts: list[Prompt]) -> dict[str, str]:
    """{suite: sha256 of its requests, in order}: two measurements of a suite compare only over the same requests."""
    requests: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        requests.setdefault(label_of(prompt)[0], []).append(list(prompt) if isinstance(prompt, list) else prompt)
    return {name: hashlib.sha256(json.dumps(items).encode()).hexdigest() for name, items in requests.items()}


class BenchmarkError(Eagle3Error):
    """Requests lost after their retries: the benchmark reports nothing rather than a smaller average."""

    def __init__(self, message: str, lost: list[int] = ()):
        super().__init__(message)
        self.lost = list(lost)


def load_prompt_file(path: Path, tokenizer=None, thinking: bool = False, limit: int | None = None) -> list[Prompt]:
    """The prompts of a file (the first `limit` when given); a record that is none of the forms is named by number."""
    prompts: list[Prompt] = []
    records = file_records(source_path(str(path)))
    for number, record in enumerate(records, start=1):
        if limit is not None and len(prompts) >= limit:
            break
        if isinstance(record, str) and not record.strip():
            continue
        try:
            prompts.append(prompt_of(decoded(record), tokenizer, thinking))
        except ValueError as err:
            raise UnreadableInput(f"{path}:{number}: {err}") from None
    if not prompts:
        raise UnreadableInput(f"{path}: holds no prompt")
    return prompts


def prompt_of(record: object, tokenizer, thinking: bool) -> Prompt:
    record = record if isinstance(record, dict) else {}
    ids, text = record.get("input_ids"), record.get("text")
    if isinstance(ids, list) and ids and all(type(t) is int and t >= 0 for t in ids):
        return ids
    if isinstance(text, str) and text:
        return text
    if "messages" not in record and "conversations" not in record:
        raise ValueError("give `input_ids` (non-empty list of ids), `text`, `messages` or `conversations`")
    turns = parse_line(record)  # the data loader's reading: the system and user turns
    if tokenizer is None:
        raise ValueError("`messages` / `conversations` need a tokenizer for the chat template (--tokenizer)")
    return prompt_ids(tokenizer, turns, thinking)


async def call(client: httpx.AsyncClient, url: str, body: dict | None, retries: int, backoff_s: float) -> tuple[dict, int]:
    """GET (body None) or POST one endpoint -> (JSON answer, attempts); retries transport errors and 5xx."""
    send = client.get if body is None else partial(client.post, json=body)
    try:
        _, response, attempts = await send_with_retries(send, itertools.repeat(url), retries, backoff_s)
    except RetriesExhausted as err:  # one url: named once, then the reasons
        reasons = ", ".join(reason for _, reason in err.failures[-SHOWN_FAILURES:])
        raise BenchmarkError(f"{url}: failed {len(err.failures)} times ({reasons})") from None
    if response.status_code != 200:
        raise BenchmarkError(f"{url}: HTTP {response.status_code}: {response.text[:200]}")
    return response.json(), attempts


async def run_server(url: str, prompts: list[Prompt], max_new_tokens: int, concurrency: int, temperature: float,
                     timeout_s: float, retries: int, backoff_s: float, log: Log,
                     engine: ServingEngine) -> tuple[dict, list, float]:
    """(the server's settings, per prompt (answer, latency_s, attempts) or the exception, wall_s), each answer read as
    SGLang's /generate gives it (ServingEngine.answer)."""
    limit, progress = asyncio.Semaphore(concurrency), Progress(f"bench {url}", total=len(prompts), unit="requests", log=log)
    limits = httpx.Limits(max_connections=max(concurrency, 10))
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        info, _ = await call(client, f"{url}{engine.info_path}", None, retries, backoff_s)

        async def one(prompt: Prompt):
            async with limit:
                body = engine.request_body(prompt, max_new_tokens, temperature, dict([PIPELINE_LABEL]))
                start = time.perf_counter()
                raw, attempts = await call(client, f"{url}{engine.generate_path}", body, retries, backoff_s)
                try:
                    answer = engine.answer(raw)
                except ValueError as err:
                    raise BenchmarkError(f"{url}{engine.generate_path}: {err}") from None
                progress.advance(1, tokens=answer["meta_info"]["completion_tokens"])
                return answer, time.perf_counter() - start, attempts

        start = time.perf_counter()
        outcomes = await asyncio.gather(*(one(p) for p in prompts), return_exceptions=True)
        return engine.read_info(info), outcomes, time.perf_counter() - start


def ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    spans = []
    for i in indices:
        if spans and spans[-1][1] == i - 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def measure(url: str, prompts: list[Prompt], max_new_tokens: int, concurrency: int, temperature: float,
            timeout_s: float, retries: int, backoff_s: float, log: Log, engine: ServingEngine) -> tuple[dict, list, float]:
    url = url.rstrip("/")
    log(f"bench: {len(prompts)} prompts on {url} ({concurrency} concurrent, max_new_tokens {max_new_tokens}, "
        f"temperature {temperature})")
    info, outcomes, wall = asyncio.run(run_server(url, prompts, max_new_tokens, concurrency, temperature, timeout_s,
                                                  retries, backoff_s, log, engine))
    lost = [i for i, outcome in enumerate(outcomes) if isinstance(outcome, BaseException)]
    if lost:
        last = outcomes[lost[-1]]
        reason = str(last) if isinstance(last, BenchmarkError) else f"{type(last).__name__}: {last}"
        raise BenchmarkError(f"{url}: {len(lost)} of {len(prompts)} requests lost after {retries} retries: prompt "
                             f"indices [{ranges(lost)}] (last: {reason}); no partial result is reported", lost)
    return info, outcomes, wall


def latency(values: list[float]) -> dict:
    p50, p90, p99 = np.percentile(values, [50, 90, 99]).tolist()
    return {"p50": p50, "p90": p90, "p99": p99, "mean": float(np.mean(values)), "max": max(values)}


def summarize(url: str, info: dict, outcomes: list, wall: float, labels: list[tuple[str, str]] | None = None) -> dict:
    """The figures of one server's answers; `labels` gives each prompt's (suite, slice) (None: heldout, base)."""
    metas = [answer["meta_info"] for answer, _, _ in outcomes]
    spec = [m for m in metas if m.get("spec_verify_ct")]
    completion, verify = sum(m["completion_tokens"] for m in metas), sum(m["spec_verify_ct"] for m in spec)
    draft_tokens = info.get("speculative_num_draft_tokens")
    per_step = draft_tokens - 1 if isinstance(draft_tokens, int) and draft_tokens > 1 else info.get("speculative_num_steps")
    per_step = per_step or next((m["spec_drafts_per_step"] for m in spec if "spec_drafts_per_step" in m), None)
    corrects = [correct_drafts_of(m) for m in spec]
    correct = sum(corrects) if None not in corrects else None
    if correct is not None and per_step:
        rate = accept_rate(correct, verify, per_step)
    else:  # no draft count or no drafts per step: the requests' own rates, weighted by their verify steps
        rate = sum(m.get("spec_accept_rate", 0.0) * m["spec_verify_ct"] for m in spec) / verify if verify else None
    hists = [histogram_of(m) for m in spec]
    hists = [h for h in hists if h is not None]
    labels = labels or [(HELDOUT, BASE_SLICE)] * len(metas)
    rows = [{"index": i, "suite": suite, "slice": name, "prompt_tokens": m.get("prompt_tokens"),
             "completion_tokens": m["completion_tokens"], "verify_ct": m.get("spec_verify_ct", 0),
             "correct_drafts": correct_drafts_of(m) if m.get("spec_verify_ct") else 0, "latency_s": lat,
             "attempts": attempts, "accept_length": accept_length(m["completion_tokens"], m.get("spec_verify_ct", 0))}
            for i, (m, (_, lat, attempts), (suite, name)) in enumerate(zip(metas, outcomes, labels))]
    return {
        "url": url, "server_version": info.get("version"), "num_prompts": len(rows), "draft_tokens_per_step": per_step,
        "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in rows), "completion_tokens": completion,
        "verify_ct": verify, "correct_drafts": correct if verify else None,
        "accept_length": accept_length(completion, verify), "accept_rate": rate,
        "histogram": sum_histograms(hists) if hists else None,
        "wall_s": wall, "output_tokens_per_s": completion / wall, "latency_s": latency([r["latency_s"] for r in rows]),
        "retried_requests": sum(r["attempts"] > 1 for r in rows), "prompts": rows,
        "suites": by_suite(rows, per_step),
    }


def run_benchmark(url: str, prompts: list[Prompt], max_new_tokens: int, concurrency: int, timeout_s: float,
                  retries: int, baseline_url: str | None = None, log: Log = print, backoff_s: float = 0.5,
                  temperature: float = 0.0, engine: ServingEngine = SGLANG) -> dict:
    """The figures of `prompts` on the server at `url` (and on the no-draft `baseline_url`), both of `engine`."""
    if not prompts or min(max_new_tokens, concurrency) < 1 or retries < 0 or timeout_s <= 0 or temperature < 0:
        raise ValueError(f"bench: needs prompts ({len(prompts)}), max_new_tokens ({max_new_tokens}) and concurrency "
                         f"({concurrency}) >= 1, retries ({retries}) >= 0, timeout_s ({timeout_s}) > 0 and "
                         f"temperature ({temperature}) >= 0")
    args = (max_new_tokens, concurrency, temperature, timeout_s, retries, backoff_s, log, engine)
    info, outcomes, wall = measure(url, prompts, *args)
    result = {**summarize(url.rstrip("/"), info, outcomes, wall, [label_of(p) for p in prompts]),
              "max_new_tokens": max_new_tokens,
              "concurrency": concurrency, "temperature": temperature, "baseline": None, "speedup": None,
              "mismatches": None, "mismatched_prompts": None}
    if baseline_url:
        base_info, base_outcomes, base_wall = measure(baseline_url, prompts, *args)
        base = summarize(baseline_url.rstrip("/"), base_info, base_outcomes, base_wall)
        if base["verify_ct"]:
            log(f"bench: WARNING: baseline {baseline_url} reports spec_* keys: it serves a draft too")
        keys = ("url", "server_version", "wall_s", "output_tokens_per_s", "latency_s", "completion_tokens")
        result.update(baseline={k: base[k] for k in keys},
                      speedup=result["output_tokens_per_s"] / base["output_tokens_per_s"])
        if not temperature:  # greedy: the draft must not change a single output
            mismatched = [i for i, (a, b) in enumerate(zip(outcomes, base_outcomes))
                          if a[0].get("output_ids", a[0].get("text")) != b[0].get("output_ids", b[0].get("text"))]
            result.update(mismatches=len(mismatched), mismatched_prompts=mismatched)
    return result


def render_table(result: dict) -> list[str]:
    lines = [f"served: {result['url']} (version {result['server_version']}), {result['num_prompts']} prompts, "
             f"{result['concurrency']} concurrent, max_new_tokens {result['max_new_tokens']}, temperature "
             f"{result['temperature']}"]
    if result["accept_length"] is None:
        lines.append("  accept length  none: the server reports no verify step (no draft loaded)")
    else:
        lines.append(f"  accept length  {result['accept_length']:.3f}  ({result['completion_tokens']} completion tokens / "
                     f"{result['verify_ct']} verify steps)")
        if result["accept_rate"] is not None:
            lines.append(f"  accept rate    {result['accept_rate']:.3f}  (correct drafts / (verify steps x "
                         f"{result['draft_tokens_per_step']}))")
        if result["histogram"] is not None:
            lines.append(f"  histogram      {' '.join(f'{a}:{n}' for a, n in enumerate(result['histogram']))}")
        lines += suite_lines(result.get("suites") or {})
    lat = result["latency_s"]
    lines.append(f"  throughput     {result['output_tokens_per_s']:.1f} output tokens/s ({result['completion_tokens']} "
                 f"tokens in {result['wall_s']:.2f} s, {result['retried_requests']} requests retried)")
    lines.append(f"  latency        p50 {lat['p50']:.3f} s  p90 {lat['p90']:.3f} s  p99 {lat['p99']:.3f} s")
    if result["baseline"] is not None:
        base = result["baseline"]
        same = ("sampled" if result["mismatches"] is None else "identical" if not result["mismatches"]
                else f"DIFFER for prompts [{ranges(result['mismatched_prompts'])}]")
        lines.append(f"  baseline       {base['output_tokens_per_s']:.1f} output tokens/s in {base['wall_s']:.2f} s "
                     f"({base['url']}); speedup {result['speedup']:.2f}x; outputs {same}")
    return lines


def suite_lines(suites: dict) -> list[str]:
    """The accept length of each suite, and of each slice of a suite with several, when there is more than one."""
    if len(suites) < 2 and not any(len(suite["slices"]) > 1 for suite in suites.values()):
        return []
    lines = []
    for name, suite in suites.items():
        lines.append(figures_line(f"suite {name}", suite))
        if len(suite["slices"]) > 1:
            lines += [figures_line(f"  {slice_name}", figures) for slice_name, figures in suite["slices"].items()]
    return lines


def figures_line(name: str, f: dict) -> str:
    length = "-" if f["accept_length"] is None else f"{f['accept_length']:.3f}"
    return (f"  {name:<22} accept length {length}  ({f['requests']} requests, {f['completion_tokens']} completion "
            f"tokens / {f['verify_ct']} verify steps)")
