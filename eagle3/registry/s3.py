"""The S3 backend of the draft registry's store (eagle3/registry/store.py states the promises both backends keep):
uploads checked against the checksum and ETag S3 reports, `put_if` through conditional writes, retries only for
requests that are safe to repeat. Credentials come from the standard AWS chain, never from our config.
"""

from __future__ import annotations

import contextlib
import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TypeVar

import boto3
import botocore.exceptions
from botocore.config import Config
from botocore.exceptions import ClientError

from eagle3.registry.store import (
    Digest, PointerConflict, RegistryError, check_download, check_key, conflict_message, digest_bytes,
    digest_file, digest_stream,
)

T = TypeVar("T")

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
