"""Training across nodes for real: two torchruns started over ssh (an sshd on 127.0.0.1, tests/sshd.py) meet at a
c10d rendezvous and train the micro draft with gloo, one rank each; the result equals one node's two ranks on the
same global batch, and a stop leaves no rank running on either node."""

import json
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from eagle3.config import resolved_config_file
from eagle3.resolve import load_config
from eagle3.train.launch import train
from helpers import TINY, metrics, run_copy
from ports import free_port
from test_train_launch import running

STEPS = ["training.max_steps=4", "training.eval_every=4", "training.save_every=4", "run.cpu_threads=1"]


def trained(overrides, lines):
    config = load_config(TINY, overrides)
    return train(config.run, config.data, config.training, config.serving, resolved_config_file(config), lines.append)


def test_two_nodes_over_ssh_train_what_one_node_trains_on_the_same_global_batch(micro_data, tmp_path, sshd):
    one_node, one_dir = run_copy(micro_data, tmp_path, "one-node", [*STEPS, "training.nproc_per_node=2"])
    two_nodes, two_dir = run_copy(micro_data, tmp_path, "two-nodes", [
        *STEPS, "training.launcher=ssh", "training.hosts=[127.0.0.1, 127.0.0.1]", "training.nnodes=2",
        "training.nproc_per_node=1", f"training.rdzv_endpoint=127.0.0.1:{free_port()}",
        f"training.python={sys.executable}", f"training.ssh_args={json.dumps(sshd.ssh_args)}"])
    lines = []
    trained(two_nodes, lines)
    assert sum(line.startswith("[127.0.0.1] ") for line in lines) > 0  # the nodes' output, each line by its host
    assert "train: 2 process(es), rank 0 on cpu" in "\n".join(lines) and "train: 4 steps done" in "\n".join(lines)
    trained(one_node, [])
    losses = [[r["loss"] for r in metrics(run_dir) if "loss" in r] for run_dir in (two_dir, one_dir)]
    assert len(losses[0]) == 4 and losses[0] == losses[1]
    across, within = (load_file(d / "train" / "final" / "model.safetensors") for d in (two_dir, one_dir))
    assert across.keys() == within.keys()
    for name in across:
        torch.testing.assert_close(across[name], within[name], rtol=1e-6, atol=1e-7, msg=name)


def test_a_stop_over_ssh_leaves_no_rank_running_on_any_node(micro_data, tmp_path, sshd):
    overrides, run_dir = run_copy(micro_data, tmp_path, "stopped", [
        "training.max_steps=500", "training.save_every=1000", "run.cpu_threads=1", "training.launcher=ssh",
        "training.hosts=[127.0.0.1, 127.0.0.1]", "training.nnodes=2", f"training.python={sys.executable}",
        f"training.rdzv_endpoint=127.0.0.1:{free_port()}", f"training.ssh_args={json.dumps(sshd.ssh_args)}"])
    config = load_config(TINY, overrides)

    alive = []

    def fail_at_step_2(record):
        if record.get("step") == 2:
            alive.extend(running(run_dir))  # the two ssh clients, torchruns and ranks
            raise RuntimeError("progress artifact upload failed")

    with pytest.raises(RuntimeError, match="upload failed"):
        train(config.run, config.data, config.training, config.serving, resolved_config_file(config), lambda line: None,
              fail_at_step_2)
    # the ranks are sshd's descendants, not ours: the stop reached them by hanging up their terminals
    deadline = time.monotonic() + 30
    while running(run_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(alive) >= 6 and not running(run_dir), alive
