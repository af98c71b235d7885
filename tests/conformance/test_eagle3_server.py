"""SGLang's own EAGLE3 server, from published releases, on the CPU, serving our exported draft on the micro
target: greedy output identical to the target's alone, every spec_* meta_info field equal to the reference
server's with the same draft and release, accept length equal to the simulator's, per request and through
the serving benchmark. SGLang 0.5.11 drafts unlike our draft_chain in two ways (chain_as_0_5_11): its counts
are asserted against a replay drafting as it does.

SGLang's EAGLE3 worker has no CPU path in these releases. It runs here unmodified with Triton's interpreter
(TRITON_INTERPRET=1: SGLang's own Triton kernels run on the CPU, slowly), the Triton attention backend, and
the redirects below (inside/cpu_redirects.py, installed in every SGLang process by sitecustomize): each
replaces one entry point that has no CPU build by an SGLang function, never by code of this project's.
"""

from __future__ import annotations

import importlib.util
import itertools
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

import releases
from eagle3.bench.client import run_benchmark
from eagle3.bench.counting import SpecRequest, correct_drafts_of
from eagle3.algorithms.eagle3 import EAGLE3
from eagle3.bench.simulate import AcceptanceResult, PromptResult, aux_features, replay, simulate_prompt, target_greedy
from eagle3.data.conversation import prompt_ids
from eagle3.data.prompts import pydoc_prompt_turns
from eagle3.runtime.targets import eos_ids_of, load_tokenizer
from eagle3.algorithms.eagle3.checkpoint import NativeDraft, save_native_draft
from eagle3.model.tree import DraftTree
from eagle3.algorithms.eagle3.served import draft_as_served
from eagle3.serve.inprocess import serve_in_thread
from eagle3.serve.reference import create_app
from eagle3.shape import DraftShape
from fixtures_tiny import one_torch_thread
from helpers import CONFIG, lens_draft, random_draft
from servers import CPU_FLAGS, sglang_server

pytestmark = pytest.mark.sglang_server

EAGLE_RELEASES = ("0.5.11", "0.5.13")  # spec v1 (overlap off), spec v2 (its only EAGLE worker)
KERNELS_RELEASE = "0.5.23"  # the newest read: its XPU path holds SGLang's Triton tree-build and greedy-verify
STEPS = 3
# The interpreted kernels cost time per request and per verify step (~1 token/s), so the requests are few and chosen
# among the first 32 pydoc prompts: ones on which the exported draft below is accepted often (4-8 correct drafts in
# 12 tokens; on most prompts it gets none), three of them drafted unlike draft_chain by SGLang 0.5.11
# (chain_as_0_5_11; the test asserts that they still are). All at once, then the benchmark on two others.
REQUEST_PROMPTS, MAX_NEW = (16, 18, 20, 28), 12
BENCH_PROMPTS, BENCH_MAX_NEW = (23, 27), 12

# Every SGLang entry point the EAGLE3 server on the CPU takes from elsewhere, one line each: what is
# replaced -> by which SGLang function: why. inside/cpu_redirects.py implements exactly these ("wheel:" is
# the 0.5.23 wheel's file, run on its XPU branch; "(its CUDA branch)" is the release's own function with
# the CUDA platform flag set, i.e. its own Triton kernel launch). A redirect whose module a release lacks
# is not installed there (0.5.11 has no triton_ops.cache_locs; its v1 worker never calls that function).
REDIRECTS = [
    "torch.cuda.synchronize -> torch.cpu.synchronize: LlamaForCausalLM.set_embed(_and_head), which hands the "
    "target's embedding to the draft, synchronizes CUDA, which the CPU build of torch refuses (a wrapper of ours "
    "calls torch.cpu.synchronize: torch.compile refuses one function registered under both names)",
    "sglang.srt.speculative.eagle_utils.sgl_build_tree_kernel_efficient -> "
    "wheel:sglang.kernels.ops.speculative.spec_tree.sgl_build_tree_kernel_triton: the tree build calls the "
    "sgl_kernel CUDA op, unbound off CUDA (NameError); newer releases build the same tree with this kernel on XPU",
    "sglang.srt.speculative.eagle_utils.verify_tree_greedy_func -> "
    "wheel:sglang.kernels.ops.speculative.spec_tree.verify_tree_greedy_func (its XPU branch): off CUDA and NPU "
    "it returns its inputs unchanged, no error and wrong counts; newer releases verify with "
    "verify_tree_greedy_triton on XPU",
    "sglang.srt.speculative.triton_ops.cache_locs.assign_extend_cache_locs_func -> "
    "sglang.srt.speculative.triton_ops.cache_locs.assign_extend_cache_locs_func (its CUDA branch): off CUDA, "
    "HIP, MUSA and NPU it returns None and the verify pass writes the KV cache at cache[None]; on CUDA it "
    "launches the release's own Triton kernel assign_extend_cache_locs",
]


def _swap(flags: tuple[str, ...], name: str, value: str) -> tuple[str, ...]:
    i = flags.index(name)
    return (*flags[: i + 1], value, *flags[i + 2 :])


# The plain CPU flags, except: Triton attention (the EAGLE draft backends exist for triton, not torch_native,
# and its kernels run under the interpreter); one KV split in Triton's decode attention (8 by default: eight
# interpreted programs per head instead of one; the same attention, reduced in one pass); the draft's context
# length (512, shorter than the target's 2048, which SGLang refuses for a draft).
def eagle_flags(shape: DraftShape) -> tuple[str, ...]:
    return (*_swap(CPU_FLAGS, "--attention-backend", "triton"), "--triton-attention-num-kv-splits", "1",
            "--context-length", str(CONFIG.max_position_embeddings),
            "--speculative-algorithm", "EAGLE3", "--speculative-num-steps", str(shape.num_steps),
            "--speculative-eagle-topk", str(shape.eagle_topk), "--speculative-num-draft-tokens",
            str(shape.num_draft_tokens))


EAGLE_FLAGS = eagle_flags(DraftShape(STEPS))
TREE, TREE_RELEASE = DraftShape(STEPS, 4, 8), "0.5.13"  # topk 4: 4 + 2 x 16 candidates, the 7 best verified
TREE_PROMPTS = REQUEST_PROMPTS[:2]  # each verify step of a tree costs ~10 s interpreted: two requests, both accepted


def cpu_redirects():
    """inside/cpu_redirects.py, loaded by path (inside/ is no package of this process)."""
    spec = importlib.util.spec_from_file_location("eagle3_cpu_redirects", releases.INSIDE / "cpu_redirects.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def replaced_by(line: str) -> str:
    """'what -> by: why' -> 'what -> by' (as the server log names an installed redirect)."""
    return line.split(": ", 1)[0]


def installed_in(release: str) -> set[str]:
    """The redirects whose module exists in `release` (torch's always does)."""
    site = releases.prepare(release)[1]

    def exists(module: str) -> bool:
        return module.split(".")[0] == "torch" or (site / (module.replace(".", "/") + ".py")).is_file()

    return {replaced_by(line) for line in REDIRECTS if exists(line.split(" -> ")[0].rsplit(".", 1)[0])}


def test_the_named_redirects_are_the_redirect_set():
    redirects = cpu_redirects().REDIRECT_SETS["eagle3-cpu"]
    assert [r.line() for r in redirects] == [replaced_by(line) for line in REDIRECTS]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with one_torch_thread():  # our side's tiny forwards; the SGLang server is another process
        yield


def bodies(micro, indices: tuple[int, ...]) -> list[dict]:
    """The pydoc prompts at `indices`, tokenized as /generate bodies."""
    tokenizer = load_tokenizer(str(micro["path"]))
    turns = list(itertools.islice(pydoc_prompt_turns(), max(indices) + 1))
    return [{"input_ids": prompt_ids(tokenizer, turns[i], False)} for i in indices]


def answers(url: str, requests: list[dict], concurrency: int) -> list[dict]:
    sampling = {"max_new_tokens": MAX_NEW, "temperature": 0}
    with httpx.Client(base_url=url, timeout=600) as client, ThreadPoolExecutor(concurrency) as pool:
        replies = list(pool.map(lambda body: client.post("/generate", json={**body, "sampling_params": sampling}),
                                requests))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200]
    return [r.json() for r in replies]


def spec_fields(meta: dict) -> dict:
    return {key: value for key, value in meta.items() if key.startswith("spec_")}


# SGLang 0.5.11 (spec v1, on Triton attention) drafts differently from 0.5.12 onwards and from our draft_chain,
# in two ways only a draft whose attention output matters can show (the outputs are the target's either way):
# 1. Its draft_forward (EAGLEWorker's; EAGLEWorkerV2's too) calls forward_batch.positions.add_(1) BEFORE each
#    chained draft forward, so the step fed draft k runs at RoPE position seq_len + k, one past seq_len + k - 1,
#    where the draft extend put the verified prefix (0.5.12 moved the increment after the forward).
# 2. After a verify step, its draft extend over the newly verified tokens (ForwardMode.DRAFT_EXTEND) gets
#    Triton attention metadata from EagleDraftInput.generate_attn_arg_prefill(req_pool_indices, seq_lens) with
#    seq_lens = seq_lens_for_draft_extend, which already counts those tokens: the forward writes their K/V into
#    the cache, the kernel reads them once as prefix and once more as the extend part, so the last one (whose
#    output gives the next first draft) attends to the whole run twice. (0.5.13's DRAFT_EXTEND_V2 does not.)
# draft_chain with exactly these two changes, replayed over the target's greedy sequence as the simulator does,
# gives 0.5.11's served counts: measured on 32 prompts x 24 tokens with this draft and with o_proj scaled by 1.0,
# all 32 of 32 (without the changes 7 and 2 of 32 differ; change 1 alone leaves 2, change 2 alone 3).
def chain_as_0_5_11(draft, aux: torch.Tensor, tokens: torch.Tensor, steps: int, run: int) -> list[int]:
    """draft_chain's drafts after x_0..x_P as SGLang 0.5.11 proposes them; `run`: tokens the last verify added."""
    length, attention, hot = aux.shape[0], draft.midlayer.self_attn, draft.hot_token_ids()
    hidden = draft.fc(aux[None])
    q, key, value = draft.project(tokens[None, 1:], hidden, torch.arange(length))
    seen_keys = torch.cat([key, key[:, :, length - run :]], 2)  # change 2: the run's keys and values twice
    seen_values = torch.cat([value, value[:, :, length - run :]], 2)
    visible = torch.ones(1, length + run, dtype=torch.bool)
    hidden, logits = draft.finish(hidden[:, -1:], attention.attend(q[:, :, -1:], seen_keys, seen_values, visible))
    token = hot[logits[0, -1].argmax()]
    keys, values, drafts = [key], [value], [int(token)]
    for j in range(1, steps):
        q, key, value = draft.project(token.view(1, 1), hidden, torch.tensor([length + j]))  # change 1: + 1
        keys.append(key)
        values.append(value)
        visible = torch.ones(1, length + j, dtype=torch.bool)
        hidden, logits = draft.finish(hidden, attention.attend(q, torch.cat(keys, 2), torch.cat(values, 2), visible))
        token = hot[logits[0, -1].argmax()]
        drafts.append(int(token))
    return drafts


@torch.no_grad()
def simulate_as_0_5_11(draft, target_model, prompt: list[int], max_new_tokens: int, eos_ids) -> PromptResult:
    """simulate_prompt, drafting as SGLang 0.5.11 does (chain_as_0_5_11)."""
    seq = prompt + target_greedy(target_model, prompt, max_new_tokens + STEPS)
    aux, tokens, last = aux_features(target_model, seq, draft.config.aux_layers), torch.tensor(seq), [None]

    def propose(p: int) -> DraftTree:
        run, last[0] = (0 if last[0] is None else p - last[0]), p  # none after the prefill's draft extend
        return DraftTree.chain(chain_as_0_5_11(draft, aux[:p], tokens[: p + 1], STEPS, run))

    return replay(seq, len(prompt), propose, STEPS, max_new_tokens, eos_ids, "0.5.11")


DRAFTS_AS = {"0.5.11": simulate_as_0_5_11}  # releases that draft unlike our draft_chain


def as_meta(row, release: str) -> dict:
    """The spec_* meta_info of a simulated request, as the release names and computes its keys."""
    request = SpecRequest(MAX_NEW, frozenset(), release, output=[0] * row.completion_tokens, verify_ct=row.verify_ct,
                          correct=row.correct_drafts, histogram=list(row.histogram))
    return request.meta_info(DraftShape(STEPS).drafts_per_step)


@pytest.fixture(scope="module")
def exported(micro, tmp_path_factory):
    """export(release) -> a draft whose attention matters, exported as that release reads it: the lens draft
    (often accepted on the micro target, see test_simulate) with an attention output projection from a random
    init scaled by 0.3 (the lens alone zeroes o_proj, and then the draft's KV cache and positions would go
    untested: its proposals would not depend on them)."""
    draft = lens_draft(micro)
    with torch.no_grad():
        draft.midlayer.self_attn.o_proj.weight.copy_(random_draft(micro, seed=3).midlayer.self_attn.o_proj.weight * 0.3)
    root, made = tmp_path_factory.mktemp("eagle3-drafts"), {}

    def export(release: str):
        if release not in made:  # one export per release, whichever test asks first
            made[release] = save_native_draft(NativeDraft(CONFIG, draft.export_state()), root / release, to="sglang",
                                              release=release)
        return made[release]

    return export


@pytest.fixture(scope="module")
def plain_outputs(micro):
    requests = bodies(micro, REQUEST_PROMPTS)
    with serve_in_thread(create_app(micro["path"])) as (url, _):
        return [answer["output_ids"] for answer in answers(url, requests, 1)]


def cpu_env() -> dict[str, str]:
    """SGLang's Triton kernels interpreted on the CPU, with the redirects above."""
    return {"TRITON_INTERPRET": "1", "EAGLE3_SGLANG_REDIRECTS": "eagle3-cpu",
            "EAGLE3_SGLANG_KERNELS_SITE": str(releases.prepare(KERNELS_RELEASE)[1])}


def test_sglangs_tree_drafting_is_the_reference_servers(micro, exported, plain_outputs, tmp_path):
    """SGLang's EAGLE3 worker drafting a tree (topk 4, 8 draft tokens): greedy output identical to the target's,
    and every spec_* field equal to the reference server's, whose draft_tree builds the tree as SGLang does
    (scores, slots, the 7 best candidates) and whose tree-masked verify forward accepts the same paths."""
    draft_dir = exported(TREE_RELEASE)
    requests = bodies(micro, TREE_PROMPTS)
    with serve_in_thread(create_app(micro["path"], draft_dir, TREE, TREE_RELEASE)) as (url, _):
        ours = answers(url, requests, 1)
    with sglang_server(TREE_RELEASE, micro["path"], tmp_path, flags=eagle_flags(TREE),
                       extra=("--speculative-draft-model-path", str(draft_dir)), env=cpu_env()) as (url, server):
        info = httpx.get(f"{url}/server_info", timeout=30).json()
        theirs = answers(url, requests, len(requests))
    assert (info["speculative_eagle_topk"], info["speculative_num_draft_tokens"]) == (4, 8)
    for body, plain, ours_, theirs_ in zip(requests, plain_outputs[:len(TREE_PROMPTS)], ours, theirs, strict=True):
        assert theirs_["output_ids"] == plain == ours_["output_ids"], f"SGLang continues {body} differently"
        assert spec_fields(theirs_["meta_info"]) == spec_fields(ours_["meta_info"])
    assert all(correct_drafts_of(answer["meta_info"]) > 0 for answer in theirs)


@pytest.mark.parametrize("release", EAGLE_RELEASES)
def test_sglangs_eagle3_server_counts_as_the_reference_server(micro, exported, plain_outputs, release, tmp_path):
    draft_dir = exported(release)
    requests, bench = bodies(micro, REQUEST_PROMPTS), bodies(micro, BENCH_PROMPTS)
    with serve_in_thread(create_app(micro["path"], draft_dir, DraftShape(STEPS), release)) as (url, _):
        ours = answers(url, requests, 1)
    served_draft = draft_as_served(draft_dir, release, micro["embed"]).eval()
    eos_ids = eos_ids_of(micro["model"])

    def simulated(max_new_tokens, request):
        if release in DRAFTS_AS:
            return DRAFTS_AS[release](served_draft, micro["model"], request["input_ids"], max_new_tokens, eos_ids)
        return simulate_prompt(EAGLE3, served_draft, micro["model"], served_draft.config.aux_layers, request["input_ids"],
                               max_new_tokens, DraftShape(STEPS), eos_ids, release)

    rows = [simulated(MAX_NEW, request) for request in requests]
    if release in DRAFTS_AS:  # the requests still tell the release's drafting from draft_chain's
        chained = [simulate_prompt(EAGLE3, served_draft, micro["model"], served_draft.config.aux_layers, request["input_ids"],
                                   MAX_NEW, DraftShape(STEPS), eos_ids, release) for request in requests]
        assert any(row != chain for row, chain in zip(rows, chained)), REQUEST_PROMPTS
    bench_rows = [simulated(BENCH_MAX_NEW, request) for request in bench]

    started = time.monotonic()
    with sglang_server(release, micro["path"], tmp_path, flags=EAGLE_FLAGS,
                       extra=("--speculative-draft-model-path", str(draft_dir)), env=cpu_env()) as (url, server):
        ready = time.monotonic()
        assert server.release == release
        theirs = answers(url, requests, len(requests))
        served = time.monotonic()
        result = run_benchmark(url, [b["input_ids"] for b in bench], BENCH_MAX_NEW, len(bench), timeout_s=600,
                               retries=0, log=lambda line: None)
        log = server.log_path.read_text(errors="replace")
    tokens = sum(answer["meta_info"]["completion_tokens"] for answer in theirs)
    unlike_ours = sum(spec_fields(a["meta_info"]) != spec_fields(o["meta_info"]) for a, o in zip(theirs, ours))
    print(f"SGLang {release} EAGLE3 on the CPU: ready in {ready - started:.0f} s; {tokens} tokens in "
          f"{served - ready:.0f} s ({tokens / (served - ready):.2f} tokens/s, {len(requests)} concurrent); benchmark "
          f"{result['output_tokens_per_s']:.2f} tokens/s; spec_* unlike the reference server's in {unlike_ours} of "
          f"{len(requests)} requests")

    installed = set(re.findall(r"^EAGLE3 redirect: (.*)$", log, re.MULTILINE))
    assert installed == installed_in(release)  # logged by each process that imports their modules
    for body, plain, ours_, theirs_, row in zip(requests, plain_outputs, ours, theirs, rows):
        assert theirs_["output_ids"] == plain == ours_["output_ids"], f"SGLang {release} continues {body} differently"
        meta = theirs_["meta_info"]
        assert spec_fields(meta) == as_meta(row, release)  # every spec_* key and value, as simulated
        assert meta["completion_tokens"] == row.completion_tokens
        if release not in DRAFTS_AS:
            assert spec_fields(meta) == spec_fields(ours_["meta_info"])  # and as the reference server serves them
    assert all(correct_drafts_of(answer["meta_info"]) > 0 for answer in theirs)  # acceptance was exercised
    assert result["accept_length"] == AcceptanceResult(DraftShape(STEPS), bench_rows).accept_length
    assert [p["verify_ct"] for p in result["prompts"]] == [r.verify_ct for r in bench_rows]
