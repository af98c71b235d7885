"""Probe: load EAGLE-3 drafts through one SGLang release's own loader, on the CPU.

job = {"drafts": {label: directory holding config.json + model.safetensors}}. For each draft the
release's own ServerArgs, draft ModelConfig (is_draft_model=True), LoadConfig and model loader run as
a speculative-decoding server's draft worker would run them, with the draft alone (no target).

The only thing added to SGLang's path is a sentinel: between the loader constructing the model and
the loader feeding it the checkpoint, every parameter and buffer is filled with NaN, so afterwards a
parameter still holding NaN is one that `load_weights` never wrote. The seam is
`loader.load_weights_and_postprocess(model, weights, device)`, which every release's
`DefaultModelLoader.load_model` calls right after `_initialize_model`; it is shadowed on the loader
*instance* only and calls the release's own function unchanged.

Answer, per label: {"written": {param: {"written", "shape", "partial"}}, "buffers": {...},
"sources": {checkpoint tensor: [{"param", "rows"?}]}, "hot_token_id", "lm_head_rows", "facts",
"yielded": names load_weights was given, "seconds"} or {"error": {"type", "message", "stage",
"where"}, "seconds"}. Top level: release, set-up steps taken, and timings.
"""

from __future__ import annotations

import inspect
import math
import socket
import time
import traceback

_T0 = time.perf_counter()

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

# Which SGLang calls the set-up made, in order: reported so a failure can be read against them.
SETUP_STEPS: list[str] = []


def run(job: dict) -> dict:
    import sglang

    import_seconds = time.perf_counter() - _T0
    # Every step below happens at most once per child; the drafts share the process groups.
    torch.set_default_dtype(torch.float32)
    drafts = {}
    parallel_error = None
    for label, path in job["drafts"].items():
        started = time.perf_counter()
        try:
            answer = _probe(str(path), parallel_ready=parallel_error is None)
        except _StageError as failure:
            answer = {"error": failure.describe()}
            if failure.stage == "parallel":
                parallel_error = answer["error"]
        if parallel_error is not None and "error" not in answer:
            answer = {"error": parallel_error}
        answer["seconds"] = round(time.perf_counter() - started, 3)
        drafts[label] = answer
    return {
        "release": getattr(sglang, "__version__", None),
        "setup": SETUP_STEPS,
        "import_seconds": round(import_seconds, 3),
        "drafts": drafts,
    }


class _StageError(Exception):
    """An exception SGLang raised, tagged with the set-up stage it came from."""

    def __init__(self, stage: str, error: BaseException):
        super().__init__(stage)
        self.stage = stage
        self.error = error

    def describe(self) -> dict:
        frames = traceback.extract_tb(self.error.__traceback__)
        # The innermost frame inside SGLang says which rule refused the draft.
        inside = [f for f in frames if "/sglang/" in f.filename]
        where = inside[-1] if inside else (frames[-1] if frames else None)
        return {
            "type": type(self.error).__name__,
            "message": str(self.error),
            "stage": self.stage,
            "where": f"{where.filename.split('/sglang/', 1)[-1]}:{where.lineno} {where.name}" if where else None,
        }


def _stage(name: str, call, *args, **kwargs):
    try:
        return call(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - the test compares whatever SGLang raises
        raise _StageError(name, error) from error


_PARALLEL_DONE = False


def _probe(path: str, parallel_ready: bool) -> dict:
    global _PARALLEL_DONE
    server_args = _stage("server_args", _server_args, path)
    _stage("publish", _publish, server_args)
    model_config = _stage("model_config", _draft_model_config, server_args, path)
    if not _PARALLEL_DONE:
        # Process groups are built once per process, as in a scheduler; a draft reuses its target's.
        _PARALLEL_DONE = True
        _stage("parallel", _init_parallel, server_args, model_config)
    return _stage("load", _load, server_args, model_config, path)


def _server_args(path: str):
    from sglang.srt.server_args import ServerArgs

    # The draft doubles as the target path: only the draft is built, and ServerArgs reads the
    # target's config.json for its speculative-decoding defaults.
    return ServerArgs(
        model_path=path,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=path,
        device="cpu",
        dtype="float32",
        tp_size=1,
    )


def _publish(server_args) -> None:
    import sglang.srt.runtime_context as _  # noqa: F401  (absent before 0.5.16: ImportError below)


def _publish_real(server_args) -> None:
    pass


def _draft_model_config(server_args, path: str):
    from sglang.srt.configs.model_config import ModelConfig

    kwargs = dict(model_path=path, model_revision=None, is_draft_model=True)
    model_config = ModelConfig.from_server_args(server_args, **kwargs)
    return model_config


def _init_parallel(server_args, model_config) -> None:
    pass


def _load(server_args, model_config, path: str) -> dict:
    return {}
