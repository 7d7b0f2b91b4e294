"""One contract for every ObjectStore backend: memory, file, S3 (a real SeaweedFS server) through
each S3 client (obstore and aiobotocore), Azure Blob Storage (a real Azurite server, on obstore),
and the simulated S3 of `lakestream.testing` (with millisecond latencies, on the real clock)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from azurite import Azurite
from s3server import S3Server, free_ports

from lakestream._errors import AccessDenied, BucketNotFound, ObjectNotFound, StoreError, StoreUnavailable
from lakestream._store import S3_CLIENTS, FileStore, ObjectStore, open_store, s3_client
from lakestream.testing import SimulatedS3

REPO = Path(__file__).resolve().parents[1]
BACKENDS = [
    "memory",
    "file",
    "simulated",
    *(pytest.param(f"s3-{c}", marks=pytest.mark.s3) for c in S3_CLIENTS),
    pytest.param("azure", marks=pytest.mark.azure),
]


@pytest.fixture(params=BACKENDS)
async def store(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[ObjectStore]:
    if request.param == "simulated":
        fast = {"put": (0.001, 0.003), "get": (0.0005, 0.002)}
        async with SimulatedS3(latency=fast).client() as sim:
            yield sim
        return
    if request.param == "memory":
        url = "memory://"
    elif request.param == "file":
        url = str(tmp_path / "store")
    elif request.param == "azure":
        url = request.getfixturevalue("az_url")
    else:
        monkeypatch.setenv("LAKESTREAM_S3_CLIENT", request.param.removeprefix("s3-"))
        url = request.getfixturevalue("s3_url")
    async with open_store(url) as s:
        yield s


@pytest.fixture(params=S3_CLIENTS)
def client(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each S3 client in turn, chosen as users choose it (`LAKESTREAM_S3_CLIENT`)."""
    monkeypatch.setenv("LAKESTREAM_S3_CLIENT", request.param)
    return str(request.param)


def is_remote(store: ObjectStore) -> bool:
    return store.url.startswith(("s3://", "az://"))  # a real server over HTTP


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
    rounds = 2 if is_remote(store) else 20  # contended conditional PUTs take seconds on SeaweedFS
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


@pytest.mark.parametrize("where", ["disk", "memory"])
async def test_file_reads_of_cached_objects_take_no_thread_and_say_what_a_thread_would(
    where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read the page cache holds is made on the event loop, with the same answers as the
    worker-thread path (which a network filesystem, or a read that would wait, takes)."""
    import anyio.to_thread

    from lakestream._errors import CorruptData
    from lakestream._store._file import filesystem_of
    from lakestream._tasks import INLINE_BYTES

    base = tmp_path if where == "disk" else Path("/dev/shm")
    if filesystem_of(base) not in ("ext4", "xfs", "btrfs", "overlay", "tmpfs"):
        pytest.skip(f"{base} is on {filesystem_of(base)!r}, not a local filesystem these reads are made on")
    root = Path(os.path.realpath(base)) / f"store-{os.getpid()}-{where}"
    store = FileStore(root, durable=False)
    try:
        big, huge = os.urandom(3 << 20), os.urandom(INLINE_BYTES + 2)
        await store.put("a/big", big)
        await store.put("a/huge", huge)
        await store.put("a/small", b"0123456789")
        (root / "a" / "dir").mkdir()
        hops: list[object] = []
        real = anyio.to_thread.run_sync

        async def counted(fn: Any, *args: Any, **kwargs: Any) -> Any:
            hops.append(fn)
            return await real(fn, *args, **kwargs)

        monkeypatch.setattr(anyio.to_thread, "run_sync", counted)
        answers = []
        for thread in (False, True):
            store._here = -1 if thread else None  # -1: every read in a worker thread
            got = [
                bytes(await store.get_range("a/big", 5, 1 << 20)),  # pooled
                bytes(await store.get_range("a/big", (3 << 20) - 10, 100)),  # cut short at the end
                await store.get_range("a/small", 2, 3),
                await store.get("a/small"),
                bytes(await store.get_range("a/big", 7 << 20, 10)),  # past the end: nothing
            ]
            assert type(got[3]) is bytes  # a whole object is bytes
            for key in ("a/missing", "b/missing"):
                with pytest.raises(ObjectNotFound):
                    await store.get_range(key, 0, 10)
            assert len(hops) == (7 if thread else 0), hops  # not one thread hop for a cached read
            with pytest.raises(CorruptData, match="a directory stands where an object should be"):
                await store.get("a/dir")  # reported where the read was made
            hops.clear()
            assert bytes(await store.get_range("a/huge", 1, INLINE_BYTES + 1)) == huge[1 : INLINE_BYTES + 2]
            assert len(hops) == 1  # over INLINE_BYTES: read in a thread, the loop is not held that long
            answers.append(got)
            hops.clear()
        assert answers[0] == answers[1] == [big[5 : 5 + (1 << 20)], big[-10:], b"234", b"0123456789", b""]
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


async def test_will_need_has_the_page_cache_read_a_range_it_does_not_hold(tmp_path: Path) -> None:
    """`FileStore.in_page_cache` tells a range the page cache does not hold, and `will_need`
    starts the disk's reads of it, so that a read of it made later takes no wait (a read with
    RWF_NOWAIT gets it all); neither is an error for a missing object or a range past the end."""
    import anyio

    from lakestream._store._file import DISK_FILESYSTEMS, filesystem_of

    if filesystem_of(tmp_path) not in DISK_FILESYSTEMS:
        pytest.skip(f"{tmp_path} is on {filesystem_of(tmp_path)!r}: will_need acts on disk filesystems only")
    store = FileStore(tmp_path / "s")  # durable: its pages are clean, so the kernel can drop them
    await store.put("a/seg", os.urandom(4 << 20))
    path = tmp_path / "s" / "a" / "seg"
    at, size = 1 << 20, 1 << 20

    def cached() -> bool:
        fd = os.open(path, os.O_RDONLY)
        try:
            return os.preadv(fd, [bytearray(size)], at, os.RWF_NOWAIT) == size
        except BlockingIOError:
            return False
        finally:
            os.close(fd)

    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    if cached():
        pytest.skip("the kernel kept the file's pages after POSIX_FADV_DONTNEED")
    assert not store.in_page_cache("a/seg", at, size)
    store.will_need("a/seg", at, size)
    deadline = time.monotonic() + 10
    while not cached():
        assert time.monotonic() < deadline, "the range was not read into the page cache"
        await anyio.sleep(0.01)
    assert store.in_page_cache("a/seg", at, size)
    for key, offset in (("a/missing", 0), ("a/seg", 8 << 20), ("../outside", 0)):
        assert store.in_page_cache(key, offset, 10)  # nothing to read ahead: the fetch reports it
        store.will_need(key, offset, 10)


def test_filesystem_of_names_the_innermost_mount(tmp_path: Path) -> None:
    from lakestream._store._file import filesystem_of

    assert filesystem_of(Path("/proc/self")) == "proc"
    assert filesystem_of(Path("/")) != ""
    assert filesystem_of(tmp_path / "not" / "yet") == filesystem_of(tmp_path)


async def test_run_sync_runs_small_work_here_and_large_work_in_a_thread() -> None:
    import threading

    from lakestream._tasks import INLINE_BYTES, INLINE_ITEMS, run_sync

    here = threading.get_ident()
    assert await run_sync(threading.get_ident, nbytes=INLINE_BYTES, items=INLINE_ITEMS) == here
    assert await run_sync(threading.get_ident, nbytes=INLINE_BYTES + 1) != here
    assert await run_sync(threading.get_ident, nbytes=0, items=INLINE_ITEMS + 1) != here
    assert await run_sync(divmod, 7, 2, nbytes=0) == (3, 1)


# -- S3 store -------------------------------------------------------------------------------------


def s3_store_class(client: str) -> Any:
    if client == "obstore":
        from lakestream._store._obstore import ObstoreS3Store

        return ObstoreS3Store
    from lakestream._store._s3 import S3Store

    return S3Store


def test_s3_client_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LAKESTREAM_S3_CLIENT", raising=False)
    assert s3_client() == "obstore"
    assert type(open_store("s3://b/p")).__name__ == "ObstoreS3Store"
    monkeypatch.setenv("LAKESTREAM_S3_CLIENT", "AioBotoCore")
    assert type(open_store("s3://b/p")).__name__ == "S3Store"
    monkeypatch.setenv("LAKESTREAM_S3_CLIENT", "boto3")
    with pytest.raises(ValueError, match=r"LAKESTREAM_S3_CLIENT='boto3': expected one of obstore, aiobotocore"):
        open_store("s3://b/p")
    assert type(open_store("memory://")).__name__ == "MemoryStore"  # other schemes do not care


async def test_s3_url_and_options(
    s3_server: S3Server, s3_url: str, monkeypatch: pytest.MonkeyPatch, client: str
) -> None:
    S3Store = s3_store_class(client)
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
        assert await whole_bucket.list(prefix[:3]) == [f"{prefix}/k"]


@pytest.mark.parametrize("key_id, secret", [("bogus", "bogus"), (None, "wrong-secret")])
async def test_s3_bad_credentials(
    s3_server: S3Server, s3_url: str, key_id: str | None, secret: str, client: str
) -> None:
    bucket = s3_url.split("/")[2]
    creds = {"aws_access_key_id": key_id or s3_server.access_key, "aws_secret_access_key": secret}
    async with open_store(s3_url, **creds) as store:
        for call in (lambda: store.get("k"), lambda: store.put("k", b"v"), lambda: store.list("")):
            with pytest.raises(AccessDenied) as info:
                await call()
            assert isinstance(info.value, PermissionError)
            assert s3_server.endpoint_url in str(info.value) and bucket in str(info.value)


def every_call(store: ObjectStore) -> tuple[Callable[[], Awaitable[Any]], ...]:
    """One call of each operation of `store`, on key `k`."""
    return (
        lambda: store.get("k"),
        lambda: store.get_range("k", 0, 1),
        lambda: store.put("k", b"v"),
        lambda: store.put_if_absent("k", b"v"),
        lambda: store.list(""),
        lambda: store.delete(["k"]),
    )


async def test_s3_missing_bucket(s3_server: S3Server, s3_url: str, client: str) -> None:
    url = "s3://lakestream-no-such-bucket/p"
    async with open_store(url) as store:
        for call in every_call(store):
            with pytest.raises(BucketNotFound) as info:
                await call()
            assert isinstance(info.value, FileNotFoundError)
            assert s3_server.endpoint_url in str(info.value)
            assert "lakestream-no-such-bucket" in str(info.value)


@pytest.mark.s3
async def test_s3_unreachable_endpoint(monkeypatch: pytest.MonkeyPatch, client: str) -> None:
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
    assert isinstance(info.value, ConnectionError) and info.value.retried
    assert endpoint in str(info.value) and "some-bucket" in str(info.value)


@pytest.mark.s3
async def test_s3_throttling_is_retried_then_reported(monkeypatch: pytest.MonkeyPatch, client: str) -> None:
    """A server that answers every request `503 SlowDown`: each call is retried, then raises
    StoreUnavailable naming the code; a 501 (not implemented) is not retried."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    with Answering(b"503 Slow Down", b"SlowDown") as server:
        async with open_store("s3://b/p", endpoint_url=server.url, max_attempts=3, retry_timeout=30) as store:
            for call in every_call(store):
                before = server.requests
                with pytest.raises(StoreUnavailable, match="SlowDown") as info:
                    await call()
                assert info.value.retried and "3 attempts" in str(info.value)
                assert server.requests - before == 3
    with Answering(b"501 Not Implemented", b"NotImplemented") as server:
        async with open_store("s3://b/p", endpoint_url=server.url, max_attempts=3) as store:
            with pytest.raises(StoreError, match="NotImplemented") as error:
                await store.put("k", b"v")
            assert not isinstance(error.value, StoreUnavailable) and server.requests == 1


# -- Azure Blob Storage (az://, a real Azurite server) ---------------------------------------------


async def test_azure_url_and_options(azurite: Azurite, az_url: str) -> None:
    container = az_url.split("/")[2]
    async with open_store(az_url) as store:
        assert store.url == az_url and azurite.endpoint_url in repr(store)
        await store.put("k", b"v")
        prefix = az_url.split("/", 3)[3]
    async with open_store(f"az://{container}") as whole_container:
        assert await whole_container.list(prefix[:-1]) == [f"{prefix}/k"]
    for bad in ("az://", "az:///p", "az://a/b/../c"):
        with pytest.raises(ValueError):
            async with open_store(bad) as store:
                await store.get("k")


async def test_azure_missing_container(azurite: Azurite, az_url: str) -> None:
    async with open_store("az://lakestream-no-such-container/p") as store:
        for call in every_call(store):
            with pytest.raises(BucketNotFound) as info:
                await call()
            assert isinstance(info.value, FileNotFoundError)
            assert azurite.endpoint_url in str(info.value) and "lakestream-no-such-container" in str(info.value)


async def test_azure_bad_key_and_no_account(azurite: Azurite, az_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    wrong = base64.b64encode(b"w" * 64).decode()
    async with open_store(az_url, account_key=wrong) as store:
        for call in (lambda: store.get("k"), lambda: store.put("k", b"v"), lambda: store.list("")):
            with pytest.raises(AccessDenied) as info:
                await call()
            assert isinstance(info.value, PermissionError)
            assert azurite.endpoint_url in str(info.value) and az_url.split("/")[2] in str(info.value)
            assert "AZURE_STORAGE_ACCOUNT_KEY" in str(info.value)
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT_NAME")
    async with open_store(az_url) as store:
        with pytest.raises(AccessDenied, match="AZURE_STORAGE_ACCOUNT_NAME"):
            await store.get("k")


async def test_azure_unreachable_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    (port,) = free_ports(1)
    endpoint = f"http://127.0.0.1:{port}/devstoreaccount1"
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "devstoreaccount1")
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", base64.b64encode(b"k" * 64).decode())
    start = time.monotonic()
    async with open_store("az://some-container/p", endpoint_url=endpoint, retry_timeout=2) as store:
        with pytest.raises(StoreUnavailable) as info:
            await store.get("k")
    assert time.monotonic() - start < 10
    assert isinstance(info.value, ConnectionError) and info.value.retried
    assert endpoint in str(info.value) and "some-container" in str(info.value)


async def test_azure_server_busy_is_retried_then_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """Azure's throttling answer, `503 ServerBusy`, to every request: each call is retried, then
    raises StoreUnavailable naming the code."""
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "devstoreaccount1")
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", base64.b64encode(b"k" * 64).decode())
    with Answering(b"503 Server Busy", b"ServerBusy") as server:
        async with open_store("az://c-busy/p", endpoint_url=server.url, max_attempts=3, retry_timeout=30) as store:
            for call in every_call(store):
                before = server.requests
                with pytest.raises(StoreUnavailable, match="ServerBusy") as info:
                    await call()
                assert info.value.retried and "3 attempts" in str(info.value)
                assert server.requests - before == 3


class Answering:
    """An HTTP server on loopback that answers every request with one S3 error response."""

    def __init__(self, status: bytes, code: bytes) -> None:
        body = b"<?xml version='1.0'?><Error><Code>" + code + b"</Code><Message>no</Message></Error>"
        self.response = b"HTTP/1.1 %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (status, len(body), body)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests = 0
        self.headers: list[bytes] = []

    def __enter__(self) -> Answering:
        threading.Thread(target=self._serve, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                head = b""
                while b"\r\n\r\n" not in head and (chunk := conn.recv(65536)):
                    head += chunk
                self.headers.append(head.split(b"\r\n\r\n")[0])
                self.requests += 1
                with contextlib.suppress(OSError):
                    conn.sendall(self.response)


@pytest.mark.s3
@pytest.mark.parametrize("op", ["put", "put_if_absent"])
async def test_s3_an_upload_cut_off_after_its_headers_leaves_no_object(
    s3_server: S3Server, s3_url: str, op: str, client: str
) -> None:
    """A producer killed (or a task cancelled) between the request's headers and its body: the
    server must not store an empty object. SeaweedFS does unless the request carries a checksum
    it can check: every put carries `x-amz-checksum-crc32` (aiobotocore) or `-crc64nvme` (obstore).
    The request each client sends is caught by a stand-in server, then its headers alone are
    sent to the real one and the connection is closed."""
    with Answering(b"400 Bad Request", b"Caught") as catcher:
        async with open_store(s3_url, endpoint_url=catcher.url, max_attempts=1) as store:
            with pytest.raises(StoreError):
                await getattr(store, op)("cut/record", b'{"kind": "commit"}' * 50)
    (head,) = catcher.headers
    assert re.search(
        rb"(?im)^x-amz-checksum-crc32:" if client == "aiobotocore" else rb"(?im)^x-amz-checksum-crc64nvme:", head
    )
    head = b"\r\n".join(line for line in head.split(b"\r\n") if not line.lower().startswith(b"expect:"))
    with socket.create_connection(("127.0.0.1", int(s3_server.endpoint_url.rsplit(":", 1)[1])), timeout=5) as s:
        s.sendall(head + b"\r\n\r\n")
        time.sleep(0.2)
    await asyncio.sleep(0.5)
    async with open_store(s3_url) as store:
        with pytest.raises(ObjectNotFound):
            await store.get("cut/record")


@pytest.mark.parametrize("op", ["put", "put_if_absent"])
@pytest.mark.parametrize("sent", [0, 400, 900])
async def test_azure_an_upload_cut_off_leaves_no_object(azurite: Azurite, az_url: str, op: str, sent: int) -> None:
    """A producer killed between the request's headers and the end of its body: Azure stores a
    blob only once the whole body its Content-Length announces has arrived. The request obstore
    sends is caught by a stand-in server, then its headers and `sent` bytes of its 900-byte body
    go to Azurite and the connection is closed: the whole body (the request is valid) stores it."""
    body = b'{"kind": "commit"}' * 50
    with Answering(b"400 Bad Request", b"Caught") as catcher:
        endpoint = f"{catcher.url}/devstoreaccount1"
        async with open_store(az_url, endpoint_url=endpoint, max_attempts=1) as store:
            with pytest.raises(StoreError):
                await getattr(store, op)("cut/record", body)
    (head,) = catcher.headers
    assert len(body) == 900 and re.search(rb"(?im)^content-length: *900\r?$", head), head
    head = b"\r\n".join(line for line in head.split(b"\r\n") if not line.lower().startswith(b"expect:"))
    port = int(azurite.endpoint_url.split(":")[2].split("/")[0])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(head + b"\r\n\r\n" + body[:sent])
        time.sleep(0.2)
    await asyncio.sleep(0.5)
    async with open_store(az_url) as store:
        if sent == len(body):
            assert await store.get("cut/record") == body
        else:
            with pytest.raises(ObjectNotFound):
                await store.get("cut/record")


def crc64nvme(data: bytes) -> int:
    """CRC-64/NVME (reflected polynomial 0x9A6C9329AC4BC9B5, all ones in and out), bit by bit."""
    crc = 0xFFFFFFFFFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x9A6C9329AC4BC9B5 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFFFFFFFFFF


def test_crc64nvme_of_the_standard_check_string() -> None:
    assert crc64nvme(b"123456789") == 0xAE8B14860A799888


@pytest.mark.s3
@pytest.mark.parametrize("checksum", ["crc64nvme", "sha256", None])
async def test_s3_obstore_puts_carry_a_checksum_of_their_body_the_server_keeps(
    s3_server: S3Server, s3_url: str, monkeypatch: pytest.MonkeyPatch, checksum: str | None
) -> None:
    """obstore's PUTs send `x-amz-checksum-crc64nvme` over an unsigned payload by default (the CRC
    costs a fraction of the SHA-256 a signed payload needs), `x-amz-checksum-sha256` with
    `LAKESTREAM_S3_CHECKSUM=sha256`; the server checks it against the body (a wrong one is
    BadDigest) and keeps it: the checksum it reports is the body's, computed here."""
    monkeypatch.setenv("LAKESTREAM_S3_CLIENT", "obstore")
    if checksum is None:
        monkeypatch.delenv("LAKESTREAM_S3_CHECKSUM", raising=False)
    else:
        monkeypatch.setenv("LAKESTREAM_S3_CHECKSUM", checksum.upper())
    body = bytes(range(256)) * 41 + b"tail"
    async with open_store(s3_url) as store:
        await store.put("sum/put", body)
        assert await store.put_if_absent("sum/create", body)
    bucket, _, prefix = s3_url.removeprefix("s3://").partition("/")
    client = s3_server._client()
    for key in ("sum/put", "sum/create"):
        head = client.head_object(Bucket=bucket, Key=f"{prefix}/{key}", ChecksumMode="ENABLED")
        if checksum == "sha256":
            assert head["ChecksumSHA256"] == base64.b64encode(hashlib.sha256(body).digest()).decode()
        else:
            assert head["ChecksumCRC64NVME"] == base64.b64encode(crc64nvme(body).to_bytes(8, "big")).decode()


def test_s3_an_unknown_checksum_is_refused_when_the_store_opens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAKESTREAM_S3_CLIENT", "obstore")
    monkeypatch.setenv("LAKESTREAM_S3_CHECKSUM", "md5")
    with pytest.raises(ValueError, match=r"LAKESTREAM_S3_CHECKSUM='md5': expected one of crc64nvme, sha256"):
        open_store("s3://b/p")


EXITER = """
import asyncio, os, sys
from lakestream._errors import StoreUnavailable
from lakestream._store import open_store
async def main():
    async with open_store("s3://b/p", endpoint_url=sys.argv[1], max_attempts=1) as store:
        try:
            await store.get("k")
        except StoreUnavailable:
            pass
statuses = []
for _ in range(int(sys.argv[2])):
    pid = os.fork()
    if pid == 0:  # a child runs one call and exits as a program does: atexit, then finalization
        asyncio.run(main())
        sys.exit(0)
    statuses.append(os.waitpid(pid, 0)[1])
print(" ".join(map(str, statuses)))
"""


@pytest.mark.s3
def test_a_process_that_used_the_s3_client_exits_cleanly(client: str) -> None:
    """obstore completes calls on its own threads; one still handing a result to the event loop
    as the interpreter finalizes used to abort the process (SIGABRT, in about one exit in ten).
    Each of `runs` processes (forked, so lakestream is imported once) makes one call and exits."""
    (port,) = free_ports(1)
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    aws = {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_REGION": "us-east-1"}
    env = {**os.environ, "PYTHONPATH": path, **aws}
    runs = 30 if client == "obstore" else 3
    args = [sys.executable, "-c", EXITER, f"http://127.0.0.1:{port}", str(runs)]
    out = subprocess.run(args, env=env, timeout=120, check=True, capture_output=True, text=True).stdout
    assert out.split() == ["0"] * runs


FORKER = """
import asyncio, os, sys
from lakestream._errors import StoreError
from lakestream._store import open_store
url = sys.argv[1]
async def round_trip(store, key):
    await asyncio.wait_for(store.put(key, key.encode()), 20)
    assert bytes(await asyncio.wait_for(store.get_range(key, 0, 100), 20)) == key.encode()
async def parent():
    store = open_store(url)
    await round_trip(store, "parent")
    return store
inherited = asyncio.run(parent())
pid = os.fork()
if pid == 0:  # as a DataLoader worker forked from a process that read the stream
    async def child():
        async with open_store(url) as store:
            await round_trip(store, "child")
            print(type(store).__name__, flush=True)
        try:
            await asyncio.wait_for(inherited.get("parent"), 20)
        except StoreError as e:
            print("inherited:", e, flush=True)
    asyncio.run(child())
    sys.exit(0)
_, status = os.waitpid(pid, 0)
print("child exit", status, flush=True)
"""


def test_a_process_forked_after_obstore_was_used_opens_its_stores_on_aiobotocore(s3_url: str) -> None:
    """obstore's calls run on threads a fork does not copy: in a forked child a call never
    returned. A store opened there uses aiobotocore; one inherited from the parent says why it
    cannot be used."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    env.pop("LAKESTREAM_S3_CLIENT", None)
    proc = subprocess.run([sys.executable, "-c", FORKER, s3_url], env=env, timeout=120, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "S3Store", proc.stdout + proc.stderr[-3000:]
    assert lines[1].startswith("inherited: ") and "forked" in lines[1] and s3_url in lines[1], lines
    assert lines[2] == "child exit 0", proc.stdout + proc.stderr[-3000:]


AZ_FORKER = """
import asyncio, os, sys
from lakestream._errors import StoreError
from lakestream._store import open_store
url = sys.argv[1]
async def parent():
    async with open_store(url) as store:
        await store.put("parent", b"p")
asyncio.run(parent())
pid = os.fork()
if pid == 0:  # as a DataLoader worker forked from a process that read the stream
    async def child():
        async with open_store(url) as store:
            try:
                print("read", await asyncio.wait_for(store.get("parent"), 20), flush=True)
            except StoreError as e:
                print("error:", e, flush=True)
    asyncio.run(child())
    sys.exit(0)
_, status = os.waitpid(pid, 0)
print("child exit", status, flush=True)
"""


def test_a_process_forked_after_obstore_was_used_is_told_to_spawn_for_az(az_url: str) -> None:
    """obstore's threads do not survive a fork and az:// has no other client: a store opened in a
    forked child raises StoreError naming the fork and the way out, rather than never returning."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", AZ_FORKER, az_url], env={**os.environ, "PYTHONPATH": path}, timeout=120,
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    error, exit_line = proc.stdout.splitlines()
    assert error.startswith("error: ") and az_url in error and "forked" in error and "spawn" in error, error
    assert exit_line == "child exit 0", proc.stdout + proc.stderr[-3000:]


async def test_s3_credentials_and_region_from_the_aws_config_files(
    s3_server: S3Server, s3_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, client: str
) -> None:
    """No keys in the environment: both clients find them in the credentials file of a profile,
    as botocore does; with none anywhere, AccessDenied says what to set."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name)
    (tmp_path / "credentials").write_text(
        f"[bench]\naws_access_key_id = {s3_server.access_key}\naws_secret_access_key = {s3_server.secret_key}\n"
    )
    (tmp_path / "config").write_text("[profile bench]\nregion = us-east-1\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_PROFILE", "bench")
    async with open_store(s3_url) as store:
        await store.put("k", b"v")
        assert bytes(await store.get_range("k", 0, 1)) == b"v"
    monkeypatch.delenv("AWS_PROFILE")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    async with open_store(s3_url) as store:
        with pytest.raises(AccessDenied, match="AWS_ACCESS_KEY_ID") as info:
            await store.get("k")
    assert s3_server.endpoint_url in str(info.value)
