"""Offline acceptance simulator: chain speculative decoding replayed over the target's greedy output.

For a greedy target the accepted tokens are exactly its greedy continuation, so one target pass over
prompt + continuation gives every feature the draft needs. Counting follows SGLang (DESIGN §3):
the first completion token comes from prefill (no verify step); each verify step emits the accepted
drafts plus the bonus token; when the request finishes mid-step (EOS or max_new_tokens) only the
tokens up to the finish are emitted and the step counts emitted - 1 correct drafts.

    accept_length = Σ completion_tokens / Σ verify_ct
    accept_rate   = Σ correct_drafts / (Σ verify_ct × num_steps)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from eagle3.config import PipelineConfig
from eagle3.data.conversation import prompt_ids as render_prompt_ids
from eagle3.data.prompts import load_prompts
from eagle3.data.regenerate import HELDOUT_FILE
from eagle3.data.targets import load_tokenizer
from eagle3.errors import UnreadableInput
from eagle3.fsutil import atomic_write_json
from eagle3.model.draft import Eagle3Draft
from eagle3.model.ttt import draft_chain
from eagle3.model.weights import draft_as_served, target_head
from eagle3.progress import Progress

Log = Callable[[str], None]
RESULT_FILE = "simulated.json"


@dataclass
class PromptResult:
    completion_tokens: int
    verify_ct: int
    correct_drafts: int
    histogram: list[int]  # [num_steps + 1]: verify steps by number of correct drafts


@dataclass
class AcceptanceResult:
    num_steps: int
    rows: list[PromptResult]

    @property
    def completion_tokens(self) -> int:
        return sum(row.completion_tokens for row in self.rows)

    @property
    def verify_ct(self) -> int:
        return sum(row.verify_ct for row in self.rows)

    @property
    def correct_drafts(self) -> int:
        return sum(row.correct_drafts for row in self.rows)

    @property
    def histogram(self) -> list[int]:
        return [sum(column) for column in zip(*(row.histogram for row in self.rows))] or [0] * (self.num_steps + 1)

    @property
    def accept_length(self) -> float | None:  # None like SGLang's absent keys: no verify step at all
        return self.completion_tokens / self.verify_ct if self.verify_ct else None

    @property
    def accept_rate(self) -> float | None:
        return self.correct_drafts / (self.verify_ct * self.num_steps) if self.verify_ct else None

    def to_dict(self) -> dict:
        return {
            "num_prompts": len(self.rows),
            "num_steps": self.num_steps,
            "completion_tokens": self.completion_tokens,
            "verify_ct": self.verify_ct,
            "correct_drafts": self.correct_drafts,
            "accept_length": self.accept_length,
            "accept_rate": self.accept_rate,
            "histogram": self.histogram,
            "prompts": [asdict(row) for row in self.rows],
        }


def target_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_id: int | None) -> list[int]:
    """The target's greedy continuation, ending with EOS (kept) or after max_new_tokens."""
    ids = torch.tensor([prompt_ids])  # [1, T]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         temperature=None, top_p=None, top_k=None, eos_token_id=eos_id, pad_token_id=eos_id)
    continuation = out[0, len(prompt_ids):].tolist()
    return continuation[: continuation.index(eos_id) + 1] if eos_id in continuation else continuation


def aux_features(model, seq: list[int], aux_layers: list[int]) -> torch.Tensor:
    """[T, n_aux * H] float32: the outputs of decoder layers `aux_layers` (HF hidden_states[k + 1])."""
    out = model(torch.tensor([seq]), output_hidden_states=True)
    return torch.cat([out.hidden_states[k + 1][0] for k in aux_layers], dim=-1).float()


def replay(seq: list[int], prompt_len: int, propose: Callable[[int], list[int]], num_steps: int) -> PromptResult:
    """Count chain drafting over a known greedy sequence; propose(P) drafts x_{P+1}.. after verified x_P."""
    emitted_total = min(1, len(seq) - prompt_len)  # the prefill token
    verify_ct, correct, histogram = 0, 0, [0] * (num_steps + 1)
    p = prompt_len  # index of the last verified token
    while p + 1 < len(seq):
        drafts, remaining = propose(p), len(seq) - 1 - p
        accepted = 0
        while accepted < min(num_steps, remaining) and drafts[accepted] == seq[p + 1 + accepted]:
            accepted += 1
        emitted = min(accepted + 1, remaining)  # accepted drafts + bonus, cut where the request finishes
        emitted_total, verify_ct, correct = emitted_total + emitted, verify_ct + 1, correct + emitted - 1
        histogram[emitted - 1] += 1
        p += emitted
    return PromptResult(emitted_total, verify_ct, correct, histogram)


@torch.no_grad()
def simulate_prompt(draft: Eagle3Draft, target_model, aux_layers: list[int], prompt_ids: list[int],
                    max_new_tokens: int, num_steps: int, eos_id: int | None) -> PromptResult:
    seq = list(prompt_ids) + target_greedy(target_model, list(prompt_ids), max_new_tokens, eos_id)
    aux = aux_features(target_model, seq, aux_layers)  # [T, n_aux * H]
    tokens = torch.tensor(seq)  # [T]
    return replay(seq, len(prompt_ids), lambda p: draft_chain(draft, aux[:p], tokens[: p + 1], num_steps), num_steps)


def heldout_prompt_ids(config: PipelineConfig, tokenizer) -> list[list[int]]:
    path = config.stage_dir("data") / HELDOUT_FILE
    if not path.is_file():
        raise UnreadableInput(f"{path}: no held-out prompts; run the data stage first (eagle3 data regenerate)")
    prompts = load_prompts(str(path), limit=config.benchmark.num_prompts).prompts
    if not prompts:
        raise UnreadableInput(f"{path}: holds no usable prompt")
    return [render_prompt_ids(tokenizer, list(p.turns), config.data.thinking) for p in prompts]


def render_table(result: AcceptanceResult) -> list[str]:
    if result.verify_ct == 0:
        return [f"simulate: {len(result.rows)} prompts, no verify step (every continuation is one token)"]
    buckets = " ".join(f"{a}:{count}" for a, count in enumerate(result.histogram))
    return [
        f"simulate: {len(result.rows)} prompts, {result.completion_tokens} completion tokens, {result.verify_ct} verify steps",
        f"  accept length  {result.accept_length:.3f}  (completion tokens / verify steps)",
        f"  accept rate    {result.accept_rate:.3f}  (correct drafts / (verify steps x {result.num_steps}))",
        f"  histogram      {buckets}  (verify steps by correct drafts)",
    ]


def simulate(config: PipelineConfig, checkpoint: Path, log: Log = print, prompts: list[list[int]] | None = None) -> AcceptanceResult:
    """Simulate the served draft at `checkpoint` on the held-out prompts (or the given prompt ids)."""
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        target = AutoModelForCausalLM.from_pretrained(config.target.path, dtype=torch.float32).eval()
        draft = draft_as_served(Path(checkpoint), config.serving.release, target_head(config.target.path)["embed"]).eval()
        prompts = prompts if prompts is not None else heldout_prompt_ids(config, load_tokenizer(config.target.path))
        eos_id, num_steps = target.generation_config.eos_token_id, config.serving.num_steps
        progress = Progress("simulate", total=len(prompts), unit="prompts", log=log)
        rows = []
        for ids in prompts:
            rows.append(simulate_prompt(draft, target, draft.config.aux_layers, ids, config.benchmark.max_new_tokens, num_steps, eos_id))
            progress.advance(1, tokens=rows[-1].completion_tokens)
    result = AcceptanceResult(num_steps, rows)
    for line in render_table(result):
        log(line)
    out = config.stage_dir("bench") / RESULT_FILE
    atomic_write_json(out, {"checkpoint": str(checkpoint), "engine_release": config.serving.release,
                            "max_new_tokens": config.benchmark.max_new_tokens, **result.to_dict()})
    log(f"simulate: wrote {out}")
    return result
