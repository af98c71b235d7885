"""The data-quality report: its figures on replies made up to show each defect, and a degenerate target (final
norm zeroed: it writes one id forever) failing `eagle3 data regenerate` in one line."""

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from eagle3.cli import main
from eagle3.resolve import load_config
from eagle3.config.data import QualitySection
from eagle3.config.deployment import GateSection
from eagle3.data.quality import Reply, replies_in_file, report
from eagle3.data.regenerate import regenerate, regenerated_replies
from eagle3.errors import UnreadableInput
from eagle3.records.manifest import read_manifest
from eagle3.registry.gate import Metrics, decide
from helpers import TINY, micro_overrides

PROSE = [tuple(range(start, start + 20)) for start in range(0, 200, 20)]  # ten distinct replies, no repeated id


def replies(*ids_lists, text="words", hit_limit=False):
    return [Reply(tuple(ids), text, hit_limit) for ids in ids_lists]


def codes(found: dict) -> list[str]:
    return [p["code"] for p in found["problems"]]


def test_healthy_replies_pass_and_every_figure_is_measured():
    found = report(replies(*PROSE), QualitySection(), 96, str)
    assert found["passed"] and found["problems"] == []
    figures = found["figures"]
    assert figures["replies"] == 10 and figures["tokens"] == 200
    assert figures["top_token_share"] == pytest.approx(1 / 200) and figures["looping_share"] == 0.0
    assert figures["empty_share"] == figures["hit_limit_share"] == figures["duplicate_share"] == 0.0


@pytest.mark.parametrize(("made", "code", "evidence"), [
    (replies(*PROSE[:5], *[(7,) * 20] * 5), "repeated-token", "50% of generated tokens are id 7 '<7>'"),
    (replies(*[tuple(range(i, i + 3)) * 7 for i in range(0, 30, 3)]), "looping", "100% of replies loop: their last 64 tokens repeat a span"),
    (replies(*PROSE, text=" \n"), "empty-replies", "100% of replies hold no text, only whitespace or special tokens"),
    (replies(*PROSE, hit_limit=True), "no-end-token",
     "100% of replies hit max_new_tokens (96) without an end token and without looping"),
    (replies(*PROSE[:5], *[PROSE[0]] * 5), "duplicate-replies", "50% of replies repeat another reply word for word"),
])
def test_each_defect_is_named_with_its_evidence(made, code, evidence):
    found = report(made, QualitySection(), 96, lambda ids: "".join(f"<{i}>" for i in ids))
    assert not found["passed"] and code in codes(found)
    message = next(p["message"] for p in found["problems"] if p["code"] == code)
    assert evidence in message


def looping_reply(start: int) -> tuple[int, ...]:
    """60 distinct ids, then a 10-id span repeated six times: the tail of a small model's greedy reply."""
    return tuple(range(start, start + 60)) + tuple(range(start + 50, start + 60)) * 6


def test_a_reply_that_runs_into_the_limit_because_it_loops_counts_as_looping_not_as_a_missing_stop():
    made = [Reply(looping_reply(1000 * i), "words", True) for i in range(6)]  # loop, then hit the limit
    made += [Reply(PROSE[i], "words", True) for i in range(2)]  # hit the limit, no loop: no end token
    made += [Reply(PROSE[i], "words", False) for i in range(2, 10)]  # ended
    found = report(made, QualitySection(), 120, str)
    figures = found["figures"]
    assert figures["looping_share"] == pytest.approx(6 / 16) and figures["hit_limit_share"] == pytest.approx(8 / 16)
    assert figures["looping_at_limit_share"] == pytest.approx(6 / 16)
    assert figures["unended_share"] == pytest.approx(2 / 16)
    assert codes(found) == ["looping"]  # 12 % unended is under the 50 % bar: no stop-token advice
    message = found["problems"][0]["message"]
    assert "38% of replies loop" in message and "38% of all replies running into max_new_tokens" in message
    assert "stop token" in message and "check the stop tokens" not in message


def test_only_replies_that_neither_loop_nor_end_earn_the_stop_token_advice():
    made = [Reply(PROSE[i], "words", True) for i in range(10)] + [Reply(looping_reply(5000), "words", True)]
    found = report(made, QualitySection(max_looping_share=0.5), 120, str)
    assert codes(found) == ["no-end-token"]
    assert "91% of replies hit max_new_tokens (120) without an end token and without looping" in (
        found["problems"][0]["message"])
    assert "no reply ended its turn" in found["problems"][0]["message"]
    assert "check the stop tokens" in found["problems"][0]["message"]
    some_end = made + [Reply(PROSE[i], "words", False) for i in range(3)]  # 3 of 14 replies end: stop tokens work
    message = report(some_end, QualitySection(max_looping_share=0.5), 120, str)["problems"][0]["message"]
    assert "21% of replies did end their turn, so the stop tokens work: the answers are longer than" in message
    assert "check the stop tokens" not in message


def test_the_loop_bar_is_set_by_config():
    repeated_20 = tuple(range(100, 120)) * 4  # a 20-id span: 20 of the last 64 ids' 63 bigrams distinct (32 %)
    assert codes(report(replies(repeated_20), QualitySection(), None, str)) == ["looping"]
    assert codes(report(replies(repeated_20), QualitySection(loop_min_distinct=0.3), None, str)) == []
    prose_then_loop = tuple(range(100)) + (7, 8) * 10  # a 2-id loop in the last 20 ids only
    assert codes(report(replies(prose_then_loop), QualitySection(), None, str)) == []
    assert codes(report(replies(prose_then_loop), QualitySection(loop_window=20), None, str)) == ["looping"]


def test_a_waived_problem_passes_and_stays_recorded():
    found = report(replies(*PROSE, hit_limit=True), QualitySection(waive=["no-end-token"]), 96, str)
    assert found["passed"] and found["problems"][0]["waived"]


def test_the_gate_refuses_failed_data_and_names_a_waiver():
    metrics = dict(accept_length=2.5, accept_rate=0.5, simulated_accept_length=2.5)
    problem = {"code": "no-end-token", "message": "100% of replies hit max_new_tokens"}
    refused = decide(Metrics(**metrics, data_problems=({**problem, "waived": False},)), None, GateSection())
    assert not refused.promote and [r.rule for r in refused.reasons] == ["data-quality"]
    assert "failed its quality check: 100% of replies hit max_new_tokens" in refused.summary()
    waived = decide(Metrics(**metrics, data_problems=({**problem, "waived": True},)), None, GateSection())
    assert waived.promote and "no-end-token waived on purpose" in waived.summary()


@pytest.fixture
def degenerate_target(micro_target, tmp_path):
    """The micro target with its final norm zeroed: every logit is 0, so greedy decoding writes id 0 forever."""
    target = tmp_path / "degenerate"
    shutil.copytree(micro_target, target)
    weights = load_file(target / "model.safetensors")
    weights["model.norm.weight"].zero_()
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return target


def test_a_degenerate_target_fails_regeneration_in_one_line(degenerate_target, tmp_path, capsys):
    args = ["--config", str(TINY)] + [f"--set={o}" for o in micro_overrides(tmp_path / "run", degenerate_target)]
    assert main(["data", "regenerate", *args]) != 0
    [error] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("eagle3:")]  # one line
    assert "100% of generated tokens are id 0 '<|bos|>'" in error
    assert "check the chat template and the stop tokens" in error
    quality = read_manifest(tmp_path / "run" / "data" / "regen")["quality"]  # the evidence is kept with the data
    assert not quality["passed"] and "repeated-token" in codes(quality)


def test_a_waiver_lets_the_data_through_and_the_manifest_says_so(degenerate_target, tmp_path):
    waive = "data.quality.waive=[repeated-token, looping, empty-replies, no-end-token, duplicate-replies]"
    config = load_config(TINY, micro_overrides(tmp_path / "run", degenerate_target) + [waive])
    lines = []
    regenerate(config, log=lines.append)
    quality = read_manifest(config.stage_dir("data") / "regen")["quality"]
    assert quality["passed"] and all(p["waived"] for p in quality["problems"])
    assert any("data quality WAIVED (repeated-token)" in line for line in lines)
    records = [json.loads(line) for line in (config.stage_dir("data") / "regen" / "samples-00000.jsonl").open()]
    assert all(finish == "length" for record in records for *_, finish in record["replies"])
    args = ["data", "quality", "--config", str(TINY)] + [f"--set={o}" for o in micro_overrides(tmp_path / "run",
                                                                                                degenerate_target)]
    assert main([*args, f"--set={waive}"]) == 0  # the regenerated replies, judged again: waived
    assert main(args) == 1  # the same replies under the micro tests' waivers only: failed


def test_a_conversations_file_is_checked_before_it_is_used(micro_target, tmp_path, capsys):
    conversations = tmp_path / "conversations.jsonl"
    lines = [{"conversations": [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": answer}]}
             for i, answer in enumerate(["Sure, here is the answer you asked for."] * 3 + ["A list holds items."])]
    conversations.write_text("".join(json.dumps(line) + "\n" for line in lines))
    overrides = [f"--set={o}" for o in micro_overrides(tmp_path / "run", micro_target)]
    assert main(["data", "quality", "--config", str(TINY), *overrides, "--set=data.quality.waive=[]",
                 "--file", str(conversations)]) == 1
    out = capsys.readouterr().out
    assert "4 replies" in out and "FAILED duplicate-replies: 50% of replies repeat another reply" in out
    assert "hit max_new_tokens n/a" in out  # unknown from text


def test_samples_written_without_their_replies_are_refused_by_name(tmp_path):
    regen = tmp_path / "regen"
    regen.mkdir()
    (regen / "sample_ids.json").write_text('["a"]')
    (regen / "samples-00000.jsonl").write_text(json.dumps({"id": "a", "input_ids": [1], "loss_mask": [1]}) + "\n")
    with pytest.raises(UnreadableInput, match=r"sample a was written by an eagle3 that did not record its replies; "
                                              r"remove .* and regenerate"):
        list(regenerated_replies(regen, tokenizer=None))


def test_a_conversations_file_that_is_not_there_is_named(tmp_path):
    with pytest.raises(UnreadableInput, match=r"missing.jsonl: no such prompt file"):
        list(replies_in_file(tmp_path / "missing.jsonl", encode=list))
