"""The offline acceptance simulator on the micro target: equal to a brute-force speculative decoding
loop, counted the way SGLang counts (docs/contracts.md), and fed drafts loaded the way SGLang loads them."""

import json

import pytest
import torch

from eagle3.bench.client import summarize
from eagle3.bench.counting import SpecRequest
from eagle3.algorithms.eagle3 import EAGLE3
from eagle3.bench.simulate import AcceptanceResult, PromptResult, replay, simulate_prompt
from eagle3.cli import main
from eagle3.resolve import load_config
from eagle3.data.capture import HELDOUT_DIR, feature_widths, heldout_records, write_shard
from eagle3.data.shards import shard_file
from eagle3.runtime.features import TransformersFeatures
from eagle3.algorithms.eagle3.checkpoint import NativeDraft, save_native_draft
from eagle3.algorithms.eagle3.model import Eagle3Draft
from eagle3.model.tree import DraftTree
from eagle3.algorithms.eagle3.ttt import draft_chain
from eagle3.algorithms.eagle3.served import draft_as_served
from eagle3.shape import DraftShape
from helpers import (
    AUX_LAYERS, CONFIG, NEWLINE, TINY, lens_draft, micro_overrides, random_draft, rewrite, store_requests,
)


pytestmark = pytest.mark.usefixtures("one_thread")


def constant_draft(micro, token: int) -> Eagle3Draft:
    """Every head row predicts `token` (offsets: i + d2t[i] == token)."""
    model = random_draft(micro)
    model.d2t.copy_(token - torch.arange(CONFIG.draft_vocab_size))
    return model


# ---------------------------------------------------------------------------------------------
# 1. The simulator equals speculative decoding done the slow way


@torch.no_grad()
def brute_force(draft, model, prompt, max_new_tokens, num_steps, eos):
    """Chain speculative decoding without a precomputed continuation: every verify step runs the target
    on the growing sequence (features for the draft) and on sequence + drafts (its greedy tokens)."""

    def forward(ids):
        out = model(torch.tensor([ids]), output_hidden_states=True)
        return out.logits[0], torch.cat([out.hidden_states[k + 1][0] for k in AUX_LAYERS], dim=-1)

    seq = list(prompt)
    seq.append(int(forward(seq)[0][-1].argmax()))  # prefill
    completion, verify_ct, correct, histogram = 1, 0, 0, [0] * (num_steps + 1)

    def finished():
        return seq[-1] == eos or completion == max_new_tokens

    while not finished():
        _, aux = forward(seq)  # [P + 1, 3H]; the last verified token's own features are not used
        drafts = draft_chain(draft, aux[:-1], torch.tensor(seq), num_steps)
        logits, _ = forward(seq + drafts)
        greedy = logits[len(seq) - 1 :].argmax(-1).tolist()  # [num_steps + 1] the target's token after each
        accepted = 0
        while accepted < num_steps and drafts[accepted] == greedy[accepted]:
            accepted += 1
        for token in greedy[: accepted + 1]:  # the run is emitted up to the finish (EOS checked first)
            seq.append(token)
            completion += 1
            if finished():
                break
        verify_ct, correct = verify_ct + 1, correct + accepted  # every accepted draft counts, past the finish too
        histogram[accepted] += 1
    return completion, verify_ct, correct, histogram[: max((i for i, n in enumerate(histogram) if n), default=-1) + 1]


@pytest.mark.parametrize("kind", ["random", "newline", "lens"])
@pytest.mark.parametrize("num_steps", [1, 3, 5])
@pytest.mark.parametrize("eos", ["target", NEWLINE])
def test_simulator_equals_brute_force_speculative_decoding(micro, kind, num_steps, eos):
    draft = {"random": random_draft, "newline": lambda m: constant_draft(m, NEWLINE), "lens": lens_draft}[kind](micro)
    eos_id = micro["eos"] if eos == "target" else eos  # "\n" as EOS: requests that finish on a draft token
    rows = []
    for prompt in micro["prompts"]:
        row = simulate_prompt(EAGLE3, draft, micro["model"], AUX_LAYERS, prompt, 13, DraftShape(num_steps), frozenset({eos_id}), None)
        expected = brute_force(draft, micro["model"], prompt, 13, num_steps, eos_id)
        assert (row.completion_tokens, row.verify_ct, row.correct_drafts, row.histogram) == expected
        rows.append(row)
    if kind != "random" and eos == "target":
        assert sum(sum(row.histogram[1:]) for row in rows) > 0  # the comparison covered accepted drafts


# ---------------------------------------------------------------------------------------------
# 2. Counting as docs/contracts.md states it


def test_a_never_accepted_draft_gives_n_over_n_minus_1(micro):
    seen = set(sum(micro["seqs"], []))
    absent = next(token for token in range(512) if token not in seen)
    draft = constant_draft(micro, absent)
    rows = [simulate_prompt(EAGLE3, draft, micro["model"], AUX_LAYERS, p, 13, DraftShape(3), frozenset({micro["eos"]}), None)
            for p in micro["prompts"]]
    for row in rows:
        n = row.completion_tokens
        assert n == 13 and row.verify_ct == n - 1 and row.correct_drafts == 0 and row.histogram == [n - 1]
    result = AcceptanceResult(DraftShape(3), rows)
    assert result.accept_length == pytest.approx(39 / 36) and result.accept_rate == 0.0
    assert result.histogram == [36]  # SGLang's histogram grows only as far as a step reached
    assert json.loads(json.dumps(result.to_dict()))["prompts"][0]["histogram"] == [12]


# ---------------------------------------------------------------------------------------------
# 3. Right drafts raise the accept length (the replay with drafts taken from the answer)


def test_oracle_drafts_and_the_finish_inside_a_verify_step():
    prompt = list(range(100, 105))
    seq = prompt + list(range(10, 23))  # a 5-token prompt, a 13-token greedy continuation (no EOS)

    def oracle(right: int):
        return lambda p: DraftTree.chain((seq[p + 1 : p + 1 + right] + [-1] * 4)[:3])

    def run(right: int, max_new: int, eos=frozenset(), release=None):
        row = replay(seq, 5, oracle(right), 3, max_new, eos, release)
        return row.completion_tokens, row.verify_ct, row.correct_drafts, row.histogram

    # 1 from prefill, then runs of 4: the third crosses the cap of 10 and still counts its 3 drafts
    assert run(3, 10) == (10, 3, 9, [0, 0, 0, 3])
    assert run(1, 10) == (10, 5, 5, [0, 5])  # 1, then 2 per step
    assert run(0, 10) == (10, 9, 0, [9])
    assert run(3, 1) == (1, 0, 0, [])  # one token: prefill only
    # EOS (token 16, the 7th completion token) inside a run that crosses the cap of 8: up to 0.5.17 the cap
    # is checked first and the tokens after the EOS are kept; from 0.5.18 the EOS finishes the request
    assert run(3, 8, frozenset({16}), "0.5.17") == (8, 2, 6, [0, 0, 0, 2])
    assert run(3, 8, frozenset({16}), "0.5.18") == (7, 2, 6, [0, 0, 0, 2])
    assert [AcceptanceResult(DraftShape(3), [replay(seq, 5, oracle(r), 3, 10, frozenset(), None)]).accept_length
            for r in (3, 1, 0)] == [10 / 3, 10 / 5, 10 / 9]


def test_the_simulator_and_the_bench_client_count_the_same_requests_alike():
    """Requests grown as the reference server grows them (SpecRequest): the simulator's totals over their rows and
    the bench client's over their meta_info are one count."""
    runs = [[[7, 8, 9, 1]], [[7, 1], [8, 9, 1]], [[7], [7], [7]], []]  # verify runs (drafts + bonus); the last: none
    requests = []
    for steps in runs:
        request = SpecRequest(max_new_tokens=100, eos_ids=frozenset(), release="0.5.13")
        request.add_token(5)  # the prefill's token
        for run in steps:
            request.add_verify(run)
        requests.append(request)
    simulated = AcceptanceResult(DraftShape(3), [PromptResult(len(r.output), r.verify_ct, r.correct, r.histogram)
                                                 for r in requests]).to_dict()
    answers = [({"meta_info": {"completion_tokens": len(r.output), **r.meta_info(3)}}, 0.1, 1) for r in requests]
    served = summarize("http://127.0.0.1:1", {"speculative_num_draft_tokens": 4}, answers, 1.0)
    expected = {"completion_tokens": 16, "verify_ct": 6, "correct_drafts": 6, "accept_length": 16 / 6,
                "accept_rate": 6 / 18, "histogram": [3, 1, 1, 1]}
    assert {key: simulated[key] for key in expected} == expected == {key: served[key] for key in expected}
    assert [row["accept_length"] for row in served["prompts"]] == [5.0, 3.0, 4 / 3, None]
    assert [r.meta_info(3).get("spec_accept_rate") for r in requests] == [1.0, 3 / 6, 0.0, None]


# ---------------------------------------------------------------------------------------------
# 4. Drafts loaded the way SGLang loads them


def chains(draft, micro, num_steps=3):
    """The chain drafts at every verified position of the first prompt's greedy sequence."""
    seq, start = micro["seqs"][0], len(micro["prompts"][0])
    out = micro["model"](torch.tensor([seq]), output_hidden_states=True)
    aux = torch.cat([out.hidden_states[k + 1][0] for k in AUX_LAYERS], dim=-1)
    return [draft_chain(draft, aux[:p], torch.tensor(seq[: p + 1]), num_steps) for p in range(start, len(seq))]


@torch.no_grad()
def test_served_drafts_follow_the_loader_rules(micro, tmp_path):
    draft = random_draft(micro)  # seed 1: the loader's random init (seed 0) differs from it
    native = NativeDraft(CONFIG, draft.export_state())
    exported = save_native_draft(native, tmp_path / "sglang", to="sglang", release="0.5.13")
    expected = chains(draft, micro)
    assert chains(draft_as_served(exported, "0.5.13", micro["embed"]), micro) == expected

    absolute = rewrite(exported, tmp_path / "absolute", lambda t: {**t, "d2t": t["d2t"] + torch.arange(t["d2t"].numel())})
    assert chains(draft_as_served(absolute, "0.5.13", micro["embed"]), micro) != expected

    renamed = rewrite(exported, tmp_path / "renamed", lambda t: {k.replace("midlayer.", "layers.0."): v for k, v in t.items()})
    assert chains(draft_as_served(renamed, "0.5.11", micro["embed"]), micro) != expected  # layers.0.* skipped
    assert chains(draft_as_served(renamed, "0.5.12", micro["embed"]), micro) == expected


# ---------------------------------------------------------------------------------------------
# 5. The stage, end to end through the command line


def test_simulate_command_writes_the_result(micro, tmp_path, capsys):
    """The stage replays the held-out greedy sequences the data stage stored with their features (bf16): no target
    is loaded, and the counts equal simulate_prompt's over the live target."""
    run_dir = tmp_path / "run"
    overrides = micro_overrides(run_dir, micro["path"]) + ["benchmark.num_prompts=2", "benchmark.max_new_tokens=10"]
    config = load_config(TINY, overrides)
    (run_dir / "data").mkdir(parents=True)
    lines = [json.dumps({"id": str(i), "messages": messages}) for i, messages in enumerate(micro["turns"])]
    (run_dir / "data" / "heldout.jsonl").write_text("\n".join(lines) + "\n")
    store_heldout(config, micro)
    draft = lens_draft(micro)
    save_native_draft(NativeDraft(CONFIG, draft.export_state()), run_dir / "export" / "sglang", to="sglang",
                      release="0.5.13")

    args = ["simulate", "--config", str(TINY)] + [a for o in overrides for a in ("--set", o)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "accept length" in out and "accept rate" in out and "histogram" in out

    saved = json.loads((run_dir / "bench" / "simulated.json").read_text())
    assert {"accept_length", "accept_rate", "histogram", "prompts", "verify_ct", "completion_tokens",
            "correct_drafts", "num_steps", "num_prompts", "checkpoint", "engine_release", "max_new_tokens"} <= set(saved)
    rows = [simulate_prompt(EAGLE3, draft, micro["model"], AUX_LAYERS, p, 10, config.serving.shape,
                            frozenset({micro["eos"]}), config.serving.release) for p in micro["prompts"][:2]]
    expected = AcceptanceResult(config.serving.shape, rows).to_dict()
    assert {key: saved[key] for key in expected} == expected
    assert saved["num_prompts"] == 2 and len(saved["histogram"]) <= config.serving.num_steps + 1
    assert saved["correct_drafts"] > 0  # the exported lens draft is right on the newline run


def store_heldout(config, micro):
    """What the data stage leaves for the simulator: greedy continuations, then their features in data/heldout."""
    store_requests(config, micro)
    backend = TransformersFeatures(str(micro["path"]), AUX_LAYERS, "post_norm", torch.device("cpu"))
    write_shard(shard_file(config.stage_dir("data") / HELDOUT_DIR, 0), heldout_records(config.run), {}, backend,
                feature_widths(config.data, config.target), batch_size=4)
