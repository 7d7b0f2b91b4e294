"""The lean GET of `s3://` on obstore (`_store/_lean.py`): against a real SeaweedFS, and against
stand-in servers on loopback that answer badly (hostile heads, bodies in chunks, huge lengths,
dropped connections, silence)."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import anyio
import pytest
from s3server import S3Server, free_ports

from lakestream._errors import AccessDenied, BucketNotFound, ObjectNotFound, StoreUnavailable
from lakestream._store import open_store
from lakestream._store._lean import MAX_BODY, LeanAnswer, LeanFailed, LeanGet, LeanUnavailable

pytestmark = pytest.mark.s3

KEYS = ("k", "s", None)


@pytest.fixture
def obstore_client(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAKESTREAM_S3_CLIENT", "obstore")
    monkeypatch.delenv("LAKESTREAM_S3_LEAN_GET", raising=False)


async def test_gets_are_answered_by_the_lean_path_and_agree_with_obstore(s3_url: str, obstore_client: None) -> None:
    async with open_store(s3_url) as store:
        payload = bytes(range(256)) * 41
        await store.put("_lakestream/log/000001", payload)
        await store.put("odd key/ü é+%~", b"odd")
        assert await store.get("_lakestream/log/000001") == payload
        lean = store._lean  # type: ignore[attr-defined]
        assert isinstance(lean, LeanGet)
        assert await store.get("odd key/ü é+%~") == b"odd"  # the path is encoded as it is signed
        with pytest.raises(ObjectNotFound, match="_lakestream/log/000002"):
            await store.get("_lakestream/log/000002")
        assert lean.answered == 3 and sum(map(len, lean._pools.values())) == 1  # one kept connection served all three
        assert not lean.resting()


async def test_the_lean_path_is_off_when_asked_and_a_bad_setting_fails_on_open(
    s3_url: str, obstore_client: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LAKESTREAM_S3_LEAN_GET", "0")
    async with open_store(s3_url) as store:
        await store.put("a", b"1")
        assert await store.get("a") == b"1"
        assert store._lean is None  # type: ignore[attr-defined]
    monkeypatch.setenv("LAKESTREAM_S3_LEAN_GET", "maybe")
    with pytest.raises(ValueError, match="LAKESTREAM_S3_LEAN_GET"):
        open_store(s3_url)


async def test_a_proxy_in_the_environment_leaves_gets_to_obstore(
    s3_server: S3Server, s3_url: str, obstore_client: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    assert LeanGet.proxied(s3_server.endpoint_url)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    assert not LeanGet.proxied(s3_server.endpoint_url)
    monkeypatch.delenv("NO_PROXY")
    async with open_store(s3_url) as store:
        assert store._lean is None  # type: ignore[attr-defined]
    monkeypatch.delenv("HTTP_PROXY")


async def test_error_answers_become_the_same_errors_as_obstore_gives(
    s3_server: S3Server, s3_url: str, obstore_client: None
) -> None:
    async with open_store(s3_url, aws_secret_access_key="wrong") as store:
        with pytest.raises(AccessDenied):
            await store.get("_lakestream/x")
        assert store._lean.answered == 1  # type: ignore[attr-defined]
    async with open_store("s3://lakestream-no-such-bucket/p") as store:
        with pytest.raises(BucketNotFound, match="lakestream-no-such-bucket"):
            await store.get("_lakestream/x")
        assert store._lean.answered == 1  # type: ignore[attr-defined]


# -- stand-in servers --------------------------------------------------------------------------------

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A loopback server running `handler` per connection: (endpoint, [connections accepted])."""
    accepted = [0]

    async def on_connect(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        accepted[0] += 1
        try:
            await handler(r, w)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", accepted
    finally:
        server.close()


def lean(endpoint: str, read_timeout: float = 5.0) -> LeanGet:
    return LeanGet(endpoint, "b", "us-east-1", KEYS, connect_timeout=2.0, read_timeout=read_timeout, pool=4)


def answering(*responses: bytes, then_close: bool = False) -> Handler:
    """Answer each request on a connection with the next response (the last one again)."""

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        n = 0
        while True:
            await r.readuntil(b"\r\n\r\n")
            w.write(responses[min(n, len(responses) - 1)])
            await w.drain()
            n += 1
            if then_close:
                return

    return handler


def ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


async def test_a_kept_connection_serves_later_gets_and_an_error_answer_is_an_answer() -> None:
    body = b"<Error><Code>SlowDown</Code></Error>"
    slow = b"HTTP/1.1 503 Slow Down\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    async with serving(answering(ok(b"one"), ok(b""), slow, ok(b"x" * 300_000))) as (url, accepted):
        g = lean(url)
        assert await g.get("p/a") == b"one"
        assert await g.get("p/a") == b""
        with pytest.raises(LeanAnswer) as info:
            await g.get("p/a")
        assert info.value.status == 503 and info.value.body == body
        assert await g.get("p/a") == b"x" * 300_000
        assert accepted == [1]


async def test_a_connection_the_server_closed_while_idle_is_replaced_once() -> None:
    async with serving(answering(ok(b"one"), then_close=True)) as (url, accepted):
        g = lean(url)
        assert await g.get("a") == b"one"
        await asyncio.sleep(0.05)
        assert await g.get("a") == b"one"
        assert accepted == [2]


@pytest.mark.parametrize(
    "response, why",
    [
        (b"SSH-2.0-OpenSSH\r\n\r\n", "status line"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\none\r\n0\r\n\r\n", "chunks"),
        (b"HTTP/1.1 200 OK\r\n\r\none", "no Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -3\r\n\r\n", "Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\none", "Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY + 1), "a body of"),
        (b"HTTP/1.1 200 OK\r\nX: " + b"y" * 70_000 + b"\r\n\r\n", "head too long"),
    ],
    ids=["not-http", "chunked", "no-length", "negative", "two-lengths", "huge", "long-head"],
)
async def test_a_malformed_answer_is_left_to_obstore_and_its_connection_dropped(response: bytes, why: str) -> None:
    async with serving(answering(response, then_close=True)) as (url, _):
        g = lean(url)
        with pytest.raises(LeanUnavailable, match=why):
            await g.get("a")
        assert not any(g._pools.values()) and not g.resting()  # an answer came: the path stays, the connection goes


async def test_silence_times_out_and_a_cancelled_get_leaves_no_connection_to_reuse() -> None:
    async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.readuntil(b"\r\n\r\n")
        await asyncio.sleep(30)

    async with serving(silent) as (url, accepted):
        g = lean(url, read_timeout=0.2)
        with pytest.raises(LeanFailed, match=r"no answer in 0\.2s"):
            await g.get("a")
        task = asyncio.ensure_future(g.get("a"))
        while accepted[0] < 2:  # the request is on its way (the server reads it, then says nothing)
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not any(g._pools.values()) and accepted == [2]


async def test_a_refused_connection_rests_the_lean_path_and_the_store_still_answers(
    obstore_client: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    (port,) = free_ports(1)
    g = lean(f"http://127.0.0.1:{port}")
    with pytest.raises(LeanUnavailable, match="connect"):
        await g.get("a")
    assert g.resting()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    async with open_store("s3://b/p", endpoint_url=f"http://127.0.0.1:{port}", retry_timeout=1) as store:
        with pytest.raises(StoreUnavailable, match="unreachable"):  # obstore's answer, as before
            await store.get("_lakestream/x")
        assert store._lean.resting()  # type: ignore[attr-defined]


def test_an_endpoint_with_a_path_is_not_served() -> None:
    with pytest.raises(ValueError, match="does not serve"):
        lean("http://127.0.0.1:9000/some/path")
    with pytest.raises(ValueError, match="does not serve"):
        lean("ftp://127.0.0.1:9000")


def test_one_store_serves_event_loops_in_two_threads_each_on_its_own_connections(
    s3_url: str, obstore_client: None
) -> None:
    store = open_store(s3_url)
    asyncio.run(store.put("_lakestream/a", b"1"))
    got: list[bytes] = []

    def reads() -> None:
        async def many() -> None:
            for _ in range(40):
                got.append(await store.get("_lakestream/a"))
                await asyncio.sleep(0)

        asyncio.run(many())

    threads = [threading.Thread(target=reads) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [b"1"] * 80
    assert store._lean.answered == 80  # type: ignore[attr-defined]


async def test_an_answer_cut_off_is_retried_by_the_store_not_asked_of_obstore_too(
    obstore_client: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every connection answers half a body, then closes: each attempt of the store's retries is
    one request (the lean GET's), and the call ends StoreUnavailable as a dropped connection does."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    cut = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort"
    async with serving(answering(cut, then_close=True)) as (url, accepted):
        g = lean(url)
        with pytest.raises(LeanFailed, match="closed before the whole answer"):
            await g.get("a")
        async with open_store("s3://b/p", endpoint_url=url, max_attempts=3, retry_timeout=30) as store:
            with pytest.raises(StoreUnavailable, match="3 attempts"):
                await store.get("_lakestream/x")
            assert store._lean.answered == 0 and not store._lean.resting()  # type: ignore[attr-defined]
        assert accepted == [4]


async def test_ranges_are_read_into_writable_memory_of_their_own(s3_url: str, obstore_client: None) -> None:
    async with open_store(s3_url) as store:
        payload = bytes(range(256)) * 10_000  # 2.56 MB: pooled memory
        await store.put("seg", payload)
        whole = await store.get_range("seg", 0, len(payload))
        assert isinstance(whole, memoryview) and not whole.readonly and whole == payload
        assert await store.get_range("seg", 1000, 77) == payload[1000:1077]
        assert await store.get_range("seg", len(payload) - 5, 100) == payload[-5:]  # fewer at the end
        assert await store.get_range("seg", len(payload), 10) == b""  # past the end: 416
        with pytest.raises(ObjectNotFound, match="nope"):
            await store.get_range("nope", 0, 10)
        assert store._lean.answered == 5  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "response, why",
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc", "a whole object for a ranged GET"),
        (b"HTTP/1.1 206 Partial\r\nContent-Length: 11\r\n\r\nabcdefghijk", "a range of 11 bytes"),
        (b"HTTP/1.1 206 Partial\r\nContent-Range: bytes 0-2/9\r\nContent-Length: 3\r\n\r\nabc", "from 0 for 4 from 5"),
    ],
    ids=["ignored-range", "longer", "elsewhere"],
)
async def test_a_range_answered_otherwise_than_asked_is_left_to_obstore(response: bytes, why: str) -> None:
    async with serving(answering(response)) as (url, _):
        g = lean(url)
        with pytest.raises(LeanUnavailable, match=why):
            await g.get_range("a", 5, 4)


async def test_a_range_answered_in_pieces_is_whole_and_the_connection_kept() -> None:
    body = bytes(range(200)) * 2000

    async def pieces(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            await r.readuntil(b"\r\n\r\n")
            w.write(b"HTTP/1.1 206 Partial\r\nContent-Range: bytes 7-%d/999999\r\n" % (7 + len(body) - 1))
            await w.drain()
            await asyncio.sleep(0.01)
            w.write(b"Content-Length: %d\r\n\r\n%s" % (len(body), body[:1000]))
            await w.drain()
            await asyncio.sleep(0.01)
            w.write(body[1000:])
            await w.drain()

    async with serving(pieces) as (url, accepted):
        g = lean(url)
        for _ in range(2):
            assert await g.get_range("a", 7, len(body)) == body
        assert accepted == [1]


async def test_https_with_the_certificate_authorities_of_aws_ca_bundle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TLS, as on S3 itself: a server whose certificate only AWS_CA_BUNDLE vouches for."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    openssl = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"]
    await anyio.run_process([*openssl, "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", cert])
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    handler = answering(ok(b"secret"))
    server = await asyncio.start_server(handler, "127.0.0.1", 0, ssl=context)
    url = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        with pytest.raises(LeanUnavailable, match="CERTIFICATE_VERIFY_FAILED"):  # not trusted by default
            await lean(url).get("a")
        monkeypatch.setenv("AWS_CA_BUNDLE", str(cert))
        g = lean(url)
        assert await g.get("a") == b"secret" and await g.get("a") == b"secret"
        g.close()
    finally:
        server.close()


async def test_an_answer_followed_by_bytes_nobody_asked_for_leaves_its_connection_unused() -> None:
    async with serving(answering(ok(b"one") + b"HTTP/1.1 200 OK\r\n")) as (url, accepted):
        g = lean(url)
        assert await g.get("a") == b"one"
        assert await g.get("a") == b"one"
        assert accepted == [2]
