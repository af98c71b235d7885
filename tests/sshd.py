"""A second "node" on this machine: Debian's OpenSSH server on 127.0.0.1, for the tests that start training and
servers through the ssh launcher for real.

`running_sshd(directory)` generates a host key, a client key authorised for the user running the tests (root in CI),
a known_hosts file holding the host key and an sshd_config, all in `directory`; starts `sshd -D -e` on a free port
and stops it at the end. `Sshd.ssh_args` are the options a config's `training.ssh_args` / `serving.ssh_args` take to
reach it: its port, the client key, the known_hosts file (the host key checked, strictly) and no password prompt.

CI installs openssh-server (.ci/run); `require_sshd()` skips with the reason on a machine without it, and fails
instead where EAGLE3_REQUIRE_SSHD is set (.ci/run sets it).
"""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ports import free_port

SSHD = Path(os.environ.get("SSHD", "/usr/sbin/sshd"))
PRIVILEGE_SEPARATION_DIR = Path("/run/sshd")  # Debian's sshd refuses to start without it
START_TIMEOUT_S = 20.0


def require_sshd() -> Path:
    """sshd and the ssh client, or skip (fail where EAGLE3_REQUIRE_SSHD is set) naming what is missing."""
    missing = [f"no sshd at {SSHD}"] if not (SSHD.is_file() and os.access(SSHD, os.X_OK)) else []
    missing += [f"no {tool} on PATH" for tool in ("ssh", "ssh-keygen") if shutil.which(tool) is None]
    if missing:
        reason = f"{'; '.join(missing)} (Debian: apt-get install openssh-server; .ci/run installs it)"
        if os.environ.get("EAGLE3_REQUIRE_SSHD"):
            pytest.fail(reason)
        pytest.skip(reason)
    return SSHD


@dataclass(frozen=True)
class Sshd:
    host: str
    port: int
    ssh_args: list[str]
    log_path: Path

    def run(self, command: str, timeout_s: float = 30.0) -> subprocess.CompletedProcess:
        return subprocess.run(["ssh", *self.ssh_args, self.host, command], capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=timeout_s)


def keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name, "-f", str(path)], check=True)


def sshd_config(directory: Path, port: int) -> str:
    # StrictModes no: pytest's tmp directories are not owned and moded as sshd demands of a home's .ssh;
    # UsePAM no: key authentication alone, no login session to set up in a container
    return "\n".join([
        f"Port {port}", "ListenAddress 127.0.0.1", f"HostKey {directory / 'host_key'}",
        f"AuthorizedKeysFile {directory / 'authorized_keys'}", f"PidFile {directory / 'sshd.pid'}",
        "PermitRootLogin prohibit-password", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
        "UsePAM no", "StrictModes no", "X11Forwarding no", "PrintMotd no", "LogLevel INFO", "",
    ])


@contextlib.contextmanager
def running_sshd(directory: Path) -> Iterator[Sshd]:
    sshd = require_sshd()
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("host_key", "client_key"):
        keygen(directory / name)
    (directory / "authorized_keys").write_text((directory / "client_key.pub").read_text())
    host, port = "127.0.0.1", free_port()
    key_type, key = (directory / "host_key.pub").read_text().split()[:2]
    (directory / "known_hosts").write_text(f"[{host}]:{port} {key_type} {key}\n")
    config = directory / "sshd_config"
    config.write_text(sshd_config(directory, port))
    PRIVILEGE_SEPARATION_DIR.mkdir(mode=0o755, exist_ok=True)
    ssh_args = ["-p", str(port), "-i", str(directory / "client_key"), "-F", "/dev/null",
                "-o", f"UserKnownHostsFile={directory / 'known_hosts'}", "-o", "StrictHostKeyChecking=yes",
                "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes", "-l", getpass.getuser()]
    log_path = directory / "sshd.log"
    with open(log_path, "ab") as log:
        # sshd re-executes itself for each connection, which it does only from an absolute path
        process = subprocess.Popen([str(sshd.resolve()), "-D", "-e", "-f", str(config)], stdout=log,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    server = Sshd(host, port, ssh_args, log_path)
    try:
        wait_until_it_answers(server, process)
        yield server
    finally:
        stop(process)


def wait_until_it_answers(server: Sshd, process: subprocess.Popen) -> None:
    end = time.monotonic() + START_TIMEOUT_S
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"sshd exited with status {process.returncode}:\n{server.log_path.read_text()}")
        answer = server.run("true", timeout_s=START_TIMEOUT_S)
        if answer.returncode == 0:
            return
        if time.monotonic() > end:
            raise RuntimeError(f"ssh to sshd on {server.host}:{server.port} failed for {START_TIMEOUT_S:.0f} s: "
                               f"{answer.stderr.strip()}\nsshd's log:\n{server.log_path.read_text()}")
        time.sleep(0.2)


def stop(process: subprocess.Popen) -> None:
    """sshd and the sessions it forked (each in the group sshd leads until it starts the user's command)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@pytest.fixture(scope="session")
def sshd(tmp_path_factory) -> Iterator[Sshd]:
    """One sshd per test session (per pytest-xdist worker), on 127.0.0.1 at a free port."""
    with running_sshd(tmp_path_factory.mktemp("sshd")) as server:
        yield server
