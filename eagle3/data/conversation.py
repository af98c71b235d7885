"""Token sequences for training samples, built with the target's own chat template.

A sample's tokens are the template's text around each turn (loss mask 0) followed by the target's
generated ids for each assistant turn (loss mask 1). Generated ids are kept as the engine produced
them, never re-tokenized from text.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

from eagle3.errors import Eagle3Error
from eagle3.target.files import thinking_switches


@dataclass(frozen=True)
class Sample:
    input_ids: list[int]
    loss_mask: list[int]  # 1 on tokens the target generated (assistant turns), 0 elsewhere
    conversation: list[dict]
    replies: list[list[int]]  # [start, end) of each generated reply in input_ids (end may pass a cut at max_length)


def render(tokenizer, messages: list[dict], thinking: bool, generation_prompt: bool) -> str:
    """The template's text, thinking switched by the variable(s) the template itself reads (Qwen's enable_thinking,
    Kimi's thinking; config load refuses data.thinking for a template with none)."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
    switches = {name: thinking for name in template_switches(template)}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **switches)


@functools.lru_cache(maxsize=8)
def template_switches(template: str | None) -> tuple[str, ...]:
    return thinking_switches(template)


def renders_reasoning(tokenizer) -> bool:
    """Whether the chat template writes an assistant message's reasoning_content itself."""
    return "reasoning_content" in (tokenizer.chat_template or "")


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_ids(tokenizer, messages: list[dict], thinking: bool) -> list[int]:
    """The ids the engine continues from: the conversation so far plus the generation prompt."""
    return encode(tokenizer, render(tokenizer, messages, thinking, generation_prompt=True))


def chat_template_hash(tokenizer) -> str:
    return hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest()


THINK_END = "</think>"


class TemplateMismatch(Eagle3Error):
    """The chat template would show the engine other ids for earlier turns than the ones stored."""


def assistant_message(text: str) -> dict:
    """A reply as a chat message; a thinking target's reasoning is kept as reasoning_content (chat
    templates that support thinking read it from there). The ids always keep it, as generated."""
    if THINK_END not in text:
        return {"role": "assistant", "content": text}
    reasoning, _, answer = text.partition(THINK_END)
    return {"role": "assistant", "content": answer.lstrip("\n"), "reasoning_content": reasoning.replace("<think>", "").strip()}


def split_reasoning(tokenizer, turns: list[dict]) -> list[dict]:
    """Assistant turns whose content holds an inline <think>…</think>, with the reasoning moved to reasoning_content
    where the template renders reasoning itself (else it would write it twice); other turns as they are."""
    if not renders_reasoning(tokenizer):
        return turns
    return [assistant_message(turn["content"]) if turn["role"] == "assistant" and "reasoning_content" not in turn
            else turn for turn in turns]


def added_ids(tokenizer, covered: str, rendered: str) -> list[int]:
    """The ids of the text `rendered` adds after `covered`; TemplateMismatch when it renders `covered` otherwise."""
    if not rendered.startswith(covered):
        raise TemplateMismatch("the chat template renders earlier turns differently once a later turn is added; "
                               "the sample ends before that turn")
    return encode(tokenizer, rendered[len(covered) :])


def template_sample(tokenizer, turns: list[dict], thinking: bool) -> tuple[Sample, bool]:
    """A finished conversation through the chat template, built as regeneration builds a sample: the template text
    up to each assistant turn's generation prompt (loss mask 0), then the assistant turn as the template renders it,
    end-of-turn tokens included (loss mask 1). Returns the sample and whether it ended early (a template that
    rewrites earlier turns, as regeneration's samples end)."""
    ids: list[int] = []
    mask: list[int] = []
    replies: list[list[int]] = []
    covered, kept = "", 0  # kept: the turns the sample covers (trailing turns without a reply are dropped)
    for end, turn in enumerate(turns, start=1):
        if turn["role"] != "assistant":
            continue
        try:
            prompt = render(tokenizer, turns[: end - 1], thinking, generation_prompt=True)
            before = added_ids(tokenizer, covered, prompt)
            reply_text = render(tokenizer, turns[:end], thinking, generation_prompt=False)
            reply = added_ids(tokenizer, prompt, reply_text)
        except TemplateMismatch:
            return Sample(ids, mask, turns[:kept], replies), True
        replies.append([len(ids) + len(before), len(ids) + len(before) + len(reply)])
        ids += before + reply
        mask += [0] * len(before) + [1] * len(reply)
        covered, kept = reply_text, end
    return Sample(ids, mask, turns[:kept], replies), False


class SampleBuilder:
    """Builds one sample turn by turn: the prompt for each reply is exactly the stored ids so far.

    The template text before each reply is found by rendering the conversation up to the generation
    prompt and removing the text the ids already cover, so each template piece is tokenized on its
    own. That equals tokenizing the whole conversation when turns are delimited by special tokens. A
    template that rewrites earlier turns (e.g. drops past reasoning) is refused: the ids the engine
    saw would differ from the ones stored.
    """

    def __init__(self, tokenizer, turns: list[dict], thinking: bool, rendered: str | None = None):
        self.tokenizer, self.thinking = tokenizer, thinking
        self.remaining = [dict(turn) for turn in turns]
        self.rendered = rendered  # a prompt the chat template was already applied to: its ids are sent as they are
        self.messages: list[dict] = []
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.covered = ""  # the text the ids so far decode to
        self.replies: list[list[int]] = []

    def next_prompt(self) -> list[int] | None:
        """Ids to generate the next reply from (after the next user turn), or None when done.
        Raises TemplateMismatch (and ends the sample where it stands) when the template rewrites history."""
        if self.rendered is not None:  # one reply, to the prompt exactly as the target received it
            self.ids, self.covered, self.rendered = encode(self.tokenizer, self.rendered), self.rendered, None
            self.mask = [0] * len(self.ids)
            self.messages = [{"role": "rendered", "content": self.covered}]
            return list(self.ids)
        pending = []
        while self.remaining:
            pending.append(self.remaining.pop(0))
            if pending[-1]["role"] == "user":
                break
        else:
            return None
        messages = self.messages + pending
        rendered = render(self.tokenizer, messages, self.thinking, generation_prompt=True)
        try:
            piece = added_ids(self.tokenizer, self.covered, rendered)
        except TemplateMismatch:
            self.remaining = []
            raise
        self.messages = messages
        self.ids += piece
        self.mask += [0] * len(piece)
        self.covered = rendered
        return list(self.ids)

    def add_reply(self, reply: list[int]) -> None:
        self.replies.append([len(self.ids), len(self.ids) + len(reply)])
        self.ids += reply
        self.mask += [1] * len(reply)
        self.covered += self.tokenizer.decode(reply, skip_special_tokens=False)
        self.messages.append(assistant_message(self.tokenizer.decode(reply, skip_special_tokens=True)))

    def sample(self, max_length: int) -> Sample:
        return Sample(input_ids=self.ids[:max_length], loss_mask=self.mask[:max_length], conversation=self.messages,
                      replies=self.replies)
