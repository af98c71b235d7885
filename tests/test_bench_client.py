"""The serving benchmark client against real reference servers (uvicorn on 127.0.0.1, micro target): served
accept length equal to the simulator's, SGLang's histogram, no-draft servers, baseline identity and speedup,
lost requests named (never a smaller average), retries counted once, and `eagle3 bench` end to end."""

import itertools
import json

import pytest

from eagle3.serve.inprocess import serve_in_thread
from fake_sglang import FakeSGLang
from eagle3.bench.client import BenchmarkError, load_prompt_file, render_table, run_benchmark
from eagle3.algorithms.eagle3 import EAGLE3
from eagle3.bench.simulate import simulate_prompt
from eagle3.cli import main
from eagle3.resolve import load_config
from eagle3.data.conversation import prompt_ids
from eagle3.data.prompts import pydoc_prompt_turns
from eagle3.runtime.targets import load_tokenizer
from eagle3.algorithms.eagle3.served import draft_as_served
from eagle3.serve.reference import create_app
from eagle3.shape import DraftShape
from helpers import RELEASE, STEPS, TINY, micro_overrides, prompt_of, requests, store_requests

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_NEW = 24
FAST = dict(timeout_s=60, retries=2, backoff_s=0.01, log=lambda line: None)


serving = serve_in_thread


@pytest.fixture(scope="module")
def plain_url(micro):
    with serving(create_app(micro["path"])) as (url, _):
        yield url


@pytest.fixture(scope="module")
def draft_url(micro, drafts):
    with serving(create_app(micro["path"], drafts["good"], shape=DraftShape(STEPS), release=RELEASE)) as (url, _):
        yield url


def bench_prompts(micro):
    """Three rendered pydoc prompts as ids and two plain texts (sent as `text`)."""
    return [r.get("input_ids", r.get("text")) for r in requests(micro)]


def test_served_accept_length_equals_the_simulators(micro, drafts, draft_url):
    result = run_benchmark(draft_url, bench_prompts(micro), MAX_NEW, 2, **FAST)
    served_draft = draft_as_served(drafts["good"], RELEASE, micro["embed"]).eval()
    rows = [simulate_prompt(EAGLE3, served_draft, micro["model"], served_draft.config.aux_layers, prompt_of(micro, r), MAX_NEW,
                            DraftShape(STEPS), frozenset({micro["eos"]}), RELEASE) for r in requests(micro)]
    simulated = sum(r.completion_tokens for r in rows) / sum(r.verify_ct for r in rows)
    assert result["accept_length"] == pytest.approx(simulated, rel=0.02) and result["accept_length"] > 1.3
    assert [(p["completion_tokens"], p["verify_ct"]) for p in result["prompts"]] == [(r.completion_tokens, r.verify_ct) for r in rows]
    assert sum(result["histogram"]) == result["verify_ct"] and len(result["histogram"]) <= STEPS + 1
    assert result["correct_drafts"] == sum(r.correct_drafts for r in rows)
    assert result["accept_rate"] == result["correct_drafts"] / (result["verify_ct"] * STEPS)
    assert result["server_version"] == RELEASE and result["draft_tokens_per_step"] == STEPS
    assert result["num_prompts"] == 5 and [p["index"] for p in result["prompts"]] == list(range(5))
    assert result["completion_tokens"] == sum(p["completion_tokens"] for p in result["prompts"])
    assert result["prompt_tokens"] == sum(len(prompt_of(micro, r)) for r in requests(micro))
    lat = result["latency_s"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"] and result["output_tokens_per_s"] > 0
    assert result["retried_requests"] == 0 and result["baseline"] is None and result["speedup"] is None
    json.dumps(result)  # JSON-ready
    assert any("accept length" in line for line in render_table(result))


def test_no_draft_server_reports_no_accept_length(micro, plain_url):
    result = run_benchmark(plain_url, bench_prompts(micro), 8, 3, **FAST)
    assert result["accept_length"] is None and result["accept_rate"] is None and result["histogram"] is None
    assert result["verify_ct"] == 0 and result["completion_tokens"] == 5 * 8
    assert all(p["accept_length"] is None for p in result["prompts"])
    assert "no draft" in "\n".join(render_table(result))


def test_baseline_outputs_are_identical_and_speedup_is_reported(micro, plain_url, draft_url):
    result = run_benchmark(draft_url, bench_prompts(micro), MAX_NEW, 2, baseline_url=plain_url, **FAST)
    assert result["mismatches"] == 0 and result["mismatched_prompts"] == []
    assert isinstance(result["speedup"], float) and result["speedup"] > 0
    assert result["speedup"] == pytest.approx(result["baseline"]["wall_s"] / result["wall_s"])
    assert result["baseline"]["completion_tokens"] == result["completion_tokens"]
    assert result["baseline"]["server_version"] == "reference"
    assert "speedup" in "\n".join(render_table(result))


def test_a_server_that_dies_mid_run_names_the_lost_prompts(micro):
    """Stopped after 3 answers: uvicorn finishes what it holds, refuses the rest; every prompt it did not
    answer is named, and no result comes back."""
    tokenizer = load_tokenizer(str(micro["path"]))
    prompts = [prompt_ids(tokenizer, turns, False) for turns in itertools.islice(pydoc_prompt_turns(), 30)]
    assert len({tuple(p) for p in prompts}) == len(prompts)
    answered, inner = [], create_app(micro["path"])
    state = {}

    async def app(scope, receive, send):  # records each answered prompt, stops the server after the third
        if scope["type"] != "http" or scope["path"] != "/generate":
            return await inner(scope, receive, send)
        body = bytearray()

        async def recording():
            message = await receive()
            body.extend(message.get("body", b""))
            return message

        await inner(scope, recording, send)
        answered.append(prompts.index(json.loads(body)["input_ids"]))
        if len(answered) >= 3:
            state["server"].should_exit = True

    with serving(app) as (url, server):
        state["server"] = server
        with pytest.raises(BenchmarkError) as caught:
            run_benchmark(url, prompts, 48, 2, **FAST)
    lost = caught.value.lost
    assert lost and sorted(lost) == sorted(set(range(len(prompts))) - set(answered))
    assert len(prompts) - 1 in lost and "no partial result" in str(caught.value)
    assert f"{len(lost)} of {len(prompts)} requests lost" in str(caught.value)


def test_a_500_then_ok_is_retried_and_counted_once():
    # A pre-0.5.12 server (histogram under its old name) without speculative_num_steps in /server_info.
    spec = {"spec_verify_ct": 2, "spec_num_correct_drafts": 2, "spec_accept_rate": 1 / 3, "spec_accept_histogram": [1, 0, 1, 0]}
    with FakeSGLang(version="0.5.11", spec_meta=spec) as server:
        server.faults = ["500"]
        result = run_benchmark(server.url, [[1, 2, 3], [4, 5]], 5, 1, **FAST)
    posts = server.bodies
    assert len(posts) == 3 and result["num_prompts"] == 2 and result["retried_requests"] == 1
    assert [p["attempts"] for p in result["prompts"]] == [2, 1]
    assert result["completion_tokens"] == 10 and result["verify_ct"] == 4 and result["accept_length"] == 2.5
    assert result["histogram"] == [2, 0, 2, 0]  # the pre-0.5.12 name, summed
    assert result["accept_rate"] == pytest.approx(1 / 3) and result["draft_tokens_per_step"] is None
    assert posts[0]["sampling_params"] == {"max_new_tokens": 5, "temperature": 0}


def test_a_request_failing_all_its_retries_is_named():
    with FakeSGLang(spec_meta={"spec_verify_ct": 2, "spec_num_correct_drafts": 2}) as server:
        server.faults = ["ok", "500", "500", "500"]
        with pytest.raises(BenchmarkError, match=r"1 of 2 requests lost after 2 retries: prompt indices \[1\]"):
            run_benchmark(server.url, [[1], [2]], 5, 1, **FAST)
    assert len(server.bodies) == 4


def test_prompt_file_formats(micro, tmp_path):
    tokenizer = load_tokenizer(str(micro["path"]))
    path = tmp_path / "prompts.jsonl"
    lines = [{"input_ids": [1, 2]}, {"text": "The"}, {"messages": micro["turns"][0]}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    assert load_prompt_file(path, tokenizer) == [[1, 2], "The", micro["prompts"][0]]
    with pytest.raises(Exception, match="prompts.jsonl:3: `messages` / `conversations` need a tokenizer"):
        load_prompt_file(path)
    path.write_text('{"input_ids": []}\n')
    with pytest.raises(Exception, match="prompts.jsonl:1: give `input_ids`"):
        load_prompt_file(path)


def test_bench_sends_the_first_n_prompts_of_a_sharegpt_file(micro, draft_url, tmp_path):
    """ShareGPT V3's form (a JSON array of `conversations`, cut short) read as data.prompts reads it."""
    turns = list(itertools.islice(pydoc_prompt_turns(), 12))
    records = [{"id": str(i), "conversations": [{"from": "human", "value": t[0]["content"]}, {"from": "gpt",
                                                "value": "an answer"}]} for i, t in enumerate(turns)]
    path, out = tmp_path / "sharegpt.json", tmp_path / "served.json"
    path.write_text(json.dumps(records)[:-40])  # cut inside the last record
    assert main(["bench", "--url", draft_url, "--prompts", str(path), "--tokenizer", str(micro["path"]),
                 "--num-prompts", "8", "--max-new-tokens", "6", "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    tokenizer = load_tokenizer(str(micro["path"]))
    assert saved["num_prompts"] == 8 and len(saved["prompts"]) == 8
    # the user turns only, rendered as the held-out prompts are: the reply in the file is not sent
    assert [p["prompt_tokens"] for p in saved["prompts"]] == [len(prompt_ids(tokenizer, t, False)) for t in turns[:8]]
    with pytest.raises(SystemExit):  # argparse: the usage and one line naming --num-prompts
        main(["bench", "--url", draft_url, "--prompts", str(path), "--num-prompts", "0"])


def test_bench_command_prints_the_table_and_writes_json(micro, plain_url, draft_url, tmp_path, capsys):
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "served.json"
    lines = [{"input_ids": micro["prompts"][1]}, {"text": "import os\n"}, {"messages": micro["turns"][2]}]
    prompts.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    assert main(["bench", "--url", draft_url, "--baseline-url", plain_url, "--prompts", str(prompts), "--tokenizer",
                 str(micro["path"]), "--max-new-tokens", "12", "--concurrency", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "accept length" in printed and "speedup" in printed and "identical" in printed
    saved = json.loads(out.read_text())
    assert saved["num_prompts"] == 3 and saved["max_new_tokens"] == 12 and saved["mismatches"] == 0
    assert saved["accept_length"] > 1 and saved["prompts"][2]["prompt_tokens"] == len(micro["prompts"][2])


def test_bench_command_takes_its_defaults_from_the_config(micro, draft_url, tmp_path, capsys):
    run_dir = tmp_path / "run"
    overrides = micro_overrides(run_dir, micro["path"]) + ["benchmark.num_prompts=2", "benchmark.max_new_tokens=10"]
    (run_dir / "data").mkdir(parents=True)
    lines = [json.dumps({"id": str(i), "messages": messages}) for i, messages in enumerate(micro["turns"])]
    (run_dir / "data" / "heldout.jsonl").write_text("\n".join(lines) + "\n")
    store_requests(load_config(TINY, overrides), micro)  # what the data stage makes: the benchmark's requests
    assert main(["bench", "--url", draft_url, "--config", str(TINY)] + [a for o in overrides for a in ("--set", o)]) == 0
    assert "accept length" in capsys.readouterr().out
    saved = json.loads((load_config(TINY, overrides).stage_dir("bench") / "served.json").read_text())
    assert saved["num_prompts"] == 2 and saved["max_new_tokens"] == 10
    assert [p["prompt_tokens"] for p in saved["prompts"]] == [len(p) for p in micro["prompts"][:2]]
    assert len(saved["suites"]["heldout"]["sha256"]) == 64  # the gate compares figures on equal requests only
    # a subset goes beside the run's served.json, which keeps every request
    assert main(["bench", "--url", draft_url, "--config", str(TINY), "--num-prompts", "1"]
                + [a for o in overrides for a in ("--set", o)]) == 0
    bench = load_config(TINY, overrides).stage_dir("bench")
    assert json.loads((bench / "served-first-1.json").read_text())["num_prompts"] == 1
    assert json.loads((bench / "served.json").read_text())["num_prompts"] == 2
    assert main(["bench", "--url", draft_url]) == 2  # neither --prompts nor --config: one line, no traceback
