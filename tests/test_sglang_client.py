"""Regeneration against SGLang's HTTP protocol: retries, round-robin, resume; nothing duplicated or lost."""

import json

import pytest

from eagle3.resolve import load_config
from eagle3.data.regenerate import read_samples, regenerate
from eagle3.runtime.generators import EngineError
from helpers import TINY
from fake_sglang import FakeSGLang, answer_for


@pytest.fixture
def prompts_file(tmp_path):
    lines = [json.dumps({"messages": [{"role": "user", "content": f"Describe topic number {i}."}]}) for i in range(30)]
    lines.append(json.dumps({"conversations": [{"from": "human", "value": "First question?"},
                                                {"from": "gpt", "value": "an old answer, replaced"},
                                                {"from": "human", "value": "And a follow-up?"}]}))
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def sglang_config(tmp_path, micro_target, prompts_file, servers, **extra):
    overrides = [
        f"run.dir={tmp_path / 'run'}",
        f"target.path={micro_target}",
        "target.hidden_size=64",
        "target.vocab_size=512",
        "vocab.draft_vocab_size=128",
        "data.generator=sglang",
        f"data.servers={json.dumps(servers)}",
        f"data.prompts={prompts_file}",
        "data.num_samples=100",
        "data.max_new_tokens=6",
        "data.concurrency=4",
        "data.shard_samples=8",
        "data.request_timeout_s=0.5",
        *[f"{key}={value}" for key, value in extra.items()],
    ]
    return load_config(TINY, overrides)


def check_complete(run_dir, expected):
    records = list(read_samples(run_dir / "data" / "regen"))
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)) == expected  # nothing duplicated, nothing lost
    for record in records:
        generated = [t for t, m in zip(record["input_ids"], record["loss_mask"]) if m]
        assert len(generated) == 6 * (len(record["conversation"]) // 2)
    return records


def test_retries_round_robin_and_stored_output_ids(tmp_path, micro_target, prompts_file):
    with FakeSGLang() as first, FakeSGLang() as second:
        first.faults = ["500", "drop", "slow", "ok", "500"]
        second.faults = ["drop", "500"]
        config = sglang_config(tmp_path, micro_target, prompts_file, [first.url, second.url])
        regenerate(config, log=lambda line: None)
        assert first.answered and second.answered  # both servers served
    manifest = json.loads((tmp_path / "run" / "data" / "regen" / "manifest.json").read_text())
    assert manifest["engine_release"] == "0.5.23" and manifest["engine"] == "sglang"
    records = check_complete(tmp_path / "run", manifest["samples"])
    # The server's ids are stored as they came, after exactly the ids it was sent.
    served = set(first.answered) | set(second.answered)
    for record in records:
        ids, mask = record["input_ids"], record["loss_mask"]
        start = mask.index(1)
        assert tuple(ids[:start]) in served and ids[start : start + 6] == answer_for(ids[:start])
    two_turns = [r for r in records if len(r["conversation"]) == 4]
    assert len(two_turns) == 1 and "an old answer" not in json.dumps(two_turns[0])


def first_prompt(record):
    return tuple(record["input_ids"][: record["loss_mask"].index(1)])


def test_crash_then_resume_neither_repeats_nor_loses(tmp_path, micro_target, prompts_file):
    regen = tmp_path / "run" / "data" / "regen"
    with FakeSGLang() as server:
        server.fail_after = 10  # then HTTP 500 for good: the run dies mid-way
        config = sglang_config(tmp_path, micro_target, prompts_file, [server.url], **{"data.retries": 1})
        with pytest.raises(EngineError, match="HTTP 500"):
            regenerate(config, log=lambda line: None)
        written = {r["id"]: first_prompt(r) for r in read_samples(regen)}
        assert 0 < len(written) <= 10
        server.fail_after = None
        server.answered.clear()
        lines = []
        regenerate(config, log=lines.append)
    assert any("resuming" in line for line in lines)
    assert not set(written.values()) & set(server.answered)  # finished samples were not requested again
    manifest = json.loads((regen / "manifest.json").read_text())
    records = check_complete(tmp_path / "run", manifest["samples"])
    assert set(written) <= {r["id"] for r in records}


def test_client_errors_are_not_retried(tmp_path, micro_target, prompts_file):
    with FakeSGLang() as server:
        server.faults = ["400"]
        config = sglang_config(tmp_path, micro_target, prompts_file, [server.url], **{"data.concurrency": 1})
        with pytest.raises(EngineError, match="HTTP 400: .*input too long"):
            regenerate(config, log=lambda line: None)
        assert server.requests == 1


def test_unreachable_server_is_named(tmp_path, micro_target, prompts_file):
    config = sglang_config(tmp_path, micro_target, prompts_file, ["http://127.0.0.1:9"])
    with pytest.raises(EngineError, match="127.0.0.1:9/server_info"):
        regenerate(config, log=lambda line: None)
