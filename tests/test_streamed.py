"""Streamed features for real (eagle3/stream/): a Mooncake master, the coordinator, capture workers and trainer ranks,
each its own process on this machine, train the micro draft; the result equals in-rank online training on the same
batches. The faults the stream must survive run here too: a capture worker killed, the master killed, a trainer
killed, and a re-run over the ledger."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import sys

import pytest
import torch

from eagle3.procs import process_table
from eagle3.resolve import load_config
from eagle3.stream.session import ledger_path
from eagle3.train.launch import TrainingFailed
from family_targets import STREAMED_CONFIG
from helpers import TINY, run_copy
from ports import free_port
from streaming import HIGH_GIB, LOW_GIB, final_weights, losses, streamed, trained

pytestmark = pytest.mark.usefixtures("mooncake")


STEPS = ["training.max_steps=10", "training.eval_every=2", "training.save_every=2", "run.cpu_threads=1",
         "training.nproc_per_node=2", "training.best_by=step_acc"]


def assert_same_training(run_dir, reference_dir):
    torch.testing.assert_close(losses(run_dir), losses(reference_dir), rtol=1e-5, atol=1e-7)
    ours, theirs = final_weights(run_dir), final_weights(reference_dir)
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-6, msg=name)


def ledger(run_dir) -> dict:
    with sqlite3.connect(run_dir / "train" / "stream" / "ledger.sqlite") as db:
        rows = db.execute("SELECT sample_id, state, captures, consumptions, dropped FROM samples").fetchall()
    return {sample_id: dict(state=state, captures=c, consumptions=u, dropped=d) for sample_id, state, c, u, d in rows}


def ledger_lengths(run_dir) -> list[int]:
    with sqlite3.connect(run_dir / "train" / "stream" / "ledger.sqlite") as db:
        return [length for (length,) in db.execute("SELECT length FROM samples")]


def processes(run_dir, marker: str) -> list[int]:
    """Live processes of this run whose command line holds `marker`."""
    found = []
    for pid in process_table():
        try:
            command = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in command and (str(run_dir) in command or marker == "mooncake_master"):
            found.append(pid)
    return found


@pytest.fixture(scope="module")
def online_reference(micro_data, tmp_path_factory):
    """In-rank online training, two gloo ranks, the same batches and seed."""
    overrides, run_dir = run_copy(micro_data, tmp_path_factory.mktemp("online"), "online",
                                  [*STEPS, "training.features=online"])
    trained(overrides)
    return run_dir


def test_streamed_training_equals_in_rank_online_training(micro_data, tmp_path, online_reference):
    overrides, run_dir = run_copy(micro_data, tmp_path, "streamed", [*STEPS, *streamed()])
    lines = []
    trained(overrides, lines)
    text = "\n".join(lines)
    assert "stream: started mooncake_master" in text and "2 capture worker(s)" in text
    assert_same_training(run_dir, online_reference)
    rows = ledger(run_dir)
    assert rows and all(r["captures"] == r["consumptions"] for r in rows.values()), rows  # none captured for nothing
    assert not processes(run_dir, "eagle3.stream.worker")
    # the store stayed within the high watermark, plus the micro-batch the trainers waited on while it was paused
    summary = json.loads((run_dir / "train" / "stream" / "summary.json").read_text())
    config = load_config(TINY, overrides)
    sample_bytes = sorted(length * (len(config.data.aux_layers) + 1) * config.target.hidden_size * 4
                          for length in ledger_lengths(run_dir))
    assert summary["peak_bytes"] > LOW_GIB * 2**30
    assert summary["peak_bytes"] <= HIGH_GIB * 2**30 + sum(sample_bytes[-config.training.batch_size:])


def test_a_killed_capture_worker_hands_its_samples_to_the_other(micro_data, tmp_path, online_reference):
    overrides, run_dir = run_copy(micro_data, tmp_path, "worker-killed", [*STEPS, *streamed()])
    killed = []

    def kill_a_worker(record):
        if record.get("step") == 1 and not killed:
            victim = processes(run_dir, "eagle3.stream.worker")[0]
            os.kill(victim, signal.SIGKILL)
            killed.append(victim)

    lines = []
    trained(overrides, lines, kill_a_worker)
    assert killed and re.search(r"capture worker capture-0-\d exited with code -9; its \d+ claimed sample\(s\) go to "
                                r"the others \(1 alive\)", "\n".join(lines))
    assert_same_training(run_dir, online_reference)


def test_a_killed_master_stops_the_run_naming_it_and_a_rerun_resumes(micro_data, tmp_path, online_reference):
    overrides, run_dir = run_copy(micro_data, tmp_path, "master-killed", [*STEPS, *streamed(1)])
    master_port = next(o.split("=")[1] for o in overrides if o.startswith("training.stream.master_port="))

    def kill_the_master(record):
        if "eval_loss" in record:  # step 2's evaluation: its checkpoint follows, steps 3 and 4 need the store
            for pid in processes(run_dir, "mooncake_master"):
                if f"--rpc_port={master_port}" in open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace"):
                    os.kill(pid, signal.SIGKILL)

    with pytest.raises(TrainingFailed, match="the Mooncake master on .* exited"):
        trained(overrides, None, kill_the_master)
    assert ledger_path(load_config(TINY, overrides).run).exists()
    lines = []
    trained(overrides, lines)  # a new master; the trainer resumes from step 2's checkpoint
    assert "train: resumed from" in "\n".join(lines)
    assert_same_training(run_dir, online_reference)
    rows = ledger(run_dir).values()
    # what the dead master's store held was captured again, once; nothing else was captured twice for one use
    assert sum(r["dropped"] for r in rows) > 0
    assert all(r["captures"] == r["consumptions"] + r["dropped"] for r in rows), rows


def test_a_killed_trainer_resumes_as_in_rank_training_does(micro_data, tmp_path, online_reference):
    overrides, run_dir = run_copy(micro_data, tmp_path, "trainer-killed", [*STEPS, *streamed(1)])

    def kill_a_rank(record):
        if record.get("step") == 3:
            for pid in processes(run_dir, "eagle3.train"):
                os.kill(pid, signal.SIGKILL)

    with pytest.raises(TrainingFailed):
        trained(overrides, None, kill_a_rank)
    lines = []
    trained(overrides, lines)
    assert "train: resumed from" in "\n".join(lines)
    assert_same_training(run_dir, online_reference)
    rows = ledger(run_dir)
    # steps 3 and 4 were read twice: once before the kill, once after the resume; no sample captured without a use
    assert all(r["captures"] == r["consumptions"] + r["dropped"] for r in rows.values()), rows


def test_two_capture_workers_and_two_trainer_nodes_over_ssh_train_what_in_rank_training_does(
        micro_data, tmp_path, online_reference, sshd):
    """A capture "node" and two training "nodes", each reached through ssh (tests/sshd.py), as on a cluster."""
    nodes = ["training.launcher=ssh", "training.hosts=[127.0.0.1, 127.0.0.1]", "training.nnodes=2",
             "training.nproc_per_node=1", f"training.rdzv_endpoint=127.0.0.1:{free_port()}",
             f"training.python={sys.executable}", f"training.ssh_args={json.dumps(sshd.ssh_args)}",
             "training.stream.capture_hosts=[127.0.0.1]"]
    overrides, run_dir = run_copy(micro_data, tmp_path, "over-ssh", [*STEPS, *streamed(2, *nodes)])
    lines = []
    trained(overrides, lines)
    text = "\n".join(lines)
    assert "2 capture worker(s): capture-0-0, capture-0-1" in text and "train: 2 process(es)" in text
    assert_same_training(run_dir, online_reference)
    assert not processes(run_dir, "eagle3.stream.worker")



def test_a_capture_worker_of_two_ranks_claims_on_rank_0_and_prefills_on_both(micro_data, tmp_path, online_reference):
    """A replica as a tensor-parallel group (SGLang's runner over serving.tp GPUs on the node): one torchrun of two
    ranks, rank 0 claiming and putting; here each rank runs the whole local target."""
    overrides, run_dir = run_copy(micro_data, tmp_path, "two-rank-replica",
                                  [*STEPS, *streamed(1, "training.stream.replica_ranks=2")])
    lines = []
    trained(overrides, lines)
    assert "1 capture worker(s): capture-0-0" in "\n".join(lines)
    assert_same_training(run_dir, online_reference)
    assert json.loads((run_dir / "train" / "stream" / "summary.json").read_text())["workers"] == {
        "capture-0-0": "running at the end"}


def test_the_shipped_streamed_config_runs_one_worker_beside_the_trainer_within_its_store():
    """configs/tiny-streamed-cpu.yaml: the CPU default's run with its features streamed, two busy processes on two
    cores, its own registry."""
    config = load_config(STREAMED_CONFIG, ["run.dir=/runs/streamed"])
    stream = config.training.stream
    assert config.training.features == "streamed" and stream.master == "start" and not stream.capture_hosts
    assert stream.workers * config.training.nproc_per_node == 1 and config.training.busy_processes_here == 2
    assert stream.low_watermark_gib < stream.high_watermark_gib <= 0.85 * stream.store_gib
    assert str(config.registry.path).endswith("registry-streamed")

