"""The seam for draft algorithms (docs/algorithms.md): the registry, the config's names, and the trainer and the
simulator running an entry that is not EAGLE-3 (the toy of tests/algorithm_toy.py) through it alone."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3.algorithms import ALGORITHMS, algorithm, require_deployable
from eagle3.bench.simulate import heldout_samples, replay_stored
from eagle3.data.regenerate import greedy_length
from eagle3.resolve import load_config
from eagle3.distributed import Dist
from eagle3.errors import ConfigError, Eagle3Error
from eagle3.model.weights import target_head
from eagle3.train.parts import read_vocab_map, training_parts
from eagle3.train.trainer import Trainer
from algorithm_toy import HEADS, TOY
from helpers import TINY, metrics, run_copy

QUIET = lambda line: None  # noqa: E731


def test_the_config_names_exactly_the_registered_algorithms(monkeypatch):
    """The schema knows no kind: the resolve step checks draft.algorithm against the registry, so registering an entry
    is what makes a config able to name it."""
    assert load_config(TINY).draft.algorithm == "eagle3"
    with pytest.raises(ConfigError, match=r"draft.algorithm \(from --set\): 'toy' is not registered; give 'dflash', "
                                          "'dspark' or 'eagle3'"):
        load_config(TINY, ["draft.algorithm=toy"])
    monkeypatch.setitem(ALGORITHMS, TOY.name, TOY)
    assert load_config(TINY, ["draft.algorithm=toy"]).draft.algorithm == "toy"


def test_an_unregistered_algorithm_is_refused_naming_the_registered_ones():
    with pytest.raises(Eagle3Error, match=r"draft.algorithm 'medusa' is no registered draft algorithm \(registered: "
                                          r"eagle3, dflash, dspark\); see docs/algorithms.md"):
        algorithm("medusa")
    with pytest.raises(ConfigError, match=r"draft.algorithm.*'eagle3'"):
        load_config(TINY, ["draft.algorithm=medusa"])


def test_the_whole_pipeline_refuses_an_algorithm_it_cannot_serve_before_any_stage(monkeypatch):
    monkeypatch.setitem(ALGORITHMS, TOY.name, TOY)
    with pytest.raises(Eagle3Error, match=f"eagle3 run: draft.algorithm {TOY.name} is trained, replayed and exported "
                                          "here, but its serving and gate are not built yet"):
        require_deployable(TOY.name, "eagle3 run")
    for name in ("eagle3", "dflash", "dspark"):
        require_deployable(name, "eagle3 run")


def toy_parts(config, log):
    """The config's training parts with the toy's model in place of EAGLE-3's: built apart from the Trainer."""
    parts = training_parts(config.run, config.data, config.target, config.training, config.draft, config.vocab,
                           greedy_length(config), Dist(), log)
    head = target_head(Path(config.target.path))
    vocab_map = read_vocab_map(config.run, config.vocab, config.target)
    cfg = TOY.draft_config(config.draft, config.target, config.vocab.draft_vocab_size, config.data.aux_layers)
    model = TOY.initial_model(cfg, config.training, head, vocab_map, torch.device("cpu"), None, log)
    return replace(parts, algorithm=TOY, model=model)


def test_the_trainer_trains_checkpoints_resumes_and_replays_an_entry_through_the_seam_alone(micro_data, tmp_path):
    """The toy's heads train (its K, not training.ttt_steps, in every per-step list), its evaluation replays the
    held-out sequences with the toy's drafter, its checkpoints are the toy's files, and a longer run resumes from
    them; the simulator counts the trained toy's drafts over the same sequences."""
    overrides, run_dir = run_copy(micro_data, tmp_path, "toy", ["training.max_steps=12", "training.eval_every=6",
                                                                "training.save_every=6", "training.replay_prompts=2"])
    config = load_config(TINY, overrides)
    Trainer(config, log=QUIET, parts=toy_parts(config, QUIET)).run()
    steps = [m for m in metrics(run_dir) if "loss" in m]
    assert config.training.ttt_steps != HEADS and {len(m["step_acc"]) for m in steps} == {HEADS}
    assert sum(m["loss"] for m in steps[-3:]) < sum(m["loss"] for m in steps[:3])  # it learns
    evals = [m for m in metrics(run_dir) if "eval_time_s" in m]
    assert [m["step"] for m in evals] == [6, 12] and all(m["eval_accept_length"] >= 1.0 for m in evals)
    for kept in ("best", "final", "checkpoints/step-0000012"):
        assert set(load_file(run_dir / "train" / kept / "toy.safetensors")) == {"heads.weight", "d2t"}

    longer = load_config(TINY, overrides + ["training.max_steps=14"])
    lines = []
    Trainer(longer, log=lines.append, parts=toy_parts(longer, lines.append)).run()
    assert any("resumed from" in line and "step-0000012 at step 12" in line for line in lines), lines
    assert [m["step"] for m in metrics(run_dir) if "loss" in m][-3:] == [12, 13, 14]

    trained = TOY.served_model(run_dir / "train" / "final", None, Path(config.target.path), "")
    refs = heldout_samples(config.run, greedy_length(config))[:2]
    rows = [replay_stored(TOY, trained, ref.load(), config.replay_shape, 16, frozenset(), None) for ref in refs]
    assert all(row.completion_tokens >= 16 and 0 < row.verify_ct <= row.completion_tokens for row in rows)
    assert max(len(row.histogram) for row in rows) <= HEADS + 1  # never more than the toy's heads accepted a step
