"""Which files under a run directory a stage reads and writes, recorded while its runner runs, and the audit that holds
the reads to the stage's key (tests/test_stage_reads.py).

What is seen: the interpreter's audit events - `open` (builtins.open, io, os.open: json, yaml, numpy, torch.load,
shutil's copies) as a read or a write by its flags, `os.rename` (atomic writes) and `os.truncate` as writes - and
safetensors' opens, which happen in Rust and raise no audit event, through wrappers around `safe_open` (load_file
calls it) and `serialize_file` (save_file). A child process (the trainer, under `python -m eagle3.train`) records into
the file EAGLE3_READ_AUDIT names when it starts with the sitecustomize `child_site` writes.

Not seen: directory listings and stat calls (a file a listing finds is judged when it is opened), and files other
native code opens: tokenizers reads the target's files (outside the run directory), torch.save writes through C++ (a
stage's checkpoints, under its own output: a write only decides which later reads are its own).

An audit hook cannot be removed: it is installed once per process and records only while `recording` is active.
"""

from __future__ import annotations

import hashlib
import os
import sys
from contextlib import contextmanager
from pathlib import Path

LOG_ENV = "EAGLE3_READ_AUDIT"  # the file a child process appends its records to, one `kind<TAB>path` a line
ROOT_ENV = "EAGLE3_READ_AUDIT_ROOT"  # the run directory whose files it records
READ, WRITE = "read", "write"
WATCHED = frozenset({"open", "os.rename", "os.truncate"})


class Recording:
    """The events on files under `root`, in order: (READ or WRITE, absolute path)."""

    def __init__(self, root: Path):
        self.roots = tuple({str(Path(root).absolute()) + os.sep, str(Path(root).resolve()) + os.sep})
        self.events: list[tuple[str, str]] = []

    def note(self, kind: str, path) -> None:
        if isinstance(path, int):  # an open file descriptor: its path was seen when it was opened
            return
        text = os.path.normpath(os.path.join(os.getcwd(), os.fsdecode(path)))
        if text.startswith(self.roots):
            self.add(kind, text)

    def add(self, kind: str, path: str) -> None:
        self.events.append((kind, path))


class ChildRecording(Recording):
    """A child process's recording: each event appended to the parent's file at once (the trainer may leave through
    os._exit, which flushes nothing)."""

    def __init__(self, root: Path, log: Path):
        super().__init__(root)
        self.log = open(log, "a", buffering=1)  # noqa: SIM115 - open for the life of the process

    def add(self, kind: str, path: str) -> None:
        self.log.write(f"{kind}\t{path}\n")


_active: Recording | None = None  # the recording in progress in this process, if any: the hook reads it


def on_event(event: str, args: tuple) -> None:
    recording = _active
    if recording is None or event not in WATCHED:
        return
    if event == "open":
        path, _, flags = args
        flags = flags or 0
        access = flags & os.O_ACCMODE
        fresh = flags & os.O_TRUNC or (flags & (os.O_CREAT | os.O_EXCL)) == (os.O_CREAT | os.O_EXCL)  # made empty
        if access != os.O_WRONLY and not fresh:
            recording.note(READ, path)
        if access != os.O_RDONLY:
            recording.note(WRITE, path)
    elif event == "os.rename":
        recording.note(WRITE, args[1])
    else:
        recording.note(WRITE, args[0])


_hooked = False


def hook() -> None:
    global _hooked
    if not _hooked:
        sys.addaudithook(on_event)
        _hooked = True


@contextmanager
def recording(into: Recording):
    """Record into `into` while the block runs."""
    global _active
    hook()
    _active = into
    try:
        yield into
    finally:
        _active = None


def noting(kind: str, function, position: int):
    """`function` (a safetensors entry point) noting its argument at `position`, a file, as `kind` when recording."""
    def wrapped(*args, **kwargs):
        if _active is not None:
            _active.note(kind, args[position] if len(args) > position else kwargs["filename"])
        return function(*args, **kwargs)
    wrapped.__wrapped__ = function
    return wrapped


def safetensors_patches() -> list[tuple[object, str, object]]:
    """(module, name, wrapper) for every loaded module that holds safetensors' `safe_open` or `serialize_file`:
    modules import them by name, so each binding is replaced, not just the package's."""
    import safetensors
    import safetensors.torch  # noqa: F401 - load_file and save_file look the names up in its namespace

    originals = {id(safetensors.safe_open): noting(READ, safetensors.safe_open, 0),  # (filename, framework, ...)
                 id(safetensors.serialize_file): noting(WRITE, safetensors.serialize_file, 1)}  # (tensors, filename)
    return [(module, name, originals[id(value)]) for module in list(sys.modules.values())
            for name, value in list(getattr(module, "__dict__", {}).items()) if id(value) in originals]


def record_child() -> None:
    """In a child process started with `child_site`'s sitecustomize: record everything it does under the run
    directory, from its start."""
    global _active
    for module, name, wrapper in safetensors_patches():
        setattr(module, name, wrapper)
    hook()
    _active = ChildRecording(Path(os.environ[ROOT_ENV]), Path(os.environ[LOG_ENV]))


def child_site(directory: Path) -> Path:
    """A directory holding a sitecustomize that makes a Python process started with it on PYTHONPATH record its
    run-directory files (`record_child`), when EAGLE3_READ_AUDIT is set."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(
        "import importlib.util, os, sys\n"
        f"if os.environ.get({LOG_ENV!r}):\n"
        f"    spec = importlib.util.spec_from_file_location('read_audit', {str(Path(__file__).resolve())!r})\n"
        "    module = importlib.util.module_from_spec(spec)\n"
        "    sys.modules['read_audit'] = module\n"
        "    spec.loader.exec_module(module)\n"
        "    module.record_child()\n")
    return directory


def child_events(log: Path) -> list[tuple[str, str]]:
    if not log.is_file():
        return []
    return [tuple(line.split("\t", 1)) for line in log.read_text().splitlines() if line]


# ---- the audit

def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def within(path: Path, places) -> bool:
    """Whether `path` is one of `places` or lies under one (a directory renamed into place holds what it holds)."""
    return any(path.is_relative_to(place) for place in places)


def foreign_reads(events: list[tuple[str, str]], own: list[Path]) -> list[Path]:
    """The files read that are not the stage's own: outside its own places (`own`: its output and what it resumes
    from) and not written by it before it read them."""
    written: set[Path] = set()
    found: dict[Path, None] = {}
    for kind, path in events:
        if kind == WRITE:
            written.add(Path(path))
        elif not within(Path(path), [*own, *written]):
            found[Path(path)] = None
    return list(found)


def writer(writers: dict[Path, str], path: Path) -> str:
    """The stage that wrote `path`, or a directory it renamed into place that holds it."""
    return next((writers[place] for place in (path, *path.parents) if place in writers), "no stage")


def keyed_files(read_by_fingerprint: list[Path], run_dir: Path) -> set[Path]:
    """The files whose content a stage's fingerprint pins: those the fingerprint hashes (its output's manifest, or
    the file itself), every file whose sha256 a pinned JSON file records, and every manifest whose directory's
    fingerprint a pinned JSON file records (how a key would chain through an output that records its upstream's
    fingerprint) - to a fixed point."""
    from eagle3.records.manifest import MANIFEST_FILE, fingerprint

    files = sorted(path for path in run_dir.rglob("*") if path.is_file() and not path.is_symlink())
    hashes = {path: sha256(path) for path in files}
    manifests = {path: fingerprint(path.parent) for path in files if path.name == MANIFEST_FILE}
    pinned, texts, grew = set(read_by_fingerprint), {}, True
    while grew:
        texts.update({path: path.read_text() for path in pinned - texts.keys() if path.suffix in (".json", ".jsonl")})
        recorded = {path for candidates in (hashes, manifests) for path, digest in candidates.items()
                    if any(digest in text for text in texts.values())}
        grew = not recorded <= pinned
        pinned |= recorded
    return pinned


def audit(stages: dict, reads: dict[str, list[Path]], keyed: dict[str, set[Path]], writers: dict[Path, str],
          run_dir: Path) -> list[str]:
    """Each file a stage read, not its own, that no upstream its key names pins: `stages` is the table (its
    `upstream` read now, so a test can drop an edge), `reads` the foreign reads by stage, `keyed` the files each
    stage's fingerprint pins, `writers` the stage that wrote each file."""
    problems = []
    for name, files in reads.items():
        sources = list(stages[name].upstream.values())
        for path in files:
            if not any(path in keyed[source] for source in sources):
                problems.append(f"{name} reads {path.relative_to(run_dir)} (written by {writer(writers, path)})"
                                f", which no output its key names pins (upstream: {', '.join(sources) or 'none'})")
    return problems
