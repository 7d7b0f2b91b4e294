"""A lean GET for `s3://` on obstore: whole objects (the log's versions, its tail, the marks) and
ranges (the slices), fetched with plain HTTP/1.1 requests over asyncio and signed (SigV4) here.

Why not obstore for these: each of its calls crosses from the event loop to its tokio threads and
back, twice for a GET (the request, then the body). On a 2-core VM that is 0.6-0.9 ms of CPU for a
small object or a 404, against 0.2-0.3 ms here, and a follower of the log at its tail reads it two
to four times a step: that was most of what a live reader or a mount spent above a broker's
consumer. aiohttp was measured too, at 0.6-0.85 ms: its request machinery, not the I/O.

Only what these reads need is here: GET, a `Content-Length` body, keep-alive, TLS. Whatever falls
outside that (a proxy in the environment, a chunked or malformed answer, a connection that cannot
be made) raises `LeanUnavailable`, and obstore answers that call; after a failed connection the
lean path stands aside for `REST` seconds, so a store it cannot reach costs no more than before.
An error answer (403, 404, 503, ...) is an answer, and no answer (a connection that closed first,
a read timeout) is `LeanFailed`: the caller translates and retries both as it does obstore's, so
a throttled or silent server is not asked twice. What the server sends is bounded before use:
the head to 64 KiB, the body to `MAX_BODY`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import ssl
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import quote, urlsplit

from .._buffers import pool as buffers

__all__ = ["LeanAnswer", "LeanFailed", "LeanGet", "LeanUnavailable", "lean_enabled"]

MAX_HEAD = 64 * 1024  # status line and headers
MAX_BODY = 64 * 1024 * 1024  # a larger object is left to obstore
REST = 60.0  # seconds the lean path stands aside after a connection failed
IDLE = 10.0  # an idle connection older than this is closed, not reused (servers drop idle ones)
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()

Credentials = tuple[str, str, str | None]  # access key id, secret, session token


class LeanUnavailable(Exception):
    """The lean path cannot serve this call: obstore will."""


class LeanFailed(Exception):
    """No whole answer: the connection closed first, or none came in time. Retried by the caller
    as obstore's transport errors are (not asked of obstore too: it would most likely wait as long)."""


class LeanAnswer(Exception):
    """An answer other than 200: its status and (error) body."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"status code: {status}")
        self.status = status
        self.body = body


def lean_enabled() -> bool:
    """`LAKESTREAM_S3_LEAN_GET` (default on): 0/false/off leaves every GET to obstore. ValueError
    for another value (read when a store is opened, so that a bad value fails there)."""
    value = os.environ.get("LAKESTREAM_S3_LEAN_GET", "").strip().lower()
    if value in ("", "1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"LAKESTREAM_S3_LEAN_GET={value!r}: expected 1 or 0")


class _Connection(asyncio.BufferedProtocol):
    """One keep-alive connection: one request at a time, its answer parsed as it arrives. The head
    is read into scratch memory; the body straight into its own buffer (`recv_into`: no copy)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.scratch = bytearray(MAX_HEAD)
        self.filled = 0  # bytes of `scratch` read: the head, perhaps the start of its body
        self.body: memoryview | None = None  # once the head is read
        self.got = 0  # bytes of the body read
        self.status = 0
        self.keep = False
        self.asked: tuple[int, int] | None = None  # (offset, length) of a ranged GET
        self.answer: asyncio.Future[tuple[int, memoryview, bool]] | None = None
        self.used = time.monotonic()
        self.lost = False  # the connection ended (either side closed it)

    def reset(self, asked: tuple[int, int] | None) -> None:
        self.filled, self.body, self.got, self.asked = 0, None, 0, asked

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.answer is not None and not self.answer.done():
            why = f"connection closed before the whole answer came ({exc or 'by the server'})"
            self.answer.set_exception(LeanFailed(why))

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.body is not None and self.got < len(self.body):
            return self.body[self.got :]
        if self.filled < len(self.scratch):
            return memoryview(self.scratch)[self.filled :]
        return memoryview(bytearray(4096))  # bytes nobody asked for: buffer_updated drops the connection

    def buffer_updated(self, nbytes: int) -> None:
        if self.answer is None or self.answer.done() or (self.body is not None and self.got == len(self.body)):
            self.close()  # nothing asked: the connection is out of step
            return
        try:
            if self.body is None:
                self.filled += nbytes
                self._head()
            else:
                self.got += nbytes
        except ValueError as e:  # an answer this path does not take (obstore may)
            self.answer.set_exception(LeanUnavailable(str(e)))
            return
        if self.body is not None and self.got == len(self.body):
            self.answer.set_result((self.status, self.body, self.keep))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def usable(self) -> bool:
        """Open, and not being closed by either side."""
        return not self.lost and self.transport is not None and not self.transport.is_closing()

    def _head(self) -> None:
        end = self.scratch.find(b"\r\n\r\n", 0, self.filled)
        if end < 0:
            if self.filled >= MAX_HEAD:
                raise ValueError("response head too long")
            return
        lines = self.scratch[:end].decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        code = rest[:3]
        if not version.startswith("HTTP/1.") or len(code) != 3 or not code.isdigit():
            raise ValueError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        status = int(code)
        length: int | None = None
        first: int | None = None  # of a Content-Range
        keep = version == "HTTP/1.1"
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name, value = name.strip().lower(), value.strip()
            if name == "content-length":
                if not value.isdigit() or (length is not None and int(value) != length):
                    raise ValueError(f"bad Content-Length {value[:40]!r}")
                length = int(value)
            elif name == "transfer-encoding":
                raise ValueError("a body in chunks")
            elif name == "connection":
                keep = value.lower() == "keep-alive" or (keep and value.lower() != "close")
            elif name == "content-range":
                unit, _, span = value.partition(" ")
                first_text = span.partition("-")[0]
                first = int(first_text) if unit == "bytes" and first_text.isdigit() else -1
        if length is None:
            raise ValueError("no Content-Length")
        pooled = False
        if self.asked is not None and status == 200:
            raise ValueError("a whole object for a ranged GET")
        if self.asked is not None and status == 206:
            offset, most = self.asked
            if length > most or (first is not None and first != offset):
                raise ValueError(f"a range of {length} bytes from {first} for {most} from {offset}")
            pooled = True
        elif length > MAX_BODY:
            raise ValueError(f"a body of {length} bytes")
        self.status, self.keep = status, keep
        self.body = buffers.take(length) if pooled else memoryview(bytearray(length))
        start = end + 4
        got = min(self.filled - start, length)
        self.body[:got] = self.scratch[start : start + got]
        self.got = got
        if self.filled - start > length:  # more than the answer: the connection is out of step
            self.keep = False


class _Pool(list[_Connection]):
    """The idle connections of one event loop, and an async generator that closes them: a loop
    that shuts down finalizes the async generators it saw start (`shutdown_asyncgens`), while it
    can still close their transports."""

    def __init__(self) -> None:
        super().__init__()
        self.closer = self._closer()

    async def _closer(self) -> AsyncIterator[None]:
        try:
            yield
        finally:
            for conn in self:
                conn.close()
            self.clear()


class LeanGet:
    """GETs of whole objects from one bucket at an endpoint, path-style, with a small pool of
    keep-alive connections on the running event loop (connections of another loop are dropped)."""

    def __init__(
        self,
        endpoint: str,
        bucket: str,
        region: str,
        credentials: Credentials | Callable[[], Credentials],
        *,
        connect_timeout: float,
        read_timeout: float,
        pool: int,
    ) -> None:
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/"):
            raise ValueError(f"the lean GET does not serve endpoint {endpoint!r}")
        self.https = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.https else 80)
        self.netloc = parts.netloc.rpartition("@")[2]
        self.bucket = bucket
        self.region = region
        self._credentials = credentials
        self._frozen: tuple[Credentials, float] | None = None
        self.connect_timeout, self.read_timeout, self.pool = connect_timeout, read_timeout, max(1, pool)
        # idle connections of each event loop that used this (a store may serve loops in threads)
        self._pools: dict[asyncio.AbstractEventLoop, _Pool] = {}
        self._rest_until = 0.0
        self.answered = 0  # answers received (any status)
        self._ssl: ssl.SSLContext | None = None
        self._day: tuple[str, str, bytes] | None = None  # (day, access key id, signing key)
        self._second: tuple[int, str] = (-1, "")

    @staticmethod
    def proxied(endpoint: str) -> bool:
        """True if the environment sends requests to `endpoint` through a proxy (left to obstore)."""
        parts = urlsplit(endpoint)
        proxies = urllib.request.getproxies_environment()
        if not (proxies.get(parts.scheme) or proxies.get("all")):
            return False
        bypass = urllib.request.proxy_bypass_environment  # type: ignore[attr-defined]  # not in typeshed
        return not bypass(parts.hostname or "", proxies)

    def resting(self) -> bool:
        return time.monotonic() < self._rest_until

    async def get(self, key: str) -> bytes:
        """The object at `key` (the full key, prefix included). LeanAnswer for another status than
        200; LeanFailed if no whole answer came; LeanUnavailable if this path does not serve the
        call (the caller asks obstore)."""
        return bytes(await self._fetch(key, None))

    async def get_range(self, key: str, offset: int, length: int) -> memoryview:
        """At most `length` bytes of the object at `key` from `offset`, in a writable buffer of
        their own (pooled, _buffers.py). LeanAnswer for another status than 206; as `get` else."""
        return await self._fetch(key, (offset, length))

    async def _fetch(self, key: str, asked: tuple[int, int] | None) -> memoryview:
        idle = await self._idle(asyncio.get_running_loop())
        path = f"/{self.bucket}/{quote(key, safe='/~')}"
        request = await self._request(path, asked)
        while idle:  # a kept connection may have been dropped by the server meanwhile: try the next
            conn = idle.pop()
            if not conn.usable() or time.monotonic() - conn.used > IDLE:
                conn.close()
                continue
            try:
                return await self._exchange(conn, request, asked)
            except LeanFailed:
                if conn.filled or not conn.lost:  # not a kept connection the server had closed
                    raise
        try:
            conn = await self._connect()
        except (OSError, TimeoutError, ssl.SSLError) as e:
            self._rest_until = time.monotonic() + REST
            raise LeanUnavailable(f"connect: {e}") from None
        return await self._exchange(conn, request, asked)

    async def _exchange(self, conn: _Connection, request: bytes, asked: tuple[int, int] | None) -> memoryview:
        loop = asyncio.get_running_loop()
        conn.reset(asked)
        conn.answer = loop.create_future()
        kept = False
        try:
            assert conn.transport is not None
            conn.transport.write(request)
            try:
                async with asyncio.timeout(self.read_timeout):
                    status, body, kept = await conn.answer
                self.answered += 1
            except TimeoutError:
                raise LeanFailed(f"no answer in {self.read_timeout:g}s") from None
        finally:
            conn.answer = None
            conn.used = time.monotonic()
            idle: list[_Connection] = self._pools.get(loop, [])
            if kept and conn.usable() and len(idle) < self.pool:
                conn.reset(None)
                idle.append(conn)
            else:
                conn.close()
        if status != (200 if asked is None else 206):
            raise LeanAnswer(status, bytes(body))
        return body

    async def _idle(self, loop: asyncio.AbstractEventLoop) -> list[_Connection]:
        """The idle connections of `loop`: closed when the loop shuts down (asyncio.run, anyio.run),
        whose transports would otherwise outlive it unclosed."""
        if (idle := self._pools.get(loop)) is None:
            for gone in [other for other in self._pools if other.is_closed()]:
                del self._pools[gone]
            idle = self._pools[loop] = _Pool()
            await anext(idle.closer)
        return idle

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        if self.https and self._ssl is None:
            self._ssl = ssl.create_default_context(cafile=os.environ.get("AWS_CA_BUNDLE") or None)
        async with asyncio.timeout(self.connect_timeout):
            _, conn = await loop.create_connection(
                _Connection, self.host, self.port, ssl=self._ssl, server_hostname=self.host if self.https else None
            )
        return conn

    def close(self) -> None:
        """Close the idle connections (on the loop they belong to; others are dropped)."""
        pools, self._pools = self._pools, {}
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        for conn in pools.get(running, []) if running is not None else []:
            conn.close()

    async def _keys(self) -> Credentials:
        if not callable(self._credentials):
            return self._credentials
        now = time.monotonic()
        if self._frozen is None or now > self._frozen[1]:
            # botocore refreshes temporary credentials itself, perhaps over the network: in a thread
            frozen = await asyncio.to_thread(self._credentials)
            self._frozen = (frozen, now + 300)
        return self._frozen[0]

    async def _request(self, path: str, asked: tuple[int, int] | None = None) -> bytes:
        """The request for `path` (with `asked`, a range of it), signed (SigV4, an empty payload)."""
        key_id, secret, token = await self._keys()
        now = int(time.time())
        if self._second[0] != now:
            self._second = (now, time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now)))
        stamp = self._second[1]
        day = stamp[:8]
        if self._day is None or self._day[:2] != (day, key_id):
            k = hmac.digest(("AWS4" + secret).encode(), day.encode(), "sha256")
            for part in (self.region, "s3", "aws4_request"):
                k = hmac.digest(k, part.encode(), "sha256")
            self._day = (day, key_id, k)
        signed = "host;x-amz-content-sha256;x-amz-date" + (";x-amz-security-token" if token else "")
        headers = f"host:{self.netloc}\nx-amz-content-sha256:{EMPTY_SHA256}\nx-amz-date:{stamp}\n"
        if token:
            headers += f"x-amz-security-token:{token}\n"
        canonical = f"GET\n{path}\n\n{headers}\n{signed}\n{EMPTY_SHA256}"
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = f"AWS4-HMAC-SHA256\n{stamp}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
        signature = hmac.digest(self._day[2], to_sign.encode(), "sha256").hex()
        lines = [
            f"GET {path} HTTP/1.1",
            f"Host: {self.netloc}",
            f"x-amz-content-sha256: {EMPTY_SHA256}",
            f"x-amz-date: {stamp}",
            f"Authorization: AWS4-HMAC-SHA256 Credential={key_id}/{scope}, SignedHeaders={signed}, "
            f"Signature={signature}",
        ]
        if token:
            lines.append(f"x-amz-security-token: {token}")
        if asked is not None:
            lines.append(f"Range: bytes={asked[0]}-{asked[0] + asked[1] - 1}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode()


def botocore_keys(credentials: Any) -> Callable[[], Credentials]:
    """A credentials callable over botocore's refreshing credentials."""

    def keys() -> Credentials:
        frozen = credentials.get_frozen_credentials()
        return frozen.access_key, frozen.secret_key, frozen.token

    return keys
