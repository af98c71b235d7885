"""Our DFlash export through each release's own loader (inside/loader.py): the release builds DFlashDraftModel from
our config.json and every parameter is written whole from our tensors (q/k/v and gate/up into its fused ones); for
each fault, what the loader does and what our validation says agree.

The probe's ServerArgs name EAGLE3, not DFLASH: from 0.5.13 the CPU platform refuses DFLASH in ServerArgs' own
checks, before anything is loaded. The loader builds the class config.json's `architectures` names either way
(asserted below), and DFlashDraftModel reads no speculative flag while loading."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.algorithms.dflash import DFLASH
from eagle3.algorithms.dflash.layout import validate_sglang, write_sglang
from eagle3.algorithms.dflash.contract import FIXED_ROPE_THETA, dflash_rope_problem
from eagle3.records.manifest import write_manifest
from releases import RELEASES

sys.path.insert(0, str(Path(__file__).parent.parent))
from test_dflash import tiny_dflash  # noqa: E402

FAULTS = ("missing-tensor", "skipped-tensor")


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """The good export of a 2-layer tiny draft, and one copy per fault; with the data manifest they were made for."""
    root = tmp_path_factory.mktemp("dflash-exports")
    model = tiny_dflash(layers=2)
    native = root / "native"
    native.mkdir()
    DFLASH.write_draft(model.config, model.export_state(), native, {})
    paths = {"good": write_sglang(native, root / "good")}
    fixed = tiny_dflash(layers=2, rope_theta=FIXED_ROPE_THETA)  # what 0.5.11-0.5.12 rotate every DFlash draft with
    (root / "native-fixed").mkdir()
    DFLASH.write_draft(fixed.config, fixed.export_state(), root / "native-fixed", {})
    paths["fixed-rope"] = write_sglang(root / "native-fixed", root / "fixed-rope")
    for fault in FAULTS:
        path = write_sglang(native, root / fault)
        tensors = load_file(path / "model.safetensors")
        if fault == "missing-tensor":
            del tensors["layers.1.self_attn.k_norm.weight"]
        else:
            tensors["layers.0.self_attn.gate.weight"] = torch.zeros(4, 4)
        save_file(tensors, path / "model.safetensors")
        paths[fault] = path
    data = root / "data"
    data.mkdir()
    (data / "samples.json").write_text("[]")
    write_manifest(data, kind="dataset", fields={"capture": {"aux_layers": model.config.aux_layers},
                                                 "target": {"family": "llama"}})
    return {"good": model, "fixed-rope": fixed}, paths, data


@pytest.fixture(scope="module", params=RELEASES)
def loaded(request, run_sglang, exports):
    _, paths, _ = exports
    job = {"drafts": {name: str(path) for name, path in paths.items()}, "algorithm": "EAGLE3"}
    return request.param, run_sglang(request.param, "loader", job)


def test_every_parameter_of_the_release_is_written_whole_from_our_export(loaded, exports):
    release, answer = loaded
    good = answer["drafts"]["good"]
    assert "error" not in good, f"SGLang {release}: {good.get('error')}"
    unwritten = [name for name, state in good["written"].items() if not state["written"] or state["partial"]]
    assert unwritten == [] and good["written"], f"SGLang {release} leaves {unwritten} unwritten"
    assert good["facts"]["class"] == "DFlashDraftModel"
    assert {"layers.0.self_attn.qkv_proj.weight", "layers.0.mlp.gate_up_proj.weight", "fc.weight",
            "hidden_norm.weight", "norm.weight"} <= set(good["written"])
    assert sorted(good["yielded"]) == sorted(load_file(exports[1]["good"] / "model.safetensors"))


@pytest.mark.parametrize("fault", FAULTS)
def test_what_the_loader_does_with_a_fault_our_validation_says(loaded, exports, fault):
    release, answer = loaded
    _, paths, data = exports
    result = answer["drafts"][fault]
    report = validate_sglang(paths[fault], release, data / "manifest.json", context_length=128)
    codes = {problem.code for problem in report.errors()}
    rope = {"unsupported-flag"} if dflash_rope_problem(release, 10000.0) else set()  # the base, not the fault
    assert codes == {fault} | rope, report.to_dict()
    if fault == "missing-tensor":
        assert not result["written"]["layers.1.self_attn.k_norm.weight"]["written"], f"SGLang {release}"
    else:  # loaded, whole, but the extra tensor landed nowhere
        assert all(state["written"] for state in result["written"].values()), f"SGLang {release}"
        assert result["sources"]["layers.0.self_attn.gate.weight"] == [], f"SGLang {release}"


def test_the_good_export_validates_clean(exports):
    _, paths, data = exports
    assert validate_sglang(paths["good"], "0.5.13", data / "manifest.json", context_length=128).errors() == []


@pytest.mark.parametrize("release", RELEASES)
def test_the_release_computes_our_blocks_from_our_export(run_sglang, exports, release):
    """One block through SGLang's loaded modules (inside/dflash_forward.py) equals ours: the same fused weights, norms
    in the same places (the context's keys straight from hidden_norm(fc(...))), the same RoPE. Where the release
    rotates every DFlash draft with 1,000,000 (eagle3.algorithms.dflash.contract), a draft trained with 10,000 computes otherwise
    there and validation refuses it for that release; one trained with 1,000,000 computes ours."""
    models, paths, data = exports
    torch.manual_seed(0)
    aux, ids = torch.randn(12, 96), torch.randint(0, 39, (12,))
    fixed_rope = dflash_rope_problem(release, 10000.0) is not None
    for name, model in models.items():
        job = {"drafts": {name: str(paths[name])}, "anchor": 7, "block_size": model.config.block_size,
               "mask_token_id": model.config.mask_token_id,
               "inputs": {"aux": aux.tolist(), "ids": ids.tolist(), "embed": model.embed_tokens.weight.tolist()}}
        answer = run_sglang(release, "dflash_forward", job)["drafts"][name]
        assert "hidden" in answer, f"SGLang {release}: {answer['load'].get('error')}"
        with torch.no_grad():
            ours = model.blocks(model.context(aux[None]), ids[7].view(1, 1), torch.tensor([[7]]))[0, 0]
        served = torch.tensor(answer["hidden"])
        refused = bool(validate_sglang(paths[name], release, data / "manifest.json", 128).errors())
        if fixed_rope and name == "good":
            assert not torch.allclose(served, ours, rtol=1e-4, atol=1e-4) and refused, f"SGLang {release}"
            continue
        assert not refused
        torch.testing.assert_close(served, ours, rtol=1e-4, atol=1e-4, msg=lambda m: f"SGLang {release}: {m}")
