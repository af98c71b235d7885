"""The reference server over real HTTP (uvicorn on 127.0.0.1, httpx): greedy output unchanged by the
draft, counts equal to the simulator's, SGLang's meta_info keys, and drafts loaded by SGLang's rules."""

import json
import shutil

import pytest
import torch
import uvicorn

from eagle3.bench.counting import correct_drafts_of
from eagle3.algorithms.eagle3 import EAGLE3
from eagle3.bench.simulate import simulate_prompt
from eagle3.cli import main
from eagle3.runtime.targets import load_tokenizer
from eagle3.algorithms.eagle3.served import draft_as_served
from eagle3.shape import DraftShape
from helpers import (
    MAX_NEW, NEWLINE, RELEASE, STEPS, generate, greedy_reply, prompt_of, requests, serving,
)

BASE_KEYS = {"prompt_tokens", "completion_tokens", "finish_reason", "e2e_latency", "response_sent_to_client_ts"}
SPEC_KEYS = {"spec_verify_ct", "spec_accept_length", "spec_accept_rate", "spec_num_correct_drafts",  # 0.5.13's
             "spec_num_proposed_drafts", "spec_correct_drafts_histogram",
             "spec_accepted_drafts", "spec_proposed_drafts", "spec_accept_histogram"}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def plain(micro):
    with serving(micro["path"]) as client:
        yield client


@pytest.fixture(scope="module")
def speculative(micro, drafts):
    with serving(micro["path"], drafts["good"], shape=DraftShape(STEPS), release=RELEASE) as client:
        yield client


def test_greedy_output_is_the_targets_with_and_without_the_draft(micro, plain, speculative):
    accepted = 0
    for request in requests(micro):
        base, spec = generate(plain, **request), generate(speculative, **request)
        expected = greedy_reply(micro["model"], prompt_of(micro, request), MAX_NEW, micro["eos"])
        assert base["output_ids"] == spec["output_ids"] == expected
        assert base["text"] == spec["text"] == load_tokenizer(str(micro["path"])).decode(expected, skip_special_tokens=True)
        accepted += spec["meta_info"]["spec_num_correct_drafts"]
    assert accepted > 0  # the draft was right, so acceptance and the bonus token were exercised


@pytest.mark.parametrize("max_new_tokens", [2, 5, 24])
def test_served_counts_equal_the_simulators(micro, drafts, speculative, max_new_tokens):
    served_draft = draft_as_served(drafts["good"], RELEASE, micro["embed"]).eval()
    for request in requests(micro):
        meta = generate(speculative, max_new_tokens, **request)["meta_info"]
        row = simulate_prompt(EAGLE3, served_draft, micro["model"], served_draft.config.aux_layers, prompt_of(micro, request),
                              max_new_tokens, DraftShape(STEPS), frozenset({micro["eos"]}), RELEASE)
        assert (meta["completion_tokens"], meta["spec_verify_ct"], meta["spec_num_correct_drafts"],
                meta["spec_correct_drafts_histogram"]) == (row.completion_tokens, row.verify_ct, row.correct_drafts, row.histogram)
        assert meta["spec_accept_length"] == row.completion_tokens / row.verify_ct
        assert meta["spec_accept_rate"] == row.correct_drafts / (row.verify_ct * STEPS)


def test_meta_info_keys_and_counting(micro, plain, speculative):
    prompt = micro["prompts"][0]
    base = generate(plain, input_ids=prompt)["meta_info"]
    assert set(base) == BASE_KEYS  # no spec_* key without a draft
    assert base["prompt_tokens"] == len(prompt) and base["completion_tokens"] == MAX_NEW
    assert base["finish_reason"] == {"type": "length", "length": MAX_NEW} and base["e2e_latency"] > 0

    meta = generate(speculative, input_ids=prompt)["meta_info"]
    assert set(meta) == BASE_KEYS | SPEC_KEYS
    histogram, verify_ct = meta["spec_correct_drafts_histogram"], meta["spec_verify_ct"]
    assert len(histogram) <= STEPS + 1 and histogram[-1] > 0 and sum(histogram) == verify_ct
    assert meta["spec_num_correct_drafts"] == sum(a * n for a, n in enumerate(histogram))
    assert meta["spec_accepted_drafts"] == meta["spec_num_correct_drafts"] and meta["spec_accept_histogram"] == histogram
    assert meta["spec_num_proposed_drafts"] == meta["spec_proposed_drafts"] == verify_ct * STEPS
    # the prefill token is a completion token but no verify step: each step emits correct drafts + 1, but the
    # last run may cross the cap, and its drafts past it count as correct without being emitted
    assert meta["completion_tokens"] == MAX_NEW <= 1 + verify_ct + meta["spec_num_correct_drafts"]
    assert meta["spec_accept_length"] == MAX_NEW / verify_ct
    assert meta["spec_accept_rate"] == meta["spec_num_correct_drafts"] / (verify_ct * STEPS)

    one = generate(speculative, 1, input_ids=prompt)  # prefill only: no verify step, so no spec_* key
    assert set(one["meta_info"]) == BASE_KEYS and len(one["output_ids"]) == one["meta_info"]["completion_tokens"] == 1


def test_eos_ids_from_the_generation_config_end_the_request(micro, drafts, tmp_path):
    """Several EOS ids, one of them "\\n": requests stop on the prefill token or inside a verify step."""
    target = shutil.copytree(micro["path"], tmp_path / "target")
    generation = json.loads((target / "generation_config.json").read_text())
    (target / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [micro["eos"], NEWLINE]}))
    served_draft = draft_as_served(drafts["good"], RELEASE, micro["embed"]).eval()
    stops = []
    with serving(target, drafts["good"], shape=DraftShape(STEPS), release=RELEASE) as client:
        for request in requests(micro):
            out, prompt = generate(client, **request), prompt_of(micro, request)
            meta = out["meta_info"]
            assert out["output_ids"] == greedy_reply(micro["model"], prompt, MAX_NEW, NEWLINE)
            if out["output_ids"][-1] == NEWLINE:
                assert meta["finish_reason"] == {"type": "stop", "matched": NEWLINE}
                stops.append(meta["completion_tokens"])
            row = simulate_prompt(EAGLE3, served_draft, micro["model"], served_draft.config.aux_layers, prompt, MAX_NEW, DraftShape(STEPS),
                                  frozenset({micro["eos"], NEWLINE}), RELEASE)
            assert meta["completion_tokens"] == row.completion_tokens and meta.get("spec_verify_ct", 0) == row.verify_ct
            if row.verify_ct == 0:
                assert set(meta) == BASE_KEYS  # a draft, but no verify step: no spec_* key
            else:
                assert meta["spec_correct_drafts_histogram"] == row.histogram
    assert 1 in stops and max(stops) > 1  # stopped on the prefill token, and inside the verify steps


def served_counts(client, micro) -> list[tuple[int, int, int]]:
    """(completion_tokens, verify_ct, correct drafts) per request."""
    metas = [generate(client, **request)["meta_info"] for request in requests(micro)]
    return [(m["completion_tokens"], m["spec_verify_ct"], correct_drafts_of(m)) for m in metas]


def accept_length(counts) -> float:
    return sum(c for c, _, _ in counts) / sum(v for _, v, _ in counts)


BASELINE = MAX_NEW / (MAX_NEW - 1)  # a draft that is never accepted: n / (n - 1), not 1.0


def test_absolute_d2t_serves_at_the_baseline(micro, drafts, speculative):
    with serving(micro["path"], drafts["absolute"], shape=DraftShape(STEPS), release=RELEASE) as client:
        counts = served_counts(client, micro)
    assert BASELINE <= accept_length(counts) <= 1.05 * BASELINE < 1.3 < accept_length(served_counts(speculative, micro))


def test_layers_0_names_are_skipped_up_to_0_5_11(micro, drafts, speculative):
    """The renamed draft's layer keeps its random init under 0.5.11 (chance hits only), loads under 0.5.12."""
    with serving(micro["path"], drafts["renamed"], shape=DraftShape(STEPS), release="0.5.11") as client:
        assert BASELINE <= accept_length(served_counts(client, micro)) <= 1.05 * BASELINE
    with serving(micro["path"], drafts["renamed"], shape=DraftShape(STEPS), release="0.5.12") as client:
        served = served_counts(client, micro)
    assert served == served_counts(speculative, micro) and accept_length(served) > 1.3


def test_server_info_model_info_and_health(micro, drafts, plain):
    with serving(micro["path"], drafts["good"], shape=DraftShape(STEPS), release=RELEASE) as client:
        assert client.get("/health").status_code == 200
        info = client.get("/server_info").json()
        assert info["version"] == RELEASE and info["speculative_num_steps"] == STEPS
        assert "avg_spec_accept_length" not in info["internal_states"][0]  # no verify step yet
        assert client.get("/health_generate").status_code == 200
        metas = [generate(client, n, input_ids=p)["meta_info"] for n, p in zip((24, 9, 1), micro["prompts"])]
        assert client.get("/health_generate").status_code == 200  # health checks do not count
        average = client.get("/server_info").json()["internal_states"][0]["avg_spec_accept_length"]
        # SGLang's server-wide figure: accepted tokens per verify step (correct drafts + the bonus), no prefill
        verify_ct = sum(m.get("spec_verify_ct", 0) for m in metas)
        assert average == (sum(m.get("spec_num_correct_drafts", 0) for m in metas) + verify_ct) / verify_ct
        assert client.get("/get_model_info").json() == {
            "model_path": str(micro["path"]), "is_generation": True, "draft_model_path": str(drafts["good"])}
    info = plain.get("/server_info").json()
    assert info["version"] == "reference" and info["internal_states"] == [{}]
    assert plain.get("/get_model_info").json()["draft_model_path"] is None
    assert plain.get("/health_generate").status_code == 200


def test_requests_the_server_cannot_serve_are_refused(micro, plain):
    prompt = micro["prompts"][0]
    for params, field in (({"temperature": -0.5}, "temperature"), ({"temperature": "hot"}, "temperature"),
                          ({"temperature": 0.7, "top_p": 0.9}, "top_p"), ({"top_k": 20}, "top_k")):
        refused = plain.post("/generate", json={"input_ids": prompt, "sampling_params": params})
        assert refused.status_code == 400 and f"sampling_params.{field}" in refused.json()["error"]["message"]
    for body in ({"sampling_params": {"temperature": 0}}, {"text": ["a", "b"], "sampling_params": {"temperature": 0}},
                 {"input_ids": [9999], "sampling_params": {"temperature": 0}},
                 {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 0}}):
        response = plain.post("/generate", json=body)
        assert response.status_code == 400, body


def test_serve_command_runs_uvicorn_on_its_share_of_the_cores(micro, drafts, monkeypatch):
    calls = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: calls.append((app, kwargs, torch.get_num_threads())))
    args = ["serve", "--target", str(micro["path"]), "--draft", str(drafts["good"]), "--num-steps", "2",
            "--release", RELEASE, "--port", "30123"]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert main(args + ["--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    (app, kwargs, serving_threads), = calls
    assert kwargs["host"] == "127.0.0.1" and kwargs["port"] == 30123 and serving_threads == 1
    paths = {route.path for route in app.routes}
    assert {"/generate", "/health", "/health_generate", "/get_model_info", "/server_info"} <= paths
    # a tree SGLang could not draft is refused before anything loads, naming the flags
    assert main(args + ["--eagle-topk", "2", "--num-draft-tokens", "9"]) == 2 and len(calls) == 1


# ---------------------------------------------------------------------------------------------
# Trees and sampling

TREES = [DraftShape(3, 4, 8), DraftShape(2, 2, 4), DraftShape(1, 3, 3)]


@pytest.mark.parametrize("shape", TREES, ids=lambda s: f"steps{s.num_steps}-topk{s.eagle_topk}-tokens{s.num_draft_tokens}")
def test_a_tree_serves_the_targets_greedy_text_counted_as_the_simulator(micro, drafts, plain, shape):
    served_draft = draft_as_served(drafts["good"], RELEASE, micro["embed"]).eval()
    accepted = 0
    with serving(micro["path"], drafts["good"], shape=shape, release=RELEASE) as client:
        info = client.get("/server_info").json()
        assert (info["speculative_eagle_topk"], info["speculative_num_draft_tokens"]) == (shape.eagle_topk,
                                                                                          shape.num_draft_tokens)
        for request in requests(micro):
            spec, base = generate(client, **request), generate(plain, **request)
            assert spec["output_ids"] == base["output_ids"] and spec["text"] == base["text"]
            meta = spec["meta_info"]
            row = simulate_prompt(EAGLE3, served_draft, micro["model"], served_draft.config.aux_layers,
                                  prompt_of(micro, request), MAX_NEW, shape, frozenset({micro["eos"]}), RELEASE)
            assert (meta["completion_tokens"], meta["spec_verify_ct"], meta["spec_num_correct_drafts"],
                    meta["spec_correct_drafts_histogram"]) == (row.completion_tokens, row.verify_ct,
                                                               row.correct_drafts, row.histogram)
            # SGLang's denominator: every tree node but the root, per verify step
            assert meta["spec_num_proposed_drafts"] == meta["spec_verify_ct"] * (shape.num_draft_tokens - 1)
            assert len(meta["spec_correct_drafts_histogram"]) <= shape.num_steps + 1
            accepted += meta["spec_num_correct_drafts"]
    assert accepted > 0


def test_a_wider_tree_accepts_at_least_what_its_chain_does(micro, drafts):
    """The tree keeps the chain's path (the top-1 child at every depth scores highest), so its greedy accept
    length can only grow."""
    served_draft = draft_as_served(drafts["good"], RELEASE, micro["embed"]).eval()

    def accept_length(shape):
        rows = [simulate_prompt(EAGLE3, served_draft, micro["model"], served_draft.config.aux_layers, prompt_of(micro, r),
                                MAX_NEW, shape, frozenset({micro["eos"]}), RELEASE) for r in requests(micro)]
        return sum(r.completion_tokens for r in rows) / sum(r.verify_ct for r in rows)

    assert accept_length(DraftShape(3, 4, 16)) >= accept_length(DraftShape(3)) > 1.3


def test_sampled_requests_answer_with_sglangs_meta_info_keys(micro, drafts):
    with serving(micro["path"], drafts["good"], shape=DraftShape(3, 4, 8), release=RELEASE) as client:
        for request in requests(micro):
            body = {**request, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0.7}}
            answer = client.post("/generate", json=body).json()
            meta = answer["meta_info"]
            assert set(meta) == BASE_KEYS | SPEC_KEYS and meta["completion_tokens"] == len(answer["output_ids"])
            assert meta["spec_num_proposed_drafts"] == meta["spec_verify_ct"] * 7
        default = client.post("/generate", json={"input_ids": micro["prompts"][0]})  # SGLang's default: 1.0
        assert default.status_code == 200 and len(default.json()["output_ids"]) == 128


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_a_verify_forward_sees_what_the_targets_own_masks_let_it_see(family, tmp_path):
    """A chain verified over a prefix longer than Gemma 3's sliding window scores each node as a plain causal forward
    over prefix + chain does (an explicit mask replaces transformers' own, window included); Llama has no window."""
    from family_targets import SHAPE, build_family_target
    from eagle3.model.tree import DraftTree, tree_attention
    from eagle3.serve.reference import verify_masks
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_family_target(tmp_path / family, family),
                                                 dtype=torch.float32).eval()
    window = getattr(model.config, "sliding_window", None)
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(6, SHAPE["vocab_size"], (3 * (window or 16),), generator=generator).tolist()
    chain = DraftTree.chain(torch.randint(6, SHAPE["vocab_size"], (3,), generator=generator).tolist())
    positions, visible = tree_attention(len(prefix), chain)
    with torch.no_grad():
        verified = model(torch.tensor([prefix + chain.tokens]), position_ids=positions[None],
                         attention_mask=verify_masks(model, positions, visible)).logits[0]
        plain = model(torch.tensor([prefix + chain.tokens])).logits[0]
    assert torch.allclose(verified, plain, atol=1e-5), float((verified - plain).abs().max())
