import json

import boto3
import pytest
from moto.server import ThreadedMotoServer

import eagle3.data.prompts as prompts_module
from eagle3.data.prompts import BUILTIN_PYDOC, load_prompts, parse_line, split_heldout
from eagle3.errors import UnreadableInput


def test_sharegpt_and_openai_shapes():
    sharegpt = {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hi"},
                                  {"from": "gpt", "value": "old"}, {"from": "human", "value": "more"}]}
    assert parse_line(json.dumps(sharegpt)) == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}, {"role": "user", "content": "more"}
    ]
    openai = {"messages": [{"role": "developer", "content": "rules"},
                           {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert parse_line(json.dumps(openai)) == [{"role": "system", "content": "rules"}, {"role": "user", "content": "ab"}]


def test_malformed_lines_are_counted_with_line_numbers(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        "\n".join([
            json.dumps({"messages": [{"role": "user", "content": "fine"}]}),
            "{not json",
            json.dumps({"conversations": [{"from": "robot", "value": "x"}]}),
            "",
            json.dumps({"messages": [{"role": "assistant", "content": "no user"}]}),
            json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            json.dumps([1, 2]),
            json.dumps({"messages": [{"role": "user", "content": "fine"}]}),
        ]) + "\n"
    )
    result = load_prompts(str(path))
    assert len(result.prompts) == 1 and result.duplicates == 1
    assert [n for n, _ in result.malformed] == [2, 3, 5, 6, 7]
    reasons = dict(result.malformed)
    assert "not JSON" in reasons[2] and "robot" in reasons[3] and "no user turn" in reasons[5]
    assert "text content parts" in reasons[6] and "not a JSON object" in reasons[7]


def test_missing_file_is_named(tmp_path):
    with pytest.raises(UnreadableInput, match="no such prompt file"):
        load_prompts(str(tmp_path / "missing.jsonl"))


def test_heldout_split_is_deterministic_and_disjoint():
    prompts = load_prompts(BUILTIN_PYDOC).prompts
    assert len(prompts) > 500
    train, heldout = split_heldout(prompts, 0.1)
    again_train, again_heldout = split_heldout(list(reversed(prompts)), 0.1)
    assert {p.id for p in heldout} == {p.id for p in again_heldout}
    assert not {p.id for p in train} & {p.id for p in heldout}
    assert 0.05 < len(heldout) / len(prompts) < 0.15


def test_s3_source_over_http(tmp_path, monkeypatch):
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        host, port = server.get_host_and_port()
        for key, value in {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "test",
                           "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}.items():
            monkeypatch.setenv(key, value)
        s3 = boto3.client("s3")
        s3.create_bucket(Bucket="eagle3-prompts")
        body = json.dumps({"messages": [{"role": "user", "content": "from s3"}]}) + "\n{broken\n"
        s3.put_object(Bucket="eagle3-prompts", Key="sets/a.jsonl", Body=body.encode())
        result = load_prompts("s3://eagle3-prompts/sets/a.jsonl")
        assert [p.turns[0]["content"] for p in result.prompts] == ["from s3"] and [n for n, _ in result.malformed] == [2]
        with pytest.raises(UnreadableInput, match="s3://eagle3-prompts/missing.jsonl"):
            load_prompts("s3://eagle3-prompts/missing.jsonl")
    finally:
        server.stop()


def test_reasoning_is_kept_apart_from_the_answer():
    from eagle3.data.conversation import assistant_message

    assert assistant_message("<think>\nweigh options\n</think>\n\nAnswer.") == {
        "role": "assistant", "content": "Answer.", "reasoning_content": "weigh options"
    }
    assert assistant_message("Plain answer.") == {"role": "assistant", "content": "Plain answer."}


def test_a_template_that_rewrites_history_ends_the_sample_cleanly(micro_target):
    from transformers import AutoTokenizer

    from eagle3.data.conversation import SampleBuilder, TemplateMismatch

    tokenizer = AutoTokenizer.from_pretrained(micro_target)
    # Renders only the last two messages: once a turn is added, earlier text disappears.
    tokenizer.chat_template = "{% for m in messages[-2:] %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}" \
                              "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    builder = SampleBuilder(tokenizer, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], thinking=False)
    first = builder.next_prompt()
    builder.add_reply(tokenizer("x", add_special_tokens=False)["input_ids"])
    with pytest.raises(TemplateMismatch):
        builder.next_prompt()
    assert builder.next_prompt() is None
    sample = builder.sample(max_length=100)
    assert [m["role"] for m in sample.conversation] == ["user", "assistant"]  # no dangling user turn
    assert sample.input_ids[: len(first)] == first and sum(sample.loss_mask) == len(sample.input_ids) - len(first)


def sharegpt_record(number: int) -> dict:
    return {"id": f"r{number}", "conversations": [{"from": "human", "value": f"question {number} {'x' * 40}"},
                                                  {"from": "gpt", "value": "answer"}]}


def test_a_json_array_cut_short_is_read_record_by_record(tmp_path, monkeypatch):
    """ShareGPT V3's shape: one JSON array, cut short inside its last record. Small pieces make records straddle
    them, as the 125 MB file's records straddle its 1 MiB pieces."""
    monkeypatch.setattr(prompts_module, "ARRAY_CHUNK", 64)
    whole = json.dumps([sharegpt_record(n) for n in range(30)] + [{"conversations": []}], indent=2)
    path = tmp_path / "sharegpt.json"
    path.write_text(whole[: whole.rindex('"answer"') + 3])  # cut inside record 30 (numbered from 1: the 30th)
    result = load_prompts(str(path))
    assert [p.turns[0]["content"] for p in result.prompts] == [f"question {n} {'x' * 40}" for n in range(29)]
    assert [n for n, _ in result.malformed] == [30]
    assert "cut short or broken in this record" in result.malformed[0][1]
    path.write_text(whole)  # complete: every record, the empty last one named
    result = load_prompts(str(path))
    assert len(result.prompts) == 30 and result.malformed == [(31, "no user turn")]


def test_an_array_followed_by_more_text_is_not_silently_cut(tmp_path):
    path = tmp_path / "odd.jsonl"
    path.write_text(json.dumps([sharegpt_record(0)]) + "\n" + json.dumps(sharegpt_record(1)) + "\n")
    result = load_prompts(str(path))
    assert len(result.prompts) == 1 and "text after the end of the JSON array" in result.malformed[0][1]


def test_an_installed_package_names_its_data_file():
    with pytest.raises(UnreadableInput, match="no-such-prompts: neither a file nor an installed package"):
        load_prompts("pkg:no-such-prompts")
    with pytest.raises(UnreadableInput, match=r"pytest: the package ships 0 \.json / \.jsonl files"):
        load_prompts("pkg:pytest")
