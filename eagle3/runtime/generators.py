"""The engines that regenerate answers (eagle3/data/regenerate.py drives them), one interface: `generate(prompts)`
-> one Generation per prompt, `continue_greedy(prompts, length)`, and `release` (the live server's release, or None).

- `local`: transformers, batched greedy/sampled `generate` (the tiny target on the CPU);
- `sglang`, `vllm`: an async HTTP client for one or more running servers of that serving engine (round-robin, bounded
  concurrency, retries with backoff on connection errors and 5xx), speaking its API (eagle3.serving). It sends token
  ids rendered with the target's own chat template and returns the server's output ids as they are.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
from collections import Counter
from dataclasses import dataclass

import httpx

from eagle3.config.data import DataSection
from eagle3.config.run import TargetSection
from eagle3.runtime.targets import eos_ids_of, load_target_model
from eagle3.errors import Eagle3Error
from eagle3.http_retry import RetriesExhausted, send_with_retries
from eagle3.serving import serving_engine
from eagle3.serving.base import ServingEngine


class EngineError(Eagle3Error):
    """A generation engine that failed after its retries."""


@dataclass(frozen=True)
class Generation:
    output_ids: list[int]
    finish_reason: str


class LocalGenerator:
    """Batched generation with transformers (left padding, so every prompt ends where generation starts)."""

    release = None

    def __init__(self, target: TargetSection | str, max_new_tokens: int, temperature: float, seed: int = 0):
        import torch

        self.torch = torch
        self.model = load_target_model(target)  # the target's one precision: the reference server serves in it too
        self.max_new_tokens, self.temperature, self.seed = max_new_tokens, temperature, seed
        config = self.model.generation_config
        self.eos = set(eos_ids_of(self.model))  # some targets end turns with several ids
        self.pad = config.pad_token_id if config.pad_token_id is not None else min(self.eos)

    def generate(self, prompts: list[list[int]]) -> list[Generation]:
        torch = self.torch
        batch, attention = left_padded(prompts, self.pad)
        torch.manual_seed(self.seed)
        with torch.no_grad():
            out = self.model.generate(
                input_ids=batch,
                attention_mask=attention,
                max_new_tokens=self.max_new_tokens,
                do_sample=self.temperature > 0,
                temperature=self.temperature if self.temperature > 0 else None,
                top_p=None,
                top_k=None,
                pad_token_id=self.pad,
                eos_token_id=sorted(self.eos),
            )
        return [self._trim(row[batch.shape[1]:].tolist()) for row in out]

    def continue_greedy(self, prompts: list[list[int]], length: int) -> list[list[int]]:
        return greedy_continuations(self.model, prompts, length, self.pad)

    def _trim(self, generated: list[int]) -> Generation:
        """Cut at the first EOS (kept: the draft learns to end turns) and drop the padding after it."""
        for position, token in enumerate(generated):
            if token in self.eos:
                return Generation(generated[: position + 1], "stop")
        return Generation(generated, "length")


def left_padded(prompts: list[list[int]], pad: int):
    """(ids [B, T], attention mask [B, T]) with every prompt ending at the right edge, where generation starts."""
    import torch

    width = max(map(len, prompts))
    batch = torch.full((len(prompts), width), pad, dtype=torch.long)  # [B, T]
    attention = torch.zeros_like(batch)
    for row, ids in enumerate(prompts):
        batch[row, width - len(ids) :] = torch.tensor(ids)
        attention[row, width - len(ids) :] = 1
    return batch, attention


def greedy_continuations(model, prompts: list[list[int]], length: int, pad: int = 0) -> list[list[int]]:
    """`length` tokens of the target's greedy continuation of each prompt, not stopping at EOS, in one batch.
    EOS is an empty list: None would be refilled from the target's generation_config, and a target that ends its
    turns would stop there (and pad the rest)."""
    import torch

    batch, attention = left_padded(prompts, pad)
    config = copy.deepcopy(model.generation_config)
    config.update(eos_token_id=[], do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=pad,
                  max_new_tokens=length, min_new_tokens=None)
    with torch.no_grad():
        out = model.generate(batch, attention_mask=attention, generation_config=config)
    return [row[batch.shape[1]:].tolist() for row in out]


def target_greedy(model, prompt_ids: list[int], length: int) -> list[int]:
    """`length` tokens of the target's greedy continuation of one prompt, not stopping at EOS."""
    return greedy_continuations(model, [prompt_ids], length)[0]


class ServerClient:
    """Generate requests against running servers of one serving engine (its API: eagle3.serving), with token ids in
    and the server's output ids out."""

    def __init__(
        self,
        engine: ServingEngine,
        urls: list[str],
        max_new_tokens: int,
        temperature: float,
        concurrency: int,
        retries: int,
        timeout_s: float,
        backoff_s: float = 0.5,
    ):
        self.engine, self.urls = engine, [url.rstrip("/") for url in urls]
        self.next_url = itertools.cycle(self.urls)
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.concurrency, self.retries, self.timeout_s, self.backoff_s = concurrency, retries, timeout_s, backoff_s
        self.answered: Counter[str] = Counter()  # url -> requests it answered (the data stage logs the spread)
        self.release = self._server_release()

    def _server_release(self) -> str:
        """The live release (it decides loader and aux-id rules later); all servers must agree."""
        releases = set()
        for url in self.urls:
            try:
                releases.add(self.engine.reported_release(url, 30))
            except (httpx.HTTPError, ValueError) as err:
                raise EngineError(f"{url}{self.engine.info_path}: no {self.engine.title} release reported: {err}") from None
        if len(releases) != 1:
            raise EngineError(f"{self.engine.title} servers run different releases {sorted(releases)}: {self.urls}")
        return releases.pop()

    def generate(self, prompts: list[list[int]]) -> list[Generation]:
        return asyncio.run(self._generate_all(prompts, self.max_new_tokens, self.temperature, False))

    def continue_greedy(self, prompts: list[list[int]], length: int) -> list[list[int]]:
        generations = asyncio.run(self._generate_all(prompts, length, 0.0, True))
        short = [len(g.output_ids) for g in generations if len(g.output_ids) != length]
        if short:
            raise EngineError(f"greedy continuations of {length} tokens came back with {short[:3]} tokens "
                              "(ignore_eos not honoured, or a context limit below prompt + continuation)")
        return [g.output_ids for g in generations]

    async def _generate_all(self, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                            ignore_eos: bool) -> list[Generation]:
        limit = asyncio.Semaphore(self.concurrency)
        async with httpx.AsyncClient(timeout=self.timeout_s) as client:

            async def one(ids: list[int]) -> Generation:
                async with limit:
                    body = self.engine.request_body(ids, max_new_tokens, temperature, {}, ignore_eos)
                    return await self._request(client, body)

            return await asyncio.gather(*(one(ids) for ids in prompts))

    async def _request(self, client: httpx.AsyncClient, body: dict) -> Generation:
        path = self.engine.generate_path
        send = lambda url: client.post(f"{url}{path}", json=body)  # noqa: E731
        try:  # a retry goes to the next server
            url, response, _ = await send_with_retries(send, self.next_url, self.retries, self.backoff_s)
        except RetriesExhausted as err:
            raise EngineError(f"{path} {err}") from None
        if response.status_code != 200:
            raise EngineError(f"{url}{path}: HTTP {response.status_code}: {response.text[:300]}")
        try:
            answer = self.engine.answer(response.json())
        except ValueError as err:  # a body that is no JSON too
            raise EngineError(f"{url}{path}: {err}") from None
        self.answered[url] += 1
        finish = (answer.get("meta_info") or {}).get("finish_reason") or {}
        return Generation(list(answer["output_ids"]), finish.get("type", "unknown") if isinstance(finish, dict) else str(finish))


def make_generator(data: DataSection, target: TargetSection, seed: int):
    """data.generator's generator: the target on this machine (sampling seeded with `seed`, training.seed), or a client
    of data.servers."""
    if data.generator == "local":
        return LocalGenerator(target, data.max_new_tokens, data.temperature, seed)
    if not data.servers:  # data.nodes: the servers exist only while the regenerate stage runs
        raise EngineError("data.nodes: only the regenerate stage (the flow, `eagle3 data regenerate`) starts the "
                          "target's servers; for this command start them yourself and set data.servers to their URLs")
    return ServerClient(serving_engine(data.generator), data.servers, data.max_new_tokens, data.temperature,
                        data.concurrency, data.retries, data.request_timeout_s)
