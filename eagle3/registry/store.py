"""The object stores under the draft registry: a local directory or an S3 bucket, behind one small API.

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
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol, TypeVar

import boto3
import botocore.exceptions
from botocore.config import Config
from botocore.exceptions import ClientError

from eagle3.errors import Eagle3Error
from eagle3.fsutil import atomic_write_bytes

T = TypeVar("T")
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


# --- S3 ----------------------------------------------------------------------------------------------------------

# Transient failures worth retrying for repeat-safe requests: refused/reset connections, timeouts, cut streams.
CONNECTION_ERRORS = (botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError)
MISSING_CODES = {"404", "NoSuchKey", "NotFound"}
# 412: the condition did not hold; 409: a concurrent conditional write to the same key is in flight (AWS);
# NoSuchKey: If-Match on a key that was deleted meanwhile.
CONFLICT_CODES = {"PreconditionFailed", "412", "ConditionalRequestConflict", "NoSuchKey"}
ACCESS_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "403"}
ATTEMPTS, RETRY_DELAY_S = 3, 0.25
SINGLE_PUT_LIMIT = 5 * 1024**3  # S3 refuses a single PUT over 5 GiB
MD5_ETAG = re.compile(r"^[0-9a-f]{32}$")


def error_code(err: ClientError) -> str:
    return str(err.response.get("Error", {}).get("Code", ""))


def etag_is_md5(response: dict) -> bool:
    """S3 documents the ETag of a single-part PUT as the MD5 of the data unless the object is encrypted
    with SSE-KMS or a customer key; multipart ETags carry a '-N' suffix and are not MD5s either."""
    return (bool(MD5_ETAG.match(response.get("ETag", "").strip('"')))
            and response.get("ServerSideEncryption") not in ("aws:kms", "aws:kms:dsse")
            and not response.get("SSECustomerAlgorithm"))


class S3Store:
    def __init__(self, bucket: str, prefix: str = "", endpoint_url: str | None = None):
        # botocore's own retries are off: we retry only requests that are safe to repeat, and never a
        # conditional write (its lost reply is settled by reading the key back, see put_if).
        options = {"s3": {"addressing_style": "path"}} if endpoint_url else {}  # what S3-compatible stores expect
        config = Config(retries={"total_max_attempts": 1}, connect_timeout=10, read_timeout=120, **options)
        self.client = boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=config)
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.endpoint = endpoint_url or self.client.meta.endpoint_url
        self.location = f"s3://{bucket}/{self.prefix}".rstrip("/")

    def _full(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _where(self, key: str | None) -> str:
        return f"s3://{self.bucket}/{self._full(key)}" if key else self.location

    def _call(self, what: str, key: str | None, request: Callable[[], T], attempts: int = ATTEMPTS) -> T:
        """Run one request, retrying connection failures with backoff; translate botocore errors to one line."""
        attempt = 1
        while True:
            try:
                return request()
            except CONNECTION_ERRORS as err:
                if attempt >= attempts:
                    raise RegistryError(
                        f"{self._where(key)}: {what} failed after {attempts} attempt(s): cannot reach {self.endpoint} "
                        f"({err}); check registry.endpoint_url and the network, then retry") from None
                time.sleep(RETRY_DELAY_S * 2 ** (attempt - 1))
                attempt += 1
            except ClientError as err:
                raise self._translate(what, key, err) from None
            except (botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError):
                raise RegistryError(
                    f"{self.location}: no usable AWS credentials: provide them through the standard AWS chain "
                    "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or an instance role)") from None
            except botocore.exceptions.BotoCoreError as err:
                raise RegistryError(f"{self._where(key)}: {what} failed: {err}") from None

    def _translate(self, what: str, key: str | None, err: ClientError) -> RegistryError:
        code, message = error_code(err), err.response.get("Error", {}).get("Message", "")
        if code == "NoSuchBucket":
            return RegistryError(f"bucket {self.bucket!r} does not exist at {self.endpoint}: create it or fix registry.bucket")
        if code in ACCESS_CODES:
            return RegistryError(
                f"{self._where(key)}: {what} was refused ({code}): check the AWS credentials (standard AWS chain) "
                "and the bucket policy")
        return RegistryError(f"{self._where(key)}: {what} failed: {code} {message}".rstrip())

    def _put(self, key: str, body: Callable[[], BinaryIO | bytes], digest: Digest, **condition: str) -> dict:
        # Sending the SHA-256 makes S3 check the body it received (BadDigest otherwise) and store the checksum.
        return self.client.put_object(
            Bucket=self.bucket, Key=self._full(key), Body=body(), ChecksumAlgorithm="SHA256",
            ChecksumSHA256=digest.sha256_base64, **condition)

    def _check_stored(self, key: str, stored: dict, digest: Digest, source: str) -> None:
        """Compare what the server says it stored with the local digest.

        The SHA-256 is the checksum the server keeps for the object (AWS computes it from the bytes it received;
        moto only echoes the one we sent). The MD5 ETag is computed by the server from the stored bytes, moto
        included; it is used where S3 documents it as an MD5 (see etag_is_md5). At least one must be checkable."""
        problems, checked = [], []
        if "ContentLength" in stored and stored["ContentLength"] != digest.bytes:
            problems.append(f"{stored['ContentLength']} bytes stored, {digest.bytes} sent")
        if stored.get("ChecksumSHA256"):
            checked.append("sha256")
            if stored["ChecksumSHA256"] != digest.sha256_base64:
                problems.append(f"stored sha256 {stored['ChecksumSHA256']} != sent {digest.sha256_base64}")
        if etag_is_md5(stored):
            checked.append("md5")
            if stored["ETag"].strip('"') != digest.md5:
                problems.append(f"stored MD5 ETag {stored['ETag'].strip(chr(34))} != sent {digest.md5}")
        if problems:
            raise RegistryError(
                f"{self._where(key)}: the stored object does not match {source} ({'; '.join(problems)}): "
                "the upload was corrupted on the way; publish again")
        if not checked:
            raise RegistryError(
                f"{self._where(key)}: cannot verify the upload: the store reported neither a SHA-256 checksum nor an "
                "MD5 ETag for it; use a store that keeps S3 checksums")

    def _put_verified(self, key: str, body: Callable[[], BinaryIO | bytes], digest: Digest, source: str) -> Digest:
        if digest.bytes > SINGLE_PUT_LIMIT:
            raise RegistryError(
                f"{source}: {digest.bytes:,} bytes is over S3's 5 GiB single-upload limit, and the registry does not "
                "do multipart uploads; split the checkpoint into smaller shards")
        self._call("upload", key, lambda: self._put(key, body, digest))
        stored = self._call("verification", key, lambda: self.client.head_object(
            Bucket=self.bucket, Key=self._full(key), ChecksumMode="ENABLED"))
        self._check_stored(key, stored, digest, source)
        return digest

    def put_file(self, key: str, path: Path) -> Digest:
        with contextlib.ExitStack() as opened:
            def body() -> BinaryIO:  # reopened for every attempt: a failed one may have consumed the stream
                return opened.enter_context(open(path, "rb"))

            return self._put_verified(key, body, digest_file(path), str(path))

    def put_bytes(self, key: str, data: bytes) -> Digest:
        return self._put_verified(key, lambda: data, digest_bytes(data), "the data")

    def read(self, key: str) -> tuple[bytes | None, str | None]:
        def get() -> tuple[bytes | None, str | None]:
            try:
                response = self.client.get_object(Bucket=self.bucket, Key=self._full(key))
            except ClientError as err:
                if error_code(err) in MISSING_CODES:
                    return None, None
                raise
            return response["Body"].read(), response["ETag"]

        return self._call("read", key, get)

    def download(self, key: str, dest: Path, sha256: str) -> None:
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)

        def get() -> Digest:
            response = self.client.get_object(Bucket=self.bucket, Key=self._full(key))
            with open(dest, "wb") as sink:  # "wb": a retried download starts the file over
                return digest_stream(response["Body"], sink)

        check_download(self._where(key), self._call("download", key, get), sha256)

    def list(self, prefix: str) -> list[str]:
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        strip = len(self.prefix) + 1 if self.prefix else 0

        def list_all() -> list[str]:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full)
            return [item["Key"][strip:] for page in pages for item in page.get("Contents", [])]

        return sorted(self._call("listing", None, list_all))

    def exists(self, key: str) -> bool:
        def head() -> bool:
            try:
                self.client.head_object(Bucket=self.bucket, Key=self._full(key))
            except ClientError as err:
                if error_code(err) in MISSING_CODES:
                    return False
                raise
            return True

        return self._call("existence check", key, head)

    def delete(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):  # delete_objects takes at most 1000 keys
            batch = {"Objects": [{"Key": self._full(key)} for key in keys[start:start + 1000]], "Quiet": True}
            response = self._call("delete", None, lambda batch=batch: self.client.delete_objects(
                Bucket=self.bucket, Delete=batch))
            if response.get("Errors"):
                failed = ", ".join(f"{e['Key']} ({e.get('Code')})" for e in response["Errors"][:5])
                raise RegistryError(f"{self.location}: could not delete {failed}; delete them by hand")

    def put_if(self, key: str, data: bytes, expected_etag: str | None) -> str:
        digest = digest_bytes(data)
        condition = {"IfNoneMatch": "*"} if expected_etag is None else {"IfMatch": expected_etag}

        def put() -> tuple[dict | None, Exception | None]:
            try:
                return self._put(key, lambda: data, digest, **condition), None
            except ClientError as err:
                if error_code(err) in CONFLICT_CODES:
                    raise PointerConflict(conflict_message(self._where(key), expected_etag)) from None
                raise
            except CONNECTION_ERRORS as err:
                return None, err  # the write may or may not have landed: settle it by reading, never by retrying

        response, lost = self._call("conditional write", key, put, attempts=1)
        if lost is not None:
            return self._settle_lost_write(key, data, lost)
        self._check_stored(key, response, digest, "the data")
        return response["ETag"]

    def _settle_lost_write(self, key: str, data: bytes, err: Exception) -> str:
        stored, etag = self.read(key)
        if stored == data:
            return etag
        raise RegistryError(
            f"{self._where(key)}: the conditional write failed ({err}) and did not land; the object is unchanged: "
            "retry")

    def check_conditional_writes(self) -> None:
        """Prove on this endpoint that a PUT whose condition fails is refused (412): a store that ignores
        If-None-Match / If-Match would let two promotions both "win" and silently overwrite the pointer."""
        key = f".probe/{uuid.uuid4().hex}"
        self.put_if(key, b"probe", None)
        try:
            for header, etag in (("If-None-Match: *", None), ("If-Match", f'"{"0" * 32}"')):
                try:
                    self.put_if(key, b"this write must be refused", etag)
                except PointerConflict:
                    continue
                raise RegistryError(
                    f"{self.location} at {self.endpoint}: the store accepted a PUT whose {header} condition does not "
                    "hold, so the production pointer cannot be moved atomically there; use a store with S3 "
                    "conditional writes (AWS S3, MinIO, Cloudflare R2) or registry.backend local")
        finally:
            self.delete([key])
