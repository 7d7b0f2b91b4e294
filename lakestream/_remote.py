"""Source files in S3 (`wds:s3://…`, `parquet:s3://…`): listing with ETags, and objects read as files.

Sources are iterated synchronously (the producer pipeline calls `next` in a worker thread), so this
module uses botocore's synchronous client, configured as the S3 store configures its own: the same
environment (AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_REGION / AWS_DEFAULT_REGION, default 'us-east-1'), path-style addressing, botocore's retries
off. Our retries: throttling, 5xx, refused connections, timeouts and cut streams are retried with
the store's backoff (`S3_BACKOFF`) for as long as it takes, as the producer retries its own uploads
(a source outage must not end a producer), with a warning at most every `WARN_EVERY` seconds;
every other error is raised at once as a Lakestream error: NoSuchBucket as BucketNotFound, a
missing key as ObjectNotFound, refused credentials as AccessDenied.

Every read of an object names the ETag it was listed with (`If-Match`): an object rewritten after
the listing fails the read with ConfigMismatch instead of mixing two versions. `ObjectReader`
streams one GET body (a tar shard is read member by member, never downloaded whole) and resumes a
cut stream from the byte it reached; with `ranged=True` every `read(n)` after a `seek` is one
ranged GET of exactly those bytes (Parquet's footer and column chunks).
"""

from __future__ import annotations

import io
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ._errors import AccessDenied, BucketNotFound, ConfigMismatch, ObjectNotFound, StoreError
from ._retry import WARN_EVERY

try:
    import botocore.session
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, PartialCredentialsError

    from ._store._s3 import _DENIED_CODES, S3_BACKOFF, _code_status, _retryable

    _BOTOCORE = True
except ImportError:  # pragma: no cover - depends on the environment
    _BOTOCORE = False

__all__ = ["ObjectReader", "RemoteObject", "S3Objects", "split_s3"]

T = TypeVar("T")
STREAM_BUFFER = 1 << 20  # bytes read from a streamed GET body at a time
log = logging.getLogger("lakestream.sources")


def split_s3(url: str) -> tuple[str, str]:
    """(bucket, key or key prefix) of `s3://BUCKET/KEY`; ValueError if there is no bucket."""
    bucket, _, key = url.removeprefix("s3://").partition("/")
    if not bucket or not url.startswith("s3://"):
        raise ValueError(f"{url!r}: expected s3://BUCKET/KEY")
    return bucket, key


@dataclass(frozen=True, slots=True)
class RemoteObject:
    key: str
    size: int
    etag: str
    mtime_ns: int


class S3Objects:
    """One bucket, read synchronously: `list(prefix)`, `head(key)`, `open(obj)`."""

    def __init__(self, bucket: str, *, connect_timeout: float = 5.0, read_timeout: float = 60.0) -> None:
        if not _BOTOCORE:  # pragma: no cover - depends on the environment
            raise ImportError("s3:// sources need the 's3' extra: pip install 'lakestream[s3]'")
        self.bucket = bucket
        session = botocore.session.get_session()
        region = os.environ.get("AWS_REGION") or session.get_config_variable("region") or "us-east-1"
        config = Config(
            s3={"addressing_style": "path"},
            retries={"total_max_attempts": 1, "mode": "standard"},  # retries are ours
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self.client: Any = session.create_client("s3", region_name=region, config=config)
        self.endpoint_url: str = self.client.meta.endpoint_url
        self.requests = 0  # HTTP requests sent, retries included

    def where(self, key: str | None = None) -> str:
        return f"s3://{self.bucket}/{key}" if key is not None else f"bucket {self.bucket!r} at {self.endpoint_url}"

    def error(self, e: Exception, key: str | None, op: str) -> Exception:
        """The Lakestream error for a botocore error that is not worth another attempt."""
        if isinstance(e, (NoCredentialsError, PartialCredentialsError)):
            return AccessDenied(
                f"{self.where()}: no usable credentials: {e}; set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
            )
        if not isinstance(e, ClientError):
            return StoreError(f"{self.where()}: {op} failed: {e!r}")
        code, status = _code_status(e)
        message = str(e.response.get("Error", {}).get("Message", "")) or str(e)
        if code == "NoSuchBucket":
            return BucketNotFound(f"{self.where()} does not exist")
        if code in ("PreconditionFailed",) or status == 412:
            return ConfigMismatch(
                f"{self.where(key)} was rewritten (its ETag changed) while it was being read; "
                "produce the changed source under a new --producer-id"
            )
        if key is not None and (code in ("NoSuchKey", "NotFound") or status == 404):
            return ObjectNotFound(f"{self.where(key)}: no such object in {self.where()}")
        if code in _DENIED_CODES or status == 403:
            return AccessDenied(
                f"{self.where()} denied {op} of {self.where(key) if key else 'the listing'} ({code or status}: "
                f"{message}); check the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) and their permissions"
            )
        return StoreError(f"{self.where()}: {op} {key or ''} failed: {code or status}: {message}")

    def call(self, op: str, key: str | None, attempt: Callable[[], T]) -> T:
        """`attempt()`, again after each transient failure (backoff, no end); any other error translated."""
        n = 0
        warned = -math.inf
        while True:
            try:
                return attempt()
            except (ClientError, BotoCoreError) as e:
                if not _retryable(e):
                    raise self.error(e, key, op) from e
                n += 1
                now = time.monotonic()
                if now - warned >= WARN_EVERY:
                    warned = now
                    log.warning("source %s unavailable, still retrying %s (attempt %d): %s", self.where(), op, n, e)
            time.sleep(S3_BACKOFF.delay(n))

    def _request(self, method: Callable[..., T], **params: Any) -> T:
        self.requests += 1
        return method(**params)

    def list(self, prefix: str) -> list[RemoteObject]:
        """Every object whose key starts with `prefix` (no "directory" markers), sorted by key."""
        found: list[RemoteObject] = []
        token: str | None = None
        while True:
            params: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
            if token:
                params["ContinuationToken"] = token
            page = self.call("list", None, lambda: self._request(self.client.list_objects_v2, **params))
            for o in page.get("Contents", ()):
                if not str(o["Key"]).endswith("/"):
                    found.append(_object(o))
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return sorted(found, key=lambda o: o.key)

    def head(self, key: str) -> RemoteObject | None:
        """The object `key`, or None if there is none."""
        try:
            r = self.call("head", key, lambda: self._request(self.client.head_object, Bucket=self.bucket, Key=key))
        except ObjectNotFound:
            return None
        return _object(
            {"Key": key, "Size": r.get("ContentLength"), "ETag": r.get("ETag"), "LastModified": r.get("LastModified")}
        )

    def open(self, obj: RemoteObject, *, ranged: bool = False) -> io.BufferedReader | ObjectReader:
        """`obj` as a binary file: streamed through a buffer of STREAM_BUFFER bytes (tarfile's small
        reads are served from it), or `ranged` (each read one GET, for Parquet's exact ranges)."""
        reader = ObjectReader(self, obj, ranged=ranged)
        return reader if ranged else io.BufferedReader(reader, STREAM_BUFFER)


def _object(o: dict[str, Any]) -> RemoteObject:
    """A listed object, checked (the listing is untrusted)."""
    key, size, etag = o.get("Key"), o.get("Size"), o.get("ETag")
    if not isinstance(key, str) or isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise StoreError(f"S3 listed an object with an unusable key or size: {o!r:.200}")
    modified: Any = o.get("LastModified")
    mtime_ns = int(modified.timestamp() * 1e9) if hasattr(modified, "timestamp") else 0
    return RemoteObject(key, size, str(etag or ""), mtime_ns)


class ObjectReader(io.RawIOBase):
    """An S3 object as a read-only binary file at the ETag it was listed with (see the module docs)."""

    def __init__(self, objects: S3Objects, obj: RemoteObject, *, ranged: bool = False) -> None:
        super().__init__()
        self.objects, self.obj, self.ranged = objects, obj, ranged
        self.pos = 0
        self._body: Any = None  # the open GET body (streaming mode), positioned at self.pos

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.obj.size}[whence]
        pos = base + offset
        if pos < 0:
            raise ValueError(f"{self.objects.where(self.obj.key)}: seek to {pos}")
        if pos != self.pos:
            self._drop()
            self.pos = pos
        return self.pos

    def _drop(self) -> None:
        body, self._body = self._body, None
        if body is not None:
            try:
                body.close()
            except Exception:
                pass

    def close(self) -> None:
        self._drop()
        super().close()

    def _get(self, end: int) -> Any:
        """The GET response body from byte pos, for bytes up to end-1 at least (the ETag pinned)."""
        span = f"bytes={self.pos}-{end - 1}" if end < self.obj.size else f"bytes={self.pos}-"
        params: dict[str, Any] = {"Bucket": self.objects.bucket, "Key": self.obj.key, "Range": span}
        if self.obj.etag:
            params["IfMatch"] = self.obj.etag
        resp = self.objects._request(self.objects.client.get_object, **params)
        body = resp["Body"]
        if resp["ResponseMetadata"]["HTTPStatusCode"] == 200 and self.pos:  # Range ignored: the whole object
            body.read(self.pos)
        return body

    def read(self, size: int | None = -1) -> bytes:
        end = self.obj.size if size is None or size < 0 else min(self.obj.size, self.pos + size)
        if end <= self.pos:
            return b""
        if self.ranged:
            data: bytes = self.objects.call("get", self.obj.key, lambda: self._ranged(end))
        else:
            data = self.objects.call("get", self.obj.key, lambda: self._stream(end - self.pos))
        if not data:
            raise ConfigMismatch(
                f"{self.objects.where(self.obj.key)} ended at byte {self.pos}, but it was listed with {self.obj.size}"
            )
        self.pos += len(data)
        return data

    def _ranged(self, end: int) -> bytes:
        """Bytes pos..end-1, by one GET."""
        body = self._get(end)
        try:
            data: bytes = body.read(end - self.pos)
            return data
        finally:
            body.close()

    def _stream(self, n: int) -> bytes:
        """Up to `n` bytes from the open body; a body cut off is dropped, so the retry opens a new one here."""
        try:
            if self._body is None:
                self._body = self._get(self.obj.size)
            data: bytes = self._body.read(n)
            return data
        except BaseException:
            self._drop()
            raise

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        n = len(data)
        memoryview(buffer).cast("B")[:n] = data
        return n
