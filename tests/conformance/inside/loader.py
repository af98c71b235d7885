"""Probe: load EAGLE-3 drafts through one SGLang release's own loader, on the CPU.

job = {"drafts": {label: directory holding config.json + model.safetensors}, "target": optional
directory whose config.json stands for the target's (default: each draft's own), "algorithm": the
--speculative-algorithm the server runs (default EAGLE3; DFLASH for DFlashDraftModel drafts), "environment": optional
{label: {variable: value}} set while that draft loads (SGLang's envs are read when the model is built: DSpark's
SGLANG_RAGGED_VERIFY_MODE decides whether its confidence head exists)}. For each draft the
release's own ServerArgs, draft ModelConfig (is_draft_model=True), LoadConfig and model loader run as
a speculative-decoding server's draft worker runs them, with the draft alone: no target is built.

The only thing added to SGLang's path is a sentinel. Between the loader constructing the model and
feeding it the checkpoint, every parameter and floating buffer is filled with NaN, so a parameter
still holding NaN afterwards is one `load_weights` never wrote. The seam is
`loader.load_weights_and_postprocess(model, weights, device)`, which every release's
`DefaultModelLoader.load_model` calls right after `_initialize_model`; it is shadowed on the loader
*instance* only, and the release's own function then runs unchanged (only the names it is fed are
recorded on the way through).

Answer: {"release", "setup": the SGLang calls the set-up made, "import_seconds", "drafts": {label:
  {"written": {param: {"written", "partial", "shape"}}, "buffers": {buffer: same},
   "sources": {checkpoint tensor: [{"param", "rows"?}]}, "hot_token_id", "lm_head_rows", "facts",
   "yielded": names load_weights was given, "seconds"}
  or {"error": {"type", "message", "stage", "where"}, "seconds"}}}.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import socket
import time
import traceback

_T0 = time.perf_counter()

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

# The SGLang calls the set-up made, in order, so a failure can be read against them.
SETUP_STEPS: list[str] = []
_PARALLEL_DONE = False
_PARALLEL_FAILURE: "_StageError | None" = None
LOADED = None  # the draft model the last load built (read by mla_draft.py)


def run(job: dict) -> dict:
    import sglang.srt.server_args  # noqa: F401  (the import is most of a child's time: measure it)

    import_seconds = time.perf_counter() - _T0
    drafts = {}
    for label, path in job["drafts"].items():
        started = time.perf_counter()
        try:
            with _environment((job.get("environment") or {}).get(label, {})):
                answer = _probe(str(path), str(job.get("target") or path), job.get("algorithm", "EAGLE3"))
        except _StageError as failure:
            answer = {"error": failure.describe()}
        answer["seconds"] = round(time.perf_counter() - started, 3)
        drafts[label] = answer
    import sglang

    return {
        "release": getattr(sglang, "__version__", None),
        "setup": SETUP_STEPS,
        "import_seconds": round(import_seconds, 3),
        "drafts": drafts,
    }


@contextlib.contextmanager
def _environment(variables: dict):
    """`variables` set in os.environ for the block, and restored after: one draft's settings never reach the next."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


class _StageError(Exception):
    """An exception SGLang raised, tagged with the step it came from."""

    def __init__(self, stage: str, error: BaseException):
        super().__init__(stage)
        self.stage = stage
        self.error = error

    def describe(self) -> dict:
        frames = traceback.extract_tb(self.error.__traceback__)
        # The innermost frame inside SGLang's package names the rule that refused the draft (the
        # exception itself may come from deeper, e.g. transformers' config __getattribute__).
        inside = [f for f in frames if "/sglang/srt/" in f.filename]
        where = inside[-1] if inside else (frames[-1] if frames else None)
        return {
            "type": type(self.error).__name__,
            "message": str(self.error),
            "stage": self.stage,
            "where": f"{where.filename.rsplit('/sglang/', 1)[-1]}:{where.lineno} {where.name}" if where else None,
        }


def _stage(name: str, call, *args, **kwargs):
    try:
        return call(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - the test compares whatever SGLang raises
        raise _StageError(name, error) from error


def _step(description: str) -> None:
    if description not in SETUP_STEPS:
        SETUP_STEPS.append(description)


def _probe(path: str, target: str, algorithm: str) -> dict:
    global _PARALLEL_DONE, _PARALLEL_FAILURE
    server_args = _stage("server_args", _server_args, path, target, algorithm)
    _stage("publish", _publish, server_args)
    model_config = _stage("model_config", _draft_model_config, server_args, path)
    if not _PARALLEL_DONE:
        # Process groups are built once per process, as a scheduler does; a draft worker reuses its
        # target's. A failure here is reported for this draft and every later one.
        _PARALLEL_DONE = True
        try:
            _stage("parallel", _init_parallel, server_args, model_config)
        except _StageError as failure:
            _PARALLEL_FAILURE = failure
    if _PARALLEL_FAILURE is not None:
        raise _PARALLEL_FAILURE
    return _stage("load", _load, server_args, model_config, path)


def _server_args(path: str, target: str, algorithm: str):
    from sglang.srt.server_args import ServerArgs

    # No target is built: ServerArgs only reads the target's config.json for its speculative-decoding
    # defaults, so by default the draft stands in for it.
    _step(f"ServerArgs(model_path=target or draft, speculative_algorithm={algorithm}, speculative_draft_model_path=draft, "
          "device=cpu, dtype=float32, tp_size=1)")
    return ServerArgs(
        model_path=target,
        speculative_algorithm=algorithm,
        speculative_draft_model_path=path,
        device="cpu",
        dtype="float32",
        tp_size=1,
    )


def _publish(server_args) -> None:
    try:
        from sglang.srt import runtime_context
    except ImportError:  # before 0.5.16 server args were a module global, with no runtime context
        runtime_context = None
    publish = getattr(runtime_context, "publish", None)
    spawn_ranks = getattr(runtime_context, "SpawnRanks", None)
    if publish is not None and spawn_ranks is not None and "ranks" in inspect.signature(publish).parameters:
        # Where publish takes the launcher's placement, the scheduler process publishes with it:
        # rank reads are refused otherwise. One process: world rank 0, no DP controller, device 0.
        _step("runtime_context.publish(server_args, role='scheduler', ranks=SpawnRanks(world_rank=0, gpu_id=0))")
        publish(server_args, role="scheduler", ranks=spawn_ranks(world_rank=0, dp_rank=None, gpu_id=0))
        return
    from sglang.srt.server_args import set_global_server_args_for_scheduler

    # 0.5.11-0.5.13: sets the module global; 0.5.16: a shim over the runtime context;
    # 0.5.17: a shim over runtime_context.publish(role="scheduler").
    _step("server_args.set_global_server_args_for_scheduler(server_args)")
    set_global_server_args_for_scheduler(server_args)


def _draft_model_config(server_args, path: str):
    from sglang.srt.configs.model_config import ModelConfig

    # As TpModelWorker._init_model_config does for a draft worker.
    _step("ModelConfig.from_server_args(server_args, model_path=draft, is_draft_model=True)")
    return ModelConfig.from_server_args(server_args, model_path=path, model_revision=None, is_draft_model=True)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _init_parallel(server_args, model_config) -> None:
    port = _free_port()
    try:
        from sglang.srt.distributed import bootstrap
    except ImportError:
        bootstrap = None
    if hasattr(bootstrap, "init_parallel_runtime"):
        # 0.5.23 onwards: the scheduler's own entry builds every group from the published context
        # (WORLD over gloo on the CPU, model-parallel groups, DP attention), then sizes layer state.
        _step("distributed.bootstrap.init_parallel_runtime(device=cpu, dist_port=free port)")
        bootstrap.init_parallel_runtime(server_args=server_args, device="cpu", dist_port=port)
        if hasattr(bootstrap, "init_layer_runtime"):
            _step("distributed.bootstrap.init_layer_runtime(model_config)")
            bootstrap.init_layer_runtime(model_config=model_config)
        return

    # Earlier releases build the groups inside ModelRunner.init_torch_distributed (0.5.16/0.5.17:
    # bootstrap.init_torch_distributed, which wants a whole ParallelState); these are the calls it
    # makes for one CPU rank.
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.layers.dp_attention import initialize_dp_attention

    _step("distributed.init_distributed_environment(backend=gloo, world_size=1, rank=0, tcp://127.0.0.1)")
    init_distributed_environment(
        backend="gloo",
        world_size=1,
        rank=0,
        local_rank=0,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
    )
    _step("distributed.initialize_model_parallel(tensor_model_parallel_size=1)")
    initialize_model_parallel(tensor_model_parallel_size=1)
    _step("dp_attention.initialize_dp_attention(server_args, model_config)")
    if "model_config" in inspect.signature(initialize_dp_attention).parameters:
        initialize_dp_attention(server_args=server_args, model_config=model_config)
    else:
        initialize_dp_attention(server_args=server_args)


def _load_config(server_args):
    from sglang.srt.configs.load_config import LoadConfig

    # The fields ModelRunner.load_model (or build_load_config) takes from server args that bear on
    # reading a local safetensors file; the rest concern remote or quantised loading.
    wanted = dict(
        load_format=server_args.load_format,
        download_dir=server_args.download_dir,
        model_loader_extra_config=server_args.model_loader_extra_config,
        tp_rank=0,
    )
    accepted = inspect.signature(LoadConfig).parameters
    return LoadConfig(**{key: value for key, value in wanted.items() if key in accepted})


def _load(server_args, model_config, path: str) -> dict:
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.update_config import adjust_config_with_unaligned_cpu_tp
    from sglang.srt.model_loader import get_model_loader

    load_config = _load_config(server_args)
    # ModelRunner.load_model applies this on the CPU before choosing a loader.
    _step("update_config.adjust_config_with_unaligned_cpu_tp(model_config, load_config, 1)")
    model_config = adjust_config_with_unaligned_cpu_tp(model_config, load_config, 1)
    _step("model_loader.get_model_loader(load_config, model_config).load_model(device_config=DeviceConfig('cpu'))")
    loader = get_model_loader(load_config=load_config, model_config=model_config)

    seen = {}
    original = loader.load_weights_and_postprocess

    def prefilled_then_loaded(model, weights, target_device):
        seen["model"] = model
        seen["filled"] = _fill_with_sentinel(model)
        seen["yielded"] = []
        return original(model, _recorded(weights, seen["yielded"]), target_device)

    global LOADED
    loader.load_weights_and_postprocess = prefilled_then_loaded
    model = LOADED = loader.load_model(model_config=model_config, device_config=DeviceConfig("cpu"))
    if "model" not in seen:
        raise RuntimeError(f"{type(loader).__name__}.load_model never reached load_weights_and_postprocess: "
                           "the sentinel could not be placed")
    return _report(model, path, seen["yielded"])


def _recorded(weights, names: list):
    for name, tensor in weights:
        names.append(name)
        yield name, tensor


def _fill_with_sentinel(model: torch.nn.Module) -> int:
    filled = 0
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            if tensor.is_floating_point():
                tensor.fill_(float("nan"))
                filled += 1
    return filled


def _written(tensor: torch.Tensor) -> dict:
    if not tensor.is_floating_point():
        return {"written": None, "partial": False, "shape": list(tensor.shape)}
    unwritten = int(torch.isnan(tensor).sum())
    return {
        "written": unwritten == 0,
        "partial": 0 < unwritten < tensor.numel(),
        "shape": list(tensor.shape),
    }


def _report(model: torch.nn.Module, path: str, yielded: list) -> dict:
    params = {name: param.detach() for name, param in model.named_parameters()}
    checkpoint = load_file(f"{path}/model.safetensors")
    hot = getattr(model, "hot_token_id", None)
    lm_head = getattr(model, "lm_head", None)
    lm_head_weight = getattr(lm_head, "weight", None)
    config = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    return {
        "written": {name: _written(param) for name, param in params.items()},
        "buffers": {name: _written(buffer) for name, buffer in model.named_buffers()},
        "sources": {name: _sources(tensor, params) for name, tensor in checkpoint.items()},
        "hot_token_id": hot.tolist() if isinstance(hot, torch.Tensor) else hot,
        "lm_head_rows": int(lm_head_weight.shape[0]) if lm_head_weight is not None else None,
        "facts": {
            "class": type(model).__name__,
            "param_dtypes": sorted({str(param.dtype) for param in params.values()}),
            "lm_head_is_embed_tokens": lm_head is not None and lm_head is getattr(inner, "embed_tokens", None),
            "load_lm_head_from_target": getattr(model, "load_lm_head_from_target", None),
            "config_draft_vocab_size": getattr(config, "draft_vocab_size", None),
            "num_aux_hidden_states": getattr(inner, "num_aux_hidden_states", None),
            "norm_before_fc": getattr(inner, "norm_before_fc", None),
            "has_fc_norm": getattr(inner, "fc_norm", None) is not None,
            "has_input_norm": getattr(inner, "input_norm", None) is not None,
            "norm_output": getattr(inner, "norm_output", None),
        },
        "yielded": yielded,
    }


def _sources(tensor: torch.Tensor, params: dict) -> list:
    """Where `tensor`'s values landed: whole parameters equal to it, or row ranges of fused ones
    (q/k/v inside qkv_proj, gate/up inside gate_up_proj, a padded lm_head)."""
    if not tensor.is_floating_point():
        return []
    wanted = tensor.to(torch.float32)
    found = []
    for name, param in params.items():
        if not param.is_floating_point() or param.dim() != wanted.dim() or param.dim() == 0:
            continue
        if param.shape == wanted.shape:
            if torch.equal(param.to(torch.float32), wanted):
                found.append({"param": name})
            continue
        rows = wanted.shape[0]
        if param.shape[1:] != wanted.shape[1:] or param.shape[0] <= rows:
            continue
        candidate = param.to(torch.float32)
        # Rows of the parameter equal to the tensor's first row are the only possible starts.
        first = candidate == wanted[0]
        starts = first.reshape(first.shape[0], -1).all(dim=1).nonzero().flatten().tolist()
        for start in starts:
            if start + rows <= candidate.shape[0] and torch.equal(candidate[start:start + rows], wanted):
                found.append({"param": name, "rows": [start, start + rows]})
    return found
