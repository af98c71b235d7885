"""Launching servers: command lines for every launcher, health waits with deadlines, log tails on failure,
stops that leave no process of the group behind, and validation against the live release before any
benchmark. Real processes on 127.0.0.1; the reference server stands in for SGLang."""

import os
import re
import shlex
import stat
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from drafts import write_draft
from eagle3.resolve import load_config
from eagle3.errors import ConfigError, Eagle3Error
from eagle3.procs import GPU_QUERY, LaunchError, wrap
from eagle3.serving import ENGINES, serving_engine
from eagle3.serving.reference import REFERENCE
from eagle3.serving.sglang import SGLANG
from eagle3.serve.launch import Server, launch_and_validate, server_for
from eagle3.warm import fork_module
from eagle3.serving.base import launch_spec
from helpers import MICRO_DRAFT, RELEASE, TINY
from ports import free_port


def config_for(tmp_path, *overrides):
    return load_config(TINY, [f"run.dir={tmp_path}", f"serving.port={free_port()}", "serving.context_length=512",
                              *overrides])


def live_members(pgid: int) -> list[int]:
    """Processes of the group that are not zombies (PID 1 here may not reap orphans)."""
    pids = []
    for path in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = path.read_text()
        except OSError:
            continue
        state, _, group = text[text.rindex(")") + 2:].split()[:3]
        if int(group) == pgid and state != "Z":
            pids.append(int(path.parent.name))
    return pids


def python_server(tmp_path, code: str, logs: list) -> Server:
    return Server([sys.executable, "-c", code], "127.0.0.1", free_port(), tmp_path / "logs", logs.append,
                  label="test endpoint, launcher local", gpu_query=None, grace_s=5)


# ---------------------------------------------------------------------------------------------
# Command lines


def test_sglang_command_with_and_without_a_draft(tmp_path):
    config = config_for(tmp_path, "serving.engine=sglang", "serving.tp=8", "serving.num_steps=4",
                        "data.sglang_python=/opt/sglang/bin/python",
                        "serving.extra_args=[--trust-remote-code, --mem-fraction-static, '0.85']")
    s = config.serving
    command = SGLANG.command(launch_spec(config), "/models/kimi", "/drafts/d1")
    assert command == [
        "/opt/sglang/bin/python", "-m", "sglang.launch_server", "--model-path", "/models/kimi",
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/drafts/d1",
        "--speculative-num-steps", "4", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "5",
        "--tp-size", "8", "--host", "127.0.0.1", "--port", str(s.port), "--context-length", "512",
        "--trust-remote-code", "--mem-fraction-static", "0.85"]
    plain = SGLANG.command(launch_spec(config), "/models/kimi", None)
    assert plain == command[:5] + command[15:]  # the same without the five speculative flags
    assert not [a for a in plain if "speculative" in a]


@pytest.mark.parametrize("extra", [["--speculative-algorithm", "EAGLE"], ["--speculative-algorithm=EAGLE"],
                                   ["--speculative_algorithm", "EAGLE3"]])
def test_extra_args_never_set_the_algorithm(tmp_path, extra):
    config = config_for(tmp_path, "serving.engine=sglang", f"serving.extra_args={extra}")
    for draft in ("/drafts/d1", None):
        with pytest.raises(LaunchError, match="--speculative-algorithm"):
            SGLANG.command(launch_spec(config), "/models/kimi", draft)


@pytest.mark.parametrize("extra, named", [
    ("--port=1234", "--port (= --port)"),
    ("--tp-size", "--tp-size (= --tp-size)"),
    ("--tensor-parallel-size", "--tensor-parallel-size (= --tp-size)"),
    ("--tp", "--tp (= --tp-size)"),  # an argparse abbreviation sets the same field
    ("--context-len", "--context-len (= --context-length)"),
    ("--model", "--model (= --model-path)"),
])
def test_extra_args_may_not_repeat_a_flag_the_launcher_sets(tmp_path, extra, named):
    config = config_for(tmp_path, "serving.engine=sglang", f"serving.extra_args=['{extra}', '4']")
    with pytest.raises(LaunchError, match=re.escape(f"repeats {named}")):
        SGLANG.command(launch_spec(config), "/models/kimi", "/drafts/d1")


@pytest.mark.parametrize("flag", ["--enable-two-batch-overlap", "--enable-two-batch"])
def test_two_batch_overlap_is_refused_where_it_loses_the_aux_capture(tmp_path, flag):
    config = config_for(tmp_path, "serving.engine=sglang", f"serving.extra_args=['{flag}']", "target.family=deepseek_v2",
                        "data.aux_layers=[1, 2]")  # DeepSeek's files cannot capture layer 0 from 0.5.13 on
    with pytest.raises(LaunchError, match="captures aux hidden states only below first_k_dense_replace"):
        SGLANG.command(launch_spec(config), "/models/kimi", "/drafts/d1")
    assert flag in SGLANG.command(launch_spec(config), "/models/kimi", None)  # a server without a draft captures nothing
    llama = config_for(tmp_path, "serving.engine=sglang", f"serving.extra_args=['{flag}']", "target.family=llama")
    assert flag in SGLANG.command(launch_spec(llama), "/models/llama", "/drafts/d1")


def test_reference_command(tmp_path):
    config = config_for(tmp_path, "run.cpu_threads=1")
    assert REFERENCE.command(launch_spec(config), "/t", "/d") == [
        sys.executable, "-m", "eagle3.cli", "serve", "--target", "/t", "--draft", "/d", "--num-steps", "3",
        "--eagle-topk", "1", "--num-draft-tokens", "4", "--release", RELEASE, "--dtype", "auto", "--threads", "1",
        "--host", "127.0.0.1", "--port", str(config.serving.port)]
    unreleased = config_for(tmp_path, "serving.release=null")
    command = REFERENCE.command(launch_spec(unreleased), "/t", None)
    assert "--draft" not in command and "--release" not in command


def test_serving_engines_by_name():
    assert serving_engine("sglang") is SGLANG and serving_engine("reference") is REFERENCE
    assert REFERENCE.forks_warm and not SGLANG.forks_warm  # only an in-project server forks from the warm process
    assert SGLANG.served_release("0.5.14", "0.5.13") == "0.5.14"  # SGLang: what the live server reports
    assert REFERENCE.served_release("0.5.14", "0.5.13") == "0.5.13"  # the reference server: the release it stands for
    with pytest.raises(Eagle3Error, match="serving.engine 'tgi' is no registered serving engine .*sglang, reference, vllm"):
        serving_engine("tgi")
    for name in ENGINES:  # a config can name every registered engine, and only those (the resolve step checks it)
        assert load_config(TINY, [f"serving.engine={name}"]).serving.engine == name
    with pytest.raises(ConfigError, match=r"serving.engine \(from --set\): 'tgi' is not registered; give 'reference', "
                                          "'sglang' or 'vllm'"):
        load_config(TINY, ["serving.engine=tgi"])


def test_launchers_wrap_the_command(tmp_path):
    command = ["python", "-m", "sglang.launch_server", "--model-path", "/models/my target", "--port", "30000"]
    assert wrap(command, "local") == command
    ssh = wrap(command, "ssh", "gpu-node-1")
    assert ssh[:3] == ["ssh", "-tt", "gpu-node-1"] and len(ssh) == 4 and shlex.split(ssh[3]) == command
    assert wrap(command, "srun", srun_args=["--nodes=1", "--gres=gpu:8"]) == ["srun", "--nodes=1", "--gres=gpu:8", *command]
    with pytest.raises(LaunchError, match="needs a host"):
        wrap(command, "ssh", None)


def test_server_for_names_endpoint_and_launcher(tmp_path):
    config = config_for(tmp_path, "serving.engine=sglang", "serving.launcher=ssh", "serving.host=10.0.0.5",
                        "serving.ssh_host=gpu-node-1")
    lines = []
    server = server_for(launch_spec(config), "/models/kimi", "/drafts/d1", lines.append)
    assert server.command[:3] == ["ssh", "-tt", "gpu-node-1"] and "sglang.launch_server" in server.command[3]
    assert server.url == f"http://10.0.0.5:{config.serving.port}" and server.log_dir == tmp_path / "logs"
    assert server.gpu_query == ["ssh", "-tt", "gpu-node-1", shlex.join(GPU_QUERY)]
    server.log("hello")
    assert lines == [f"[candidate sglang endpoint http://10.0.0.5:{config.serving.port}, launcher ssh gpu-node-1] hello"]
    srun = server_for(launch_spec(config_for(tmp_path, "serving.launcher=srun", "serving.srun_args=[-N1]")), "/t", None)
    assert srun.command[:2] == ["srun", "-N1"] and "launcher srun" in srun.label


def test_ssh_args_go_before_the_host_of_every_ssh_the_server_needs(tmp_path):
    options = ["-p", "2222", "-i", "/keys/node", "-o", "ProxyJump=login-1", "-vq"]
    config = config_for(tmp_path, "serving.engine=sglang", "serving.launcher=ssh", "serving.host=10.0.0.5",
                        f"serving.ssh_args={options}")
    server = server_for(launch_spec(config), "/models/kimi", None)
    assert server.command[:-1] == ["ssh", "-tt", *options, "10.0.0.5"]
    assert server.gpu_query == ["ssh", "-tt", *options, "10.0.0.5", shlex.join(GPU_QUERY)]


@pytest.mark.parametrize("options, message", [
    (["gpu-2"], "'gpu-2' is not an ssh option: the launcher puts the host and the command after these"),
    (["-p", "2222", "nvidia-smi"], "'nvidia-smi' is not an ssh option"),
    (["--port=2222"], "'--port=2222' is not an ssh option"),
    (["-i"], "-i needs a value after it"),
    (["-N"], "-N runs no remote command"),
    (["-vT"], "-T takes away the terminal the launcher asks for"),
    (["-f"], "-f puts ssh in the background"),
    (["-o", "RemoteCommand=uptime"], "-o RemoteCommand=uptime replaces the launcher's command"),
    (["-oRequestTTY no"], "-o RequestTTY no changes the terminal"),
    (["-Z"], "ssh has no option -Z"),
])
def test_ssh_args_that_would_break_the_launcher_are_refused_naming_the_field(tmp_path, options, message):
    with pytest.raises(Eagle3Error, match=rf"serving\.ssh_args.*{re.escape(message)}"):
        config_for(tmp_path, "serving.launcher=ssh", f"serving.ssh_args={options}")


# ---------------------------------------------------------------------------------------------
# Processes


def test_a_server_that_never_serves_fails_at_the_deadline(tmp_path):
    logs = []
    server = python_server(tmp_path, "import time; print('loading', flush=True); time.sleep(60)", logs)
    server.start()
    pgid, start = server.process.pid, time.monotonic()
    with pytest.raises(LaunchError, match="not healthy after 2 s") as err:
        server.wait_healthy(2, interval_s=0.2)
    assert 2 <= time.monotonic() - start < 15
    assert "loading" in str(err.value) and server.process is None and not live_members(pgid)
    assert all(line.startswith("[test endpoint, launcher local] ") for line in logs)


def test_a_server_that_exits_at_start_fails_with_its_log_tail(tmp_path):
    logs = []
    code = "import sys\nfor i in range(100): print('line', i)\nprint('boom: bad flag'); sys.exit(3)"
    server = python_server(tmp_path, code, logs)
    server.start()
    start = time.monotonic()
    with pytest.raises(LaunchError) as err:
        server.wait_healthy(60, interval_s=0.2)
    message = str(err.value)
    assert time.monotonic() - start < 10 and "exited with status 3" in message and "boom: bad flag" in message
    assert "line 61" in message and "line 60\n" not in message  # the last 40 lines, no more


def test_a_healthy_server_that_reports_no_release_fails_naming_it(tmp_path):
    """The release picks the loader rules the draft is validated by: a server that reports none is stopped."""
    logs = []
    code = ("from http.server import BaseHTTPRequestHandler, HTTPServer\n"
            "class H(BaseHTTPRequestHandler):\n"
            "    def do_GET(self):\n"
            "        body = b'{}' if self.path == '/server_info' else b'ok'\n"
            "        self.send_response(200); self.end_headers(); self.wfile.write(body)\n"
            "import sys; HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n")
    server = python_server(tmp_path, code, logs)
    server.command.append(server.url.rsplit(":", 1)[1])
    server.start()
    pgid = server.process.pid
    with pytest.raises(LaunchError, match=r"healthy, but its release report failed: /server_info has no version: \{\}"):
        server.wait_healthy(30, interval_s=0.2)
    assert server.process is None and not live_members(pgid)


def test_an_endpoint_another_server_already_answers_on_is_refused_before_starting(tmp_path):
    """A server a stopped run left behind would answer the new one's health check and be measured in its place."""
    from fastapi import FastAPI

    from eagle3.serve.inprocess import serve_in_thread

    with serve_in_thread(FastAPI()) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        server = Server([sys.executable, "-c", "print('never run')"], "127.0.0.1", port, tmp_path / "logs",
                        lambda line: None, label="test endpoint, launcher local", gpu_query=None)
        with pytest.raises(LaunchError, match=f"{url} already answers before this server started"):
            server.start()
    assert server.process is None and not (tmp_path / "logs").exists()


def test_stop_kills_the_whole_group(tmp_path):
    logs = []
    server = Server(["sh", "-c", "sleep 300 & sleep 300"], "127.0.0.1", free_port(), tmp_path / "logs", logs.append,
                    label="test endpoint, launcher local", grace_s=5)
    with server:
        pgid = server.process.pid
        deadline = time.monotonic() + 10
        while len(live_members(pgid)) < 3 and time.monotonic() < deadline:  # sh and two sleeps
            time.sleep(0.05)
        assert len(live_members(pgid)) == 3 and pgid != os.getpgid(0)
    assert not live_members(pgid) and server.process is None
    assert any("nvidia-smi not found" in line for line in logs) or any("GPU memory" in line for line in logs)
    server.stop()  # a second stop is harmless


def test_stop_kills_what_ignores_term(tmp_path):
    logs = []
    server = Server(["sh", "-c", "trap '' TERM; sleep 300 & sleep 300"], "127.0.0.1", free_port(), tmp_path, logs.append,
                    gpu_query=None, grace_s=1)
    server.start()
    pgid = server.process.pid
    time.sleep(0.3)
    server.stop()
    assert not live_members(pgid) and any("still alive 1 s after SIGTERM" in line for line in logs)


def fake_nvidia_smi(tmp_path, readings: list[str]) -> Path:
    """An nvidia-smi that answers the memory query with the next reading on each call (then the last)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for i, reading in enumerate(readings):
        (bin_dir / f"reading{i}").write_text(reading)
    script = bin_dir / "nvidia-smi"
    script.write_text(f"#!/bin/sh\nd={bin_dir}\nn=$(cat $d/calls 2>/dev/null || echo 0)\necho $((n+1)) > $d/calls\n"
                      f"[ $n -ge {len(readings)} ] && n={len(readings) - 1}\ncat $d/reading$n\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def test_stop_waits_for_gpu_memory(tmp_path, monkeypatch):
    bin_dir = fake_nvidia_smi(tmp_path, ["80000\n79000\n", "30000\n100\n", "500\n20\n"])
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(time, "sleep", lambda s, real=time.sleep: real(min(s, 0.05)))
    logs = []
    server = Server(["sleep", "300"], "127.0.0.1", free_port(), tmp_path / "logs", logs.append, label="e", gpu_free_mib=1024)
    server.start()
    server.stop()
    assert (bin_dir / "calls").read_text().strip() == "3" and "[e] GPU memory used (MiB) [500, 20]: below 1024" in logs[-1]

    (bin_dir / "calls").unlink()
    stuck = Server(["sleep", "300"], "127.0.0.1", free_port(), tmp_path / "logs", logs.append, label="e",
                   gpu_free_mib=10, gpu_free_timeout_s=0.2)
    stuck.start()
    with pytest.raises(LaunchError, match=r"GPU memory still in use .* \[500, 20\] MiB"):
        stuck.stop()


def test_no_nvidia_smi_is_skipped_and_said(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # sleep is found by its full path
    logs = []
    server = Server(["/bin/sleep", "300"], "127.0.0.1", free_port(), tmp_path / "logs", logs.append, label="e")
    with server:
        pass
    assert logs[-1] == "[e] nvidia-smi not found here: not waiting for GPU memory"


# ---------------------------------------------------------------------------------------------
# The reference server for the micro target, validated against the release it reports


@pytest.fixture(scope="module")
def micro_drafts(tmp_path_factory):
    root = tmp_path_factory.mktemp("launch-drafts")
    good = write_draft(root / "good", layout="sglang", release=RELEASE, **MICRO_DRAFT)
    absolute = root / "absolute"
    absolute.mkdir()
    for path in good.iterdir():
        (absolute / path.name).write_bytes(path.read_bytes())
    tensors = load_file(absolute / "model.safetensors")
    tensors["d2t"] = tensors["d2t"] + torch.arange(tensors["d2t"].numel())  # target ids instead of offsets
    save_file(tensors, absolute / "model.safetensors", metadata={"format": "pt"})
    return {"good": good, "absolute": absolute}


@pytest.mark.parametrize("warm", [True, False], ids=["forked-warm", "new-interpreter"])
def test_reference_server_becomes_healthy_and_reports_its_release(tmp_path, micro_target, warm):
    config = config_for(tmp_path, f"run.warm_start={warm}")
    logs = []
    with server_for(launch_spec(config), micro_target, None, logs.append) as server:
        assert server.warm is warm
        assert server.wait_healthy(120, interval_s=0.2) == RELEASE
        info = httpx.get(f"{server.url}/get_model_info", timeout=10).json()
        assert info["model_path"] == str(micro_target) and info["draft_model_path"] is None
        pgid = server.process.pid
        assert os.getsid(pgid) == pgid  # a session of its own either way: a signal to the caller never reaches it
    assert not live_members(pgid)
    label = f"[candidate reference endpoint http://127.0.0.1:{config.serving.port}, launcher local] "
    assert logs and all(line.startswith(label) for line in logs)
    assert any(f"reports version {RELEASE}" in line for line in logs)
    assert ("forked from the warm process" in logs[0]) is warm
    assert any(p.name.startswith("server-") for p in (tmp_path / "logs").iterdir())


def test_a_production_server_that_outlives_the_run_is_never_forked(tmp_path):
    config = config_for(tmp_path)
    assert server_for(launch_spec(config), tmp_path, None, role="candidate").warm
    assert not server_for(launch_spec(config), tmp_path, None, role="production", outlives_run=True).warm
    assert not server_for(launch_spec(config), tmp_path, None, role="production", unit="eagle3-production.scope").warm
    assert not server_for(launch_spec(config_for(tmp_path, "serving.engine=sglang")), tmp_path, None).warm


def test_a_fork_runs_its_module_with_the_callers_environment_and_reports_its_exit(tmp_path, monkeypatch):
    missing = [sys.executable, "-m", "json.tool", str(tmp_path / "missing.json")]
    failed = fork_module(missing, tmp_path / "fail.log")  # the fork server is running from here on
    assert failed.wait(60) == 2 and "missing.json" in (tmp_path / "fail.log").read_text()  # argparse's status
    monkeypatch.setenv("EAGLE3_WARM_PROBE", "set after the fork server started")
    probe = "import os; print('probe:', os.environ['EAGLE3_WARM_PROBE'], 'leads its session:', os.getsid(0) == os.getpid())"
    forked = fork_module([sys.executable, "-m", "timeit", "-n", "1", "-r", "1", "-s", probe, "pass"], tmp_path / "env.log")
    assert forked.wait(60) == 0 and forked.poll() == 0
    assert "probe: set after the fork server started leads its session: True" in (tmp_path / "env.log").read_text()
    with pytest.raises(ValueError, match="does not run a module"):
        fork_module([sys.executable, "-c", "pass"], tmp_path / "never.log")


def test_launch_and_validate_passes_a_good_draft(tmp_path, micro_target, micro_drafts):
    config = config_for(tmp_path)
    logs = []
    server = launch_and_validate(launch_spec(config), micro_target, micro_drafts["good"], logs.append)
    try:
        assert server.release == RELEASE and server.process.poll() is None
        info = httpx.get(f"{server.url}/get_model_info", timeout=10).json()
        assert info["draft_model_path"] == str(micro_drafts["good"])
        assert any(f"validated for SGLang {RELEASE}" in line for line in logs)
    finally:
        server.stop()


def test_launch_and_validate_refuses_absolute_d2t_and_stops_the_server(tmp_path, micro_target, micro_drafts):
    config = config_for(tmp_path)
    logs = []
    with pytest.raises(LaunchError) as err:
        launch_and_validate(launch_spec(config), micro_target, micro_drafts["absolute"], logs.append)
    assert "d2t-absolute" in str(err.value) and str(micro_drafts["absolute"]) in str(err.value)
    pgid = int(next(line for line in logs if "stopping process group" in line).rsplit(" ", 1)[1])
    assert not live_members(pgid)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{config.serving.port}/health", timeout=5)


def test_launch_and_validate_refuses_a_missing_draft_before_launching(tmp_path, micro_target):
    logs = []
    with pytest.raises(LaunchError, match="no such directory; nothing was launched"):
        launch_and_validate(launch_spec(config_for(tmp_path)), micro_target, tmp_path / "nope", logs.append)
    assert logs == []
