"""Capture on the GPU node: the node command, rank behaviour, signals and errors. The sglang feature backend itself is
run from SGLang's published wheel in tests/conformance/test_features.py."""

import sys
from pathlib import Path

import pytest
import torch

from eagle3.cli import main
from eagle3.resolve import load_config
from eagle3.data.capture import capture
from eagle3.data.node_capture import node_command
from eagle3.data.regenerate import regenerate
from eagle3.data.shards import read_dataset
from eagle3.runtime.features import TransformersFeatures
from helpers import KIMI, TINY, micro_overrides


def test_the_node_command_is_torchrun_over_the_serving_gpus_reading_the_resolved_config():
    config = load_config(KIMI)
    command = node_command(config.data, config.serving, "/data/run/config.resolved.yaml")
    assert command == ["/opt/sglang/bin/python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8",
                       "-m", "eagle3.data.node_capture", "--config", "/data/run/config.resolved.yaml"]


def test_only_the_main_rank_writes_and_every_rank_computes_the_same_batches(tmp_path, micro_target):
    """A tensor-parallel backend needs every rank in every forward: a rank that is not main runs the same batches
    and leaves no file behind."""
    config = load_config(TINY, micro_overrides(tmp_path / "run", micro_target) + ["data.num_samples=12"])
    regenerate(config, log=lambda line: None)
    seen = {True: [], False: []}

    def backend_for(main):
        backend = TransformersFeatures(str(micro_target), [0, 1, 2], "post_norm", torch.device("cpu"))
        inner = backend.features
        backend.features = lambda batch, rows=slice(None): seen[main].append(batch.sample_ids) or inner(batch, rows)
        return backend

    capture(config.run, config.data, config.target, config.training, log=lambda line: None, backend_for=lambda: backend_for(False), main=False)
    assert not (config.stage_dir("data") / "hidden").exists() or not any((config.stage_dir("data") / "hidden").iterdir())
    capture(config.run, config.data, config.target, config.training, log=lambda line: None, backend_for=lambda: backend_for(True))
    assert seen[True] == seen[False] and seen[True]
    assert len(list(read_dataset(config.stage_dir("data") / "hidden"))) == 12


def test_pre_norm_is_refused_for_sglang_capture():
    with pytest.raises(Exception, match="SGLang returns the last hidden state after the final norm"):
        load_config(TINY, ["data.feature_backend=sglang", "data.last_hidden=pre_norm"])


def test_sigterm_to_the_cli_stops_the_node_process_group(tmp_path):
    import signal
    import subprocess
    import time

    node_python = tmp_path / "node-python"
    pid_file = tmp_path / "child.pid"
    node_python.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nsleep 300 &\nwait\n")
    node_python.chmod(0o755)
    cli = subprocess.Popen([sys.executable, "-m", "eagle3.cli", "data", "capture", "--config", str(TINY),
                            f"--set=run.dir={tmp_path / 'run'}", "--set=data.feature_backend=sglang",
                            f"--set=data.sglang_python={node_python}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    group = int(pid_file.read_text())
    cli.send_signal(signal.SIGTERM)
    assert cli.wait(timeout=60) == 128 + signal.SIGTERM
    time.sleep(0.2)
    assert live_members(group) == []  # the engine and its workers are gone (zombies awaiting a reaper aside)


def live_members(group: int) -> list[int]:
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
            members.append(int(stat.parent.name))
    return members


def test_a_missing_node_python_is_one_line(tmp_path, capsys):
    assert main(["data", "capture", "--config", str(TINY), f"--set=run.dir={tmp_path}", "--set=data.feature_backend=sglang",
                 "--set=data.sglang_python=/nonexistent/python"]) == 2
    assert "data.sglang_python" in capsys.readouterr().err
