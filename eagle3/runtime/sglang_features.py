"""The `sglang` feature backend: SGLang's model runner built inside this process (one torchrun rank), the target
tensor-parallel over the ranks, one forward per batch giving the aux hidden states and the last hidden state as
tensors on the rank's device. Nothing passes through Python lists, the scheduler or IPC (docs/conformance.md).

Pinned release: 0.5.23. How the runner is brought up follows what its scheduler process does
(managers/scheduler.py `run_scheduler_process` and `Scheduler.__init__`), without the scheduler:

    runtime_context.publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank, gpu_id))
    bootstrap.init_parallel_runtime(...); bootstrap.init_layer_runtime(model_config)
    MoE / GEMM process configs
    ModelRunner(...)                     loads the weights (TP-sharded)
    runner.alloc_memory_pool()           KV cache pools
    runner.init_attention_backends()
    runner.init_cuda_graphs()            with CUDA graphs disabled: builds only the eager runner
    model.set_eagle3_layers_to_capture(ids)

A batch becomes Req objects, a ScheduleBatch (`prepare_for_extend` allocates KV slots), and an EXTEND ForwardBatch, as
the scheduler builds a prefill; `ModelRunner.forward` runs it. The model's logits processor is replaced by a module
that hands back its inputs: the model's own forward (with its model-specific contexts) runs to the final norm, and
no vocab-sized logits are computed. The KV slots are freed after every batch.

torch.distributed: when the trainer has initialised it (torchrun + init_process_group), SGLang builds its groups on
that world (`init_distributed_environment` skips `init_process_group` when one exists) and requires the world to be
exactly the TP group: tp_size == world size, tp_rank == rank. Construction is collective (every rank must construct
it at the same point, it creates process groups). Without a process group only tp_size 1 is possible (SGLang then
creates a one-rank group of its own on a free local port).

engine_args: extra ServerArgs fields. On a GPU that the trainer shares, bound the memory SGLang takes:
`mem_fraction_static`, `max_total_tokens` (the KV pool: one batch's tokens suffice) and `max_running_requests`
(rows per batch). On the CPU: device="cpu", attention_backend="torch_native", dtype="float32".
"""

from __future__ import annotations

import gc
import socket
from array import array

import torch
from torch import nn

from eagle3.runtime.features import FeatureBackend, Features, TokenBatch
from eagle3.errors import Eagle3Error
from eagle3.contract import engines
from eagle3.contract.releases import ReleaseRange, parse_release

SUPPORTED_RELEASES = ReleaseRange("0.5.23", "0.5.23")

# Set for every runner: prefix sharing would return rows for the uncached tokens only, chunked prefill would split a
# row over forwards, and no scheduler thread or graph capture exists here.
FIXED_ARGS = {
    "skip_tokenizer_init": True,
    "disable_radix_cache": True,
    "chunked_prefill_size": -1,
    "disable_overlap_schedule": True,
    "disable_cuda_graph": True,
}
# Values engine_args may not change: otherwise a rank would not run every token of the batch, or not the whole model.
REQUIRED_ARGS = {"enable_dp_attention": False, "pp_size": 1, "dp_size": 1}


class SGLangFeatures(FeatureBackend):
    name = "sglang"

    def __init__(self, model_path: str, family: str, num_hidden_layers: int, aux_layers: list[int],
                 last_hidden: str, tp_rank: int, tp_size: int, device, engine_args: dict | None = None):
        if last_hidden != "post_norm":
            raise Eagle3Error(f"last_hidden '{last_hidden}': SGLang's model forward returns the state after the final "
                              "norm only; use last_hidden: post_norm (or the transformers backend for pre_norm)")
        if not aux_layers:
            raise Eagle3Error("aux_layers is empty: name the decoder layers whose outputs the draft reads")
        check_engine_args(engine_args or {})
        check_process_group(tp_rank, tp_size)
        import sglang

        self.release = sglang.__version__
        if parse_release(self.release) not in SUPPORTED_RELEASES:
            raise Eagle3Error(f"SGLang {self.release} is not supported for online features (supported: "
                              f"{SUPPORTED_RELEASES}); install a supported release in the node's SGLang environment")
        try:
            ids = engines.sglang_ids_for_layers(list(aux_layers), family, self.release, num_hidden_layers)
        except ValueError as err:
            raise Eagle3Error(f"aux layers {list(aux_layers)}: {err}") from None
        self.aux_layers = list(aux_layers)
        self.device = torch.device(device)
        self.runner = build_runner(model_path, tp_rank, tp_size, self.device, dict(engine_args or {}))
        # As ModelRunner.init_attention_backends does for an EAGLE3 target (configure_aux_hidden_state_capture); it
        # runs before graph capture there, and no graph is captured here.
        self.runner.model.set_eagle3_layers_to_capture(ids)
        replace_logits_processors(self.runner.model)
        self._free_kv = self.runner.token_to_kv_pool_allocator.available_size()

    @torch.no_grad()
    def features(self, batch: TokenBatch, rows: slice = slice(None)) -> Features:
        """Every rank of the TP group passes the same batch (a TP forward needs all ranks on the same tokens); each
        gets rows `rows`, padded to their longest row."""
        lengths = [int(n) for n in batch.lengths]  # host ints: the lengths tensor lives on the CPU
        ids = batch.input_ids.to("cpu", torch.int64)  # [B, T]
        run = [i for i, n in enumerate(lengths) if n > 0]  # an empty row has nothing to run (SGLang refuses one)
        last, aux = self._forward([ids[i, : lengths[i]] for i in run])  # [N, H], [N, n_aux * H]
        start = dict(zip(run, _offsets([lengths[i] for i in run])))
        keep = range(len(lengths))[rows]
        return Features(aux=_padded(aux, keep, start, lengths), last=_padded(last, keep, start, lengths))

    def _forward(self, rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """One EXTEND forward of the token rows; (last [N, H], aux [N, n_aux * H]) over their tokens in row order."""
        from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states

        hidden, dtype = self.runner.model_config.hidden_size, self.runner.model_config.dtype
        if not rows:
            empty = torch.empty(0, hidden, dtype=dtype, device=self.device)
            return empty, torch.empty(0, len(self.aux_layers) * hidden, dtype=dtype, device=self.device)
        schedule_batch, forward_batch = prefill_batch(self.runner, rows)
        try:
            states = self.runner.forward(forward_batch).logits_output
        finally:
            free_kv(self.runner, schedule_batch)
        if self.runner.token_to_kv_pool_allocator.available_size() != self._free_kv:
            raise RuntimeError("SGLang's KV pool did not get every slot of the batch back")
        if not isinstance(states, HiddenStates) or states.aux is None:
            raise Eagle3Error(f"{type(self.runner.model).__name__}.forward did not hand its final hidden states and "
                              "captured aux states to the logits processor: this model file is not supported")
        last, aux = states.last, pack_aux_hidden_states(states.aux)  # [N, H], [N, n_aux * H]
        tokens = sum(len(r) for r in rows)
        if last.shape != (tokens, hidden) or aux.shape != (tokens, len(self.aux_layers) * hidden):
            raise Eagle3Error(f"SGLang returned last {tuple(last.shape)} and aux {tuple(aux.shape)} for {tokens} "
                              f"tokens of hidden size {hidden} at {len(self.aux_layers)} aux layers: a setting in "
                              "engine_args scatters tokens over ranks or captures other layers")
        return last, aux

    def close(self) -> None:
        from sglang.srt.distributed.parallel_state import destroy_model_parallel
        from sglang.srt.eplb.expert_location import set_global_expert_location_metadata

        # The model-parallel groups go; SGLang's WORLD wraps the trainer's process group and stays (a later runner in
        # this process reuses it). An MoE target's expert placement is process-global and set once per runner: a
        # later runner refuses to start while it is held.
        self.runner = None
        destroy_model_parallel()
        set_global_expert_location_metadata(None, allow_overwrite=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


class HiddenStates:
    def __init__(self, last: torch.Tensor, aux):
        self.last, self.aux = last, aux  # [N, H]; a list of [N, H] or a packed [N, n_aux * H] (per model file)


class KeepHiddenStates(nn.Module):
    """Stands in for the model's LogitsProcessor (called as `logits_processor(input_ids, hidden_states, lm_head,
    forward_batch, aux_hidden_states)` at the end of the model's forward): returns the states it is given."""

    def forward(self, input_ids, hidden_states, lm_head, forward_batch, aux_hidden_states=None, **_):
        return HiddenStates(hidden_states, aux_hidden_states)


def replace_logits_processors(model: nn.Module) -> None:
    """Every LogitsProcessor of the model (the causal LM's own; a multimodal wrapper's language model's) becomes a
    KeepHiddenStates: the model's forward then returns its post-norm states and aux captures, with no logits."""
    from sglang.srt.layers.logits_processor import LogitsProcessor

    found = [name for name, module in model.named_modules() if isinstance(module, LogitsProcessor)]
    if not found:
        raise Eagle3Error(f"{type(model).__name__} has no LogitsProcessor to take the hidden states from")
    for name in found:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, KeepHiddenStates())


def build_runner(model_path: str, tp_rank: int, tp_size: int, device: torch.device, engine_args: dict):
    """SGLang 0.5.23's ModelRunner for this rank, as its scheduler process brings one up."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import bootstrap
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.runtime_context import SpawnRanks, get_schedule, publish, spawn_world_rank
    from sglang.srt.server_args import ServerArgs

    gpu_id = device.index if device.index is not None else 0
    args = {"model_path": model_path, "tp_size": tp_size, "device": device.type, **engine_args, **FIXED_ARGS}
    server_args = ServerArgs(**args)
    publish(server_args, role="scheduler",
            ranks=SpawnRanks(world_rank=spawn_world_rank(server_args, tp_rank=tp_rank, pp_rank=0), gpu_id=gpu_id))
    model_config = ModelConfig.from_server_args(server_args)
    port = free_port()  # used only when no process group exists (tp_size 1)
    bootstrap.init_parallel_runtime(server_args=server_args, device=device.type, dist_port=port)
    bootstrap.init_layer_runtime(model_config=model_config)
    init_process_configs()
    runner = ModelRunner(model_config=model_config, mem_fraction_static=get_schedule().mem_fraction_static,
                         gpu_id=gpu_id, nccl_port=port, server_args=server_args)
    runner.alloc_memory_pool()
    runner.init_attention_backends()
    runner.init_cuda_graphs()
    return runner


def check_engine_args(engine_args: dict) -> None:
    for key, allowed in REQUIRED_ARGS.items():
        if key in engine_args and engine_args[key] != allowed:
            raise Eagle3Error(f"engine_args {key}={engine_args[key]!r}: online features need every rank to run the "
                              f"whole model on every token (leave {key} at {allowed!r})")


def check_process_group(tp_rank: int, tp_size: int) -> None:
    """SGLang builds WORLD on an existing default group and requires WORLD == TP x PP (parallel_state.py
    initialize_model_parallel); say so here, naming the fix, rather than fail inside SGLang."""
    if torch.distributed.is_initialized():
        world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        if (world, rank) != (tp_size, tp_rank):
            raise Eagle3Error(f"SGLang's target runs tensor-parallel over the whole torch.distributed world: tp_size "
                              f"{tp_size} / tp_rank {tp_rank} must equal world size {world} / rank {rank}")
    elif tp_size != 1:
        raise Eagle3Error(f"tp_size {tp_size} needs torch.distributed initialised first (torchrun, then "
                          "torch.distributed.init_process_group) on every rank")


def init_process_configs() -> None:
    """The process-wide MoE and GEMM settings Scheduler.init_moe_gemm_config seeds from the published config."""
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.layers.quantization.fp4_utils import initialize_fp4_gemm_config
    from sglang.srt.layers.quantization.fp8_utils import initialize_fp8_gemm_config
    from sglang.srt.layers.quantization.unquant import initialize_bf16_gemm_config

    initialize_moe_config()
    initialize_fp8_gemm_config()
    initialize_fp4_gemm_config()
    initialize_bf16_gemm_config()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class NoPrefixCache:
    """The prefix cache a ScheduleBatch allocates through, with nothing cached: every row is computed whole and its
    slots go straight back to the allocator (no radix tree: features need every token's forward). It has what
    prepare_for_extend's allocation path (mem_cache/allocation.py alloc_for_extend) reads, as the one-batch benchmark's
    stand-in (benchmark/one_batch.py) does."""

    def __init__(self, runner):
        self.page_size = runner.page_size
        self.device = runner.device
        self.req_to_token_pool = runner.req_to_token_pool
        self.token_to_kv_pool_allocator = runner.token_to_kv_pool_allocator

    def supports_prefix_sharing(self) -> bool:  # nothing to evict before allocating
        return False

    def supports_swa(self) -> bool:
        return False

    def supports_mamba(self) -> bool:
        return False

    def maybe_hand_to_session(self, req) -> None:  # no streaming sessions: the request keeps its row
        pass


def prefill_batch(runner, rows: list[torch.Tensor]):
    """(ScheduleBatch, EXTEND ForwardBatch) for token rows [n_i] int64 on the CPU, built as the scheduler builds a
    prefill of whole prompts: Req -> ScheduleBatch.init_new -> prepare_for_extend -> ForwardBatch.init_new."""
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    reqs = []
    for i, row in enumerate(rows):
        ids = array("q")
        ids.frombytes(row.contiguous().numpy().tobytes())  # token ids as the Req's int64 array, no Python list
        req = Req(rid=f"features-{i}", origin_input_text="", origin_input_ids=ids,
                  sampling_params=SamplingParams(temperature=0, max_new_tokens=1))
        req.init_next_round_input()  # fill ids = the prompt; no tree cache, so no prefix
        req.extend_end = len(ids)  # what PrefillAdder sets when it admits a whole prompt (no chunking)
        reqs.append(req)
    batch = ScheduleBatch.init_new(reqs=reqs, req_to_token_pool=runner.req_to_token_pool,
                                   token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
                                   tree_cache=NoPrefixCache(runner), model_config=runner.model_config,
                                   enable_overlap=False, spec_algorithm=SpeculativeAlgorithm.NONE)
    batch.prepare_for_extend()  # allocates request rows and KV slots
    # The scheduler's resolve_forward_inputs step: the prompt tokens, staged on the host, to the device.
    batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device, non_blocking=True)  # [N]
    batch.prefill_input_ids_cpu = None
    forward_batch = ForwardBatch.init_new(batch, runner, capture_hidden_mode=CaptureHiddenMode.NULL,
                                          return_hidden_states_before_norm=False)
    return batch, forward_batch


def free_kv(runner, batch) -> None:
    """Give back the batch's KV slots and request rows (no cache keeps them)."""
    runner.token_to_kv_pool_allocator.free(batch.out_cache_loc)
    for req in batch.reqs:
        runner.req_to_token_pool.free(req)


def _offsets(lengths: list[int]) -> list[int]:
    starts, at = [], 0
    for n in lengths:
        starts.append(at)
        at += n
    return starts


def _padded(flat: torch.Tensor, keep: range, start: dict[int, int], lengths: list[int]) -> torch.Tensor:
    """Rows `keep` of the flat token states [N, D] (row i at start[i]), right-padded with zeros to the longest of
    them: [len(keep), T, D], by device copies."""
    width = max((lengths[i] for i in keep), default=0)
    out = flat.new_zeros(len(keep), width, flat.shape[-1])  # [b, T, D]
    for j, i in enumerate(keep):
        if lengths[i]:
            out[j, : lengths[i]] = flat[start[i] : start[i] + lengths[i]]
    return out
