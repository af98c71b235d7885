"""Probe: what one SGLang release does with EAGLE-3 aux hidden-state ids on the target model.

Runs inside a child process that has one release on its path (see ../releases.py). For each case it
calls the release's OWN `set_eagle3_layers_to_capture` of the family's model class, then runs the
release's OWN inner-model `forward` (LlamaModel, DeepseekV2Model, ...) to see which hidden states that
loop really records for the ids the method set. Neither the ids rule nor the loop is restated here:
both come from the release.

The target is never built (a 61-layer MoE cannot be, and a tiny one needs attention backends, KV pools
and a process group). Instead:

- the model objects are the release's classes made with `__new__`, holding only the attributes the
  method and the forward loop read (the config, the pipeline-rank flags, the inner model, its layers);
- each decoder layer is a recording stand-in that takes the release's real decoder-layer signature, so
  it sees exactly what the loop hands it (the hidden state, the residual, and, in the releases that
  capture inside the layer, the capture sink).

Hidden states are [1, 1] tensors that encode their position in the stack: the embedding output is 0 and
layer i turns an input worth s into hidden 0.75 plus residual s + 0.25 (a plain pre-norm residual
block, so hidden + residual = s + 1). "Boundary" b is then the sum entering layer b, i.e. the output of
layer b - 1; boundary n is the last layer's output before the final norm. A captured value that is not a
whole number shows the loop recorded only one of hidden/residual (0.75: the hidden alone).

Replaced with recorders (named in each answer): the two-batch-overlap executor the DeepSeek loops hand
the MoE layers to (it needs real layers' operation strategies), and in releases that keep the residual
in `forward_batch.residual_stream` (0.5.23) the stream helpers, whose `final_norm(capture=...)` is given
the sum it documents capturing. Anything else the forward needs and the stand-in lacks fails the run and
is reported as an error rather than faked.

job: {"cases": [{"family", "num_layers", "ids" (list or null), "first_k_dense_replace" (optional)}]}
answer: {"release", "cases": [...], "families": {...}, "two_batch_overlap": {...}, "eagle3_mla_draft": {...}}
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import re
import time
import traceback
from contextlib import contextmanager
from types import SimpleNamespace

# family -> (causal-LM class, inner model class whose forward holds the loop, decoder-layer class), each
# as (module under sglang.srt.models, class name). kimi_k25 has no decoder of its own: its
# set_eagle3_layers_to_capture delegates to the DeepseekV3ForCausalLM it wraps as `language_model`.
FAMILIES = {
    "llama": (("llama", "LlamaForCausalLM"), ("llama", "LlamaModel"), ("llama", "LlamaDecoderLayer")),
    "deepseek_v2": (("deepseek_v2", "DeepseekV2ForCausalLM"), ("deepseek_v2", "DeepseekV2Model"),
                    ("deepseek_v2", "DeepseekV2DecoderLayer")),
    "deepseek_v3": (("deepseek_v2", "DeepseekV3ForCausalLM"), ("deepseek_v2", "DeepseekV2Model"),
                    ("deepseek_v2", "DeepseekV2DecoderLayer")),
    "kimi_k25": (("kimi_k25", "KimiK25ForConditionalGeneration"), ("deepseek_v2", "DeepseekV2Model"),
                 ("deepseek_v2", "DeepseekV2DecoderLayer")),
    "glm4_moe_lite": (("glm4_moe_lite", "Glm4MoeLiteForCausalLM"), ("glm4_moe_lite", "Glm4MoeLiteModel"),
                      ("glm4_moe_lite", "Glm4MoeLiteDecoderLayer")),
    "gpt_oss": (("gpt_oss", "GptOssForCausalLM"), ("gpt_oss", "GptOssModel"), ("gpt_oss", "GptOssDecoderLayer")),
    "qwen2": (("qwen2", "Qwen2ForCausalLM"), ("qwen2", "Qwen2Model"), ("qwen2", "Qwen2DecoderLayer")),
    "qwen3": (("qwen3", "Qwen3ForCausalLM"), ("qwen3", "Qwen3Model"), ("qwen3", "Qwen3DecoderLayer")),
    "qwen3_moe": (("qwen3_moe", "Qwen3MoeForCausalLM"), ("qwen3_moe", "Qwen3MoeModel"),
                  ("qwen3_moe", "Qwen3MoeDecoderLayer")),
    "gemma3": (("gemma3_causal", "Gemma3ForCausalLM"), ("gemma3_causal", "Gemma3TextModel"),
               ("gemma3_causal", "Gemma3DecoderLayer")),
}
KIMI_LANGUAGE_MODEL = ("deepseek_v2", "DeepseekV3ForCausalLM")

# Names the DeepSeek-style loops hand the layers after `first_k_dense_replace` to under TBO.
TBO_EXECUTORS = ("model_forward_maybe_tbo", "model_forward_stages")
# Checks some loops make of the process-wide parallel config (Qwen2-MoE's from 0.5.17).
CONTEXT_PARALLEL_CHECKS = ("is_prefill_context_parallel_enabled",)
# Keyword names by which a loop hands a layer the place to put its captured input (0.5.16 onwards).
CAPTURE_SINKS = ("captured_last_layer_outputs", "capture_output")

EMBEDDING_VALUE = 0.0
LAYER_HIDDEN = 0.75  # what a layer adds; its residual output carries the rest (input + 0.25)


def run(job: dict) -> dict:
    import torch  # noqa: F401  (imported here so a failure names the release's environment)

    started = time.monotonic()
    answer = {"release": _release(), "cases": [], "families": {}, "server_args": _install_default_server_args()}
    for case in job["cases"]:
        answer["cases"].append(_run_case(case, answer["families"]))
    answer["two_batch_overlap"] = _tbo_facts()
    answer["eagle3_mla_draft"] = _eagle3_mla_draft()
    answer["probe_seconds"] = round(time.monotonic() - started, 2)
    return answer


def _release() -> str:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        import sglang

        return getattr(sglang, "__version__", "unknown")


def _install_default_server_args() -> str:
    """Some loops read a server flag (0.5.11: `disable_piecewise_cuda_graph`) from the process-wide
    ServerArgs a scheduler installs. Install one holding the dataclass defaults, as a server started
    with no flags would; its __post_init__ is skipped (it resolves a model path and a device)."""
    import dataclasses

    module = importlib.import_module("sglang.srt.server_args")
    setter = getattr(module, "set_global_server_args_for_scheduler", None)
    if setter is None or not dataclasses.is_dataclass(getattr(module, "ServerArgs", None)):
        return "not installed: no set_global_server_args_for_scheduler, or ServerArgs is no dataclass"
    args = object.__new__(module.ServerArgs)
    for field in dataclasses.fields(module.ServerArgs):
        if field.default is not dataclasses.MISSING:
            object.__setattr__(args, field.name, field.default)
        elif field.default_factory is not dataclasses.MISSING:
            object.__setattr__(args, field.name, field.default_factory())
    try:
        setter(args)
    except Exception as error:  # 0.5.17 on validates what is published; its loops do not need one
        return f"not installed: {_describe(error)}"
    return "defaults of ServerArgs installed"


# ---------------------------------------------------------------------------------------------
# One case: the release's rule, then its loop.


def _run_case(case: dict, families: dict) -> dict:
    family, n, ids = case["family"], case["num_layers"], case.get("ids")
    first_k = case.get("first_k_dense_replace")
    out = {"family": family, "num_layers": n, "ids": ids, "first_k_dense_replace": first_k}
    classes = _classes(family)
    if isinstance(classes, str):  # the release lacks the file, the class or the method
        out["skipped"] = classes
        families.setdefault(family, {"skipped": classes})
        return out
    causal_cls, model_cls, layer_cls = classes
    facts = families.setdefault(family, _family_facts(causal_cls, model_cls, layer_cls))
    if str(n) not in facts["capturable"]:
        facts["capturable"][str(n)] = _capturable(family, classes, n)

    causal, inner = _stand_in(family, causal_cls, model_cls, layer_cls, n, first_k)
    try:
        # A list copy: the method must not see (or keep) the job's own list.
        causal.set_eagle3_layers_to_capture(None if ids is None else list(ids))
    except Exception as error:  # the method itself refusing the ids is an answer too
        out["set_error"] = _describe(error)
        return out
    out["layers_to_capture"] = _plain(inner.layers_to_capture)
    out["capture_aux_hidden_states"] = _capture_flag(family, causal)

    out["capture_loop"] = _forward(inner, n, can_run_tbo=False)
    if first_k is not None and hasattr(inner, "first_k_dense_replace"):
        out["capture_loop_tbo"] = _forward(inner, n, can_run_tbo=True)
    return out


def _classes(family: str):
    """The family's three classes in this release, or a sentence saying which one it lacks."""
    if family not in FAMILIES:
        return f"family {family!r} is not known to this probe (known: {', '.join(FAMILIES)})"
    found = []
    for module, name in FAMILIES[family]:
        cls = _class(module, name)
        if isinstance(cls, str):
            return cls
        found.append(cls)
    if not hasattr(found[0], "set_eagle3_layers_to_capture"):
        return f"{found[0].__name__} of this release has no set_eagle3_layers_to_capture"
    return tuple(found)


def _class(module: str, name: str):
    try:
        mod = importlib.import_module(f"sglang.srt.models.{module}")
    except ModuleNotFoundError as error:
        if error.name == f"sglang.srt.models.{module}":
            return f"this release has no sglang/srt/models/{module}.py"
        raise
    return getattr(mod, name, None) or f"sglang/srt/models/{module}.py of this release has no class {name}"


def _family_facts(causal_cls, model_cls, layer_cls) -> dict:
    method = causal_cls.set_eagle3_layers_to_capture
    return {
        "method": f"{method.__module__}.{method.__qualname__}",  # shows inheritance (e.g. from DeepseekV2)
        "forward": f"{model_cls.forward.__module__}.{model_cls.forward.__qualname__}",
        "layer_signature": list(_layer_parameters(layer_cls)),
        "capturable": {},
    }


def _capturable(family, classes, n) -> dict:
    """The loop's reach, found by running it: layers_to_capture = [b] alone for the edge boundaries
    (0 = embedding output, n = last layer's output), bypassing the ids rule. One entry per boundary:
    what came back, or the error the forward raised."""
    reach = {}
    for boundary in (0, 1, n - 1, n):
        causal, inner = _stand_in(family, *classes, n, None)
        inner.layers_to_capture = [boundary]
        loop = _forward(inner, n, can_run_tbo=False)
        reach[str(boundary)] = loop.get("captured", loop.get("error"))
    return reach


def _capture_flag(family, causal):
    target = causal.language_model if family == "kimi_k25" else causal
    return getattr(target, "capture_aux_hidden_states", None)


# ---------------------------------------------------------------------------------------------
# Stand-ins: the release's classes without their __init__, holding only what is read.


def _bare(cls):
    import torch.nn as nn

    obj = cls.__new__(cls)
    nn.Module.__init__(obj)  # only so attribute assignment works; none of the class's own init runs
    return obj


def _stand_in(family, causal_cls, model_cls, layer_cls, n, first_k):
    config = SimpleNamespace(num_hidden_layers=n, first_k_dense_replace=first_k if first_k is not None else 0)
    ranks = SimpleNamespace(is_first_rank=True, is_last_rank=True)  # a single pipeline stage owns every layer

    inner = _bare(model_cls)
    inner.config = config
    inner.pp_group = ranks
    inner.start_layer, inner.end_layer = 0, n
    inner.layers_to_capture = []  # the value every release's __init__ starts with
    inner.embed_tokens = _embed
    inner.norm = _final_norm
    inner.rotary_emb = inner.rotary_emb_local = _no_rotary  # Gemma 3 computes both in its loop, for the layers
    inner.layers = [_RecordingLayer(i, layer_cls) for i in range(n)]
    if "first_k_dense_replace" in inspect.getsource(model_cls.forward):  # the loops that split off TBO
        _deepseek_model_attributes(inner, config)

    if family == "kimi_k25":
        language_model = _bare(_class(*KIMI_LANGUAGE_MODEL))
        language_model.config, language_model.pp_group, language_model.model = config, ranks, inner
        causal = _bare(causal_cls)
        causal.language_model = language_model
    else:
        causal = _bare(causal_cls)
        causal.config, causal.pp_group, causal.model = config, ranks, inner
    return causal, inner


def _deepseek_model_attributes(inner, config):
    # What DeepseekV2Model.__init__ would have set and its forward reads; all "feature off" values,
    # so the loop takes its plain path (no context parallelism, no DSA index sharing, no A2A gather,
    # no Llama-4 scaling). first_k_dense_replace decides where TBO takes over.
    inner.first_k_dense_replace = config.first_k_dense_replace
    inner.dsa_enable_prefill_cp = False
    inner.mla_enable_prefill_cp = False
    inner.llama_4_scaling_config = None
    inner.enable_a2a_moe = False
    inner.use_dsa = False
    inner.next_full_attention_layer_id = {}


def _embed(input_ids):
    import torch

    return torch.full((input_ids.shape[0], 1), EMBEDDING_VALUE)


def _no_rotary(hidden_states, positions):
    return None  # the recording layers apply no attention


def _final_norm(hidden_states, residual=None, *args, **kwargs):
    # RMSNorm's fused-add call returns (normed, new residual); the sum stands in for both.
    if residual is None:
        return hidden_states
    total = hidden_states + residual
    return total, total


def _layer_parameters(layer_cls):
    params = inspect.signature(layer_cls.forward).parameters
    return {name: p for name, p in params.items() if name != "self"}


class _RecordingLayer:
    """Stands for decoder layer `index`: binds the call to the real layer's signature, records what it
    was handed, and returns what the real layer's signature says it returns."""

    def __init__(self, index, layer_cls):
        self.index = index
        self.parameters = _layer_parameters(layer_cls)
        self.signature = inspect.Signature(list(self.parameters.values()))
        # A layer annotated as returning a tuple returns one even for a single value (Gemma 3's `(hidden_states,)`).
        self.returns_tuple = str(inspect.signature(layer_cls.forward).return_annotation).lower().startswith("tuple")
        self.calls = []
        # Read by the TBO hand-off (`input_data_scatter_mode=layers[k - 1].layer_scatter_modes...`).
        self.layer_scatter_modes = SimpleNamespace(layer_output_mode=None)

    def __call__(self, *args, **kwargs):
        import torch

        bound = self.signature.bind(*args, **kwargs).arguments
        hidden, residual = bound["hidden_states"], bound.get("residual")
        entering = float(hidden.sum()) + (float(residual.sum()) if residual is not None else 0.0)
        sink_name = next((s for s in CAPTURE_SINKS if bound.get(s) is not None), None)
        self.calls.append({"input": entering, "sink": sink_name})
        if sink_name is not None:
            # In these releases the layer's LayerCommunicator / attention boundary captures its input
            # (the residual after the fused add, i.e. hidden + residual); do what that code does.
            sink = bound[sink_name]
            value = torch.full_like(hidden, entering)
            sink.append(value) if hasattr(sink, "append") else sink(value)

        outputs = []
        if "residual" in self.parameters:
            outputs += [torch.full_like(hidden, LAYER_HIDDEN), torch.full_like(hidden, entering + 1 - LAYER_HIDDEN)]
        else:  # one complete value out (0.5.23's residual stream; Gemma 3's layers before 0.5.13)
            outputs.append(torch.full_like(hidden, entering + 1))
        if "prev_topk_indices" in self.parameters:
            outputs.append(None)  # DSA top-k indices; none without DSA
        return outputs[0] if len(outputs) == 1 and not self.returns_tuple else tuple(outputs)


# ---------------------------------------------------------------------------------------------
# Running the release's forward loop on the stand-in.


class _ForwardMode:
    def __getattr__(self, name):
        # Every `forward_mode.is_*()` question: a plain extend batch is none of the special modes
        # except "extend" itself; decode-only, idle, target-verify etc. answer False.
        if name.startswith("is_"):
            return lambda *a, **k: name == "is_extend"
        raise AttributeError(name)


def _forward_batch(can_run_tbo):
    # attn_cp_metadata: read by the context-parallel checks of the DeepSeek forwards (None: no CP).
    return SimpleNamespace(can_run_tbo=can_run_tbo, forward_mode=_ForwardMode(), attn_cp_metadata=None)


def _forward(inner, n, can_run_tbo):
    import torch

    for layer in inner.layers:
        layer.calls.clear()
    handed_off = []
    replaced = []
    result = {}
    try:
        with _patched(inner, handed_off, replaced):
            output = type(inner).forward(inner, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                                         _forward_batch(can_run_tbo))
        result["captured"] = _decode(output)
    except Exception as error:  # the release's own failure (a crash at layer 0, a count check) is the answer
        result["error"] = _describe(error)
    result["visited"] = _ranges([layer.index for layer in inner.layers if layer.calls])
    sinks = sorted({c["sink"] for layer in inner.layers for c in layer.calls if c["sink"]})
    result["sink_layers"] = [layer.index for layer in inner.layers if any(c["sink"] for c in layer.calls)]
    result["capture_site"] = (f"layer i captures its own input: the loop passes {'/'.join(sinks)} when i in "
                              "layers_to_capture" if sinks else "the forward appends the state its loop holds itself")
    if all(isinstance(b, int) for b in result.get("captured", [])):
        # Whole numbers are sums hidden + residual at a boundary; one part alone would not be whole.
        result["records"] = "hidden_states + residual (boundary b = input of layer b = output of layer b-1)"
    if handed_off:
        result["handed_to_tbo"] = handed_off
    if replaced:
        result["replaced"] = replaced
    return result


def _decode(output):
    """Boundaries (see module doc) in the order the forward returned them; non-integers kept as they are."""
    if not isinstance(output, tuple):
        return []  # the release returns the bare hidden state when nothing was captured
    aux = output[1]
    values = aux.flatten().tolist() if hasattr(aux, "flatten") else [float(t.sum()) for t in aux]
    return [int(v) if float(v).is_integer() else v for v in values]


@contextmanager
def _patched(inner, handed_off, replaced):
    """Swap in recorders for what cannot run on stand-ins, in the forward's own module namespace."""
    namespace = type(inner).forward.__globals__
    saved = {}

    def hand_off(name):
        def executor(layers, enable_tbo=None, **kwargs):
            # Record which layers TBO takes and whether anything could carry a capture to them.
            indices = [layer.index for layer in layers]
            handed_off.append({"executor": name, "layers": _ranges(indices),
                               "capture_argument": sorted(k for k in kwargs if "captur" in k or "aux" in k)})
            end = indices[-1] + 1 if indices else 0
            hidden = kwargs["hidden_states"]
            if "residual" in kwargs:
                return hidden.new_full(hidden.shape, LAYER_HIDDEN), hidden.new_full(hidden.shape, end - LAYER_HIDDEN)
            return hidden.new_full(hidden.shape, float(end))
        return executor

    for name in TBO_EXECUTORS:
        if name in namespace:
            saved[name] = namespace[name]
            namespace[name] = hand_off(name)
            replaced.append(f"{name} (TBO executor) -> recorder")
    for name in CONTEXT_PARALLEL_CHECKS:  # read from the parallel config a launched server publishes; none here
        if name in namespace:
            saved[name] = namespace[name]
            namespace[name] = lambda *args, **kwargs: False
            replaced.append(f"{name} -> False (no context parallelism)")
    if "residual_batch" in namespace:
        saved["residual_batch"] = namespace["residual_batch"]
        namespace["residual_batch"] = _ResidualStreamStandIn
        replaced.append("residual_batch (forward_batch.residual_stream helpers) -> pass-through")
    try:
        yield
    finally:
        namespace.update(saved)


class _ResidualStreamStandIn:
    """0.5.21-0.5.23's `layer_boundary.residual.batch` for layers that return complete values: nothing is owed,
    so completing is the identity and the final norm's capture gets the stream's sum (what its docstring
    says it captures: "the same updated residual")."""

    @staticmethod
    def start(forward_batch):
        pass

    @staticmethod
    def complete_output(hidden_states, forward_batch):
        return hidden_states

    @staticmethod
    def final_norm(hidden_states, forward_batch, layernorm, capture=None, **kwargs):
        if capture is not None:
            capture(hidden_states.clone())
        return hidden_states

    @staticmethod
    def norm(hidden_states, forward_batch, layernorm, capture_output=None, **kwargs):
        """0.5.21's name for final_norm; its capture is `capture_output`."""
        if capture_output is not None:
            capture_output(hidden_states.clone())
        return hidden_states

    @staticmethod
    def snapshot(hidden_states, forward_batch):
        return hidden_states.clone()


# ---------------------------------------------------------------------------------------------
# Facts that do not depend on the case.


def _tbo_facts() -> dict:
    facts = {}
    try:
        tbo = importlib.import_module("sglang.srt.batch_overlap.two_batch_overlap")
    except ModuleNotFoundError as error:
        return {"error": _describe(error)}
    for name in TBO_EXECUTORS:
        if hasattr(tbo, name):
            # No parameter of the executor can carry a capture list into the layers it runs.
            facts[name] = list(inspect.signature(getattr(tbo, name)).parameters)
    return facts


def _eagle3_mla_draft() -> dict:
    """Does the release ship the EAGLE-3 draft with DeepSeek MLA attention, and what does it read?"""
    try:
        module = importlib.import_module("sglang.srt.models.kimi_k25_eagle3")
    except ModuleNotFoundError as error:
        if error.name and error.name.startswith("sglang.srt.models"):
            return {"shipped": False}
        return {"shipped": "unknown", "error": _describe(error)}
    except Exception as error:
        return {"shipped": "unknown", "error": _describe(error)}
    facts = {"shipped": True, "module": module.__name__,
             "entry_classes": [cls.__name__ for cls in getattr(module, "EntryClass", [])]}
    count = getattr(module, "_get_eagle_aux_layer_count", None)
    if count is not None:
        # How many aux states its fc expects, as its own helper counts them.
        probes = {
            "nested eagle_config ids [1,29,57]": SimpleNamespace(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}),
            "top-level ids [1,29,57,60]": SimpleNamespace(eagle_config=None, eagle_aux_hidden_state_layer_ids=[1, 29, 57, 60]),
            "no ids": SimpleNamespace(eagle_config=None),
        }
        facts["aux_layer_count"] = {label: _call(count, cfg) for label, cfg in probes.items()}
    source = inspect.getsource(module)
    facts["config_keys_read"] = sorted(set(re.findall(r"\bconfig\.([a-z_][a-z0-9_]*)", source))
                                       | set(re.findall(r"getattr\(\s*config,\s*\"([a-z0-9_]+)\"", source)))
    facts["checkpoint_renames"] = sorted(set(re.findall(r"re\.sub\(\s*r\"([^\"]+)\",\s*\"([^\"]+)\"", source)))
    try:
        model_config = inspect.getsource(importlib.import_module("sglang.srt.configs.model_config"))
        facts["model_config_treats_as_mla"] = "Eagle3DeepseekV2ForCausalLM" in model_config
    except Exception as error:
        facts["model_config"] = _describe(error)
    return facts


# ---------------------------------------------------------------------------------------------


def _call(fn, *args):
    try:
        return fn(*args)
    except Exception as error:
        return {"error": _describe(error)}


def _plain(value):
    return [int(v) for v in value] if value is not None else None


def _ranges(indices):
    """[0, 1, 2, 5] -> "0-2,5": 61-entry lists would bury the answer."""
    spans, start = [], None
    for i, index in enumerate(indices):
        if start is None:
            start = index
        if i + 1 == len(indices) or indices[i + 1] != index + 1:
            spans.append(f"{start}-{index}" if index != start else f"{index}")
            start = None
    return ",".join(spans)


def _describe(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    where = next((f"{f.filename.split('site/')[-1]}:{f.lineno}" for f in reversed(frames) if "/sglang/" in f.filename), "")
    return f"{type(error).__name__}: {error}" + (f" (at {where})" if where else "")
