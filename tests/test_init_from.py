"""training.init_from: a registry version or a draft directory in any layout fine-tunes on this run's data, and
starts ahead of a cold start; what cannot carry over is refused by name."""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.algorithms.eagle3 import EAGLE3
from eagle3.algorithms.init_copy import resolved_init
from eagle3.resolve import load_config
from eagle3.deployment.promotion import retrain_overrides
from eagle3.errors import Eagle3Error
from eagle3.algorithms.eagle3.checkpoint import convert
from eagle3.algorithms.eagle3.layouts.shared import PROVENANCE_KEY
from eagle3.records.manifest import read_manifest
from eagle3.init_draft import init_draft, resolve_init_from
from eagle3.registry.registry import Registry
from eagle3.registry.store import LocalStore
from eagle3.model.weights import target_head
from eagle3.train.parts import read_vocab_map
from eagle3.train.trainer import Trainer
from eagle3.algorithms.eagle3.warm_start import carry_over_problem
from drafts import tiny_config
from helpers import TINY, metrics, run_copy

QUIET = lambda line: None  # noqa: E731
FIRST_EVAL = ["training.max_steps=2"]  # evaluated at its last step: the first evaluation, two small steps in


@pytest.fixture(scope="module")
def public_draft(micro_data, tmp_path_factory):
    """A draft trained on the micro data, shaped as a downloaded public one: the sglang layout, SGLang's
    `layers.0.*` tensor names, and no record of ours in config.json (its aux ids are read for the config's release)."""
    base = tmp_path_factory.mktemp("public")
    overrides, run_dir = run_copy(micro_data, base, "trained", ["training.max_steps=40"])
    Trainer(load_config(TINY, overrides), log=QUIET).run()
    out = convert(run_dir / "train" / "final", base / "public-sglang", to="sglang", release="0.5.13", log=QUIET)
    config = json.loads((out / "config.json").read_text())
    del config[PROVENANCE_KEY]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {name.replace("midlayer.", "layers.0."): t for name, t in load_file(out / "model.safetensors").items()}
    assert any(name.startswith("layers.0.") for name in tensors)
    save_file(tensors, out / "model.safetensors")
    (out / "manifest.json").unlink()  # a downloaded draft has no manifest of ours
    return out


def first_evaluation(micro_data, tmp_path, name, extra=()):
    """Resolve training.init_from as the train stage does, train two steps, and return the first evaluation (its
    timings left out), the log and the config."""
    overrides, run_dir = run_copy(micro_data, tmp_path, name, [*FIRST_EVAL, *extra])
    config = load_config(TINY, overrides)
    lines = []
    resolve_init_from(config.run, config.training, config.draft, config.target,
                      config.serving, config.registry, lines.append)
    Trainer(config, log=lines.append).run()
    evaluation = next(m for m in metrics(run_dir) if "eval_loss" in m)
    return {k: v for k, v in evaluation.items() if not k.endswith("time_s")}, lines, config


@pytest.fixture(scope="module")
def cold(micro_data, tmp_path_factory):
    return first_evaluation(micro_data, tmp_path_factory.mktemp("cold"), "cold")[0]


def published(public_draft, registry_dir, version="public-eagle3-1"):
    Registry(LocalStore(registry_dir)).publish(version, {"sglang": public_draft}, {"lineage": {"imported": True}})
    return version


def test_an_imported_sglang_directory_fine_tunes_and_starts_ahead_of_a_cold_start(public_draft, cold, micro_data,
                                                                                    tmp_path):
    warm, lines, config = first_evaluation(micro_data, tmp_path, "warm", [f"training.init_from={public_draft}"])
    print(f"first evaluation: cold {cold}, warm {warm}")
    assert warm["eval_loss"] < 0.8 * cold["eval_loss"]
    assert warm["eval_accept_length"] > cold["eval_accept_length"] + 0.2
    run_dir = config.run.dir
    record = json.loads((run_dir / "train" / "init" / "source.json").read_text())
    content = init_draft(config.training, config.draft, config.registry).sha256
    assert record == {"init_from": str(public_draft), "kind": "directory", "where": str(public_draft),
                      "layout": "sglang", "sha256": content}
    assert any(f"sglang layout, sha256 {content[:16]}" in line for line in lines), lines
    assert read_manifest(run_dir / "train" / "best")["init_from"] == record  # the training output names its init


def test_a_registry_version_fine_tunes_as_the_same_draft_in_a_directory_does(public_draft, cold, micro_data,
                                                                             tmp_path):
    """An imported version is fetched in its sglang layout: the same content trains to the same first evaluation."""
    version = published(public_draft, tmp_path / "registry")
    registry = [f"registry.path={tmp_path / 'registry'}"]
    by_version, _, config = first_evaluation(micro_data, tmp_path, "version",
                                                  [f"training.init_from={version}", *registry])
    by_directory, _, _ = first_evaluation(micro_data, tmp_path, "directory", [f"training.init_from={public_draft}"])
    assert by_version == by_directory
    assert by_version["eval_accept_length"] > cold["eval_accept_length"] + 0.2
    run_dir = config.run.dir
    record = json.loads((run_dir / "train" / "init" / "source.json").read_text())
    assert (record["kind"], record["init_from"], record["layout"]) == ("version", version, "sglang")
    assert record["where"] == str((tmp_path / "registry").resolve())
    assert not (run_dir / "train" / "init" / "fetched-sglang").exists()  # only the native copy is kept


def test_a_retrain_fine_tunes_the_production_version_by_its_id(public_draft, tmp_path):
    registry = Registry(LocalStore(tmp_path / "registry"))
    version = published(public_draft, tmp_path / "registry", "2024")  # an id YAML would read as a number
    registry.promote(version, None, ["test"], by="test")
    overrides = [f"run.dir={tmp_path / 'run'}", f"registry.path={tmp_path / 'registry'}"]
    added = retrain_overrides(load_config(TINY, overrides).run, "eagle3", registry, log=QUIET)
    assert load_config(TINY, overrides + added).training.init_from == "2024"


def test_a_shape_that_cannot_carry_over_is_refused_naming_the_tensor_and_both_shapes(public_draft, micro_data,
                                                                                     tmp_path):
    overrides, _ = run_copy(micro_data, tmp_path, "wide", [f"training.init_from={public_draft}",
                                                           "draft.intermediate_size=256"])
    config = load_config(TINY, overrides)
    resolve_init_from(config.run, config.training, config.draft, config.target, config.serving, config.registry, QUIET)
    head, vocab_map = target_head(Path(config.target.path)), read_vocab_map(config.run, config.vocab, config.target)
    with pytest.raises(Eagle3Error, match=r"midlayer\.mlp\.gate_proj\.weight \[512, 64\] in the init draft, "
                                          r"\[256, 64\] in this config"):
        cfg = EAGLE3.draft_config(config.draft, config.target, config.vocab.draft_vocab_size, config.data.aux_layers)
        EAGLE3.initial_model(cfg, config.training, head, vocab_map, torch.device("cpu"),
                             resolved_init(config.run, config.training), QUIET)


@pytest.mark.parametrize("field, init, ours, message", [
    ("aux_layers", [0, 1, 2], [1, 2, 3], r"target layers \[0, 1, 2\].*this run's data on layers \[1, 2, 3\]"),
    ("rope_theta", 500000.0, 10000.0, r"rope_theta 500000.0 in the init draft, 10000.0 in this config"),
    ("num_attention_heads", 8, 4, r"num_attention_heads 8 in the init draft, 4 in this config"),
    ("norm_before_fc", True, False, r"input_norm\.weight \[96\] in the init draft, absent in this config"),
])
def test_what_would_compute_something_else_is_refused_by_name(field, init, ours, message):
    # 8 heads of 4 and 4 of 8 (kv: 4 of 4, 2 of 8): every tensor keeps its shape, only the fields tell
    extra = {"head_dim": 4, "num_key_value_heads": 4} if field == "num_attention_heads" else {}
    problem = carry_over_problem(tiny_config(**{field: init}, **extra), tiny_config(**{field: ours}))
    assert problem is not None and re.search(message, problem), problem


def test_metadata_and_the_draft_vocabulary_carry_over():
    init = tiny_config(target_family=None, max_position_embeddings=4096, torch_dtype="float32", draft_vocab_size=32,
                       rms_norm_eps=1e-5)
    assert carry_over_problem(init, tiny_config()) is None


def test_an_unknown_version_is_refused_naming_the_field_and_the_registry(tmp_path):
    config = load_config(TINY, [f"run.dir={tmp_path / 'run'}", f"registry.path={tmp_path / 'registry'}",
                                "training.init_from=no-such-draft"])
    with pytest.raises(Eagle3Error) as refused:
        resolve_init_from(config.run, config.training, config.draft, config.target,
                          config.serving, config.registry, QUIET)
    message = str(refused.value)
    assert "training.init_from 'no-such-draft'" in message and str((tmp_path / "registry").resolve()) in message
    assert "eagle3 registry list" in message
    assert not (tmp_path / "run" / "train" / "init").exists()


def test_an_absolute_d2t_is_refused_as_a_loader_would_misread_it(public_draft, micro_data, tmp_path):
    broken = tmp_path / "absolute-d2t"
    broken.mkdir()
    (broken / "config.json").write_text((public_draft / "config.json").read_text())
    tensors = load_file(public_draft / "model.safetensors")
    tensors["d2t"] = tensors["d2t"] + torch.arange(tensors["d2t"].numel())  # target ids, not offsets
    save_file(tensors, broken / "model.safetensors")
    overrides, run_dir = run_copy(micro_data, tmp_path, "absolute", [f"training.init_from={broken}"])
    with pytest.raises(Eagle3Error, match=r"training.init_from .*d2t is not offsets"):
        absolute = load_config(TINY, overrides)
        resolve_init_from(absolute.run, absolute.training, absolute.draft, absolute.target,
                          absolute.serving, absolute.registry, QUIET)
    assert not (run_dir / "train" / "init" / "source.json").exists()


def test_a_warm_start_with_warm_steps_auto_stops_once_accept_length_stops_improving(public_draft, micro_data,
                                                                                      tmp_path):
    """The public draft is already trained on this data: a fine-tune cannot beat its first evaluation for long, so
    patience 2 ends it well before max_steps; the log says why, and a cold start ignores the rule."""
    auto = ["training.max_steps=40", "training.eval_every=2", "training.warm_steps=auto", "training.patience=2"]
    overrides, run_dir = run_copy(micro_data, tmp_path, "auto", [*auto, f"training.init_from={public_draft}"])
    config = load_config(TINY, overrides)
    lines = []
    resolve_init_from(config.run, config.training, config.draft, config.target,
                      config.serving, config.registry, lines.append)
    Trainer(config, log=lines.append).run()
    evaluations = [m for m in metrics(run_dir) if "eval_loss" in m]
    last_best = max(i for i, m in enumerate(evaluations) if m["new_best"])
    assert len(evaluations) == last_best + 3 and evaluations[-1]["step"] < 40  # two without a new best, then stop
    assert any("warm start stopped at step" in line and "patience" in line for line in lines)
    overrides, cold_dir = run_copy(micro_data, tmp_path, "cold-auto", [*auto, "training.max_steps=6"])
    Trainer(load_config(TINY, overrides), log=QUIET).run()
    assert metrics(cold_dir)[-1]["step"] == 6  # no init_from: max_steps, whatever patience says


@pytest.mark.parametrize("steps", [0, 41])
def test_a_warm_budget_outside_max_steps_is_refused_by_name(steps):
    with pytest.raises(Exception, match=rf"training.warm_steps {steps} must be in 1..training.max_steps \(40\)"):
        load_config(TINY, ["training.max_steps=40", f"training.warm_steps={steps}"])


def test_min_gain_counts_only_gains_above_it(public_draft, micro_data, tmp_path):
    """A gain of more than 10 accept-length units never comes: the first evaluation sets the mark, two more end it."""
    overrides, run_dir = run_copy(micro_data, tmp_path, "gain", [
        "training.max_steps=40", "training.eval_every=2", "training.warm_steps=auto", "training.patience=2",
        "training.min_gain=10", f"training.init_from={public_draft}"])
    config = load_config(TINY, overrides)
    resolve_init_from(config.run, config.training, config.draft, config.target, config.serving, config.registry, QUIET)
    Trainer(config, log=QUIET).run()
    assert [m["step"] for m in metrics(run_dir) if "eval_loss" in m] == [2, 4, 6]


def test_a_resumed_warm_start_carries_its_patience_on(public_draft, micro_data, tmp_path):
    """Resumed from step 4 (one evaluation without a gain behind it), it stops at step 6 as the uninterrupted run did,
    not at 8 as a count started afresh would."""
    overrides, run_dir = run_copy(micro_data, tmp_path, "resume", [
        "training.max_steps=40", "training.eval_every=2", "training.save_every=2", "training.keep_last=5",
        "training.warm_steps=auto", "training.patience=2", "training.min_gain=10",
        f"training.init_from={public_draft}"])
    config = load_config(TINY, overrides)
    resolve_init_from(config.run, config.training, config.draft, config.target, config.serving, config.registry, QUIET)
    Trainer(config, log=QUIET).run()
    checkpoints = run_dir / "train" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir())[-1] == "step-0000006"
    for file in (checkpoints / "step-0000006").iterdir():
        file.unlink()
    (checkpoints / "step-0000006").rmdir()
    lines = []
    Trainer(config, log=lines.append).run()
    assert any("resumed from" in line and "step-0000004" in line for line in lines)
    assert any("warm start stopped at step 6 of at most 40" in line for line in lines)
    assert [m["step"] for m in metrics(run_dir) if "eval_loss" in m] == [2, 4, 6]
