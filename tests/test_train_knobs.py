"""Training knobs in the config (schedule, AdamW, best-draft rule, stored feature dtype), a training-only config, and
honest timings, on the micro data set."""

import math
import os

import pytest
import torch
import yaml

from eagle3.cli import main
from eagle3.config import require_sections
from eagle3.resolve import load_config
from eagle3.data.capture import capture
from eagle3.data.regenerate import regenerate
from eagle3.data.shards import ShardReader, ShardWriter
from eagle3.data.vocab import build_vocab
from eagle3.errors import ConfigError, Eagle3Error
from eagle3.algorithms.eagle3.checkpoint import load_native
from eagle3.records.manifest import read_manifest
from eagle3.report import training_report
from eagle3.stages.keys import begin, config_inputs, done, stage_fingerprint, stage_key
from eagle3.train.data import ShardFeatures, TrainingData
from eagle3.train.timing import Throughput
from eagle3.train.schedule import lr_factor, optimizer_and_schedule
from eagle3.train.trainer import Trainer
from helpers import TINY, metrics, micro_overrides, run_copy
from flows import run as flow_run

quiet = lambda line: None  # noqa: E731
TRAINING_ONLY = ("run", "target", "data", "vocab", "draft", "training")


def training_only_config(tmp_path, replay=True):
    """tiny-cpu.yaml with only the sections training reads."""
    raw = yaml.safe_load(TINY.read_text())
    kept = {name: raw[name] for name in TRAINING_ONLY}
    if replay:
        kept["training"].update(replay_prompts=4, replay_max_new_tokens=16)
    path = tmp_path / "train-only.yaml"
    path.write_text(yaml.safe_dump(kept))
    return path


def test_warmup_start_and_floor_shape_the_schedule():
    today = dict(floor=0.1, warmup_start="lr_over_warmup")  # the defaults: what the trainer always did
    assert lr_factor(0, 5, 100, **today) == pytest.approx(1 / 5)
    assert lr_factor(4, 5, 100, **today) == pytest.approx(1.0)
    assert lr_factor(100, 5, 100, **today) == pytest.approx(0.1)
    assert lr_factor(0, 5, 100, 0.1, "zero") == 0.0
    assert lr_factor(4, 5, 100, 0.1, "zero") == pytest.approx(4 / 5)
    assert lr_factor(5, 5, 100, 0.1, "zero") == pytest.approx(1.0)
    assert lr_factor(100, 5, 100, 0.3, "zero") == pytest.approx(0.3)
    assert lr_factor(99, 5, 100, 0.0, "zero") == pytest.approx(0.5 * (1 + math.cos(math.pi * 94 / 95)))


def test_the_knobs_reach_the_optimizer_and_the_scheduler():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[1].weight.requires_grad_(False)  # as training.freeze_head leaves the head out
    training = load_config(TINY, ["training.max_steps=40", "training.warmup_steps=5"]).training
    optimizer, scheduler = optimizer_and_schedule(model, training)
    group = optimizer.param_groups[0]
    assert (group["betas"], group["weight_decay"]) == ((0.9, 0.95), 0.0)
    assert not any(p is model[1].weight for p in group["params"]) and len(group["params"]) == 3
    assert scheduler.get_last_lr()[0] == pytest.approx(training.learning_rate / 5)
    knobs = ["training.max_steps=40", "training.warmup_start=zero", "training.lr_floor=0.3",
             "training.adam_betas=[0.8, 0.99]", "training.weight_decay=0.01"]
    optimizer, scheduler = optimizer_and_schedule(model, load_config(TINY, knobs).training)
    group = optimizer.param_groups[0]
    assert (group["betas"], group["weight_decay"]) == ((0.8, 0.99), 0.01)
    assert scheduler.get_last_lr()[0] == 0.0
    assert scheduler.lr_lambdas[0](40) == pytest.approx(0.3)  # the floor at the end of the schedule


def test_knob_values_are_checked_at_load():
    with pytest.raises(ConfigError, match=r"training.adam_betas.*each beta must be in \[0, 1\)"):
        load_config(TINY, ["training.adam_betas=[0.9, 1.0]"])
    with pytest.raises(ConfigError, match="training.warmup_start.*'lr_over_warmup' or 'zero'"):
        load_config(TINY, ["training.warmup_start=one"])
    with pytest.raises(ConfigError, match=r"training.replay_prompts \(40\) exceeds benchmark.num_prompts \(32\)"):
        load_config(TINY, ["training.replay_prompts=40"])


def test_a_rule_on_an_empty_eval_split_is_refused_when_training_starts(micro_data, tmp_path):
    """Checked on the data, not the config: a split the data names (an import) needs no eval_fraction."""
    overrides, _ = run_copy(micro_data, tmp_path, "no-eval", ["training.best_by=step_acc", "training.eval_fraction=0"])
    with pytest.raises(Eagle3Error, match="training.best_by step_acc is measured on the eval split, which holds none"):
        Trainer(load_config(TINY, overrides), log=quiet)


# (eval loss, weighted step accuracy, accept length) of three evaluations: each rule prefers another one
EVALS = [(2.0, 0.5, 1.5), (1.0, 0.4, 1.4), (1.5, 0.45, 1.6)]


@pytest.mark.parametrize("rule, best_step", [("accept_length", 3), ("step_acc", 1), ("eval_loss", 2)])
def test_best_by_keeps_the_draft_its_rule_prefers(micro_data, tmp_path, rule, best_step):
    overrides, run_dir = run_copy(micro_data, tmp_path, "best", ["training.max_steps=3", f"training.best_by={rule}"])
    lines = []
    trainer = Trainer(load_config(TINY, overrides), log=lines.append)
    k = trainer.config.training.ttt_steps
    current = {}

    def loss_sums():  # eval loss L, every step's accuracy a: [loss sums, correct, counts] over one position per step
        loss, acc, _ = current["eval"]
        return torch.stack([torch.tensor([loss] + [0.0] * (k - 1)), torch.full((k,), acc), torch.ones(k)])

    def replay_counts():
        if rule != "accept_length":
            raise AssertionError("the replay ran for a rule that does not use it")
        return torch.tensor([current["eval"][2] * 100, 100.0])

    trainer.loss_sums, trainer.replay_counts = loss_sums, replay_counts
    for step, values in enumerate(EVALS, start=1):
        current["eval"] = values
        trainer.step = step
        with torch.no_grad():
            trainer.model.fc.weight.fill_(step)  # marks the draft of this evaluation
        trainer.evaluate()
    best = load_native(run_dir / "train" / "best").tensors["fc.weight"]
    assert torch.all(best == best_step)
    evals = [m for m in metrics(run_dir) if "eval_time_s" in m]
    assert [m["step"] for m in evals if m["new_best"]][-1] == best_step
    assert ("eval_accept_length" in evals[0]) == (rule == "accept_length")
    assert evals[0]["eval_weighted_acc"] == pytest.approx(0.5) and evals[1]["eval_loss"] == pytest.approx(1.0)
    skipped = [line for line in lines if "skips the acceptance replay" in line]
    assert len(skipped) == (rule != "accept_length")


def test_metrics_carry_step_times_windowed_throughput_and_eval_times(micro_data, tmp_path):
    overrides, run_dir = run_copy(micro_data, tmp_path, "timed", ["training.max_steps=6", "training.eval_every=3",
                                                                  "training.replay_prompts=4", "training.replay_max_new_tokens=16"])
    lines = []
    Trainer(load_config(TINY, overrides), log=lines.append).run()
    steps = [m for m in metrics(run_dir) if "loss" in m]
    assert all(m["step_time_s"] > 0 and m["tokens_per_s"] > 0 for m in steps)
    evals = [m for m in metrics(run_dir) if "eval_time_s" in m]
    assert len(evals) == 2 and all(m["eval_loss_time_s"] > 0 and m["eval_replay_time_s"] > 0 for m in evals)
    assert all(m["eval_time_s"] == pytest.approx(m["eval_loss_time_s"] + m["eval_replay_time_s"], abs=2e-4) for m in evals)
    assert "best by accept_length (eval_accept_length " in lines[-1]
    report = training_report(metrics(run_dir), "accept_length")
    assert "median step time (s)" in report and "tokens/s over the last 20 steps" in report
    assert "best draft by accept_length" in report


def test_throughput_counts_only_the_window():
    window = Throughput(window=2)
    assert window.add(100, 1.0) == 100.0
    assert window.add(300, 1.0) == 200.0
    assert window.add(500, 0.5) == pytest.approx(800 / 1.5, abs=0.1)  # the first step left the window


def test_a_training_only_config_makes_its_data_and_trains_through_eagle3_train(micro_target, tmp_path, capsys):
    """No serving, benchmark or registry section: the data stage (its held-out set the replay's), the vocab map, then
    `eagle3 train`, whose evaluation replays DraftShape's default chain."""
    run_dir = tmp_path / "run"
    overrides = [*micro_overrides(run_dir, micro_target), "training.max_steps=4", "training.eval_every=2",
                 "training.batch_size=8", "training.seq_len=96"]
    path = training_only_config(tmp_path)
    config = load_config(path, overrides)
    assert config.serving is None and config.replay_shape.num_steps == 3 and config.heldout_set == (4, 16)
    regenerate(config, log=quiet)
    capture(config.run, config.data, config.target, config.training, log=quiet)
    build_vocab(config.run, config.data, config.target, config.vocab, log=quiet)
    assert read_manifest(run_dir / "data" / "heldout")["sequences"] == 4
    assert main(["train", "--config", str(path), *[arg for item in overrides for arg in ("--set", item)]]) == 0, \
        capsys.readouterr().err
    assert (run_dir / "train" / "best" / "model.safetensors").exists()
    evals = [m for m in metrics(run_dir) if "eval_time_s" in m]
    assert len(evals) == 2 and all(m["eval_accept_length"] > 1.0 and m["eval_replay_time_s"] > 0 for m in evals)
    assert "best by accept_length (eval_accept_length " in capsys.readouterr().out
    # marked as the flow marks it: a flow run with these settings takes it as done; one with another learning rate
    # starts training afresh, naming the change, instead of resuming from these checkpoints
    upstream = {"dataset": stage_fingerprint(config, "capture"), "vocab": stage_fingerprint(config, "vocab")}
    assert done("train", config, upstream)
    other = load_config(path, overrides + ["training.learning_rate=1e-3"])
    said = []
    begin("train", other, upstream, said.append)
    assert not done("train", other, upstream)
    assert [path.name for path in (run_dir / "train").iterdir()] == [".best.stage-key"]  # its in-progress mark alone
    assert said == [f"train: its inputs changed since {run_dir / 'train'} was made (config.training.learning_rate: "
                    "0.003 -> 0.001): starting it afresh"]


def test_a_stage_that_needs_a_missing_section_names_it(tmp_path, capsys):
    config = load_config(training_only_config(tmp_path))
    with pytest.raises(ConfigError, match=r"eagle3 run needs the config's serving, registry section\(s\), missing here"):
        require_sections(config, ("serving", "registry"), "eagle3 run")
    assert main(["simulate", "--config", str(training_only_config(tmp_path))]) == 2
    assert "simulate needs the config's serving, benchmark section(s), missing here" in capsys.readouterr().err
    assert flow_run.main([str(training_only_config(tmp_path))]) == 1  # before Prefect is touched
    assert "needs the config's serving, benchmark, registry section(s)" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="a config without a benchmark section sets training.replay_prompts and "
                                          "training.replay_max_new_tokens"):
        load_config(training_only_config(tmp_path, replay=False))


def test_a_training_only_config_keys_its_stages(tmp_path):
    """The stages a training-only config runs have cache keys; its held-out set is the replay's."""
    path, run = training_only_config(tmp_path), f"run.dir={tmp_path / 'run'}"
    config = load_config(path, [run])
    assert config_inputs(config, "regenerate")["heldout"] == [4, 16 + 3, []]  # the continuations run 3 drafting steps on
    assert config_inputs(config, "train")["serving.num_steps"] is None
    assert stage_key("train", config, []) != stage_key("train", load_config(path, [run, "training.best_by=eval_loss"]), [])


def test_float32_capture_is_stored_recorded_and_read_as_float32(micro_data, tmp_path):
    shared, _ = micro_data
    run_dir = tmp_path / "f32"
    (run_dir / "data").mkdir(parents=True)
    os.symlink(shared / "data" / "regen", run_dir / "data" / "regen")
    overrides = [*micro_data[1], f"run.dir={run_dir}", "data.feature_dtype=float32"]
    config = load_config(TINY, overrides)
    capture(config.run, config.data, config.target, config.training, log=quiet)
    for part in ("hidden", "heldout"):
        assert read_manifest(run_dir / "data" / part)["capture"]["dtype"] == "float32"
        sample = ShardReader(sorted((run_dir / "data" / part).glob("shard-*"))[0]).sample(0)
        assert sample.aux_hidden.dtype == sample.last_hidden.dtype == torch.float32
    # the trainer's reader keeps every stored bit (a bf16 buffer would round them)
    data = TrainingData(run_dir / "data" / "hidden", 96, 0.0)
    refs = data.train[:2]
    tokens, _ = data.tokens(refs)
    features = ShardFeatures(data, None, torch.device("cpu")).features(tokens)
    stored = data.readers[refs[0].shard].sample(refs[0].index)
    assert torch.equal(features.aux[0, : refs[0].length], stored.aux_hidden[: refs[0].length])
    # the same samples asked for in bf16: the float32 shards are not current, every one is written again
    bf16 = load_config(TINY, [*overrides, "data.feature_dtype=bfloat16"])
    capture(bf16.run, bf16.data, bf16.target, bf16.training, log=quiet)
    assert read_manifest(run_dir / "data" / "hidden")["capture"]["dtype"] == "bfloat16"
    assert ShardReader(sorted((run_dir / "data" / "hidden").glob("shard-*"))[0]).sample(0).aux_hidden.dtype == torch.bfloat16


def test_samples_without_a_generated_token_in_reach_are_left_out(tmp_path):
    """A prompt that filled data.max_length before the target answered, or a reply past seq_len, teaches nothing."""
    masks = {"answered": [0, 0, 1, 1], "prompt-only": [0, 0, 0, 0], "reply-past-seq-len": [0, 0, 0, 1],
             "answered-too": [0, 1, 1, 0]}
    with ShardWriter(tmp_path / "shard-00000.safetensors", list(masks), [4] * 4, {}, {}) as writer:
        for i, mask in enumerate(masks.values()):
            writer.write(i, input_ids=torch.arange(4), loss_mask=torch.tensor(mask))
    assert ShardReader(tmp_path / "shard-00000.safetensors").loss_tokens(3).tolist() == [1, 0, 0, 2]
    data = TrainingData(tmp_path, 3, 0.0)
    assert [ref.id for ref in data.train] == ["answered", "answered-too"] and data.without_loss == 2
    assert [ref.id for ref in TrainingData(tmp_path, 4, 0.0).train] == ["answered", "reply-past-seq-len", "answered-too"]
