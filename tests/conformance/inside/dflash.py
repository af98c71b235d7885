"""Probe: what one SGLang release does with a DFlash draft's target layer ids.

Runs inside a child process that has one release on its path (see ../releases.py). It asks the release's OWN
`build_target_layer_ids` (speculative/dflash_utils.py: the ids a draft that names none reads) and, per family, its
OWN `set_dflash_layers_to_capture` on the family's model class, then runs the release's OWN capture loop to see which
state each id records. The stand-ins are aux_ids.py's (the release's classes made with `__new__`, recording layers):
only the method called differs from the EAGLE-3 probe.

With "dspark" in the job, each case is also captured as the release's model runner sets a DSPARK target's capture:
its OWN `attention_backend_setup.configure_aux_hidden_state_capture(..., is_dspark=True)` (a target's
set_dspark_layers_to_capture where it has one, else set_dflash_layers_to_capture, else a refusal) on a fresh stand-in,
then the same loop: the case's "dspark" answer. Releases without the dispatch (no DSPARK, to 0.5.13) answer "skipped".

job: {"defaults": [[num_layers, draft_layers], ...], "cases": [{"family", "num_layers", "ids"}], "dspark": optional}
answer: {"release", "defaults": [{"num_layers", "draft_layers", "ids" | "error"}], "cases": [...]}
"""

from __future__ import annotations

import importlib
import inspect

import aux_ids


def run(job: dict) -> dict:
    answer = {"release": aux_ids._release(), "server_args": aux_ids._install_default_server_args()}
    utils = importlib.import_module("sglang.srt.speculative.dflash_utils")
    answer["defaults"] = [{"num_layers": n, "draft_layers": d, "ids": aux_ids._call(utils.build_target_layer_ids, n, d)}
                          for n, d in job["defaults"]]
    answer["cases"] = [_run_case(case) for case in job["cases"]]
    if job.get("dspark"):
        for case, out in zip(job["cases"], answer["cases"]):
            out["dspark"] = _dspark_case(case)
    return answer


def _run_case(case: dict) -> dict:
    family, n, ids = case["family"], case["num_layers"], case["ids"]
    out = {"family": family, "num_layers": n, "ids": ids}
    classes = aux_ids._classes(family)
    if isinstance(classes, str):
        out["skipped"] = classes
        return out
    if not hasattr(classes[0], "set_dflash_layers_to_capture"):
        out["skipped"] = f"{classes[0].__name__} of this release has no set_dflash_layers_to_capture"
        return out
    causal, inner = aux_ids._stand_in(family, *classes, n, case.get("first_k_dense_replace"))
    try:
        causal.set_dflash_layers_to_capture(list(ids))
    except Exception as error:  # the method itself refusing the ids is an answer too
        out["set_error"] = aux_ids._describe(error)
        return out
    out["layers_to_capture"] = aux_ids._plain(inner.layers_to_capture)
    out["capture_loop"] = aux_ids._forward(inner, n, can_run_tbo=False)
    return out


def _dspark_case(case: dict) -> dict:
    """The case's capture for a DSPARK draft, through the dispatch the release's model runner calls."""
    try:
        setup = importlib.import_module("sglang.srt.model_executor.model_runner_components.attention_backend_setup")
    except ModuleNotFoundError:
        setup = None
    configure = getattr(setup, "configure_aux_hidden_state_capture", None)
    if configure is None or "is_dspark" not in inspect.signature(configure).parameters:
        return {"skipped": "this release's model runner has no DSPARK capture dispatch"}
    family, n, ids = case["family"], case["num_layers"], case["ids"]
    classes = aux_ids._classes(family)
    if isinstance(classes, str):
        return {"skipped": classes}
    out = {"has_set_dspark_layers_to_capture": hasattr(classes[0], "set_dspark_layers_to_capture")}
    causal, inner = aux_ids._stand_in(family, *classes, n, case.get("first_k_dense_replace"))
    try:
        configure(model=causal, eagle_use_aux_hidden_state=False, eagle_aux_hidden_state_layer_ids=None,
                  dflash_use_aux_hidden_state=True, dflash_target_layer_ids=list(ids), is_dspark=True)
    except Exception as error:  # the dispatch refusing the target is an answer too
        out["set_error"] = aux_ids._describe(error)
        return out
    out["layers_to_capture"] = aux_ids._plain(inner.layers_to_capture)
    out["capture_loop"] = aux_ids._forward(inner, n, can_run_tbo=False)
    return out
