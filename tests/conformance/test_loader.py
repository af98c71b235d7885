"""Our exports, and one fixture per loader fault derived from them, through each release's own draft
loader (inside/loader.py), compared with `validate`, the loader table and `draft_as_served`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafts import write_draft
from eagle3.errors import Eagle3Error
import eagle3.algorithms.eagle3.contract as loader
from eagle3.algorithms.eagle3.checkpoint import read_checkpoint
from eagle3.algorithms.eagle3.validate import validate
from eagle3.algorithms.eagle3.served import draft_as_served
from releases import RELEASES

HIDDEN, NUM_AUX, VOCAB = 32, 3, 256
VOCAB_TENSORS = {"d2t", "t2d"}  # d2t becomes hot_token_id and t2d is ignored: no parameter for either
SWITCHED = "export-with-served-switches"
LOADER_ERRORS = {"skipped-tensor", "missing-tensor", "flag-misplaced", "draft-vocab-size", "unsupported-flag",
                 "duplicate-tensor", "shape-mismatch", "aux-count"}


def _rename(tensors, old, new):
    for name in [n for n in tensors if n.startswith(old)]:
        tensors[new + name.removeprefix(old)] = tensors.pop(name)


def _norms(count, size, names):
    return {name: torch.rand(size).to(torch.bfloat16) + 0.5 for name in names[:count]}


# fixture name -> (config change, tensor change). Faults first, then controls that must load.
FIXTURES = {
    "export": (None, None),
    "model-lm-head": (None, lambda t: _rename(t, "lm_head.", "model.lm_head.")),
    "fc-norm-nested": (lambda c: c["eagle_config"].update(fc_norm=True),
                       lambda t: t.update(_norms(3, HIDDEN, [f"fc_norm.{j}.weight" for j in range(3)]))),
    "norm-output-nested": (lambda c: c["eagle_config"].update(norm_output=True), None),
    "norm-before-fc-overridden": (lambda c: (c.update(norm_before_fc=True), c["eagle_config"].update(norm_before_fc=False)),
                                  lambda t: t.update(_norms(1, NUM_AUX * HIDDEN, ["input_norm.weight"]))),
    "layers-0": (None, lambda t: _rename(t, "midlayer.", "layers.0.")),
    "no-draft-vocab-size": (lambda c: c.pop("draft_vocab_size"), None),
    "null-draft-vocab-size": (lambda c: c.update(draft_vocab_size=None), None),
    "model-prefix": (None, lambda t: (_rename(t, "fc.", "model.fc."), _rename(t, "midlayer.", "model.midlayer."))),
    "fc-norm-top": (lambda c: c.update(fc_norm=True),
                    lambda t: t.update(_norms(3, HIDDEN, [f"fc_norm.{j}.weight" for j in range(3)]))),
    "aux-norm-legacy": (lambda c: c.update(use_aux_norm=True),
                        lambda t: t.update(_norms(3, HIDDEN, ["aux_norm_low.weight", "aux_norm_mid.weight",
                                                              "aux_norm_high.weight"]))),
    "norm-before-fc-top": (lambda c: c.update(norm_before_fc=True),
                           lambda t: t.update(_norms(1, NUM_AUX * HIDDEN, ["input_norm.weight"]))),
}


def derive(export: Path, into: Path, change_config, change_tensors) -> Path:
    shutil.copytree(export, into)
    if change_config:
        config = json.loads((into / "config.json").read_text())
        change_config(config)
        (into / "config.json").write_text(json.dumps(config))
    if change_tensors:
        tensors = load_file(into / "model.safetensors")
        change_tensors(tensors)
        save_file(tensors, into / "model.safetensors")
    return into


@pytest.fixture(scope="module", params=RELEASES)
def loaded(request, tmp_path_factory, run_sglang):
    """(release, {fixture: path}, SGLang's answer per fixture)."""
    release = request.param
    root = tmp_path_factory.mktemp(f"loader-{release}")
    export = write_draft(root / "sglang-export", layout="sglang", release=release)
    paths = {name: derive(export, root / name, *changes) for name, changes in FIXTURES.items()}
    # our export of a draft with every EAGLE 3.1 norm the release serves (none before 0.5.12)
    paths[SWITCHED] = write_draft(root / SWITCHED, layout="sglang", release=release,
                                  **{flag: True for flag in loader.loader_rule(release)[0].flags})
    answer = run_sglang(release, "loader", {"drafts": {name: str(path) for name, path in paths.items()}})
    return release, paths, answer["drafts"]


def built_switches(result: dict) -> set[str]:
    facts = result["facts"]
    built = {"fc_norm": facts["has_fc_norm"], "norm_before_fc": facts["has_input_norm"],
             "norm_output": bool(facts["norm_output"])}
    return {flag for flag, on in built.items() if on}


def declared_switches(config: dict) -> set[str]:
    """Every switch the config turns on anywhere, top level or eagle_config."""
    places = (config, config.get("eagle_config") or {})
    return {flag for flag, keys in loader.FLAG_CONFIG_KEYS.items() if any(p.get(k) for p in places for k in keys)}


def sglang_serves_as_written(result: dict, config: dict) -> bool:
    """SGLang built the draft the config declares, wrote every parameter (the embedding comes from the
    target) and used every tensor of the checkpoint."""
    if "error" in result:
        return False
    unwritten = [p for p, state in result["written"].items() if not state["written"] and "embed_tokens" not in p]
    dropped = [name for name, landed in result["sources"].items() if not landed and name not in VOCAB_TENSORS]
    return not unwritten and not dropped and built_switches(result) == declared_switches(config)


@pytest.mark.parametrize(("fixture", "named"), [("no-draft-vocab-size", "AttributeError"),
                                                 ("null-draft-vocab-size", "fails an assertion")])
def test_where_sglang_fails_to_build_the_draft_validate_says_how(loaded, fixture, named):
    release, paths, results = loaded
    assert results[fixture]["error"]["type"] in ("AttributeError", "AssertionError")
    (problem,) = [p for p in validate(paths[fixture], release=release).of("error") if p.code == "draft-vocab-size"]
    assert named in problem.message and results[fixture]["error"]["type"].removesuffix("Error").lower() in (
        problem.message.lower())


@pytest.mark.parametrize("fixture", [name for name in FIXTURES if "draft-vocab-size" not in name])
def test_the_loader_table_says_which_tensors_load(loaded, fixture):
    release, paths, results = loaded
    result = results[fixture]
    assert "error" not in result, f"SGLang {release} fails on {fixture}: {result['error']}"
    config = json.loads((paths[fixture] / "config.json").read_text())
    rule, _ = loader.loader_rule(release)
    for name, landed in result["sources"].items():
        if name in VOCAB_TENSORS:
            continue
        ours = loader.loaded_name(name, rule, loader.enabled_flags(config))
        assert (ours is not None) == bool(landed), (
            f"SGLang {release} {'loads' if landed else 'drops'} {name} of {fixture}; our table says "
            f"{'it loads as ' + ours if ours else 'it is dropped'}")


def test_our_export_with_every_switch_the_release_serves_loads_whole(loaded):
    release, paths, results = loaded
    config = json.loads((paths[SWITCHED] / "config.json").read_text())
    assert declared_switches(config) == loader.loader_rule(release)[0].flags
    assert sglang_serves_as_written(results[SWITCHED], config), results[SWITCHED].get("error")
    assert not validate(paths[SWITCHED], release=release).of("error")


@pytest.mark.parametrize("fixture", [*FIXTURES, SWITCHED])
def test_validate_passes_exactly_what_sglang_loads_whole(loaded, fixture):
    release, paths, results = loaded
    report = validate(paths[fixture], release=release)
    loader_errors = [p for p in report.of("error") if p.code in LOADER_ERRORS]
    config = json.loads((paths[fixture] / "config.json").read_text())
    assert (not loader_errors) == sglang_serves_as_written(results[fixture], config), (
        f"SGLang {release} on {fixture}: {results[fixture].get('error') or 'loaded'}; validate: {loader_errors}")


@pytest.mark.parametrize("fixture", [*FIXTURES, SWITCHED])
def test_the_served_draft_is_the_one_sglang_builds(loaded, fixture):
    """draft_as_served (the simulator's and reference server's draft) holds exactly the tensors SGLang
    loaded, the switches it built and the same hot token ids; where SGLang fails, it refuses."""
    release, paths, results = loaded
    result = results[fixture]
    embed = torch.randn(VOCAB, HIDDEN)
    if "error" in result:
        with pytest.raises(Eagle3Error):
            draft_as_served(paths[fixture], release, embed)
        return
    served = draft_as_served(paths[fixture], release, embed)
    state = served.state_dict()
    assert set(served.config.flags()) == built_switches(result)
    assert served.hot_token_ids().tolist() == result["hot_token_id"]
    checkpoint = read_checkpoint(paths[fixture])
    for name, landed in result["sources"].items():
        if name in VOCAB_TENSORS:
            continue
        tensor = checkpoint.tensors[name].float()
        same = [key for key, value in state.items() if value.shape == tensor.shape and torch.equal(value, tensor)]
        assert bool(same) == bool(landed), f"SGLang {release} {'loads' if landed else 'drops'} {name}; ours: {same}"
