"""SGLang's own server, unmodified, from published releases on the CPU: the tiny target served without a
draft gives the reference server's greedy output and meta_info."""

from __future__ import annotations

import itertools

import httpx
import pytest
from transformers import AutoTokenizer

from eagle3.data.conversation import prompt_ids
from eagle3.data.prompts import pydoc_prompt_turns
from eagle3.serve.inprocess import serve_in_thread
from eagle3.serve.reference import create_app
from servers import sglang_server

pytestmark = pytest.mark.sglang_server

PLAIN_RELEASES = ("0.5.11", "0.5.13", "0.5.23")  # spec v1 era, v2 era, the newest read
NUM_PROMPTS, MAX_NEW = 12, 24
TEXTS = ["The", "import os\n"]  # tokenized by each server, with the tokenizer's defaults
COMPARED = ("prompt_tokens", "completion_tokens", "finish_reason")


def requests(target) -> list[dict]:
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    turns = itertools.islice(pydoc_prompt_turns(), NUM_PROMPTS)
    return [{"input_ids": prompt_ids(tokenizer, messages, False)} for messages in turns] + [{"text": t} for t in TEXTS]


def answers(url: str, bodies: list[dict]) -> list[dict]:
    with httpx.Client(base_url=url, timeout=300) as client:
        replies = [client.post("/generate", json={**body, "sampling_params": {"max_new_tokens": MAX_NEW,
                                                                               "temperature": 0}}) for body in bodies]
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200]
    return [r.json() for r in replies]


@pytest.fixture(scope="module")
def reference(micro_target):
    bodies = requests(micro_target)
    with serve_in_thread(create_app(micro_target)) as (url, _):
        return bodies, answers(url, bodies)


@pytest.mark.parametrize("release", PLAIN_RELEASES)
def test_sglangs_plain_server_answers_as_the_reference_server(micro_target, reference, release, tmp_path):
    bodies, expected = reference
    with sglang_server(release, micro_target, tmp_path) as (url, server):
        assert server.release == release
        served = answers(url, bodies)
    for body, ours, theirs in zip(bodies, expected, served):
        assert theirs["output_ids"] == ours["output_ids"], f"SGLang {release} continues {body} differently"
        meta = theirs["meta_info"]
        assert {key: meta[key] for key in COMPARED} == {key: ours["meta_info"][key] for key in COMPARED}
        assert not [key for key in meta if key.startswith("spec_")]  # no draft: no spec_* key, as in ours
