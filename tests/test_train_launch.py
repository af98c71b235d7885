"""Training as a subprocess in its own process group: command lines for every launcher, streamed logs and
metrics, and stops (a cancel, a failing callback, a failing trainer) that leave no process of it behind.
Real trainers on the micro dataset; torchrun on two CPU ranks for the cancel."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from eagle3.config import resolved_config_file
from eagle3.resolve import load_config
from eagle3.errors import ConfigError, Eagle3Error
from eagle3.procs import ProcessTree, Terminated, group_alive, process_table, terminate_on_sigterm
from eagle3.train.launch import (
    MetricsFollower,
    TrainingFailed,
    TrainingStopped,
    child_env,
    failure_message,
    launch_commands,
    stopped_by_sigterm,
    train,
)
from helpers import TINY, metrics, micro_overrides, run_copy

SHORT = ["training.max_steps=6", "training.eval_every=3", "training.save_every=2"]


def config_for(*overrides):
    return load_config(TINY, ["run.dir=/runs/r1", *overrides])


RESOLVED = "/runs/r1/config.resolved.yaml"


def entry():
    return ["-m", "eagle3.train", "--config", RESOLVED]


def train_run(overrides, log, on_metrics=None):
    """What the flow's train stage does: the run's resolved config file, then the launcher."""
    config = load_config(TINY, overrides)
    return train(config.run, config.data, config.training, config.serving, resolved_config_file(config), log,
                 on_metrics)


def running(run_dir: Path) -> list[int]:
    """Live processes whose command line names the run directory: the trainer, torchrun and its workers."""
    pids = []
    for pid, (state, _, _) in process_table().items():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue  # exited meanwhile
        if state not in "ZX" and str(run_dir).encode() in cmdline:
            pids.append(pid)
    return pids


def pgid_from(lines: list[str]) -> int:
    return int(next(m[1] for line in lines if (m := re.match(r"train: process group (\d+):", line))))


# ---------------------------------------------------------------------------------------------
# Command lines and config


def test_one_process_runs_the_trainer_and_several_run_torchrun_standalone():
    one, four = config_for(), config_for("training.nproc_per_node=4")
    assert launch_commands(one.run, one.data, one.training, RESOLVED, Path("/w")) == [[sys.executable, *entry()]]
    torchrun = launch_commands(four.run, four.data, four.training, RESOLVED, Path("/w"))
    assert torchrun == [[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                         *entry()]]


def test_ssh_starts_torchrun_on_every_host_in_our_directory_with_a_rendezvous():
    config = config_for("training.nnodes=2", "training.nproc_per_node=8", "training.launcher=ssh",
                        "training.hosts=[gpu-1, gpu-2]", "training.rdzv_endpoint=gpu-1:29500",
                        "training.python=/opt/venv/bin/python", "run.cpu_threads=16",
                        "training.ssh_args=[-p, '2222', -i, /keys/cluster, -o, ProxyJump=login-1]")
    commands = launch_commands(config.run, config.data, config.training, RESOLVED, Path("/shared/my work"))
    torchrun = ["/opt/venv/bin/python", "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "8",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", "gpu-1:29500", "--rdzv-id", "tiny-cpu",
                *entry()]
    # a login's environment, not ours: the variables the ranks need travel with the command
    env = ["env", "PYTHONUNBUFFERED=1", "OMP_NUM_THREADS=2", "MKL_NUM_THREADS=2"]
    options = ["-p", "2222", "-i", "/keys/cluster", "-o", "ProxyJump=login-1"]
    assert [c[:-1] for c in commands] == [["ssh", "-tt", *options, "gpu-1"], ["ssh", "-tt", *options, "gpu-2"]]
    for command in commands:
        shell, flag, script = shlex.split(command[-1])
        assert (shell, flag) == ("sh", "-c")
        assert script == f"cd '/shared/my work' && exec {shlex.join([*env, *torchrun])}"


def test_srun_starts_one_torchrun_per_node():
    config = config_for("training.nnodes=4", "training.launcher=srun", "training.rdzv_endpoint=node-1:29500",
                        "training.srun_args=[--gres=gpu:8, --time=12:00:00]")
    [command] = launch_commands(config.run, config.data, config.training, RESOLVED, Path("/w"))
    assert command[:6] == ["srun", "--nodes=4", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--gres=gpu:8",
                           "--time=12:00:00"]
    assert command[6:12] == ["python", "-m", "torch.distributed.run", "--nnodes", "4", "--nproc-per-node"]
    assert "--standalone" not in command and command[command.index("--rdzv-endpoint") + 1] == "node-1:29500"


@pytest.mark.parametrize("overrides, message", [
    (["training.nnodes=2", "training.rdzv_endpoint=n1:29500"], "training.nnodes 2 needs training.launcher ssh"),
    (["training.nnodes=2", "training.launcher=ssh", "training.hosts=[n1]", "training.rdzv_endpoint=n1:29500"],
     "one training.hosts entry per node: 1 hosts for training.nnodes 2"),
    (["training.nnodes=2", "training.launcher=srun"], "training.nnodes 2 needs training.rdzv_endpoint host:port"),
    (["training.hosts=[n1]"], "training.hosts is for training.launcher ssh, not local"),
    (["training.launcher=srun", "training.srun_args=[-N2, --ntasks=4]"], "training.srun_args sets --ntasks, -N"),
    (["training.rdzv_endpoint=n1"], "training.rdzv_endpoint.*'n1' is not host:port"),
    (["training.ssh_args=[-p, '2222']"], "training.ssh_args is for training.launcher ssh, not local"),
])
def test_config_refuses_launchers_that_cannot_reach_every_node(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config_for(*overrides)


def test_child_env_is_unbuffered_and_splits_the_runs_threads_among_the_ranks(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "16")  # the caller's pool does not leak into the ranks
    env_of = lambda *sets: child_env(config_for(*sets).run, config_for(*sets).training)  # noqa: E731
    assert env_of("run.cpu_threads=8")["PYTHONUNBUFFERED"] == "1"
    assert env_of("run.cpu_threads=8")["OMP_NUM_THREADS"] == "8"
    assert env_of("run.cpu_threads=8", "training.nproc_per_node=2")["MKL_NUM_THREADS"] == "4"
    assert env_of("run.cpu_threads=1", "training.nproc_per_node=2")["OMP_NUM_THREADS"] == "1"
    half = max(1, len(os.sched_getaffinity(0)) // 2)  # unset: half the machine, two jobs can be busy at once
    assert child_env(config_for().run, config_for().training)["OMP_NUM_THREADS"] == str(half)


def test_failure_message_puts_the_workers_errors_first():
    lines = ["loading", "[rank1]: Traceback (most recent call last):", "[rank1]: ValueError: bad shard",
             *[f"torchrun line {i}" for i in range(40)]]
    message = failure_message(1, lines, Path("/runs/r1/logs/train.log"))
    head, tail = message.split("\nlast 30 lines of output:\n")
    assert "exited with code 1" in head and "[rank1]: ValueError: bad shard" in head
    assert tail.splitlines() == [f"torchrun line {i}" for i in range(10, 40)]
    assert "killed by SIGKILL" in failure_message(-9, [], Path("x"))


def test_a_sigterm_stop_is_143_from_the_trainer_or_torchruns_signal_exception():
    torchrun_tail = ["[rank0]: train: stopped by SIGTERM at step 7; resume continues from here", "Traceback ...",
                     "torch.distributed.elastic.multiprocessing.api.SignalException: Process 19681 got signal: 15"]
    assert stopped_by_sigterm(143, []) and stopped_by_sigterm(1, torchrun_tail)
    assert not stopped_by_sigterm(1, ["ValueError: bad shard"]) and not stopped_by_sigterm(2, torchrun_tail)
    assert not stopped_by_sigterm(1, [*torchrun_tail[:2], "SignalException: Process 5 got signal: 1"])  # SIGHUP


# ---------------------------------------------------------------------------------------------
# Metrics, signals and process trees


def append(path: Path, *records: dict, torn: str = "") -> None:
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records) + torn)


def test_metrics_follower_hands_out_each_new_complete_record_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    append(path, {"step": 1}, {"step": 2})  # a previous run's: not handed out
    follower = MetricsFollower(path, print)
    assert follower.poll() == []
    append(path, {"step": 3}, torn='{"step": 4, "lo')
    assert follower.poll() == [{"step": 3}]
    append(path, torn='ss": 1.5}\n')
    assert follower.poll() == [{"step": 4, "loss": 1.5}] and follower.poll() == []


def test_metrics_follower_after_a_resume_rewrote_the_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    append(path, *({"step": s, "loss": 9.0} for s in range(1, 6)))  # a run killed at 5, its checkpoint at 3
    follower = MetricsFollower(path, print)
    # the resumed trainer rewrites the file to the records up to 3 and appends, all between two polls
    path.write_text("".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in range(1, 4)))
    append(path, *({"step": s, "loss": 1.0, "tokens_per_s": 1234.5} for s in (4, 5, 6)))
    assert [r["step"] for r in follower.poll()] == [4, 5, 6]
    append(path, {"step": 7})
    assert follower.poll() == [{"step": 7}]


def test_metrics_follower_waits_for_the_file(tmp_path):
    follower = MetricsFollower(tmp_path / "metrics.jsonl", print)
    assert follower.poll() == []
    append(tmp_path / "metrics.jsonl", {"step": 1})
    assert follower.poll() == [{"step": 1}]


@pytest.fixture
def default_sigterm():
    """SIGTERM's default action for the test (a Prefect flow run earlier in the session leaves its own handler)."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_terminate_on_sigterm_raises_once_and_restores_the_default(default_sigterm):
    with pytest.raises(Terminated) as err, terminate_on_sigterm():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
    assert err.value.code == 143 and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_terminate_on_sigterm_keeps_a_handler_already_in_place():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with terminate_on_sigterm():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_terminate_on_sigterm_refuses_another_thread(default_sigterm):
    errors = []

    def enter():
        try:
            with terminate_on_sigterm():
                pass
        except Eagle3Error as err:
            errors.append(str(err))

    thread = threading.Thread(target=enter)
    thread.start()
    thread.join()
    assert len(errors) == 1 and "main thread" in errors[0]


LAUNCHER_LIKE_TORCHRUN = """
import subprocess, sys, time
for _ in range(2):  # workers in sessions of their own, as torchrun starts them
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
print("started", flush=True)
time.sleep(300)
"""


@pytest.mark.parametrize("launcher_dies_first", [False, True])
def test_a_stop_reaches_workers_in_their_own_sessions(launcher_dies_first):
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER_LIKE_TORCHRUN], stdout=subprocess.PIPE,
                                start_new_session=True)
    tree = ProcessTree([launcher])
    assert launcher.stdout.readline() == b"started\n"
    tree.refresh()
    workers = [g for g in tree.groups if g != launcher.pid]
    assert len(workers) == 2 and all(group_alive(g) for g in workers)
    if launcher_dies_first:  # killed outright: its workers are orphans that only remembered groups lead to
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
    tree.stop(grace_s=5, log=print)
    assert not any(group_alive(g) for g in [launcher.pid, *workers]) and launcher.returncode is not None
    launcher.stdout.close()


# ---------------------------------------------------------------------------------------------
# Real trainers


def test_train_streams_its_lines_and_every_metrics_record(micro_data, tmp_path):  # noqa: F811
    overrides, run_dir = run_copy(micro_data, tmp_path, "run", SHORT)
    lines, records = [], []
    result = train_run(overrides, lines.append, records.append)
    assert result == run_dir / "train" and (result / "final" / "model.safetensors").exists()
    assert any(line.startswith('train: {"step": 1,') for line in lines) and "train: 6 steps done" in "\n".join(lines)
    assert records == metrics(run_dir) and [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]
    [log_file] = (run_dir / "logs").glob("train-*.log")
    assert "train: 6 steps done" in log_file.read_text() and not running(run_dir)


def test_sigterm_to_the_trainer_stops_it_resumably_and_a_rerun_resumes(micro_data, tmp_path):  # noqa: F811
    overrides, run_dir = run_copy(micro_data, tmp_path, "run", ["training.max_steps=500", "training.save_every=1000"])
    lines = []

    def stop_at_step_2(record):
        if record["step"] == 2:
            os.killpg(pgid_from(lines), signal.SIGTERM)  # what a scheduler's preemption does

    with pytest.raises(TrainingStopped, match="run it again to resume"):
        train_run(overrides, lines.append, stop_at_step_2)
    stopped_at = max(r["step"] for r in metrics(run_dir))
    assert 2 <= stopped_at < 500 and not running(run_dir)
    assert [p.name for p in (run_dir / "train" / "checkpoints").iterdir()] == [f"step-{stopped_at:07d}"]
    longer = [*overrides, f"training.max_steps={stopped_at + 3}"]
    resumed = []
    train_run(longer, lines.append, resumed.append)
    assert [r["step"] for r in resumed if "loss" in r] == [stopped_at + 1, stopped_at + 2, stopped_at + 3]


def test_a_failing_callback_stops_the_trainer_and_propagates(micro_data, tmp_path):  # noqa: F811
    overrides, run_dir = run_copy(micro_data, tmp_path, "run", ["training.max_steps=500"])
    lines = []

    def broken(record):
        raise RuntimeError("progress artifact upload failed")

    with pytest.raises(RuntimeError, match="upload failed"):
        train_run(overrides, lines.append, broken)
    assert not group_alive(pgid_from(lines)) and not running(run_dir)


def test_a_failing_trainer_raises_with_its_own_error_line(tmp_path, micro_target):
    overrides = micro_overrides(tmp_path, micro_target)  # no captured dataset in it
    with pytest.raises(TrainingFailed) as err:
        train_run(overrides, lambda line: None)
    message = str(err.value)
    assert "exited with code 2" in message and "eagle3 train:" in message and "no data set here" in message


CANCELLED_FLOW = """
import json, sys
from eagle3.config import resolved_config_file
from eagle3.resolve import load_config
from eagle3.procs import terminate_on_sigterm
from eagle3.train.launch import train

config_path, *overrides = sys.argv[1:]
config = load_config(config_path, overrides)
with terminate_on_sigterm():
    train(config.run, config.data, config.training, config.serving, resolved_config_file(config),
          lambda line: print(line, flush=True),
          lambda record: print("metrics", json.dumps(record), flush=True))
"""


def test_sigterm_to_the_launcher_leaves_no_trainer_behind(micro_data, tmp_path):  # noqa: F811
    """A Prefect cancel: SIGTERM to the launching process only; torchrun's workers sit in sessions of their own."""
    overrides, run_dir = run_copy(micro_data, tmp_path, "run", [
        "training.max_steps=500", "training.save_every=1000", "training.nproc_per_node=2", "training.stop_grace_s=60"])
    launcher = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CANCELLED_FLOW), str(TINY), *overrides],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watchdog = threading.Timer(180, launcher.kill)
    watchdog.start()
    lines = []
    try:
        for line in launcher.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("metrics "):
                workers = [pid for pid in running(run_dir) if pid != launcher.pid]
                launcher.send_signal(signal.SIGTERM)
                break
        rest = launcher.stdout.read()
        code = launcher.wait()
    finally:
        watchdog.cancel()
    output = "\n".join([*lines, rest])
    assert code == 143, output[-3000:]  # Terminated: the launcher stopped because it was told to
    assert len(workers) >= 3, workers  # torchrun and two ranks were running
    assert not running(run_dir) and not group_alive(pgid_from(lines)), output[-3000:]
    assert list((run_dir / "train" / "checkpoints").glob("step-*"))  # the ranks saved before they went


def test_streamed_capture_workers_beside_the_trainers_take_their_share_of_the_threads():
    """Two capture workers started here beside one rank: three busy processes share run.cpu_threads."""
    config = config_for("run.cpu_threads=6", "training.features=streamed", "training.stream.workers_per_host=2")
    assert child_env(config.run, config.training)["OMP_NUM_THREADS"] == "2"
    assert child_env(config.run, config.training)["MC_LOG_LEVEL"] == "ERROR"  # Mooncake's client, quiet
    remote = config_for("run.cpu_threads=6", "training.features=streamed", "training.stream.capture_hosts=[cap-1]")
    assert child_env(remote.run, remote.training)["OMP_NUM_THREADS"] == "6"
