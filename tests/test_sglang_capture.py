"""Capture through SGLang's engine protocol. SGLang needs a GPU, so a stand-in `sglang` module computes
the rows with the micro target; the passes, the release pin, the merge of partial shards and the
engine arguments are the real code."""

import sys
import types
from pathlib import Path

import pytest
import torch

from eagle3.config import load_config
from eagle3.data.capture import LocalCapture, capture
from eagle3.data.regenerate import regenerate
from eagle3.data.shards import read_dataset
from eagle3.engines.sglang_capture import engine_args, node_command, sglang_passes
from eagle3.errors import Eagle3Error
from test_config import KIMI, TINY
from test_data import micro_overrides


def test_engine_arguments_for_kimi_on_eight_gpus():
    config = load_config(KIMI)
    aux = engine_args(config, "aux_hidden", "0.5.23")
    assert aux["tp_size"] == 8 and aux["trust_remote_code"] is True and aux["mem_fraction_static"] == 0.85
    assert aux["enable_return_aux_hidden_states"] is True and aux["speculative_algorithm"] == "EAGLE3"
    assert aux["return_aux_hidden_state_layer_ids"] == [1, 29, 57]  # deepseek_v2 on 0.5.23: first id 1 -> +1
    assert aux["disable_radix_cache"] is True and aux["chunked_prefill_size"] == -1
    last = engine_args(config, "last_hidden", "0.5.23")
    assert last["enable_return_hidden_states"] is True and "speculative_algorithm" not in last
    command = node_command(config, "configs/kimi.yaml", ["data.num_samples=10"])
    assert command == ["/opt/sglang/bin/python", "-m", "eagle3.engines.sglang_capture", "--config", "configs/kimi.yaml",
                       "--set=data.num_samples=10"]


class StandInEngine:
    """sglang.Engine's generate(return_hidden_states=True) contract, computed with transformers."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        aux = kwargs.get("enable_return_aux_hidden_states", False)
        # SGLang's llama rule: explicit ids + 1 = the inputs it captures = our layers (ids here are ours).
        layers = kwargs.get("return_aux_hidden_state_layer_ids", [])
        self.local = LocalCapture(kwargs["model_path"], layers, "post_norm", kinds=("aux_hidden",) if aux else ("last_hidden",))
        self.local.start(print)
        StandInEngine.started.append(kwargs)

    def generate(self, input_ids, sampling_params, return_hidden_states):
        assert return_hidden_states and sampling_params["max_new_tokens"] == 1
        rows = self.local.states(input_ids)
        return [{"meta_info": {"hidden_states": [next(iter(r.values())).tolist(), [0.0]]}} for r in rows]

    def shutdown(self):
        StandInEngine.shutdowns += 1


@pytest.fixture
def stand_in_sglang(monkeypatch):
    module = types.ModuleType("sglang")
    module.__version__ = "0.5.23"
    module.Engine = StandInEngine
    StandInEngine.started, StandInEngine.shutdowns = [], 0
    monkeypatch.setitem(sys.modules, "sglang", module)
    return module


def test_two_sglang_passes_give_the_same_shards_as_one_local_pass(tmp_path, micro_target, stand_in_sglang):
    overrides = micro_overrides(tmp_path / "run", micro_target) + ["data.num_samples=12", "data.capture_engine=sglang"]
    config = load_config(TINY, overrides)
    regenerate(config, log=lambda line: None)
    capture(config, log=lambda line: None, passes=sglang_passes(config))
    assert [kw.get("enable_return_aux_hidden_states", False) for kw in StandInEngine.started] == [True, False]
    assert StandInEngine.shutdowns == 2  # one engine at a time
    hidden = config.stage_dir("data") / "hidden"
    assert not list(hidden.glob("*.aux_hidden.*")) and not list(hidden.glob("*.last_hidden.*"))
    served = {s.id: s for s in read_dataset(hidden)}
    local = load_config(TINY, micro_overrides(tmp_path / "run", micro_target) + ["data.num_samples=12", f"run.dir={tmp_path / 'local'}"])
    regenerate(local, log=lambda line: None)
    capture(local, log=lambda line: None)
    for sample in read_dataset(local.stage_dir("data") / "hidden"):
        other = served[sample.id]
        assert torch.equal(other.input_ids, sample.input_ids) and torch.equal(other.loss_mask, sample.loss_mask)
        torch.testing.assert_close(other.aux_hidden.float(), sample.aux_hidden.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(other.last_hidden.float(), sample.last_hidden.float(), atol=2e-2, rtol=2e-2)


def test_an_unsupported_release_is_refused_before_any_engine_starts(tmp_path, micro_target, stand_in_sglang):
    stand_in_sglang.__version__ = "0.5.22"
    config = load_config(TINY, micro_overrides(tmp_path / "run", micro_target) + ["data.num_samples=4", "data.capture_engine=sglang"])
    regenerate(config, log=lambda line: None)
    with pytest.raises(Eagle3Error, match="SGLang 0.5.22 is not supported for capture \\(supported: 0.5.23\\)"):
        capture(config, log=lambda line: None, passes=sglang_passes(config))
    assert StandInEngine.started == []


def test_pre_norm_is_refused_for_sglang_capture():
    with pytest.raises(Exception, match="SGLang returns the last hidden state after the final norm"):
        load_config(TINY, ["data.capture_engine=sglang", "data.last_hidden=pre_norm"])


def test_sigterm_to_the_cli_stops_the_node_process_group(tmp_path):
    import signal
    import subprocess
    import time

    node_python = tmp_path / "node-python"
    pid_file = tmp_path / "child.pid"
    node_python.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nsleep 300 &\nwait\n")
    node_python.chmod(0o755)
    cli = subprocess.Popen([sys.executable, "-m", "eagle3.cli", "data", "capture", "--config", str(TINY),
                            f"--set=run.dir={tmp_path / 'run'}", "--set=data.capture_engine=sglang",
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


def test_a_missing_node_python_is_one_line(tmp_path):
    import subprocess

    result = subprocess.run([sys.executable, "-m", "eagle3.cli", "data", "capture", "--config", str(TINY),
                             f"--set=run.dir={tmp_path}", "--set=data.capture_engine=sglang",
                             "--set=data.sglang_python=/nonexistent/python"], capture_output=True, text=True)
    assert result.returncode == 2 and "data.sglang_python" in result.stderr and "Traceback" not in result.stderr
