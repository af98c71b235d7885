"""The knobs aimed at a draft that fits a small data set rather than learning the target (docs/training.md):
training.freeze_head, training.feature_noise and training.teacher_temperature, on the micro data set."""

import torch

from eagle3.resolve import load_config
from eagle3.algorithms.eagle3.checkpoint import load_native
from eagle3.model.teacher import TeacherHead
from eagle3.model.weights import target_head
from eagle3.train.augment import noisy_features
from eagle3.train.trainer import Trainer
from helpers import TINY, run_copy

quiet = lambda line: None  # noqa: E731
HEAD = ("lm_head.weight", "norm.weight")


def trainer_for(micro_data, tmp_path, name, extra=()):
    overrides, run_dir = run_copy(micro_data, tmp_path, name, ["training.max_steps=2", *extra])
    return Trainer(load_config(TINY, overrides), log=quiet), run_dir


def test_a_frozen_head_stays_the_targets_while_the_layer_trains(micro_data, micro_target, tmp_path):
    target = target_head(micro_target)
    assert not torch.all(target["norm"] == 1.0)  # else the draft's initial norm (ones) would pass for the target's
    trainer, run_dir = trainer_for(micro_data, tmp_path, "frozen", ["training.freeze_head=true"])
    before = {name: t.detach().clone() for name, t in trainer.model.named_parameters()}
    assert torch.equal(before["norm.weight"], target["norm"])
    trainer.run()
    final = load_native(run_dir / "train" / "final").tensors  # what SGLang loads still holds both
    hot = trainer.model.hot_token_ids()
    assert torch.equal(final["lm_head.weight"], target["lm_head"][hot])
    assert torch.equal(final["norm.weight"], target["norm"])
    trained = [name for name in before if name not in HEAD and not name.startswith("embed_tokens")]
    assert trained and all(not torch.equal(final[name], before[name]) for name in trained)
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert all(id(dict(trainer.model.named_parameters())[name]) not in optimized for name in HEAD)


def test_by_default_the_head_trains(micro_data, tmp_path):
    trainer, run_dir = trainer_for(micro_data, tmp_path, "trained")
    before = {name: trainer.model.state_dict()[name].clone() for name in HEAD}
    trainer.run()
    final = load_native(run_dir / "train" / "final").tensors
    assert all(not torch.equal(final[name], before[name]) for name in HEAD)


def test_feature_noise_is_scaled_to_each_layers_features():
    torch.manual_seed(0)
    quiet_layer, loud_layer = torch.randn(2, 50, 8), torch.randn(2, 50, 8) * 1000.0  # [B, T, H] each
    aux = torch.cat([quiet_layer, loud_layer], dim=-1)  # [B, T, 2H]
    noise = (noisy_features(aux, 0.1, 2) - aux).unflatten(-1, (2, -1))  # [B, T, 2, H]
    rms = aux.unflatten(-1, (2, -1)).pow(2).mean(-1, keepdim=True).sqrt()  # [B, T, 2, 1]
    relative = noise / rms
    assert relative.abs().max() <= 0.1 + 1e-6  # U(-0.1, 0.1) x the layer's RMS at that position
    assert relative.abs().max() > 0.09 and relative.mean().abs() < 0.01  # fills the width, centred
    assert noise[..., 1, :].abs().mean() > 100 * noise[..., 0, :].abs().mean()


def test_feature_noise_reaches_training_steps_only(micro_data, tmp_path):
    """Same init (same seed): the noisy trainer's evaluation equals the plain one's, its training step does not."""
    plain, _ = trainer_for(micro_data, tmp_path, "plain")
    noisy, _ = trainer_for(micro_data, tmp_path, "noisy", ["training.feature_noise=0.5"])
    refs = plain.data.train[:2]
    with torch.no_grad():
        evaluated = [trainer.step_stats(refs, train=False).loss_sum for trainer in (plain, noisy)]
    assert torch.equal(*evaluated)
    trained = [trainer.step_stats(refs, train=True).loss_sum.detach() for trainer in (plain, noisy)]
    assert torch.allclose(trained[0], evaluated[0], rtol=1e-5)  # train=True alone changes nothing
    assert not torch.allclose(trained[1], evaluated[1], rtol=1e-3)


def test_teacher_temperature_sharpens_the_distribution_not_the_argmax(micro_data, tmp_path):
    generator = torch.Generator().manual_seed(0)
    lm_head, last, hot = torch.randn(40, 16, generator=generator), torch.randn(3, 5, 16, generator=generator), torch.arange(0, 40, 2)
    plain, sharp = TeacherHead(lm_head, hot)(last), TeacherHead(lm_head, hot, temperature=0.5)(last)
    assert torch.allclose(sharp.probs, torch.softmax(2 * (last @ lm_head[hot].T), dim=-1), atol=1e-6)
    assert torch.all(sharp.probs.max(-1).values > plain.probs.max(-1).values)
    assert torch.equal(sharp.argmax, plain.argmax) and torch.equal(sharp.in_draft, plain.in_draft)
    trainer, _ = trainer_for(micro_data, tmp_path, "sharp", ["training.teacher_temperature=0.5"])
    features = trainer.features.features(trainer.data.tokens(trainer.data.train[:2])[0])
    plain_trainer, _ = trainer_for(micro_data, tmp_path, "soft")
    sharp_probs, plain_probs = trainer.teacher(features.last).probs, plain_trainer.teacher(features.last).probs
    assert torch.allclose(sharp_probs, torch.softmax(2 * plain_probs.log(), dim=-1), atol=1e-5)  # the config's 0.5


def test_loss_positions_all_scores_the_prompts_in_training_steps_only(micro_data, tmp_path):
    generated, _ = trainer_for(micro_data, tmp_path, "generated")
    every, _ = trainer_for(micro_data, tmp_path, "every", ["training.loss_positions=all"])
    refs = generated.data.train[:2]
    batch, loss_mask = every.data.tokens(refs, every_position=True)
    assert torch.equal(loss_mask.sum(1), batch.lengths)  # every real position, no padding
    assert torch.equal(every.data.tokens(refs)[1], generated.data.tokens(refs)[1])
    with torch.no_grad():
        evaluated = [trainer.step_stats(refs, train=False).count for trainer in (generated, every)]
        trained = [trainer.step_stats(refs, train=True).count for trainer in (generated, every)]
    assert torch.equal(*evaluated) and torch.equal(trained[0], evaluated[0])
    assert torch.all(trained[1] > trained[0])  # the prompts' positions joined the loss
    generated.train_step(refs), every.train_step(refs)
    assert not torch.equal(generated.model.fc.weight, every.model.fc.weight)
