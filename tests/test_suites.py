"""The benchmark's suites: their config, their questions (MT-bench from its installed package, a JSONL of yours in
four forms, refused with file and line when unreadable), and their requests as the data stage makes them on the micro
target: a second turn is sent after the target's own greedy answer to the first."""

import json

import pytest

from eagle3.config import check_local_inputs
from eagle3.resolve import load_config
from eagle3.config.suites import MTBENCH
from eagle3.data.conversation import prompt_ids
from eagle3.data.continuations import benchmark_requests, suites_dir
from eagle3.data.regenerate import (GREEDY_FILE, HELDOUT_FILE, REGEN_DIR, benchmark_questions, continue_benchmark,
                                    continue_heldout, continuing, greedy_length, read_greedy)
from eagle3.data.prompts import rendered_prompt
from eagle3.config.suites import mtbench_file
from eagle3.data.suites import across_slices, file_questions, reply_of, suite_questions
from eagle3.deployment.promotion import candidate_metrics
from eagle3.deployment.suites import suite_columns
from eagle3.runtime.generators import make_generator
from eagle3.runtime.targets import load_tokenizer, target_eos_ids
from eagle3.errors import ConfigError, UnreadableInput
from eagle3.registry.gate import decide
from helpers import TINY, micro_overrides, write_heldout


def test_suites_are_named_once_and_keep_the_held_out_set(tmp_path, micro_target):
    config = load_config(TINY, ["benchmark.suites=[heldout, mtbench]"])
    assert [(s.name, s.num_prompts, s.informational) for s in config.benchmark.suites] == [
        ("heldout", None, False), ("mtbench", None, False)]
    for suites, said in (("[mtbench]", "lacks heldout: the trainer's evaluation replays the held-out prompts"),
                         ("[heldout, heldout]", "heldout named twice"),
                         ("[heldout, {name: chat}]", "suite chat: give its prompts file"),
                         ("[heldout, {name: mtbench, path: x.jsonl}]", "suite mtbench is built in"),
                         ("[heldout, traffic]", "from data.traffic; add that section or remove the suite")):
        with pytest.raises(ConfigError, match="benchmark.suites|traffic") as refused:
            load_config(TINY, [f"benchmark.suites={suites}"])
        assert said in str(refused.value)
    missing = load_config(TINY, micro_overrides(tmp_path, micro_target) + [
        f"benchmark.suites=[heldout, {{name: chat, path: {tmp_path / 'chat.jsonl'}}}]"])
    with pytest.raises(ConfigError, match=r"benchmark.suites chat: .*chat.jsonl: no such file"):
        check_local_inputs(missing)


def test_mtbench_is_read_from_the_installed_package():
    questions = file_questions(mtbench_file(), MTBENCH)
    assert len(questions) == 80 and all(q.multi_turn and len(q.prompt.turns) == 2 for q in questions)
    categories = [q.prompt.slice for q in questions]
    assert {c: categories.count(c) for c in set(categories)} == {c: 10 for c in (
        "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")}
    assert questions[0].prompt.turns[0]["content"].startswith("Compose an engaging travel blog post about a recent trip")


def test_a_suite_file_takes_four_forms_and_refuses_an_unreadable_line_by_number(tmp_path):
    path = tmp_path / "mine.jsonl"
    records = [{"turns": ["What is a list?", "And a tuple?"], "category": "python"},
               {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]},
               {"prompt": "Explain len()."}, {"text": "<|im_start|>user\nHi<|im_end|>\n"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + "\n")
    questions = file_questions(path, "mine")
    assert [(q.multi_turn, q.prompt.slice) for q in questions] == [(True, "python"), (False, "base"), (False, "base"),
                                                                    (False, "base")]
    assert [t["role"] for t in questions[1].prompt.turns] == ["system", "user"]
    assert questions[2].prompt.turns == ({"role": "user", "content": "Explain len()."},)
    assert questions[3].prompt.text == records[3]["text"]
    for bad, why in (('{"turns": []}', "`turns` must be a non-empty list of non-empty strings"),
                     ('{"question": "x"}', "none of `turns`, `messages`, `prompt`, `text` is given"),
                     ('{"prompt": "x", "category": 3}', "`category` must be a non-empty string"),
                     ("[1, 2]", "not a JSON object"), ("{oops", "not JSON")):
        path.write_text(json.dumps(records[0]) + "\n" + bad + "\n")
        with pytest.raises(UnreadableInput) as refused:
            file_questions(path, "mine")
        assert str(refused.value).startswith(f"suite mine: {path}:2: {why}") and "each line is a JSON object" in \
            str(refused.value)


def test_the_second_turn_follows_the_targets_own_answer_and_every_turn_is_a_request(tmp_path, micro_target):
    config = load_config(TINY, micro_overrides(tmp_path / "run", micro_target) + [
        "benchmark.num_prompts=2", "benchmark.max_new_tokens=12", "sweep.points=[[5, 1, 6]]",
        "benchmark.suites=[heldout, {name: mtbench, num_prompts: 3}]"])
    write_heldout(config)
    rows = benchmark_requests(config.run)
    assert {row["suite"] for row in read_greedy(config.stage_dir("data") / REGEN_DIR)} == {"heldout"}
    # question by question; three questions of MT-bench taken across its categories
    assert [(r["suite"], r["turn"]) for r in rows] == [("heldout", 1)] * 2 + [("mtbench", 1), ("mtbench", 2)] * 3
    assert [r["slice"] for r in rows[2::2]] == ["writing", "roleplay", "reasoning"]
    assert {len(r["continuation_ids"]) for r in rows} == {12 + 5}  # past max_new_tokens by the deepest shape's steps
    assert greedy_length(config) == 17
    tokenizer, eos = load_tokenizer(config.target), target_eos_ids(config.target.path)
    questions = across_slices(file_questions(mtbench_file(), MTBENCH), 3)
    for question, first, second in zip(questions, rows[2::2], rows[3::2]):
        assert first["question"] == second["question"] == question.prompt.id and first["slice"] == question.prompt.slice
        assert first["prompt_ids"] == prompt_ids(tokenizer, list(question.prompt.turns[:1]), False)
        answer = reply_of(first["continuation_ids"], 12, eos)  # the served request's answer: 12 tokens or to its end
        assert second["prompt_ids"][: len(first["prompt_ids"]) + len(answer)] == first["prompt_ids"] + answer
        assert question.prompt.turns[1]["content"] in tokenizer.decode(second["prompt_ids"])
    # made once: the same questions and lengths keep the files; another count of MT-bench makes its file again and
    # leaves the held-out prompts' (training replays them)
    path, heldout = suites_dir(config.run) / GREEDY_FILE, config.stage_dir("data") / REGEN_DIR / GREEDY_FILE
    before = {file: file.stat().st_mtime_ns for file in (path, heldout)}

    def generator(of):
        return make_generator(of.data, of.target, of.training.seed)

    spec = continuing(config)
    continue_benchmark(spec, benchmark_questions(spec, held_out=False), generator(config), tokenizer, path,
                       lambda line: None)
    continue_heldout(spec, generator(config), tokenizer, heldout, lambda line: None)
    assert {file: file.stat().st_mtime_ns for file in (path, heldout)} == before
    fewer = config.model_copy(update={"benchmark": config.benchmark.model_copy(update={"suites": [
        config.benchmark.suites[0], config.benchmark.suites[1].model_copy(update={"num_prompts": 1})]})})
    fewer_spec = continuing(fewer)
    fields = continue_benchmark(fewer_spec, benchmark_questions(fewer_spec, held_out=False), generator(fewer),
                                tokenizer, path, lambda line: None)
    assert fields == {"prompts": 0, "length": 17, "requests": 2, "suites": {"mtbench": 2}}
    assert continue_heldout(fewer_spec, generator(fewer), tokenizer, heldout, lambda line: None)["requests"] == 2
    assert heldout.stat().st_mtime_ns == before[heldout]
    assert (config.stage_dir("data") / HELDOUT_FILE).is_file()


def test_a_reply_is_cut_at_max_new_tokens_or_after_its_end_token():
    assert reply_of([5, 6, 7, 8], 3, frozenset({9})) == [5, 6, 7]
    assert reply_of([5, 9, 7, 9], 3, frozenset({9})) == [5, 9]


def test_the_traffic_suite_is_the_held_out_prompts_that_came_from_traffic(tmp_path):
    config = load_config(TINY, [f"data.traffic={{records: {tmp_path}}}", "benchmark.num_prompts=3",
                                "benchmark.suites=[heldout, {name: traffic, num_prompts: 2}]"])
    heldout = [rendered_prompt(f"prompt {i}", slice_name) for i, slice_name in
               enumerate(["base", "code", "base", "docs", "code", "base"])]
    questions = suite_questions(config.benchmark, heldout)
    assert [(q.suite, q.prompt.slice) for q in questions] == [("heldout", "base"), ("heldout", "code"),
                                                               ("heldout", "base"), ("traffic", "code"), ("traffic", "docs")]
    assert not any(q.multi_turn for q in questions)


def test_the_gate_counts_gating_suites_only_and_refuses_a_gating_suite_that_made_no_request():
    config = load_config(TINY, ["benchmark.suites=[heldout, {name: chat, path: c.jsonl, informational: true}, "
                                "{name: code, path: d.jsonl}]"])
    suite = lambda completion, verify, correct: {"requests": 4, "completion_tokens": completion,  # noqa: E731
                                                 "verify_ct": verify, "correct_drafts": correct, "sha256": "s"}
    served = {"accept_length": 1.5, "accept_rate": 0.1, "draft_tokens_per_step": 3,
              "suites": {"heldout": suite(300, 100, 150), "chat": suite(110, 100, 10)}}
    simulated = {"accept_length": 1.6, "suites": {"heldout": suite(300, 100, 150), "chat": suite(130, 100, 30)}}
    metrics = candidate_metrics(config.benchmark, served, simulated, {"problems": []}, {})
    assert metrics.accept_length == pytest.approx(3.0) and metrics.accept_rate == pytest.approx(0.5)  # heldout alone
    assert metrics.simulated_accept_length == pytest.approx(3.0)
    decision = decide(metrics, None, config.gate)
    assert [r.rule for r in decision.reasons] == ["too-few-verify-steps"]
    assert decision.reasons[0].message.startswith("suite code: 0 verify steps")


def test_the_table_names_its_shapes_and_says_when_a_column_was_sampled():
    config = load_config(TINY, ["benchmark.suites=[heldout, mtbench]"])
    figures = {"heldout": {"accept_length": 2.0}, "mtbench": {"accept_length": 1.5}}
    simulated = {"shapes": [{"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4, "suites": figures}]}
    swept = {"temperature": 0.7, "points": [{"shape": {"num_steps": 7, "eagle_topk": 1, "num_draft_tokens": 8},
                                             "levels": [{"concurrency": 4, "suites": figures, "output_tokens_per_s": 9.0}]}]}
    names = [c["name"] for c in suite_columns(config.serving, simulated, {"suites": figures}, swept, None)]
    served = f"{config.serving.shape.num_steps}/{config.serving.shape.eagle_topk}/{config.serving.shape.num_draft_tokens}"
    assert names == ["3/1/4 simulated", f"{served} served", "7/1/8 served @ 4, temperature 0.7"]
    greedy = suite_columns(config.serving, simulated, {"suites": figures}, {**swept, "temperature": 0.0}, None)
    assert greedy[-1]["name"] == "7/1/8 served @ 4"
