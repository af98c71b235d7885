"""`eagle3 registry import`: a draft trained elsewhere, validated for the config's target and release, converted to the
sglang layout and published with its provenance; each fault refused in one line naming it, nothing published.
(A draft SpecForge 0.2.0 itself wrote: tests/conformance/test_specforge.py; `--as-production`: test_production.py.)"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import write_target
from drafts import write_draft
from eagle3.cli import main
from eagle3.cli.common import EXIT_OK, EXIT_PROBLEMS, EXIT_UNREADABLE
from eagle3.resolve import load_config
from eagle3.deployment.imports import IMPORTS_DIR, import_draft
from eagle3.algorithms.eagle3.checkpoint import load_native
from eagle3.fsutil import sha256_file
from eagle3.registry.registry import open_registry
from helpers import TINY

LAYERS, DATA_LAYERS, RELEASE = 8, [1, 3, 5], "0.5.13"


@pytest.fixture
def setup(tmp_path):
    """An 8-layer llama target whose data are captured at layers [1, 3, 5], served by SGLang 0.5.13 (--set args)."""
    target = write_target(tmp_path / "target", layers=LAYERS)
    overrides = [f"run.dir={tmp_path / 'run'}", f"target.path={target}", f"target.num_hidden_layers={LAYERS}",
                 "target.hidden_size=32", "target.vocab_size=256", "vocab.draft_vocab_size=64",
                 f"data.aux_layers={DATA_LAYERS}", f"registry.path={tmp_path / 'registry'}",
                 "serving.context_length=512", f"serving.release={RELEASE}"]
    return tmp_path, [arg for override in overrides for arg in ("--set", override)]


def draft(path, layout="sglang", release=RELEASE, aux_layers=DATA_LAYERS, **overrides):
    return write_draft(path, layout=layout, release=release, aux_layers=aux_layers, target_num_hidden_layers=LAYERS,
                       **overrides)


def as_found_elsewhere(path):
    """Without what our exports add (the `eagle3` record of the layers trained on, manifest.json): a draft from
    another trainer says nothing of its data's layers."""
    config = json.loads((path / "config.json").read_text())
    config.pop("eagle3")
    (path / "config.json").write_text(json.dumps(config))
    (path / "manifest.json").unlink()
    return path


def registry_of(tmp_path):
    return open_registry(load_config(TINY, [f"registry.path={tmp_path / 'registry'}"]).registry, log=lambda line: None)


def run_import(capsys, source, args, *extra):
    code = main(["registry", "import", str(source), "--config", str(TINY), *args, *extra])
    out, err = capsys.readouterr()
    return code, out, [line for line in err.splitlines() if not line.startswith("import: ")]


def test_a_speculators_draft_is_converted_validated_and_published_with_its_provenance(setup, capsys):
    tmp_path, args = setup
    source = draft(tmp_path / "speculators", layout="speculators")
    code, out, errors = run_import(capsys, source, args)
    assert code == EXIT_OK and errors == [], errors
    registry = registry_of(tmp_path)
    (version,) = registry.versions()
    assert version.startswith("import-") and out.startswith(f"{source}: version {version} (speculators layout found;")
    manifest = registry.manifest(version)
    provenance = manifest["provenance"]
    assert provenance["layout_found"] == "speculators" and provenance["source"] == str(source)
    # every original file, by its own sha256
    assert provenance["files"] == {path.name: sha256_file(path) for path in source.iterdir()}
    steps = "\n".join(provenance["steps"])
    assert "renamed 10 tensor(s): layers.0." in steps and "dropped embed_tokens.weight" in steps
    assert "eagle_config.eagle_aux_hidden_state_layer_ids [1, 3, 5]" in steps  # llama on 0.5.13: our ids
    assert manifest["layouts"] == ["sglang"] and manifest["metrics"] is None and "benchmark" not in manifest
    assert manifest["validation"]["sglang"]["ok"] and manifest["config"]["serving"]["release"] == RELEASE
    # what is published is the same draft: the tensors, the layers it was trained on
    served = registry.fetch(version, "sglang", tmp_path / "fetched")
    ours, theirs = load_native(served), load_native(source)
    assert ours.config.aux_layers == DATA_LAYERS
    assert all(torch.equal(ours.tensors[name], tensor) for name, tensor in theirs.tensors.items())


def test_importing_the_same_files_twice_publishes_one_version(setup, capsys):
    tmp_path, args = setup
    source = as_found_elsewhere(draft(tmp_path / "sglang"))
    assert run_import(capsys, source, args)[0] == EXIT_OK
    code, out, _ = run_import(capsys, source, args)
    registry = registry_of(tmp_path)
    assert code == EXIT_OK and "already in the registry, nothing published" in out
    assert len(registry.versions()) == 1 and [e["event"] for e in registry.history()] == []
    # another release may need other aux ids: the same files converted for it are another version
    assert run_import(capsys, source, args, "--set", "serving.release=0.5.12")[0] == EXIT_OK
    assert len(registry.versions()) == 2


def layers_0_names(path):
    tensors = load_file(path / "model.safetensors")
    save_file({name.replace("midlayer.", "layers.0."): t for name, t in tensors.items()}, path / "model.safetensors")


def absolute_d2t(path):
    tensors = load_file(path / "model.safetensors")
    tensors["d2t"] = tensors["d2t"] + torch.arange(tensors["d2t"].numel())  # target ids instead of offsets
    save_file(tensors, path / "model.safetensors")


def ids_shifted_by_one(path):
    """The ids in vLLM's numbering (our id + 1) copied into SGLang's eagle_config."""
    config = json.loads((path / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [k + 1 for k in DATA_LAYERS]
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(("fault", "release", "code", "named"), [
    (layers_0_names, "0.5.11", "skipped-tensor", "SGLang 0.5.11 would skip 10 tensor(s) without a word: layers.0."),
    (absolute_d2t, RELEASE, "d2t-absolute", "d2t holds absolute target ids, but SGLang reads offsets"),
    (ids_shifted_by_one, RELEASE, "captured-layers-mismatch",
     "captures the outputs of layers [2, 4, 6] for ids [2, 4, 6], but the training data were captured at layers "
     "[1, 3, 5] (the layers the pipeline captures (data.aux_layers))"),
])
def test_the_three_faults_that_started_the_project_are_refused_in_one_line(setup, capsys, fault, release, code, named):
    tmp_path, args = setup
    source = as_found_elsewhere(draft(tmp_path / "draft", release=release))
    fault(source)
    exit_code, out, errors = run_import(capsys, source, args, "--set", f"serving.release={release}")
    assert exit_code == EXIT_PROBLEMS and out == ""
    assert len(errors) == 1 and errors[0].startswith(f"eagle3: {source}: not imported: {code}: "), errors
    assert named in errors[0]
    assert registry_of(tmp_path).versions() == []  # nothing published
    assert not list((tmp_path / "run" / IMPORTS_DIR).glob("*/*"))  # nor anything converted


def test_a_speculators_draft_with_norm_before_residual_is_refused_for_sglang(setup, capsys):
    tmp_path, args = setup
    source = draft(tmp_path / "speculators", layout="speculators", norm_before_residual=True)
    code, _, errors = run_import(capsys, source, args)
    assert code == EXIT_PROBLEMS and errors == [
        f"eagle3: {source}: not imported: unsupported-flag: config sets norm_before_residual, which SGLang {RELEASE} "
        "does not implement: it would serve a different network than the one trained (no SGLang release read "
        "implements it) (fix: retrain without it)"]
    assert registry_of(tmp_path).versions() == []


def test_a_native_draft_trained_on_other_layers_than_the_pipelines_is_refused(setup, capsys):
    """Production drafts are compared with, and retrained from, drafts on the layers the pipeline captures."""
    tmp_path, args = setup
    config = load_config(TINY, args[1::2])
    result = import_draft(config, str(draft(tmp_path / "native", layout="native")), log=lambda line: None)
    assert result["published"] and result["layout_found"] == "native"
    other = draft(tmp_path / "other-layers", layout="native", aux_layers=[0, 2, 4])
    code, _, errors = run_import(capsys, other, args)
    assert code == EXIT_PROBLEMS and len(errors) == 1 and len(registry_of(tmp_path).versions()) == 1
    assert errors[0].startswith(f"eagle3: {other}: not imported: captured-layers-mismatch: ")
    assert "[0, 2, 4]" in errors[0]


def test_a_source_that_is_no_directory_and_no_hub_id_is_named(setup, capsys):
    tmp_path, args = setup
    code, _, errors = run_import(capsys, tmp_path / "nowhere", args)
    assert code == EXIT_UNREADABLE and errors == [
        f"eagle3: {tmp_path / 'nowhere'}: no such directory (a draft to import is a directory, or a hub id owner/name, "
        "fetched on the node)"]


def test_an_unmeasured_import_is_promoted_only_by_force(setup, capsys):
    tmp_path, args = setup
    source = as_found_elsewhere(draft(tmp_path / "sglang"))
    assert run_import(capsys, source, args)[0] == EXIT_OK
    (version,) = registry_of(tmp_path).versions()
    # --as-production cannot give it figures now (versions are immutable): it says what to do, and moves nothing
    code, _, errors = run_import(capsys, source, args, "--as-production")
    assert code == EXIT_UNREADABLE and errors == [
        f"eagle3: version {version} (these files) was imported without --as-production and holds no figures; versions "
        f"are immutable: `eagle3 registry promote {version} --force` makes it production, and the next run measures "
        "it on that run's prompts"]
    assert registry_of(tmp_path).production_version() is None
    code = main(["registry", "promote", version, "--config", str(TINY), *args])
    out = capsys.readouterr().out
    assert code == EXIT_PROBLEMS and f"unmeasured: {version} holds no figures (imported without --as-production)" in out
    assert main(["registry", "promote", version, "--force", "--config", str(TINY), *args]) == EXIT_OK
    assert registry_of(tmp_path).production_version() == version
    assert run_import(capsys, source, args, "--as-production")[0] == EXIT_OK  # production already: nothing to move
