"""How a request grows, finishes and is counted: each release's own scheduler and tokenizer-manager code
(inside/counting.py) against `SpecRequest` (the reference server's and the simulator's counting) and the
simulator's replay, on the same verify runs."""

from __future__ import annotations

import pytest

from eagle3.bench.counting import SpecRequest, server_accept_length
from eagle3.bench.simulate import replay
from eagle3.model.tree import DraftTree
from eagle3.shape import DraftShape
from releases import DSPARK_RELEASES, RELEASES

NUM_STEPS, EOS, PROMPT, PREFILL = 3, 1, [5, 6, 7], 10
# name -> (verify runs: accepted drafts then the bonus token, max_new_tokens)
CASES = {
    "cap-at-a-step-boundary": ([[11, 12, 13, 14], [15, 16, 17]], 8),
    "run-crosses-the-cap": ([[11, 12, 13, 14], [15, 16, 17, 18]], 7),
    "eos-inside-a-run": ([[11, 12], [13, EOS, 15, 16], [17]], 50),
    "eos-inside-a-run-that-crosses-the-cap": ([[11, 12, 13, 14], [EOS, 16, 17, 18]], 7),
    "cap-before-the-eos": ([[11, 12, 13, 14], [15, 16, EOS, 18]], 6),
    "eos-exactly-at-the-cap": ([[11, 12, 13, 14], [15, 16, EOS, 18]], 8),
    "prefill-only": ([[11, 12, 13, 14]], 1),
    "short-accepts": ([[11], [12, 13], [14], [15]], 5),
    "never-accepted": ([[11], [12], [13], [14], [15]], 5),
    "eos-as-the-bonus": ([[11, 12, 13, EOS], [15]], 20),
}
EOS_ON_PREFILL = "eos-on-prefill"


TREE = DraftShape(NUM_STEPS, 4, 8)  # the verify runs are the accepted path + the bonus, as for a chain


def job(shape: DraftShape = DraftShape(NUM_STEPS)) -> dict:
    requests = [{"name": name, "prompt_ids": PROMPT, "prefill_token": PREFILL, "verify_steps": runs,
                 "max_new_tokens": cap, "eos_token_ids": [EOS]} for name, (runs, cap) in CASES.items()]
    requests.append({"name": EOS_ON_PREFILL, "prompt_ids": PROMPT, "prefill_token": EOS,
                     "verify_steps": [[11, 12, 13, 14]], "max_new_tokens": 10, "eos_token_ids": [EOS]})
    return {"num_steps": shape.num_steps, "eagle_topk": shape.eagle_topk, "num_draft_tokens": shape.num_draft_tokens,
            "requests": requests}


@pytest.fixture(scope="module", params=RELEASES)
def counted(request, run_sglang):
    answer = run_sglang(request.param, "counting", job())
    return request.param, dict(zip([r["name"] for r in job()["requests"]], answer["requests"]))


def ours(release: str, name: str, algorithm: str = "EAGLE3") -> SpecRequest:
    runs, cap = CASES.get(name, ([[11, 12, 13, 14]], 10))
    request = SpecRequest(cap, frozenset({EOS}), release, algorithm)
    request.add_token(EOS if name == EOS_ON_PREFILL else PREFILL)
    for run in runs:
        if request.finish is not None:
            break
        request.add_verify(run)
    return request


@pytest.mark.parametrize("name", [*CASES, EOS_ON_PREFILL])
def test_output_finish_and_every_spec_key_equal_sglangs(counted, name):
    release, answers = counted
    theirs, request = answers[name], ours(release, name)
    assert request.output == theirs["output_ids"], f"SGLang {release} emits {theirs['output_ids']}"
    assert len(request.output) == theirs["completion_tokens"]
    assert request.finish == theirs["finish_reason"]
    assert request.verify_ct == theirs["verify_steps_used"]
    spec = {key: value for key, value in theirs.items() if key.startswith("spec_")}
    assert request.meta_info(NUM_STEPS) == spec, f"SGLang {release}'s meta_info"


@pytest.fixture(scope="module", params=RELEASES)
def counted_tree(request, run_sglang):
    answer = run_sglang(request.param, "counting", job(TREE))
    return request.param, dict(zip([r["name"] for r in job()["requests"]], answer["requests"]))


@pytest.mark.parametrize("name", [*CASES, EOS_ON_PREFILL])
def test_a_tree_counts_its_drafts_as_sglang_does(counted_tree, name):
    """Topk 4, 8 draft tokens: the same runs grow and finish alike, and every accept rate is over the 7 draft
    nodes verified per step (num_draft_tokens - 1), not over num_steps."""
    release, answers = counted_tree
    theirs, request = answers[name], ours(release, name)
    assert request.output == theirs["output_ids"] and request.verify_ct == theirs["verify_steps_used"]
    spec = {key: value for key, value in theirs.items() if key.startswith("spec_")}
    assert request.meta_info(TREE.drafts_per_step) == spec, f"SGLang {release}'s meta_info for a tree"


@pytest.mark.parametrize("name", CASES)
def test_the_simulators_replay_counts_the_same(counted, name):
    """The same runs replayed: a greedy sequence holding them, and drafts that agree exactly as far as
    each run's accepted part (then a token that is never right)."""
    release, answers = counted
    runs, cap = CASES[name]
    seq = PROMPT + [PREFILL] + [t for run in runs for t in run] + [999] * (NUM_STEPS + 1)
    starts, p = {}, len(PROMPT)
    for run in runs:
        starts[p] = run
        p += len(run)

    def propose(p: int) -> DraftTree:
        return DraftTree.chain((starts[p][:-1] + [-1] * NUM_STEPS)[:NUM_STEPS])

    row = replay(seq, len(PROMPT), propose, NUM_STEPS, cap, frozenset({EOS}), release)
    theirs = answers[name]
    assert (row.completion_tokens, row.verify_ct) == (theirs["completion_tokens"], theirs["verify_steps_used"])
    assert row.correct_drafts == theirs.get("spec_num_correct_drafts", theirs.get("spec_accepted_drafts", 0))
    assert row.histogram == theirs.get("spec_correct_drafts_histogram", theirs.get("spec_accept_histogram", []))


BLOCK = NUM_STEPS + 1  # DFLASH verifies the current token and 3 drafts a step: every case's runs fit


@pytest.fixture(scope="module", params=RELEASES)
def counted_dflash(request, run_sglang):
    answer = run_sglang(request.param, "counting", {**job(), "algorithm": "DFLASH", "num_draft_tokens": BLOCK})
    return request.param, dict(zip([r["name"] for r in job()["requests"]], answer["requests"]))


@pytest.mark.parametrize("name", [*CASES, EOS_ON_PREFILL])
def test_a_dflash_block_grows_finishes_and_counts_as_sglangs_dflash_worker_does(counted_dflash, name):
    """DFLASH, blocks of 4: to 0.5.13 DFlashVerifyInput.verify appends a run token by token and counts only what it
    appended (no histogram); from 0.5.16 the v2 worker's run is counted as EAGLE's. Every spec_* key as SGLang's."""
    release, answers = counted_dflash
    theirs, request = answers[name], ours(release, name, "DFLASH")
    assert request.output == theirs["output_ids"], f"SGLang {release} emits {theirs['output_ids']}"
    assert request.finish == theirs["finish_reason"] and request.verify_ct == theirs["verify_steps_used"]
    spec = {key: value for key, value in theirs.items() if key.startswith("spec_")}
    assert request.meta_info(BLOCK - 1) == spec, f"SGLang {release}'s meta_info under DFLASH"
    counters = theirs["server_counters"]
    accepted = counters.get("spec_num_accept_tokens", counters.get("spec_num_accepted_tokens"))
    if request.verify_ct:
        assert accepted / counters["spec_num_forward_ct"] == server_accept_length(request.correct, request.verify_ct)


@pytest.fixture(scope="module", params=DSPARK_RELEASES)
def counted_dspark(request, run_sglang):
    answer = run_sglang(request.param, "counting", {**job(), "algorithm": "DSPARK", "num_draft_tokens": BLOCK})
    return request.param, dict(zip([r["name"] for r in job()["requests"]], answer["requests"]))


@pytest.mark.parametrize("name", [*CASES, EOS_ON_PREFILL])
def test_a_dspark_block_grows_finishes_and_counts_as_sglangs_dspark_worker_does(counted_dspark, name):
    """DSPARK, gamma 3 in a verify window of 4: each step's result is the release's own greedy static verify
    (dspark_verify.accept_draft_tokens, FinalizeAcceptLens, BuildOutTokens, as DSparkWorkerV2 runs them), and its
    scheduler appends the committed run whole and counts it as EAGLE's, drafts per step gamma. Our counting of a DSpark
    draft (`SpecRequest(..., "DSPARK")`, whole runs in every DSpark release) equals it request by request."""
    release, answers = counted_dspark
    theirs, request = answers[name], ours(release, name, "DSPARK")
    assert request.output == theirs["output_ids"], f"SGLang {release} emits {theirs['output_ids']}"
    assert request.finish == theirs["finish_reason"] and request.verify_ct == theirs["verify_steps_used"]
    assert len(request.output) == theirs["completion_tokens"]
    spec = {key: value for key, value in theirs.items() if key.startswith("spec_")}
    assert request.meta_info(BLOCK - 1) == spec, f"SGLang {release}'s meta_info under DSPARK"
    counters = theirs["server_counters"]
    accepted = counters.get("spec_num_accept_tokens", counters.get("spec_num_accepted_tokens"))
    if request.verify_ct:
        assert accepted / counters["spec_num_forward_ct"] == server_accept_length(request.correct, request.verify_ct)


def test_the_server_wide_accept_length_is_accepted_tokens_per_verify_step(counted):
    """/server_info's avg_spec_accept_length: the scheduler's counters (raw accept lengths, the bonus
    included, past a finish too) over its verify steps; no prefill token."""
    release, answers = counted
    for name in CASES:
        counters, request = answers[name]["server_counters"], ours(release, name)
        accepted = counters.get("spec_num_accept_tokens", counters.get("spec_num_accepted_tokens"))
        if request.verify_ct:
            assert accepted / counters["spec_num_forward_ct"] == server_accept_length(request.correct, request.verify_ct)
