"""`s3://BUCKET/PREFIX` store on aiobotocore (the only module that imports botocore).

Endpoint, credentials and region come from the standard AWS environment and config files
(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION / AWS_DEFAULT_REGION,
default 'us-east-1'), each overridable by keyword. Addressing is path-style, so any S3-compatible
server works. `put_if_absent` is a conditional PutObject (`If-None-Match: *`).

Retries are ours alone (botocore's are off), as `_s3base` describes; every botocore error becomes a
Lakestream StoreError in `_translate`.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import os
import zlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import aiobotocore.session
import anyio
import anyio.to_thread
from aiobotocore.config import AioConfig
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError

from .._errors import StoreError
from ._base import Data
from ._s3base import DENIED_CODES, RETRY_CODES, S3_BACKOFF, S3Base, retryable_response

__all__ = ["S3_BACKOFF", "S3Store"]

T = TypeVar("T")

_TRANSIENT = (BotoConnectionError, HTTPClientError, IncompleteReadError)  # refused, timeouts, resets
_RETRY_CODES, _DENIED_CODES = RETRY_CODES, DENIED_CODES  # also used by `_remote`
_BATCH = 1000  # DeleteObjects limit


def _code_status(e: ClientError) -> tuple[str, int]:
    return str(e.response.get("Error", {}).get("Code", "")), int(
        e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
    )


def _retryable(e: BaseException) -> bool:
    if isinstance(e, ClientError):
        return retryable_response(*_code_status(e))
    return isinstance(e, _TRANSIENT)


def _retryable_botocore(e: Exception) -> bool:
    return isinstance(e, (ClientError, BotoCoreError)) and _retryable(e)


class S3Store(S3Base):
    """An object store rooted at `s3://bucket/prefix` on aiobotocore; keys are relative to the prefix.
    Its options are `S3Base`'s."""

    def _configure(self, *, max_pool_connections: int, connect_timeout: float, read_timeout: float) -> None:
        names = ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")
        given = {"endpoint_url": self._endpoint, **dict(zip(names, self._keys))}
        self._client_args: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
        self._config = AioConfig(
            s3={"addressing_style": "path"},
            retries={"total_max_attempts": 1, "mode": "standard"},  # retries are ours
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_pool_connections=max_pool_connections,
            # Only where S3 demands it (DeleteObjects): not every S3-compatible server speaks
            # the newer default CRC trailers, and Lakestream checksums its own data.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self._stack = contextlib.AsyncExitStack()
        self._lock = anyio.Lock()

    # -- plumbing ------------------------------------------------------------------------------

    async def _get_client(self) -> Any:
        if self._client is None:
            async with self._lock:
                if self._client is None:
                    session = aiobotocore.session.get_session()
                    region = (
                        self._region
                        or os.environ.get("AWS_REGION")  # botocore itself reads only AWS_DEFAULT_REGION
                        or session.get_config_variable("region")
                        or "us-east-1"
                    )
                    creator = session.create_client("s3", region_name=region, config=self._config, **self._client_args)
                    client = await self._stack.enter_async_context(creator)
                    self.endpoint_url = client.meta.endpoint_url
                    self._client = client
        return self._client

    def _translate(self, e: Exception, key: str | None, op: str, attempts: int, elapsed: float) -> StoreError:
        """A botocore error as a Lakestream error."""
        if isinstance(e, ClientError):
            code, status = _code_status(e)
            if _retryable(e):
                return self._kept_failing(op, attempts, elapsed, f"{code or status}: {e}")
            return self._error(code, status, str(e.response.get("Error", {}).get("Message", e)), key, op)
        if isinstance(e, (NoCredentialsError, PartialCredentialsError)):
            return self._no_credentials(e)
        if isinstance(e, _TRANSIENT):
            return self._unreachable(attempts, elapsed, e)
        return StoreError(f"{self.url}: {op} failed in {self._where()}: {e!r}")

    async def _run(self, op: str, key: str | None, attempt: Callable[[Any], Awaitable[T]]) -> T:
        """`attempt(client)` with our retries; botocore errors leave here translated."""

        async def once() -> T:
            return await attempt(await self._get_client())

        return await self._retrying(
            op,
            key,
            once,
            transient=_retryable_botocore,
            client_error=(ClientError, BotoCoreError),
            translate=self._translate,
        )

    # -- the protocol ----------------------------------------------------------------------------

    async def get(self, key: str) -> bytes:
        """The whole object. Raises ObjectNotFound."""
        full = self._key(key)

        async def attempt(c: Any) -> bytes:
            resp = await c.get_object(Bucket=self.bucket, Key=full)
            async with resp["Body"] as body:
                data: bytes = await body.read()
            return data

        return await self._run("get", key, attempt)

    async def get_range(self, key: str, offset: int, length: int) -> bytes:
        """`length` bytes from `offset` (fewer at the end of the object). Raises ObjectNotFound."""
        if offset < 0 or length < 0:
            raise ValueError(f"invalid range offset={offset} length={length}")
        full = self._key(key)
        if length == 0:
            return b""

        span = f"bytes={offset}-{offset + length - 1}"

        async def attempt(c: Any) -> bytes:
            try:
                resp = await c.get_object(Bucket=self.bucket, Key=full, Range=span)
            except ClientError as e:
                code, status = _code_status(e)
                if status == 416 or code == "InvalidRange":  # offset at or past the end
                    return b""
                raise
            async with resp["Body"] as body:
                data: bytes = await body.read()
            if resp["ResponseMetadata"]["HTTPStatusCode"] == 200:  # Range ignored: whole object
                data = data[offset : offset + length]
            return data

        return await self._run("get_range", key, attempt)

    async def put(self, key: str, data: Data) -> None:
        """Create or replace the object, whole or not at all (see `_checksum`)."""
        full = self._key(key)
        body, crc = await _checksum(data)
        await self._run("put", key, lambda c: c.put_object(Bucket=self.bucket, Key=full, Body=body, ChecksumCRC32=crc))

    async def put_if_absent(self, key: str, data: Data) -> bool:
        """Conditional PUT (`If-None-Match: *`). False on 412, which after a retry may mean an
        earlier attempt of this same call landed: the caller resolves that ambiguity."""
        full = self._key(key)
        body, crc = await _checksum(data)

        async def attempt(c: Any) -> bool:
            try:
                await c.put_object(Bucket=self.bucket, Key=full, Body=body, IfNoneMatch="*", ChecksumCRC32=crc)
            except ClientError as e:
                code, status = _code_status(e)
                if status == 412 or code == "PreconditionFailed":
                    return False
                raise
            return True

        return await self._run("put_if_absent", key, attempt)

    async def list(self, prefix: str) -> list[str]:
        """Every key starting with `prefix`, sorted here (not every server lists in byte order)."""
        return sorted(await self.list_sizes(prefix))

    async def list_sizes(self, prefix: str) -> dict[str, int]:
        """Every key starting with `prefix`, with its size."""
        full = self._root + prefix
        cut = len(self._root)
        keys: dict[str, int] = {}
        token: str | None = None
        while True:
            params: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full}
            if token:
                params["ContinuationToken"] = token
            page: dict[str, Any] = await self._run("list", None, functools.partial(_list_page, params=params))
            keys.update(
                (o["Key"][cut:], int(o.get("Size", 0))) for o in page.get("Contents", ()) if not o["Key"].endswith("/")
            )
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return keys

    async def delete(self, keys: Sequence[str]) -> None:
        """Delete the objects (DeleteObjects, 1000 a request); missing ones are ignored."""
        full = [self._key(k) for k in keys]
        for i in range(0, len(full), _BATCH):
            batch = {"Objects": [{"Key": k} for k in full[i : i + _BATCH]], "Quiet": True}
            delete = functools.partial(_delete_page, bucket=self.bucket, batch=batch)
            resp: dict[str, Any] = await self._run("delete", None, delete)
            for err in resp.get("Errors", ()):
                code = str(err.get("Code", ""))
                if code != "NoSuchKey":
                    rel = str(err.get("Key", ""))[len(self._root) :]
                    raise self._error(code, 0, str(err.get("Message", "")), None, f"delete {rel!r}")

    async def aclose(self) -> None:
        """Close the client and its connections. Idempotent."""
        self._client = None
        stack, self._stack = self._stack, contextlib.AsyncExitStack()
        self._lock = anyio.Lock()
        await stack.aclose()

    async def __aenter__(self) -> S3Store:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def _list_page(client: Any, *, params: dict[str, Any]) -> Any:
    return await client.list_objects_v2(**params)


async def _delete_page(client: Any, *, bucket: str, batch: dict[str, Any]) -> Any:
    return await client.delete_objects(Bucket=bucket, Delete=batch)


async def _checksum(data: Data) -> tuple[bytes, str]:
    """The body and its CRC-32 for `x-amz-checksum-crc32`, which the server checks before the
    object exists. Without it an upload cut off after its headers (a process killed, a task
    cancelled: aiohttp sends the body after the headers) can be stored as an empty object:
    SeaweedFS 4.48 does that even with a signed payload hash."""
    body = bytes(data)
    crc = zlib.crc32(body) if len(body) < 1 << 20 else await anyio.to_thread.run_sync(zlib.crc32, body)
    return body, base64.b64encode(crc.to_bytes(4, "big")).decode()
