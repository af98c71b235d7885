"""The object stores under the draft registry: a local directory or an S3 bucket (eagle3/registry/s3.py), behind one
small API.

Keys are relative POSIX paths ("versions/v1/sglang/config.json"). Two promises hold on both backends:
- an upload is verified against the local file before the call returns (the local copy is re-read and hashed;
  on S3 the checksum and ETag the server reports for the stored object are compared with the local ones);
- `put_if` is a compare-and-swap on one key: it writes only if the key still has the etag the caller read
  (`None`: only if the key does not exist), otherwise it raises PointerConflict. The production pointer moves
  only through it. On S3 that needs conditional writes (If-Match / If-None-Match), which
  `S3Store.check_conditional_writes` proves on the real endpoint before the registry trusts it.

S3 credentials come from the standard AWS chain (environment, profile, instance role) and are never read
from our config nor printed.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import io
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

from eagle3.errors import Eagle3Error
from eagle3.fsutil import atomic_write_bytes

CHUNK = 1 << 20


class RegistryError(Eagle3Error):
    """The registry or its store refused or failed an operation; the message names the key and the fix."""


class PointerConflict(RegistryError):
    """A conditional write lost a race: the key changed (or appeared) since the caller read it."""


@dataclass(frozen=True)
class Digest:
    bytes: int
    sha256: str  # hex
    md5: str  # hex: S3's ETag of a single-part upload that is not KMS- or customer-key encrypted

    @property
    def sha256_base64(self) -> str:  # the form S3 sends and returns in x-amz-checksum-sha256
        return base64.b64encode(bytes.fromhex(self.sha256)).decode()


def digest_stream(stream: BinaryIO, sink: BinaryIO | None = None) -> Digest:
    """Hash a stream in one pass (both sums at once), copying it to `sink` when given."""
    sha256, md5, size = hashlib.sha256(), hashlib.md5(usedforsecurity=False), 0
    while block := stream.read(CHUNK):
        sha256.update(block)
        md5.update(block)
        size += len(block)
        if sink is not None:
            sink.write(block)
    return Digest(size, sha256.hexdigest(), md5.hexdigest())


def digest_file(path: Path) -> Digest:
    with open(path, "rb") as f:
        return digest_stream(f)


def digest_bytes(data: bytes) -> Digest:
    return digest_stream(io.BytesIO(data))


def check_key(key: str) -> str:
    """Keys are built by the registry from validated ids; this guard keeps a bad one from escaping the root."""
    if not key or key.startswith("/") or any(part in ("", ".", "..") for part in key.split("/")):
        raise RegistryError(f"object key {key!r} is not a plain relative path (no empty, '.' or '..' parts)")
    return key


class Store(Protocol):
    location: str  # for messages: a directory or s3://bucket/prefix

    def put_file(self, key: str, path: Path) -> Digest: ...

    def put_bytes(self, key: str, data: bytes) -> Digest: ...

    def read(self, key: str) -> tuple[bytes | None, str | None]: ...

    def download(self, key: str, dest: Path, sha256: str) -> None: ...

    def list(self, prefix: str) -> list[str]: ...

    def exists(self, key: str) -> bool: ...

    def delete(self, keys: list[str]) -> None: ...

    def put_if(self, key: str, data: bytes, expected_etag: str | None) -> str: ...


def conflict_message(where: str, expected_etag: str | None) -> str:
    if expected_etag is None:
        return f"{where}: already exists (it was written by someone else since it was read); re-read it and retry"
    return (f"{where}: changed since it was read (expected etag {expected_etag}); someone else wrote it first: "
            "re-read it and retry")


# --- local directory -------------------------------------------------------------------------------------------

# Our own bookkeeping files next to the objects: temporary copies and compare-and-swap lock files.
LOCAL_INTERNAL = re.compile(r"^\..*\.(tmp|lock)$")


class LocalStore:
    """Objects are files under `root`. A file appears at its final path only once written, fsynced and
    re-hashed (temp file + os.replace), so a crash never leaves a partial object behind a final name."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.location = str(self.root)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _write_verified(self, key: str, source: BinaryIO, what: str) -> Digest:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as sink:
                expected = digest_stream(source, sink)
                sink.flush()
                os.fsync(sink.fileno())
            copied = digest_file(Path(tmp))  # read back what the disk holds, not what we meant to write
            if copied != expected:
                raise RegistryError(
                    f"{target}: the stored copy of {what} does not match it (sha256 {copied.sha256[:16]}… vs "
                    f"{expected.sha256[:16]}…): the source or the disk changed during the copy; publish again")
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return expected

    def put_file(self, key: str, path: Path) -> Digest:
        with open(path, "rb") as source:
            return self._write_verified(key, source, str(path))

    def put_bytes(self, key: str, data: bytes) -> Digest:
        return self._write_verified(key, io.BytesIO(data), "the data")

    def read(self, key: str) -> tuple[bytes | None, str | None]:
        try:
            data = self._path(key).read_bytes()
        except FileNotFoundError:
            return None, None
        return data, hashlib.sha256(data).hexdigest()

    def download(self, key: str, dest: Path, sha256: str) -> None:
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(self._path(key), "rb") as source, open(dest, "wb") as sink:
                got = digest_stream(source, sink)
        except FileNotFoundError:
            raise RegistryError(f"{self._path(key)}: missing from the registry; the version is incomplete") from None
        check_download(f"{self._path(key)}", got, sha256)

    def list(self, prefix: str) -> list[str]:
        base = self.root / prefix
        if not base.is_dir():
            return []
        return sorted(
            path.relative_to(self.root).as_posix()
            for path in base.rglob("*")
            if path.is_file() and not LOCAL_INTERNAL.match(path.name)
        )

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            path = self._path(key)
            path.unlink(missing_ok=True)
            self._prune_empty_parents(path.parent)

    def _prune_empty_parents(self, directory: Path) -> None:
        root = self.root.resolve()
        while directory.resolve() != root and directory.is_dir() and not any(directory.iterdir()):
            directory.rmdir()
            directory = directory.parent

    @contextlib.contextmanager
    def _locked(self, path: Path) -> Iterator[None]:
        """An exclusive flock on a lock file beside `path`: compare-and-swap across threads and processes."""
        with open(path.with_name(f".{path.name}.lock"), "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def put_if(self, key: str, data: bytes, expected_etag: str | None) -> str:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._locked(path):
            _, current = self.read(key)
            if current != expected_etag:
                raise PointerConflict(conflict_message(str(path), expected_etag))
            atomic_write_bytes(path, data)  # temp + fsync + os.replace: a crash leaves the old content
        return hashlib.sha256(data).hexdigest()


def check_download(where: str, got: Digest, sha256: str) -> None:
    if got.sha256 != sha256:
        raise RegistryError(
            f"{where}: the downloaded bytes have sha256 {got.sha256[:16]}…, the manifest says {sha256[:16]}…: "
            "the stored copy is corrupt; fetch another version or publish this one again")
