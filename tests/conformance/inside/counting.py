"""How one SGLang release grows, finishes and counts a request under EAGLE (chain) speculative decoding.

Runs inside a release's child process (see ../releases.py). `run(job)` feeds given token sequences to that
release's OWN code and answers what it produced; nothing about growing, finishing or counting is written here.

Which SGLang code runs, in the order a request meets it:

1. `ServerArgs(...)`: the release resolves EAGLE3 (topk 1, num_draft_tokens = num_steps + 1) on a tiny
   throwaway model config, and the result is published as the process-wide server args, as the scheduler
   process does (`set_global_server_args_for_scheduler`, or `runtime_context.publish` in 0.5.23).
2. `schedule_batch.Req(...)` with `SamplingParams(max_new_tokens, stop_token_ids)` (`normalize`, `verify`)
   and the model's EOS ids, as `Scheduler.handle_generate_request` builds it; one `ScheduleBatch.init_new`.
3. The scheduler's result processing, on the Scheduler's mixins (0.5.11, 0.5.12) or on
   `scheduler_components.SchedulerBatchResultProcessor` (0.5.13 on):
   - `process_batch_result_prefill`: appends the prefill token, runs the finish check;
   - spec v2 (the default for topk 1; the only EAGLE path from 0.5.13): `process_batch_result_decode`. Its
     `_resolve_spec_overlap_token_ids` (<= 0.5.12) / `_resolve_spec_v2_tokens` (>= 0.5.13) counts
     `spec_verify_ct`, the correct (accepted) drafts and the histogram on the Req, then the loop appends the
     whole accepted run to `req.output_ids` and runs the finish check once over the n new tokens:
     `Req.check_finished(n)` (<= 0.5.12) / `Req.update_finish_state(n)` (>= 0.5.13);
   - spec v1 (0.5.11, 0.5.12 with --disable-overlap-schedule): `EagleVerifyInput.verify` appends token by
     token with `req.check_finished()` after each and counts on the Req; then `process_batch_result_decode`'s
     v1 branch. The `GenerationBatchResult` is built from the verify output as `EAGLEWorker` builds it;
   - both call the real `update_spec_metrics` (the batch-level counters behind /server_info's
     `avg_spec_accept_length`) and `stream_output`, which builds the `BatchTokenIDOutput`
     (`completion_tokens = len(req.output_ids_through_stop)`).
4. `TokenizerManager._handle_batch_output` on every output (with skip_tokenizer_init the BatchTokenIDOutput
   goes straight there; the detokenizer would only copy the spec fields across): it builds `meta_info`, and
   `_calculate_spec_decoding_metrics` adds the `spec_*` keys once the request has finished.

What is NOT SGLang's code, and why:
* The verify outcome is the job's input. Spec v2: the worker's result (`next_token_ids` rows of
  num_draft_tokens, `accept_lens`). Spec v1: the CUDA-only tree-verify kernel (`verify_tree_greedy`, which
  does nothing on CPU) is replaced by a function writing the job's step into the kernel's output tensors.
* KV-cache memory is not modelled: the allocator, req-to-token pool and prefix cache are stubs, the module
  functions that free/cache a request's KV (`release_kv_cache`, ...) are replaced by recorders in the result
  processor's namespace, and v1's triton req-to-token write is a no-op. None decides what is emitted or counted.
* Scheduler, TokenizerManager and the metrics reporter are built without their __init__ (which loads a model,
  opens sockets, loads a tokenizer); the attributes their methods read are set from the ServerArgs, as
  __init__ sets them. Periodic logging is off (it queries GPU memory pools and only prints).
* `uvloop` / `setproctitle`, when the conformance environment lacks them: a stand-in event loop policy
  (asyncio's default; the tokenizer manager installs it at import) and an import placeholder (never called).

DFLASH (job "algorithm": "DFLASH", "num_draft_tokens": the block): the server args are those the release's
`_handle_dflash` resolves (num_steps 1, topk 1, num_draft_tokens = the block, no overlap schedule) to 0.5.13; the
CPU platform refuses DFLASH from 0.5.16, where EAGLE3's chain of block - 1 steps (the same num_draft_tokens) stands
in and the scheduler's components are given DFLASH as their algorithm. Up to
0.5.13 (`dflash_worker.py`, spec v1) the release's `DFlashVerifyInput.verify` runs each step: it appends the run
and counts on the Req; its greedy rule reads the target's argmax of the job's logits (one-hot rows: the accepted
drafts, then the bonus, after which the block's next candidate differs); the result is built as `DFlashWorker`
builds it and goes to the non-overlap decode processing. From 0.5.16 (`dflash_worker_v2.py`) the worker hands
the scheduler the run as EAGLE's v2 worker does (`accept_lens` = the committed run), stride = the block.

DSPARK (job "algorithm": "DSPARK", "num_draft_tokens": gamma + 1, the verify window; 0.5.16 on): every DSpark release's
CPU platform refuses DSPARK in ServerArgs ("DSpark speculative decoding only supports CUDA ..."), so EAGLE3's chain of
gamma steps stands in as for DFLASH, and the scheduler's components are given DSPARK as their algorithm. Each step's
result comes from the release's OWN static-verify code, as `DSparkWorkerV2` runs it eagerly
(`TargetVerifyExecutor.accept_and_finalize`): `dspark_verify.accept_draft_tokens` on the window [anchor, d_1..d_gamma]
and the target's logits (one-hot rows: the accepted drafts, the bonus, then tokens no draft matches; greedy, no
cutoff), then `FinalizeAcceptLens` and `BuildOutTokens`; the GenerationBatchResult is built as the worker builds it
(accept_lens = commit_lens, block_accept_lens = commit_lens + cap_trim_lens, no cap_lens, stride gamma + 1).

Job: {"num_steps": k, optional "algorithm" (EAGLE3 | DFLASH | DSPARK), "eagle_topk" and "num_draft_tokens" (a tree;
      DFLASH's block; DSPARK's window), "requests": [{"prompt_ids": [...], "prefill_token": t0,
      "verify_steps": [[accepted drafts..., bonus], ...], "max_new_tokens": N, "eos_token_ids": [...],
      optional "stop_token_ids": [...], optional "overlap_tail": true}]}
Steps are fed while the request is unfinished. With "overlap_tail", one more step is then processed with
the finished request still in the batch, as the overlap scheduler does (it launched that batch already).

Answer: {"release", "key_names" (the spec_* meta_info keys seen), "requests" (spec v2), "paths": {"v2": [...],
"v1": [...] where the release has it}, "seconds"}; per request "output_ids", "completion_tokens",
"finish_reason", "verify_steps_used", every spec_* meta_info key as the release names it, and for reading the
behaviour: "req" (the Req's output_ids, finished_len and spec_* fields), "server_counters" (the scheduler's
spec_* counters), "kv_released" (times the scheduler released the request's KV).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import inspect
import json
import os
import pickle
import sys
import tempfile
import time
import types
from array import array

import placeholders

VOCAB = 512  # the tiny model's vocabulary: every token id in a job must be below it


# -------------------------------------------------------------------------------------------- set-up


def _stand_ins() -> None:
    """Packages the tested paths import but never need, when the environment lacks them."""
    try:
        import uvloop  # noqa: F401
    except ModuleNotFoundError:
        uvloop = types.ModuleType("uvloop")
        uvloop.EventLoopPolicy = asyncio.DefaultEventLoopPolicy  # tokenizer_manager installs it at import
        sys.modules["uvloop"] = uvloop
    try:
        import setproctitle  # noqa: F401
    except ModuleNotFoundError:
        placeholders.install(("setproctitle",))


def _tiny_model(directory: str) -> tuple[str, str]:
    """A target and an EAGLE-3 draft config (ServerArgs reads configs only: no weights, no tokenizer)."""
    base = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 4, "num_hidden_layers": 1, "vocab_size": VOCAB,
            "max_position_embeddings": 4096, "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "float32"}
    target, draft = os.path.join(directory, "target"), os.path.join(directory, "draft")
    for path, arch in ((target, "LlamaForCausalLM"), (draft, "LlamaForCausalLMEagle3")):
        os.makedirs(path, exist_ok=True)  # DFLASH may ask twice (its args refused, then EAGLE3's)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({**base, "architectures": [arch]}, f)
    return target, draft


def _server_args(num_steps: int, directory: str, topk: int = 1, num_draft_tokens: int | None = None, **flags):
    """The release's own ServerArgs for EAGLE3 decoding (a chain unless topk > 1) and any other `flags`, published
    process-wide like a scheduler does."""
    return _published(directory, speculative_algorithm="EAGLE3", speculative_num_steps=num_steps,
                      speculative_eagle_topk=topk, speculative_num_draft_tokens=num_draft_tokens or num_steps + 1,
                      **flags)


def _dflash_server_args(block: int, directory: str):
    """The server args of DFLASH decoding in blocks of `block`, from the flags the launcher gives (algorithm, draft,
    --speculative-num-draft-tokens): the release's own resolution where its CPU platform allows DFLASH (0.5.11-0.5.13).
    From 0.5.16 it refuses ("only supports CUDA device", or at publishing in 0.5.23) and resolved args are read-only
    (0.5.17 on): EAGLE3's chain of block - 1 steps stands in, whose num_draft_tokens (the block: what the tokenizer
    manager and the result stride read) is DFLASH's, and the scheduler side is given DFLASH as its algorithm."""
    try:
        return _published(directory, speculative_algorithm="DFLASH", speculative_num_draft_tokens=block)
    except ValueError as refused:
        if "DFLASH speculative decoding" not in str(refused):  # "only supports CUDA device", "not supported by
            raise  # CpuSRTPlatform" (0.5.23, at publishing)
    return _server_args(block - 1, directory, 1, block)


def _dspark_server_args(window: int, directory: str):
    """The server args of DSPARK decoding in windows of `window` (gamma + 1): the release's own where its CPU platform
    allows DSPARK (none does); otherwise EAGLE3's chain of gamma steps, whose num_draft_tokens is DSPARK's window."""
    try:
        return _published(directory, speculative_algorithm="DSPARK", speculative_num_draft_tokens=window)
    except ValueError as refused:
        if "DSpark speculative decoding" not in str(refused):  # "only supports CUDA device" (and NPU, XPU later)
            raise
    return _server_args(window - 1, directory, 1, window)


def _published(directory: str, **flags):
    """ServerArgs on a tiny throwaway model for those flags, published process-wide like a scheduler does."""
    from sglang.srt import server_args as sa_module

    target, draft = _tiny_model(directory)
    args = sa_module.ServerArgs(
        model_path=target, speculative_draft_model_path=draft, device="cpu", skip_tokenizer_init=True,
        decode_log_interval=1 << 30,  # the periodic decode log never comes round (see module docstring)
        **flags,
    )
    try:
        from sglang.srt import runtime_context  # 0.5.23: config bags and ranks live in a runtime context
    except ImportError:
        runtime_context = None
    if runtime_context is not None and hasattr(runtime_context, "SpawnRanks"):
        runtime_context.publish(args, role="scheduler", ranks=runtime_context.SpawnRanks(world_rank=0, gpu_id=0))
    else:
        sa_module.set_global_server_args_for_scheduler(args)
    return args


def _call(fn, **kwargs):
    """Call `fn` with those keyword arguments its signature in this release accepts."""
    accepted = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in kwargs.items() if k in accepted})


def _spec_algorithm(server_args, name: str | None = None):
    """The release's SpeculativeAlgorithm of the server args, or of `name` (DFLASH where its args stand in)."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return SpeculativeAlgorithm.from_string(name or server_args.speculative_algorithm)


def _disaggregation_mode(server_args):
    from sglang.srt.disaggregation.utils import DisaggregationMode

    return DisaggregationMode(server_args.disaggregation_mode)


def _model_config():
    """The scheduler's ModelConfig, as far as result processing reads it: reasoning-token ids (none)."""
    return types.SimpleNamespace(think_end_id=None, think_end_ids=None, self_opened_think_start_ids=None,
                                 vocab_size=VOCAB)


# --------------------------------------------------------------------- stubs for memory and transport


class _Allocator:
    """Stands for the KV token-pool allocator (result processing brackets its frees in a group)."""

    def free_group_begin(self):
        pass

    def free_group_end(self):
        pass

    def free(self, indices):
        pass


class _TreeCache:
    """Stands for the prefix cache; `_record_kv_cache` makes the KV helpers report to it."""

    def __init__(self, allocator):
        self.token_to_kv_pool_allocator = allocator
        self.released_rids = []

    def supports_mamba(self):  # asked before releasing a finished request (0.5.23): a plain KV cache
        return False


def _record_kv_cache(module, tree_cache: _TreeCache) -> None:
    """In the namespace of the module that processes results, replace the mem_cache.common helpers that free
    or cache a request's KV memory: `release_kv_cache` (run once a request finishes) by a recorder,
    `maybe_cache_unfinished_req` / `checkpoint_kv_cache` (after an unfinished prefill) by no-ops."""

    def release_kv_cache(req, *args, **kwargs):
        tree_cache.released_rids.append(req.rid)

    module.release_kv_cache = release_kv_cache
    for name in ("maybe_cache_unfinished_req", "checkpoint_kv_cache"):
        if hasattr(module, name):
            setattr(module, name, lambda *a, **k: None)


class _ToDetokenizer:
    """Stands for the scheduler -> detokenizer socket: keeps what the scheduler sends, pickled at send time
    as the socket's send_pyobj does (the Req's lists it carries keep changing afterwards)."""

    def __init__(self):
        self.sent = []

    def send_output(self, obj, *args, **kwargs):
        self.sent.append(pickle.loads(pickle.dumps(obj)))

    send_pyobj = send_output


def _req_to_token_pool():
    import torch

    return types.SimpleNamespace(device="cpu", size=4, req_to_token=torch.zeros((4, 8192), dtype=torch.int32),
                                 free=lambda *a, **k: None)


# ------------------------------------------------------------------------------------ the request


def _make_req(spec: dict, rid: str):
    """A real Req, built as Scheduler.handle_generate_request builds one (EOS ids from the model config),
    holding a req-to-token slot as after the scheduler's allocation."""
    from sglang.srt.managers import schedule_batch
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=spec["max_new_tokens"], stop_token_ids=spec.get("stop_token_ids"),
                            temperature=spec.get("temperature", 0))  # greedy: what v1's verify asks for
    params.normalize(None)  # as the tokenizer manager does; no tokenizer (skip_tokenizer_init)
    params.verify(VOCAB)
    prompt = list(spec["prompt_ids"])
    kwargs = dict(eos_token_ids=set(spec.get("eos_token_ids") or []) or None, vocab_size=VOCAB)
    req = schedule_batch.Req(rid, "", prompt, params, **kwargs)
    if isinstance(req.output_ids, array):  # 0.5.13 on keep token ids in array("q"), from the tokenizer manager on
        req = schedule_batch.Req(rid, "", array("q", prompt), params, **kwargs)
    req.tokenizer = None

    kv = getattr(req, "kv", None)
    if hasattr(req, "kv") and kv is None:  # 0.5.16, 0.5.17: allocation attaches a ReqKvInfo
        req.kv = _call(schedule_batch.ReqKvInfo, kv_allocated_len=len(prompt), swa_evicted_seqlen=0)
    if kv is not None and hasattr(kv, "req_pool_idx"):  # 0.5.23: the slot lives on req.kv
        kv.req_pool_idx = 0
    else:
        req.req_pool_idx = 0
    return req


def _new_batch(req, pool, allocator, tree_cache, model_config, enable_overlap: bool, spec_algorithm):
    """ScheduleBatch.init_new with the one request, as the scheduler builds a batch."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    return _call(ScheduleBatch.init_new, reqs=[req], req_to_token_pool=pool, token_to_kv_pool_allocator=allocator,
                 tree_cache=tree_cache, model_config=model_config, enable_overlap=enable_overlap,
                 spec_algorithm=spec_algorithm)


# ------------------------------------------------------------------------ worker results (the input)


def _prefill_result(req, token: int):
    """What the target's extend forward hands the scheduler: the sampled token (no logprobs asked)."""
    import torch
    from sglang.srt.managers.utils import GenerationBatchResult

    return _call(GenerationBatchResult, logits_output=None, next_token_ids=torch.tensor([token]),
                 extend_input_len_per_req=[len(req.origin_input_ids)], extend_logprob_start_len_per_req=[0],
                 can_run_cuda_graph=False)


def _v2_result(step: list[int], stride: int):
    """What the spec-v2 EAGLE worker hands the scheduler for one verify (already on the CPU): per request a row
    of `stride` predicted tokens whose first `accept_lens` are the accepted drafts and the bonus token."""
    import torch
    from sglang.srt.managers.utils import GenerationBatchResult

    row = list(step) + [0] * (stride - len(step))  # the rest of the row is never read
    return _call(GenerationBatchResult, logits_output=None, next_token_ids=torch.tensor(row),
                 accept_lens=torch.tensor([len(step)], dtype=torch.int32), can_run_cuda_graph=False,
                 speculative_num_draft_tokens=stride)


def _dspark_result(step: list[int], window: int):
    """What DSparkWorkerV2 hands the scheduler for one greedy static verify of `window` = gamma + 1 positions, from the
    release's own accept code: the drafts are the step's accepted ones, then a token the target does not predict."""
    import torch
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.speculative.dspark_components import dspark_verify

    gamma = window - 1
    accepted, bonus = list(step[:-1]), step[-1]
    rejected = next(t for t in range(2, VOCAB) if t != bonus)  # a draft after the accepted ones: never the bonus
    drafts = torch.tensor([(accepted + [rejected] * gamma)[:gamma]])  # [1, gamma]
    predicted = (accepted + [bonus] + [rejected + 1] * window)[:window]  # the target's argmax after each position
    logits = torch.zeros((window, VOCAB))
    logits[torch.arange(window), torch.tensor(predicted)] = 1.0
    fields = dict(draft_tokens=drafts, corrected_logits=None, greedy_mask=torch.ones(1, dtype=torch.bool),
                  temperatures=torch.ones(1), greedy_draft=True)  # greedy_draft: 0.5.23's field
    block = dspark_verify.DraftBlockResult(**{k: v for k, v in fields.items()
                                              if k in dspark_verify.DraftBlockResult.__struct_fields__})
    candidates = torch.cat([torch.zeros((1, 1), dtype=drafts.dtype), drafts], dim=1)  # [anchor | drafts]
    correct_len, bonus_token, trim = dspark_verify.accept_draft_tokens(
        candidates=candidates, target_logits=logits, draft_block=block, sampling_info=None, draft_input=None,
        gamma=gamma, verify_num_draft_tokens=window)
    # prefix_lens only moves new_seq_lens (the next draft's input), which the scheduler never reads
    finalized = dspark_verify.FinalizeAcceptLens.execute(correct_len=correct_len, cap_trim_lens=trim,
                                                         prefix_lens=torch.zeros_like(correct_len))
    out = dspark_verify.BuildOutTokens.execute(draft_tokens=drafts, correct_len=correct_len, bonus=bonus_token,
                                               verify_num_draft_tokens=window, gamma=gamma)
    return _call(GenerationBatchResult, logits_output=None, next_token_ids=out.reshape(-1),
                 accept_lens=finalized.commit_lens, block_accept_lens=finalized.commit_lens + finalized.cap_trim_lens,
                 cap_lens=None, can_run_cuda_graph=False, speculative_num_draft_tokens=window)


def _v1_verify(server_args, batch, req, step: list[int]):
    """Spec v1: the release's EagleVerifyInput.verify on one verify, then the GenerationBatchResult EAGLEWorker
    builds from its output. Only the CUDA tree-verify kernel's output is supplied, from `step`."""
    import torch
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.speculative import eagle_info

    width = server_args.speculative_num_draft_tokens  # positions verified per request: k + 1 for a chain
    hidden = 8

    def verify_tree_greedy(predicts, accept_index, accept_token_num, *args, **kwargs):
        # The kernel's output for a one-request chain: positions 0..m accepted (m drafts, then the bonus),
        # predicts[p] = the target's token after position p, accept_token_num = m (drafts only).
        for j, token in enumerate(step):
            predicts[j] = token
            accept_index[0, j] = j
        accept_token_num[0] = len(step) - 1
        return predicts, accept_index, accept_token_num

    eagle_info.verify_tree_greedy_func = verify_tree_greedy
    eagle_info.assign_req_to_token_pool_func = lambda *a, **k: None  # triton write of the req-to-token table

    seq_len = len(req.origin_input_ids) + len(req.output_ids)
    verify = _call(
        eagle_info.EagleVerifyInput,
        draft_token=torch.tensor([req.output_ids[-1]] + list(step[:-1]) + [0] * (width - len(step))),
        custom_mask=None, positions=None, retrieve_index=torch.arange(width).reshape(1, width),
        retrieve_next_token=torch.tensor([list(range(1, width)) + [-1]]),
        retrieve_next_sibling=torch.full((1, width), -1), retrieve_cum_len=None,
        spec_steps=server_args.speculative_num_steps, topk=1, draft_token_num=width,
        capture_hidden_mode=CaptureHiddenMode.FULL, seq_lens_sum=seq_len, seq_lens_cpu=torch.tensor([seq_len]))
    verify.hidden_states = torch.zeros((width, hidden))  # EAGLEWorker.verify sets it from the target forward
    # What EAGLEWorker.verify / prepare_for_verify leave on the batch before calling verify().
    batch.spec_info = verify
    batch.model_config.spec_hidden_size, batch.model_config.dtype = hidden, torch.float32
    batch.sampling_info = _call(SamplingBatchInfo.from_schedule_batch, batch=batch, vocab_size=VOCAB)
    batch.out_cache_loc = torch.arange(width)
    batch.seq_lens, batch.seq_lens_cpu = torch.tensor([seq_len]), torch.tensor([seq_len])
    batch.req_pool_indices = torch.tensor([0])
    logits = LogitsProcessorOutput(next_token_logits=torch.zeros((width, VOCAB)))

    out = verify.verify(batch, logits, batch.token_to_kv_pool_allocator, 1)  # page size 1

    # EAGLEWorker.forward_batch_generation's result (field names differ between 0.5.11 and 0.5.12).
    per_req = getattr(out, "num_correct_drafts_per_req_cpu", None)
    if per_req is None:
        per_req = out.num_accepted_drafts_per_req_cpu
    tokens = getattr(out, "accept_tokens", None)
    if tokens is None:
        tokens = out.verified_id
    fields = {f.name for f in dataclasses.fields(GenerationBatchResult)}
    name = "num_correct_drafts" if "num_correct_drafts" in fields else "num_accepted_drafts"
    return GenerationBatchResult(logits_output=out.logits_output, next_token_ids=tokens, can_run_cuda_graph=False,
                                 **{name: sum(per_req), name + "_per_req_cpu": per_req})


def _dflash_v1_verify(server_args, batch, req, step: list[int]):
    """DFLASH spec v1 (to 0.5.13): the release's DFlashVerifyInput.verify on one block, then the GenerationBatchResult
    DFlashWorker builds from its output. The target's logits are the job's: one-hot rows whose argmax accepts the
    step's drafts and gives its bonus."""
    import torch
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.speculative import dflash_info

    block = server_args.speculative_num_draft_tokens
    accepted, bonus = list(step[:-1]), step[-1]
    rejected = next(t for t in range(VOCAB) if t != bonus)  # the block's candidate after the accepted ones
    candidates = ([req.output_ids[-1]] + accepted + [rejected] * block)[:block]  # [current, drafts...]
    predicted = (accepted + [bonus] + [rejected] * block)[:block]  # the target's argmax after each position
    logits = torch.zeros((block, VOCAB))
    logits[torch.arange(block), torch.tensor(predicted)] = 1.0
    dflash_info.assign_req_to_token_pool_func = lambda *a, **k: None  # triton write of the req-to-token table

    seq_len = len(req.origin_input_ids) + len(req.output_ids)
    verify = _call(dflash_info.DFlashVerifyInput, draft_token=torch.tensor(candidates),
                   positions=torch.arange(seq_len, seq_len + block), draft_token_num=block)
    batch.spec_info = verify
    batch.sampling_info = _call(SamplingBatchInfo.from_schedule_batch, batch=batch, vocab_size=VOCAB)
    batch.out_cache_loc = torch.arange(block)
    batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum = torch.tensor([seq_len]), torch.tensor([seq_len]), seq_len
    batch.req_pool_indices = torch.tensor([0])
    output = _call(LogitsProcessorOutput, next_token_logits=logits, hidden_states=torch.zeros((block, 8)))

    bonus_tokens, _, _, per_req = verify.verify(batch=batch, logits_output=output, page_size=1)

    fields = {f.name for f in dataclasses.fields(GenerationBatchResult)}
    name = "num_correct_drafts" if "num_correct_drafts" in fields else "num_accepted_drafts"
    return GenerationBatchResult(logits_output=output, next_token_ids=bonus_tokens, can_run_cuda_graph=False,
                                 **{name: sum(per_req), name + "_per_req_cpu": per_req})


# ------------------------------------------------------------- scheduler side, 0.5.11 and 0.5.12


def _mixin_scheduler(server_args, spec_v2: bool):
    """The release's Scheduler, whose mixins process results; its attributes set as __init__ sets them."""
    from sglang.srt.managers import scheduler_output_processor_mixin
    from sglang.srt.managers.scheduler import Scheduler

    sched = object.__new__(Scheduler)
    sched.server_args = server_args
    sched.is_generation = True
    sched.spec_algorithm = _spec_algorithm(server_args)
    sched.enable_overlap = spec_v2  # in these releases spec v2 is the overlap scheduler (ScheduleBatch.is_spec_v2)
    sched.enable_overlap_mlx = sched.enable_hisparse = False
    sched.model_config = _model_config()
    sched.token_to_kv_pool_allocator = _Allocator()
    sched.tree_cache = _TreeCache(sched.token_to_kv_pool_allocator)
    _record_kv_cache(scheduler_output_processor_mixin, sched.tree_cache)
    sched.req_to_token_pool = _req_to_token_pool()
    sched.draft_worker = types.SimpleNamespace(speculative_num_draft_tokens=server_args.speculative_num_draft_tokens)
    # The model worker is the spec worker; its on_verify_complete_cpu hook feeds adaptive speculation (off).
    sched.model_worker = types.SimpleNamespace(on_verify_complete_cpu=lambda *a, **k: None)
    sched.send_to_detokenizer = _ToDetokenizer()
    sched.stream_interval = server_args.stream_interval
    sched.disaggregation_mode = _disaggregation_mode(server_args)
    sched.decode_offload_manager = None
    sched.attn_tp_rank = sched.attn_cp_rank = sched.attn_dp_rank = sched.moe_ep_rank = sched.forward_ct = 0
    sched.dp_rank = None
    sched.enable_priority_scheduling = False
    _call(sched.init_metrics, tp_rank=0, pp_rank=0, dp_rank=None)  # the release's own counters
    sched.is_stats_logging_rank = sched.current_scheduler_metrics_enabled = False  # no periodic log lines
    sched.get_loads = lambda *a, **k: None  # load report attached to outputs (for DP routing)
    return sched


def _drive_mixin(server_args, spec: dict, rid: str, spec_v2: bool, v1_verify=_v1_verify) -> dict:
    """0.5.11, 0.5.12: Scheduler.process_batch_result_prefill, then process_batch_result_decode per step (a spec-v1
    step by `v1_verify`: EAGLE's or DFLASH's)."""
    sched = _mixin_scheduler(server_args, spec_v2)
    req = _make_req(spec, rid)
    batch = _new_batch(req, sched.req_to_token_pool, sched.token_to_kv_pool_allocator, sched.tree_cache,
                       sched.model_config, sched.enable_overlap, sched.spec_algorithm)
    assert batch.is_spec_v2 == spec_v2

    stride = server_args.speculative_num_draft_tokens
    verify = (lambda step: _v2_result(step, stride)) if spec_v2 else (
        lambda step: v1_verify(server_args, batch, req, step))
    used = _feed(sched, batch, req, spec, verify, overlap_tail=spec_v2 and spec.get("overlap_tail"))
    return dict(req=req, sent=sched.send_to_detokenizer.sent, verify_steps_used=used,
                kv_released=sched.tree_cache.released_rids.count(rid), server_counters=_spec_counters(sched))


# ---------------------------------------------------------------- scheduler side, 0.5.13 onwards


def _components(server_args, enable_overlap: bool = True, algorithm: str | None = None):
    """SchedulerBatchResultProcessor with its SchedulerOutputStreamer and SchedulerMetricsReporter: the
    release's own classes, built with the arguments Scheduler passes them (memory objects: the stubs)."""
    from sglang.srt.managers.scheduler_components import batch_result_processor as brp_module
    from sglang.srt.managers.scheduler_components.logprob_result_processor import SchedulerLogprobResultProcessor
    from sglang.srt.managers.scheduler_components.metrics_reporter import SchedulerMetricsReporter
    from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer
    from sglang.srt.observability.metrics_collector import SchedulerMetricsCollectorContext

    spec_algorithm = _spec_algorithm(server_args, algorithm)
    allocator = _Allocator()
    tree_cache = _TreeCache(allocator)
    _record_kv_cache(brp_module, tree_cache)
    model_config = _model_config()
    ps = types.SimpleNamespace(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, dp_rank=None, dp_size=1,
                               attn_tp_rank=0, attn_tp_size=1, attn_cp_rank=0, attn_cp_size=1, attn_dp_rank=0,
                               attn_dp_size=1, moe_ep_rank=0, moe_ep_size=1, moe_dp_rank=None, moe_dp_size=1,
                               gpu_id=0)  # ParallelState of a single-GPU scheduler (0.5.13-0.5.17)
    # The metrics reporter reads a few scheduler attributes (device label, FPM snapshots: off).
    scheduler = types.SimpleNamespace(server_args=server_args, device="cpu", ps=ps, enable_fpm=False,
                                      spec_algorithm=spec_algorithm, draft_worker=None, model_config=model_config)
    logging_off = SchedulerMetricsCollectorContext(enable_metrics=False, is_stats_logging_rank=False,
                                                   current_scheduler_metrics_enabled=False,
                                                   enable_kv_cache_events=False, collector=None)
    reporter = _call(SchedulerMetricsReporter, scheduler=scheduler, tp_rank=0, pp_rank=0, dp_rank=None,
                     metrics_collector_context=logging_off, metrics_collector=None)
    to_detokenizer = _ToDetokenizer()
    streamer = _call(SchedulerOutputStreamer, send_to_detokenizer=to_detokenizer, tree_cache=tree_cache, ps=ps,
                     server_args=server_args, is_generation=True, spec_algorithm=spec_algorithm,
                     disaggregation_mode=_disaggregation_mode(server_args), enable_hicache_storage=lambda: False,
                     load_inquirer_get_loads=lambda *a, **k: None, rust_server=None)
    processor = _call(
        brp_module.SchedulerBatchResultProcessor, is_generation=True,
        disaggregation_mode=_disaggregation_mode(server_args),
        # Overlap scheduling is the GPU default for EAGLE topk 1 (CPU resolution turns it off in 0.5.16 on).
        # For one request it matters only after the finish (see "overlap_tail"). DFLASH's v1 worker runs without.
        enable_overlap=enable_overlap, enable_overlap_mlx=False, server_args=server_args, model_config=model_config,
        token_to_kv_pool_allocator=allocator, tree_cache=tree_cache, hisparse_coordinator=None,
        req_to_token_pool=_req_to_token_pool(), decode_offload_manager=None, metrics_collector=None,
        metrics_reporter=reporter,
        draft_worker=types.SimpleNamespace(speculative_num_draft_tokens=server_args.speculative_num_draft_tokens),
        # The model worker is the spec worker; its on_verify_complete_cpu hook feeds adaptive speculation (off).
        model_worker=types.SimpleNamespace(on_verify_complete_cpu=lambda *a, **k: None),
        logprob_result_processor=_call(SchedulerLogprobResultProcessor, server_args=server_args,
                                       model_config=model_config),
        output_streamer=streamer, beam_coordinator=None, abort_request=lambda *a, **k: None)
    return types.SimpleNamespace(processor=processor, reporter=reporter, tree_cache=tree_cache, allocator=allocator,
                                 to_detokenizer=to_detokenizer, spec_algorithm=spec_algorithm,
                                 model_config=model_config)


def _drive_components(server_args, spec: dict, rid: str, v1_verify=None, algorithm: str | None = None,
                      v2_result=_v2_result) -> dict:
    """0.5.13 on: SchedulerBatchResultProcessor.process_batch_result_prefill, then _decode per step (spec v2, or
    without the overlap schedule each step by `v1_verify`: DFLASH's in 0.5.13)."""
    parts = _components(server_args, enable_overlap=v1_verify is None, algorithm=algorithm)
    processor = parts.processor
    req = _make_req(spec, rid)
    batch = _new_batch(req, processor.req_to_token_pool, parts.allocator, parts.tree_cache, parts.model_config,
                       processor.enable_overlap, parts.spec_algorithm)

    stride = server_args.speculative_num_draft_tokens
    verify = (lambda step: v1_verify(server_args, batch, req, step)) if v1_verify else (
        lambda step: v2_result(step, stride))
    used = _feed(processor, batch, req, spec, verify, overlap_tail=spec.get("overlap_tail"))
    return dict(req=req, sent=parts.to_detokenizer.sent, verify_steps_used=used,
                kv_released=parts.tree_cache.released_rids.count(rid), server_counters=_spec_counters(parts.reporter))


def _feed(processor, batch, req, spec: dict, verify_result, overlap_tail: bool) -> int:
    """The release's prefill processing, then its decode processing of each verify step while the request
    is unfinished (plus, with `overlap_tail`, one step more, as the overlap scheduler runs it); returns the
    verify steps the request used."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    batch.forward_mode = ForwardMode.EXTEND
    processor.process_batch_result_prefill(batch, _prefill_result(req, spec["prefill_token"]))
    used = 0
    for step in spec["verify_steps"]:
        if req.finished():
            break
        batch.forward_mode = ForwardMode.DECODE
        processor.process_batch_result_decode(batch, verify_result(step))
        used += 1
    if overlap_tail and req.finished() and used < len(spec["verify_steps"]):
        processor.process_batch_result_decode(batch, verify_result(spec["verify_steps"][used]))
    return used


def _spec_counters(holder) -> dict:
    """The batch-level spec counters (spec_num_*: since the last decode log; spec_total_*: folded in at each
    log) behind /server_info's avg_spec_accept_length = spec_total_num_accept(ed)_tokens / spec_total_num_forward_ct."""
    return {k: v for k, v in vars(holder).items() if k.startswith("spec_") and isinstance(v, (int, float))}


# ---------------------------------------------------------------------------------- tokenizer side


def _tokenizer_manager(server_args, spec: dict, rid: str):
    """The release's TokenizerManager holding the request's ReqState; attributes as __init__ sets them."""
    from sglang.srt.managers import tokenizer_manager as tm_module
    from sglang.srt.managers.io_struct import GenerateReqInput

    tm = object.__new__(tm_module.TokenizerManager)
    obj = GenerateReqInput(input_ids=list(spec["prompt_ids"]), rid=rid, stream=False,
                           sampling_params={"max_new_tokens": spec["max_new_tokens"]})
    time_stats = _call(tm_module.APIServerReqTimeStats, disagg_mode=_disaggregation_mode(server_args))
    state = tm_module.ReqState([], False, asyncio.Event(), obj, time_stats)  # as _send_one_request makes it
    tm.server_args = server_args
    tm.rid_to_state = {rid: state}
    tm.enable_metrics = False
    tm.enable_lora = server_args.enable_lora
    tm.incremental_streaming_output = getattr(server_args, "incremental_streaming_output", False)
    tm.skip_tokenizer_init = server_args.skip_tokenizer_init
    tm.crash_dump_folder = server_args.crash_dump_folder
    tm.dump_requests_folder = None
    tm._config_updates = []  # 0.5.17: control-plane config updates (none)
    tm.child_rid_to_logical_rid, tm.logical_rid_to_child_rids = {}, {}  # 0.5.17 on: parallel sampling (n=1)
    return tm, state


def _response(server_args, spec: dict, rid: str, sent: list) -> dict | None:
    """Hand every scheduler output for the request to TokenizerManager._handle_batch_output; the finished
    response (output_ids, meta_info) it queues for the client, or None while unfinished."""
    tm, state = _tokenizer_manager(server_args, spec, rid)

    async def feed():
        for out in sent:
            if rid in out.rids:
                await tm._handle_batch_output(out)

    asyncio.run(feed())
    finished = [o for o in state.out_list if o["meta_info"].get("finish_reason") is not None]
    return finished[-1] if finished else None


# ------------------------------------------------------------------------------------------------ run


def _answer(drive: dict, response: dict | None) -> dict:
    req, meta = drive["req"], (response or {}).get("meta_info", {})
    return {
        "output_ids": list(response["output_ids"]) if response else None,
        "completion_tokens": meta.get("completion_tokens"),
        "finish_reason": meta.get("finish_reason"),
        "verify_steps_used": drive["verify_steps_used"],
        **{k: v for k, v in meta.items() if k.startswith("spec_")},
        "req": {"output_ids": list(req.output_ids), "finished_len": req.finished_len,
                **{k: v for k, v in vars(req).items() if k.startswith("spec_") and isinstance(v, (int, list))}},
        "server_counters": drive["server_counters"],
        "kv_released": drive["kv_released"],
    }


def run(job: dict) -> dict:
    with tempfile.TemporaryDirectory() as directory:  # the model configs are read again when publishing
        return _run(job, directory)


def _run(job: dict, directory: str) -> dict:
    started = time.perf_counter()
    _stand_ins()
    import sglang

    dflash, dspark = job.get("algorithm") == "DFLASH", job.get("algorithm") == "DSPARK"
    if dflash:
        server_args = _dflash_server_args(job["num_draft_tokens"], directory)
    elif dspark:
        server_args = _dspark_server_args(job["num_draft_tokens"], directory)
    else:
        server_args = _server_args(job["num_steps"], directory, job.get("eagle_topk", 1), job.get("num_draft_tokens"))
    setup_s = time.perf_counter() - started
    components = importlib.util.find_spec("sglang.srt.managers.scheduler_components") is not None  # 0.5.13 on
    if dflash:  # DFlashWorker (spec v1, dflash_worker.py) to 0.5.13; the v2 worker from 0.5.16
        paths = ["v1"] if importlib.util.find_spec("sglang.srt.speculative.dflash_worker") is not None else ["v2"]
    else:
        paths = ["v2"]
        if importlib.util.find_spec("sglang.srt.speculative.eagle_worker") is not None:  # EAGLEWorker: to 0.5.12
            paths.append("v1")
    v1_verify = _dflash_v1_verify if dflash else _v1_verify

    answer = {"release": sglang.__version__, "paths": {}, "served_as": server_args.speculative_algorithm}
    for path in paths:
        answers = []
        for n, spec in enumerate(job["requests"]):
            rid = f"probe-{path}-{n}"
            if components:
                drive = _drive_components(server_args, spec, rid, v1_verify if path == "v1" else None,
                                          job.get("algorithm") if dflash or dspark else None,
                                          _dspark_result if dspark else _v2_result)
            else:
                drive = _drive_mixin(server_args, spec, rid, spec_v2=(path == "v2"), v1_verify=v1_verify)
            answers.append(_answer(drive, _response(server_args, spec, rid, drive["sent"])))
        answer["paths"][path] = answers
    answer["requests"] = answer["paths"][paths[0]]  # the default: v2 for EAGLE topk 1, the only path for DFLASH
    answer["key_names"] = sorted({k for answers in answer["paths"].values() for a in answers for k in a
                                  if k.startswith("spec_")})
    answer["seconds"] = {"setup": round(setup_s, 1), "total": round(time.perf_counter() - started, 1)}
    return answer
