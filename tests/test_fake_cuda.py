"""GPU-only paths checked on the CPU (docs/conformance.md): the trainer's step, evaluation, stop check and drafting
run on a fake accelerator (tests/fake_device.py), where a CPU tensor meeting a device tensor fails as it
would on the node. Select them with `pytest -m fake_cuda`."""

from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

from eagle3 import distributed
from eagle3.resolve import load_config
from eagle3.distributed import Dist
from eagle3.algorithms.eagle3.model import Eagle3Draft
from eagle3.model.blocks import init_weights
from eagle3.algorithms.eagle3.ttt import draft_chain
from eagle3.train.trainer import Trainer
from fake_device import fake_accelerator
from helpers import TINY, run_copy, tiny_draft

pytestmark = pytest.mark.fake_cuda
quiet = lambda line: None  # noqa: E731


def fake_trainer(micro_data, tmp_path, device) -> Trainer:
    # a short replay: what is checked is where its tensors live, not how long it drafts; micro-batches of 2, so a
    # step accumulates (its normaliser comes from the host's loss masks)
    overrides, _ = run_copy(micro_data, tmp_path, "fake", ["training.max_steps=2", "benchmark.max_new_tokens=8",
                                                           "training.micro_batch_size=2"])
    return Trainer(load_config(TINY, overrides), log=quiet, dist=Dist(device=device))


def test_the_model_the_teacher_and_a_training_step_live_on_the_device(micro_data, tmp_path):
    with fake_accelerator() as device:
        trainer = fake_trainer(micro_data, tmp_path, device)
        assert {t.device for t in [*trainer.model.parameters(), *trainer.model.buffers()]} == {device}
        assert trainer.teacher.lm_head.device == trainer.teacher.draft_row.device == device
        # token rows from the shards, their stored features moved to the device, then TTT forward, teacher, loss,
        # backward, clipping, AdamW step
        sums = trainer.train_step(trainer.data.train[:4])
        assert sums.device == device and sums.shape == (4, trainer.config.training.ttt_steps)
        state = trainer.optimizer.state[trainer.model.fc.weight]
        assert state["exp_avg"].device == state["exp_avg_sq"].device == device
        assert set(trainer.step_metrics(sums)) == {"loss", "step_loss", "step_acc", "tokens"}


def test_evaluation_and_the_acceptance_replay_stay_on_the_device(micro_data, tmp_path):
    with fake_accelerator() as device:
        trainer = fake_trainer(micro_data, tmp_path, device)
        totals, accept = trainer.loss_sums(), trainer.replay_counts()  # eval batches, then chain drafting replayed
        assert totals.device == accept.device == device
        assert totals.shape == (3, trainer.config.training.ttt_steps) and accept.shape == (2,)


def test_the_stop_check_reduces_a_device_tensor(micro_data, tmp_path):
    with fake_accelerator() as device:
        trainer = fake_trainer(micro_data, tmp_path, device)
        trainer.stop_requested = True
        assert trainer.stop_everywhere() is True


def test_no_rank_stops_until_one_is_asked_to():
    """On the host: the fake accelerator reads every number back as 1, so only a real device tells False apart."""
    rank = SimpleNamespace(stop_requested=False, dist=Dist(device=torch.device("cpu")))
    assert Trainer.stop_everywhere(rank) is False
    rank.stop_requested = True
    assert Trainer.stop_everywhere(rank) is True


def test_a_collective_refuses_a_host_tensor():
    with pytest.raises(RuntimeError, match="a collective got a tensor on cpu, this rank runs on meta"):
        Dist(device=torch.device("meta")).sum(torch.zeros(3))


def test_chain_drafting_serves_from_the_device_with_host_tokens():
    """The simulator and the reference server draft with the verified tokens on the host."""
    host_model = tiny_draft()
    with fake_accelerator() as device:
        with torch.device(device):
            model = Eagle3Draft(host_model.config, torch.randn(16, 32).to(device))
        init_weights(model, 0)
        aux = torch.randn(9, 96).to(device)
        drafts = draft_chain(model, aux, torch.arange(10), steps=3)
        assert len(drafts) == 3
        with pytest.raises(FakeTensorDeviceMismatchError):  # the check itself: a host tensor in a device matmul
            model.fc(torch.randn(1, 96))


@pytest.mark.parametrize("world, local_rank", [("1", "0"), ("1", "3"), ("8", "5")])
def test_each_process_takes_cuda_local_rank_whenever_cuda_exists(monkeypatch, world, local_rank):
    """`python -m eagle3.train` and torchrun with one process train on the GPU too, not on the CPU."""
    chosen = []
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    groups = []
    monkeypatch.setattr(distributed.dist, "init_process_group", groups.append)
    monkeypatch.setattr(distributed.dist, "get_rank", lambda: int(local_rank))
    result = distributed.setup_distributed()
    assert result.device == torch.device("cuda", int(local_rank)) and chosen == [result.device]
    assert groups == ([] if world == "1" else ["nccl"])
