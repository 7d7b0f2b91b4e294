"""One contract for every ObjectStore backend: memory, file, S3 (a real SeaweedFS server), and the
simulated S3 of `lakestream.testing` (with millisecond latencies, on the real clock)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from s3server import S3Server, free_ports

from lakestream._errors import AccessDenied, BucketNotFound, ObjectNotFound, StoreUnavailable
from lakestream._store import FileStore, ObjectStore, open_store
from lakestream.testing import SimulatedS3

REPO = Path(__file__).resolve().parents[1]
BACKENDS = ["memory", "file", "simulated", pytest.param("s3", marks=pytest.mark.s3)]


@pytest.fixture(params=BACKENDS)
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[ObjectStore]:
    if request.param == "simulated":
        fast = {"put": (0.001, 0.003), "get": (0.0005, 0.002)}
        async with SimulatedS3(latency=fast).client() as sim:
            yield sim
        return
    if request.param == "memory":
        url = "memory://"
    elif request.param == "file":
        url = str(tmp_path / "store")
    else:
        url = request.getfixturevalue("s3_url")
    async with open_store(url) as s:
        yield s


def is_s3(store: ObjectStore) -> bool:
    return store.url.startswith("s3://")


# -- the contract ---------------------------------------------------------------------------------


async def test_protocol_and_round_trip(store: ObjectStore) -> None:
    assert isinstance(store, ObjectStore)
    assert isinstance(store.url, str)
    data = bytes(range(256)) * 3
    await store.put("a/b/obj", data)
    assert await store.get("a/b/obj") == data
    await store.put("empty", b"")
    assert await store.get("empty") == b""


async def test_get_missing(store: ObjectStore) -> None:
    with pytest.raises(ObjectNotFound) as info:
        await store.get("no/such")
    assert isinstance(info.value, FileNotFoundError)
    assert "no/such" in str(info.value)
    with pytest.raises(ObjectNotFound):
        await store.get_range("no/such", 0, 10)


async def test_get_range(store: ObjectStore) -> None:
    data = bytes(range(256)) * 4
    await store.put("r", data)
    assert await store.get_range("r", 0, 10) == data[:10]
    assert await store.get_range("r", 100, 50) == data[100:150]
    assert await store.get_range("r", 1020, 10) == data[1020:]  # short at the end
    assert await store.get_range("r", 0, 5000) == data
    assert await store.get_range("r", 1024, 10) == b""  # exactly at the end
    assert await store.get_range("r", 5000, 1) == b""  # past the end
    assert await store.get_range("r", 7, 0) == b""


async def test_put_overwrites_atomically(store: ObjectStore) -> None:
    old, new = b"a" * (1 << 20), b"b" * (1 << 20) + b"tail"
    await store.put("k", old)
    seen: set[bytes] = set()

    async def read(n: int) -> None:
        for _ in range(n):
            seen.add(await store.get("k"))

    await asyncio.gather(read(5), store.put("k", new), read(5))
    assert seen <= {old, new}
    assert await store.get("k") == new


async def test_put_if_absent(store: ObjectStore) -> None:
    assert await store.put_if_absent("once", b"first") is True
    assert await store.put_if_absent("once", b"second") is False
    assert await store.get("once") == b"first"
    await store.put("plain", b"x")
    assert await store.put_if_absent("plain", b"y") is False


async def test_put_if_absent_race(store: ObjectStore) -> None:
    rounds = 2 if is_s3(store) else 20  # contended conditional PUTs take seconds on SeaweedFS
    for r in range(rounds):
        key = f"race/{r:03d}"
        results = await asyncio.gather(*(store.put_if_absent(key, f"writer {i}".encode()) for i in range(8)))
        assert results.count(True) == 1, results
        assert await store.get(key) == f"writer {results.index(True)}".encode()


async def test_list(store: ObjectStore) -> None:
    # '-' and '.' sort before '/': servers that walk directories do not list these in byte order.
    keys = ["a", "b/c", "b/d/e", "b-x", "b.y", "ba", "c/b/a", "log/00000001", "log/00000002"]
    await asyncio.gather(*(store.put(k, k.encode()) for k in reversed(keys)))
    assert await store.list("") == sorted(keys)
    assert await store.list("b") == ["b-x", "b.y", "b/c", "b/d/e", "ba"]
    assert await store.list("b/") == ["b/c", "b/d/e"]
    assert await store.list("b/d/") == ["b/d/e"]
    assert await store.list("log/0000000") == ["log/00000001", "log/00000002"]
    assert await store.list("zzz") == []
    assert await store.list("c/b/a") == ["c/b/a"]


async def test_list_and_delete_many(store: ObjectStore) -> None:
    keys = [f"many/{i:05d}" for i in range(1050)]  # more than one S3 page and one DeleteObjects batch
    sem = asyncio.Semaphore(32)

    async def put(k: str) -> None:
        async with sem:
            await store.put(k, b"x")

    await asyncio.gather(*(put(k) for k in keys))
    assert await store.list("many/") == keys
    await store.delete(keys)
    assert await store.list("many/") == []


async def test_delete(store: ObjectStore) -> None:
    await store.put("d/1", b"1")
    await store.put("d/2", b"2")
    await store.put("keep", b"k")
    await store.delete(["d/1", "d/missing", "d/2"])
    await store.delete([])
    await store.delete(["d/1"])  # again: missing is fine
    assert await store.list("") == ["keep"]
    with pytest.raises(ObjectNotFound):
        await store.get("d/1")


async def test_large_object(store: ObjectStore) -> None:
    data = os.urandom(8 << 20)
    await store.put("big", data)
    assert await store.get("big") == data
    assert await store.get_range("big", 3 << 20, 1 << 20) == data[3 << 20 : 4 << 20]


async def test_aclose_idempotent(store: ObjectStore) -> None:
    await store.put("x", b"1")
    await store.aclose()
    await store.aclose()


# -- file store -----------------------------------------------------------------------------------

RACER = """
import asyncio, os, sys, time
from lakestream._store import FileStore
root, me, flags, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
open(os.path.join(flags, "ready." + me), "w").close()
while not os.path.exists(os.path.join(flags, "go")):
    time.sleep(0.001)
async def main():
    store = FileStore(root)
    return [k for k in range(n) if await store.put_if_absent(f"race/{k:03d}", me.encode())]
print(" ".join(map(str, asyncio.run(main()))))
"""


def test_file_put_if_absent_multiprocess(tmp_path: Path) -> None:
    root, flags, procs, keys = tmp_path / "store", tmp_path / "flags", 6, 30
    flags.mkdir()
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    running = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(root), str(i), str(flags), str(keys)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(procs)
    ]
    deadline = time.monotonic() + 30
    while len(list(flags.glob("ready.*"))) < procs and time.monotonic() < deadline:
        time.sleep(0.005)
    (flags / "go").touch()
    wins: dict[int, list[int]] = {}
    for i, p in enumerate(running):
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0
        for k in out.split():
            wins.setdefault(int(k), []).append(i)
    assert sorted(wins) == list(range(keys))
    assert all(len(w) == 1 for w in wins.values()), wins
    for k, (winner,) in wins.items():
        assert (root / "race" / f"{k:03d}").read_bytes() == str(winner).encode()
    assert not [f for f in root.rglob("*") if f.name.startswith(".")]


async def test_file_list_never_shows_temp_files(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store", durable=False)  # no aclose needed: nothing to release
    expected = {f"t/{i:02d}" for i in range(10)}
    stop = asyncio.Event()
    listings: list[list[str]] = []

    async def writer() -> None:
        for _ in range(20):
            await asyncio.gather(*(store.put(k, os.urandom(4096)) for k in sorted(expected)))
            await asyncio.gather(*(store.put_if_absent(k, b"late") for k in sorted(expected)))
        stop.set()

    async def lister() -> None:
        while not stop.is_set():
            listings.append(await store.list(""))

    await asyncio.gather(writer(), lister(), lister())
    assert listings
    assert all(set(seen) <= expected for seen in listings)
    assert await store.list("") == sorted(expected)
    assert not [f for f in (tmp_path / "store").rglob("*") if f.name.startswith(".")]


# -- S3 store -------------------------------------------------------------------------------------


async def test_s3_url_and_options(s3_server: S3Server, s3_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from lakestream._store._s3 import S3Store

    s3_url = s3_server.new_bucket()  # this test looks at the whole bucket
    for name in s3_server.env():
        monkeypatch.delenv(name)
    store = S3Store.from_url(
        s3_url + "/",
        endpoint_url=s3_server.endpoint_url,
        aws_access_key_id=s3_server.access_key,
        aws_secret_access_key=s3_server.secret_key,
        region_name="us-east-1",
    )
    async with store:
        assert store.url == s3_url
        await store.put("k", b"v")
        assert await store.list("") == ["k"]
    bucket_url, prefix = s3_url.rsplit("/", 1)
    whole_bucket = S3Store.from_url(
        bucket_url,
        endpoint_url=s3_server.endpoint_url,
        aws_access_key_id=s3_server.access_key,
        aws_secret_access_key=s3_server.secret_key,
    )
    async with whole_bucket:
        assert whole_bucket.url.count("/") == 2
        assert await whole_bucket.list("") == [f"{prefix}/k"]


@pytest.mark.parametrize("key_id, secret", [("bogus", "bogus"), (None, "wrong-secret")])
async def test_s3_bad_credentials(s3_server: S3Server, s3_url: str, key_id: str | None, secret: str) -> None:
    bucket = s3_url.split("/")[2]
    creds = {"aws_access_key_id": key_id or s3_server.access_key, "aws_secret_access_key": secret}
    async with open_store(s3_url, **creds) as store:
        for call in (lambda: store.get("k"), lambda: store.put("k", b"v"), lambda: store.list("")):
            with pytest.raises(AccessDenied) as info:
                await call()
            assert isinstance(info.value, PermissionError)
            assert s3_server.endpoint_url in str(info.value) and bucket in str(info.value)


async def test_s3_missing_bucket(s3_server: S3Server, s3_url: str) -> None:
    url = "s3://lakestream-no-such-bucket/p"
    async with open_store(url) as store:
        calls = (
            lambda: store.get("k"),
            lambda: store.get_range("k", 0, 1),
            lambda: store.put("k", b"v"),
            lambda: store.put_if_absent("k", b"v"),
            lambda: store.list(""),
            lambda: store.delete(["k"]),
        )
        for call in calls:
            with pytest.raises(BucketNotFound) as info:
                await call()
            assert isinstance(info.value, FileNotFoundError)
            assert s3_server.endpoint_url in str(info.value)
            assert "lakestream-no-such-bucket" in str(info.value)


@pytest.mark.s3
async def test_s3_unreachable_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    (port,) = free_ports(1)
    endpoint = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    start = time.monotonic()
    async with open_store("s3://some-bucket/p", endpoint_url=endpoint) as store:
        with pytest.raises(StoreUnavailable) as info:
            await store.get("k")
    assert time.monotonic() - start < 15
    assert isinstance(info.value, ConnectionError)
    assert endpoint in str(info.value) and "some-bucket" in str(info.value)


class _Captured(Exception):
    pass


@pytest.mark.s3
@pytest.mark.parametrize("op", ["put", "put_if_absent"])
async def test_s3_an_upload_cut_off_after_its_headers_leaves_no_object(s3_url: str, op: str) -> None:
    """A producer killed (or a task cancelled) between the request's headers and its body: the
    server must not store an empty object. SeaweedFS does unless the request carries a checksum
    it can check; every put carries `x-amz-checksum-crc32`. The request the store would send is
    replayed by hand over a socket, headers only, then the connection is closed."""
    import socket
    from urllib.parse import urlsplit

    async with open_store(s3_url) as store:
        client = await store._get_client()  # type: ignore[attr-defined]
        sent: list[tuple[str, dict[str, str]]] = []

        def capture(request, **kw):  # type: ignore[no-untyped-def]
            sent.append(
                (request.url, {k: v.decode() if isinstance(v, bytes) else v for k, v in request.headers.items()})
            )
            raise _Captured

        client.meta.events.register("before-send.s3.PutObject", capture)
        with pytest.raises(_Captured):
            await getattr(store, op)("cut/record", b'{"kind": "commit"}' * 50)
        client.meta.events.unregister("before-send.s3.PutObject", capture)

        url, headers = sent[0]
        assert "x-amz-checksum-crc32" in {k.lower() for k in headers}
        parts = urlsplit(url)
        head = f"PUT {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items() if k.lower() != "expect") + "\r\n"
        with socket.create_connection((parts.hostname, parts.port), timeout=5) as s:
            s.sendall(head.encode())
            time.sleep(0.2)
        await asyncio.sleep(0.5)
        with pytest.raises(ObjectNotFound):
            await store.get("cut/record")
