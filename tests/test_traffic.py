"""Production traffic as a prompt source (data.traffic) and per-slice acceptance in the benchmark: SGLang request
records (written here in the exporter's shape) become rendered prompts - the pipeline's own requests skipped,
ids-only requests decoded, duplicates counted, capped per slice and in total, mixed with the base prompts by
share - regenerated without a second chat template, recorded in the data manifest, and keyed by content."""

import json
import time
from datetime import datetime
from pathlib import Path

import boto3
import pytest

from eagle3.bench.client import SlicedPrompt, render_table, run_benchmark, summarize
from eagle3.config import check_local_inputs
from eagle3.resolve import load_config
from eagle3.data.conversation import encode, prompt_ids, render
from eagle3.data.prompts import BASE_SLICE, load_prompts, rendered_prompt
from eagle3.data.continuations import continue_suites
from eagle3.data.regenerate import HELDOUT_FILE, continuing, generate_batch, read_samples, regenerate
from eagle3.data.traffic import TRAFFIC_FILE, describe_traffic, mixed, select_traffic, traffic_snapshot
from eagle3.deployment.promotion import run_prompt_ids
from eagle3.runtime.generators import LocalGenerator
from eagle3.runtime.targets import load_tokenizer
from eagle3.records.telemetry import UNLABELLED
from eagle3.errors import ConfigError
from eagle3.records.manifest import read_manifest
from eagle3.records.telemetry import RequestRecord
from eagle3.stages.keys import config_inputs
from helpers import TINY, micro_overrides
from fake_sglang import FakeSGLang
from s3_server import serve_moto_s3

FAST = dict(timeout_s=30, retries=1, backoff_s=0.01, log=lambda line: None)


def record_line(sent: float, text: str | None = None, input_ids: list[int] | None = None,
                labels: dict | None = None) -> str:
    """One finished request as SGLang's request-metrics exporter writes it (request_parameters a JSON string)."""
    parameters = {"sampling_params": {"max_new_tokens": 32}}
    if text is not None:
        parameters["text"] = text
    if input_ids is not None:
        parameters["input_ids"] = input_ids
    if labels is not None:
        parameters["custom_labels"] = labels
    return json.dumps({"request_parameters": json.dumps(parameters), "completion_tokens": 12, "spec_verify_ct": 5,
                       "response_sent_to_client_ts": sent}) + "\n"


def record_file(directory: Path, sent: float) -> Path:
    return directory / f"sglang-request-metrics-{datetime.fromtimestamp(sent).strftime('%Y%m%d_%H')}.log"


def write_records(directory: Path, lines: list[tuple[float, str]]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for sent, line in lines:
        with open(record_file(directory, sent), "a") as f:
            f.write(line)


def chat(tokenizer, content: str, system: str | None = None) -> str:
    """What SGLang records for an OpenAI chat request: the rendered prompt, generation prompt included."""
    turns = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    return render(tokenizer, turns, thinking=False, generation_prompt=True)


def traffic_config(run_dir: Path, target: Path, records: str, *more: str):
    return load_config(TINY, [*micro_overrides(run_dir, target), f"data.traffic.records={records}", *more])


@pytest.fixture(scope="module")
def tokenizer(micro_target):
    return load_tokenizer(str(micro_target))


def test_records_become_rendered_prompts_counted_and_windowed(tmp_path, micro_target, tokenizer):
    now = time.time()
    code, chatty = chat(tokenizer, "def sort a list in python", "You write code."), chat(tokenizer, "hello there")
    ids_only = chat(tokenizer, "the for statement is used to iterate")
    records = tmp_path / "records"
    write_records(records, [
        (now - 3 * 3600, record_line(now - 3 * 3600, chat(tokenizer, "too old"), labels={"app": "code"})),
        (now - 60, record_line(now - 60, code, labels={"app": "code"})),
        (now - 50, record_line(now - 50, code, labels={"app": "code"})),  # the same prompt again
        (now - 40, record_line(now - 40, chatty)),  # no slice label
        (now - 30, record_line(now - 30, chat(tokenizer, "benchmark"), labels={"eagle3": "benchmark"})),
        (now - 20, record_line(now - 20, input_ids=encode(tokenizer, ids_only), labels={"app": "docs"})),
        (now - 10, record_line(now - 10, labels={"app": "docs"})),  # no text, no ids
    ])
    config = traffic_config(tmp_path / "run", micro_target, str(records), "data.traffic.hours=1")
    made = traffic_snapshot(config.run, config.data, config.target, config.production.telemetry.slice_label)
    assert (made["records"], made["duplicates"], made["pipeline_records"], made["without_prompt"]) == (6, 1, 1, 1)
    assert made["slices"] == {UNLABELLED: {"unique": 1, "kept": 1}, "code": {"unique": 1, "kept": 1},
                              "docs": {"unique": 1, "kept": 1}}
    assert made["prompts"] == 3 and made["capped"] == 0 and made["records_location"] == str(records)
    prompts = load_prompts(str(config.stage_dir("data") / "traffic.jsonl")).prompts
    by_slice = {p.slice: p for p in prompts}
    assert by_slice["code"].text == code and by_slice[UNLABELLED].text == chatty
    assert by_slice["docs"].text == ids_only  # decoded with the target's tokenizer, special tokens kept
    assert all(p.turns == () for p in prompts)
    line = describe_traffic(made)
    assert "3 prompts from 6 request records" in line and "1 duplicates, 1 of the pipeline's own" in line
    # read once per run: new records do not change what this run took
    write_records(records, [(now - 5, record_line(now - 5, chat(tokenizer, "later"), labels={"app": "code"}))])
    assert traffic_snapshot(config.run, config.data, config.target, config.production.telemetry.slice_label) == made


def rec(number: int, slice_name: str | None) -> RequestRecord:
    labels = {} if slice_name is None else {"custom_labels": {"app": slice_name}}
    return RequestRecord(time=float(number), parameters={"text": f"prompt {number}", **labels}, completion_tokens=4,
                         spec_verify_ct=2, where=f"f:{number}")


def test_caps_per_slice_and_in_total_keep_the_newest_round_robin():
    records = [rec(n, "chatty") for n in range(5)] + [rec(10, "code"), rec(11, "code"), rec(20, None)]
    prompts, counts = select_traffic(records, decode=None, slice_label="app", max_per_slice=2, max_prompts=4)
    assert [p.text for p in prompts] == ["prompt 20", "prompt 4", "prompt 11", "prompt 3"]
    assert counts["slices"] == {UNLABELLED: {"unique": 1, "kept": 1}, "chatty": {"unique": 5, "kept": 2},
                                "code": {"unique": 2, "kept": 1}}
    assert counts["capped"] == 4 and counts["records"] == 8


def test_mixed_takes_the_share_from_traffic_in_every_prefix():
    base = [rendered_prompt(f"b{i}") for i in range(10)]
    traffic = [rendered_prompt(f"t{i}", "code") for i in range(10)]
    for share, count in ((0.3, 3), (0.5, 5), (1.0, 10)):
        first = mixed(base, traffic, share)[:10]
        assert sum(p.slice == "code" for p in first) == count
        assert mixed(base, traffic, share)[:4] == first[:4]  # more samples extend the same prefix
    short = mixed(base, traffic[:2], 0.5)
    assert len(short) == 12 and [p.slice for p in short[:10]].count("code") == 2  # the base fills the rest


def test_rendered_prompt_is_regenerated_as_sent_with_the_answer_alone_in_the_loss(tmp_path, micro_target, tokenizer):
    config = load_config(TINY, micro_overrides(tmp_path, micro_target) + ["data.max_new_tokens=6"])
    text = chat(tokenizer, "the while statement is used for", "Answer briefly.")
    sent = encode(tokenizer, text)
    assert prompt_ids(tokenizer, [{"role": "user", "content": text}], False) != sent  # what a second template makes
    record, = generate_batch(LocalGenerator(str(micro_target), 8, 0.0), tokenizer, [rendered_prompt(text, "code")],
                             config.data)
    assert record["input_ids"][: len(sent)] == sent and len(record["input_ids"]) > len(sent)
    assert record["loss_mask"] == [0] * len(sent) + [1] * (len(record["input_ids"]) - len(sent))
    assert record["replies"][0][:2] == [len(sent), len(record["input_ids"])]
    assert record["conversation"][0] == {"role": "rendered", "content": text}


def test_regenerate_mixes_traffic_records_provenance_and_benchmarks_it_as_sent(tmp_path, micro_target, tokenizer):
    now, records = time.time(), tmp_path / "records"
    write_records(records, [(now - 100 + i, record_line(now - 100 + i, chat(tokenizer, f"class number {i} is"),
                                                        labels={"app": "code" if i % 2 else "docs"}))
                            for i in range(24)])
    write_records(records, [(now - 1, record_line(now - 1, chat(tokenizer, "benchmark"), labels={"eagle3": "benchmark"}))])
    config = traffic_config(tmp_path / "run", micro_target, str(records), "data.num_samples=8", "data.max_new_tokens=4",
                            "data.heldout_fraction=0.3", "benchmark.num_prompts=6", "benchmark.max_new_tokens=4",
                            "data.quality.waive=[empty-replies, duplicate-replies, looping, repeated-token]")
    lines = []
    out = regenerate(config, log=lines.append)
    sources = read_manifest(out)["prompt_sources"]
    assert sources["base"] == {"source": "builtin:pydoc", "samples": 4}
    traffic = sources["traffic"]
    assert traffic["samples"] == 4 and sum(traffic["samples_per_slice"].values()) == 4
    assert traffic["pipeline_records"] == 1 and traffic["prompts"] == 24 and traffic["records_location"] == str(records)
    assert set(traffic["window"]) == {"since", "until"}
    assert any("4 of the first 8 training prompts" in line and "production traffic" in line for line in lines)
    assert any("prompts: production traffic: 24 prompts from 25 request records" in line for line in lines)
    samples = {r["id"]: r for r in read_samples(out)}
    from_traffic = [r for r in samples.values() if r["conversation"][0]["role"] == "rendered"]
    assert len(from_traffic) == 4
    for r in from_traffic:  # the prompt's tokens as sent, then the answer
        assert r["input_ids"][: r["replies"][0][0]] == encode(tokenizer, r["conversation"][0]["content"])
    heldout = load_prompts(str(config.stage_dir("data") / HELDOUT_FILE)).prompts
    assert {p.slice for p in heldout} >= {BASE_SLICE} and {p.slice for p in heldout} & {"code", "docs"}
    continue_suites(continuing(config), log=lines.append)  # the suites stage: the traffic suite's continuations
    benchmark = run_prompt_ids(config.benchmark, config.data, config.run, config.target)
    assert len(benchmark) == 6 and all(isinstance(p, SlicedPrompt) for p in benchmark)
    for prompt, ids in zip(heldout, benchmark):
        assert ids.slice == prompt.slice
        if prompt.text is not None:
            assert list(ids) == encode(tokenizer, prompt.text)  # no second template


def test_the_data_key_holds_the_traffic_selection_and_reads_no_records(tmp_path, micro_target, tokenizer):
    """The snapshot is the regenerate stage's work (once per run directory, whose token is in every key): computing
    the key reads no request record and writes nothing."""
    now, records = time.time(), tmp_path / "records"
    write_records(records, [(now - 10, record_line(now - 10, chat(tokenizer, "first"), labels={"app": "code"}))])
    config = traffic_config(tmp_path / "run", micro_target, str(records))
    key = config_inputs(config, "regenerate")["traffic"]
    assert not (config.stage_dir("data") / TRAFFIC_FILE).exists()
    assert key == {**config.data.traffic.model_dump(mode="json"), "slice_label": "app"}
    shared = traffic_config(tmp_path / "run", micro_target, str(records), "data.traffic.share=0.25")
    assert config_inputs(shared, "regenerate")["traffic"] == {**key, "share": 0.25}
    plain = load_config(TINY, micro_overrides(tmp_path / "plain", micro_target))
    assert config_inputs(plain, "regenerate")["traffic"] is None


def test_traffic_config_errors_name_the_field_and_the_fix(tmp_path, micro_target):
    with pytest.raises(ConfigError, match=r"data.traffic.max_per_slice \(50\) exceeds data.traffic.max_prompts \(10\)"):
        traffic_config(tmp_path, micro_target, str(tmp_path), "data.traffic.max_prompts=10",
                       "data.traffic.max_per_slice=50")
    with pytest.raises(ConfigError, match="remove data.import_path or data.traffic"):
        traffic_config(tmp_path, micro_target, str(tmp_path), f"data.import_path={tmp_path / 'rows.jsonl'}")
    with pytest.raises(ConfigError, match="data.traffic.share"):
        traffic_config(tmp_path, micro_target, str(tmp_path), "data.traffic.share=0")
    with pytest.raises(ConfigError, match=f"data.traffic.records {tmp_path / 'none'}: no such directory"):
        check_local_inputs(traffic_config(tmp_path, micro_target, str(tmp_path / "none")))
    assert load_config(TINY, micro_overrides(tmp_path, micro_target)).data.traffic is None  # off by default


def test_records_under_an_s3_prefix(tmp_path, micro_target, monkeypatch):
    for server in serve_moto_s3(monkeypatch, tmp_path):
        monkeypatch.setenv("AWS_ENDPOINT_URL", server.url)
        now = time.time()
        s3 = boto3.client("s3")
        s3.create_bucket(Bucket="prod")
        name = record_file(Path("logs"), now - 10).as_posix()
        s3.put_object(Bucket="prod", Key=name, Body=record_line(now - 10, "<|bos|>hi", labels={"app": "a"}).encode())
        config = traffic_config(tmp_path / "run", micro_target, "s3://prod/logs/")
        made = traffic_snapshot(config.run, config.data, config.target, config.production.telemetry.slice_label)
        assert made["prompts"] == 1 and made["slices"] == {"a": {"unique": 1, "kept": 1}}


def test_benchmark_reports_each_slice_and_labels_its_requests():
    spec = {"spec_verify_ct": 2, "spec_num_correct_drafts": 2}
    prompts = [SlicedPrompt([1, 2, 3], "code"), SlicedPrompt([4, 5], "code"), SlicedPrompt([6, 7, 8, 9], "docs"), [10]]
    with FakeSGLang(spec_meta=spec) as server:
        result = run_benchmark(server.url, prompts, 6, 2, **FAST)
    assert all(body["custom_labels"] == {"eagle3": "benchmark"} for body in server.bodies)
    assert [row["slice"] for row in result["prompts"]] == ["code", "code", "docs", BASE_SLICE]
    slices = result["suites"]["heldout"]["slices"]  # plain prompts belong to the held-out suite
    picked = {name: {k: f[k] for k in ("requests", "completion_tokens", "verify_ct", "correct_drafts", "accept_length")}
              for name, f in slices.items()}
    assert picked == {"code": {"requests": 2, "completion_tokens": 12, "verify_ct": 4, "correct_drafts": 4, "accept_length": 3.0},
                      "docs": {"requests": 1, "completion_tokens": 6, "verify_ct": 2, "correct_drafts": 2, "accept_length": 3.0},
                      BASE_SLICE: {"requests": 1, "completion_tokens": 6, "verify_ct": 2, "correct_drafts": 2,
                                   "accept_length": 3.0}}
    table = "\n".join(render_table(result))
    assert "  code" in table and "2 requests" in table


def test_a_slice_that_drops_is_not_averaged_away():
    def answer(completion, verify):
        return {"meta_info": {"completion_tokens": completion, "spec_verify_ct": verify, "prompt_tokens": 3}}, 0.1, 1
    outcomes = [answer(31, 10), answer(19, 10), answer(62, 20)]
    labels = [("traffic", "code"), ("traffic", "chat"), ("traffic", "code")]
    result = summarize("http://x", {"speculative_num_draft_tokens": 4}, outcomes, 1.0, labels)
    assert result["accept_length"] == pytest.approx(112 / 40)
    slices = result["suites"]["traffic"]["slices"]
    assert {k: slices["code"][k] for k in ("requests", "completion_tokens", "verify_ct", "accept_length")} == {
        "requests": 2, "completion_tokens": 93, "verify_ct": 30, "accept_length": pytest.approx(3.1)}
    assert slices["chat"]["accept_length"] == pytest.approx(1.9)
