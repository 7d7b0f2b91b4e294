"""The fault spec of `lakestream.testing` (`inject_faults`, `python -m lakestream.testing`): S3's
latencies and request rates, on a fake clock, and a real producer and readers run through them."""

from __future__ import annotations

import math
import random
import statistics
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

import lakestream
from lakestream import StoreUnavailable
from lakestream._store import MemoryStore
from lakestream.testing import S3_LATENCY_OPS, FaultyStore, inject_faults, parse_faults

GETS = ("get", "get_range", "list", "list_sizes")
PUTS = ("put", "put_if_absent", "delete")


class FakeClock:
    def __init__(self) -> None:
        self.now = 500.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def no_faults() -> Iterator[None]:
    """Whatever a test injects, stop injecting after it."""
    try:
        yield
    finally:
        inject_faults(None)


# -- the spec ---------------------------------------------------------------------------------------


def test_parse_every_key() -> None:
    faults, seed = parse_faults("ambiguous=0.1,fail=0.2,latency=s3,get_rate=55,put_rate=35.5,seed=7")
    assert faults == {
        "ambiguous_put": 0.1,
        "fail_before": 0.2,
        "latency": S3_LATENCY_OPS,
        "get_rate": 55.0,
        "put_rate": 35.5,
    }
    assert seed == 7
    faults, seed = parse_faults("latency=none")
    assert faults["latency"] == {} and faults["get_rate"] == faults["put_rate"] == math.inf and seed is None
    assert parse_faults("") == parse_faults("latency=none,ambiguous=0,fail=0")


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("latency=s3,bogus=1", r"unknown keys \['bogus'\]"),
        ("get_rate=-5", "get_rate and put_rate are requests per second, above 0"),
        ("put_rate=0", "get_rate and put_rate are requests per second, above 0"),
        ("put_rate=nan", "get_rate and put_rate are requests per second, above 0"),
        ("get_rate=fast", "could not convert"),
        ("latency=bogus", "latency is one of s3, none, not 'bogus'"),
        ("fail=1.5", "ambiguous and fail are probabilities"),
        ("seed=x", "could not convert|invalid literal"),
        ("latency", "expected ambiguous=P"),
    ],
)
def test_parse_rejects_a_bad_spec_in_one_line(spec: str, says: str) -> None:
    with pytest.raises(ValueError, match=says) as info:
        parse_faults(spec)
    assert "\n" not in str(info.value) and repr(spec) in str(info.value)


def test_the_command_says_a_bad_spec_in_one_line() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "lakestream.testing", "get_rate=-1", "status", "file:///nonexistent"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "lakestream.testing: faults 'get_rate=-1': get_rate and put_rate are requests per second, above 0"
    ]


# -- the token buckets, on a fake clock --------------------------------------------------------------


async def call(store: FaultyStore, op: str, key: str) -> None:
    if op == "get":
        await store.get(key)
    elif op == "get_range":
        await store.get_range(key, 0, 1)
    elif op == "list":
        await store.list(key.rpartition("/")[0] + "/")
    elif op == "list_sizes":
        await store.list_sizes(key.rpartition("/")[0] + "/")
    elif op == "put":
        await store.put(key, b"xy")
    elif op == "put_if_absent":
        await store.put_if_absent(key, b"xy")
    else:
        await store.delete([key])


@pytest.mark.parametrize(("rate", "ops", "kind"), [("get_rate", GETS, "GET"), ("put_rate", PUTS, "PUT")])
async def test_a_rate_lets_a_second_of_requests_through_then_answers_503(
    rate: str, ops: tuple[str, ...], kind: str
) -> None:
    inner = MemoryStore()
    await inner.put("a/b/k", b"xy")
    await inner.put("a/c/k", b"xy")
    clock = FakeClock()
    store = FaultyStore(inner, clock=clock, **{rate: 10})
    for i in range(10):
        await call(store, ops[i % len(ops)], "a/b/k")
    for op in ops:  # every call of the kind, in the same instant
        with pytest.raises(StoreUnavailable, match=f"503 SlowDown: over 10 {kind}s/s on 'a/b'"):
            await call(store, op, "a/b/k")
    other = GETS if ops is PUTS else PUTS
    await call(store, other[0], "a/b/k")  # the other kind has its own bucket
    await call(store, ops[0], "a/c/k")  # and so has another prefix
    clock.now += 0.1
    await call(store, ops[0], "a/b/k")  # a tenth of a second refills one token
    with pytest.raises(StoreUnavailable, match="503 SlowDown"):
        await call(store, ops[0], "a/b/k")
    clock.now += 60
    for _ in range(10):  # never more than a second's burst
        await call(store, ops[0], "a/b/k")
    with pytest.raises(StoreUnavailable):
        await call(store, ops[0], "a/b/k")
    assert sum(store.injected.values()) == len(ops) + 2
    assert all(k.endswith(":throttled") for k in store.injected)


async def test_write_rate_is_put_rate() -> None:
    clock = FakeClock()
    store = FaultyStore(MemoryStore(), clock=clock, write_rate=2)
    await store.put("p/1", b"")
    await store.put_if_absent("p/2", b"")
    with pytest.raises(StoreUnavailable, match="over 2 PUTs/s"):
        await store.delete(["p/1", "p/2"])
    assert await store.get("p/1") == b""


async def test_the_stores_of_a_process_share_its_rates(tmp_path: Path, no_faults: None) -> None:
    inject_faults("put_rate=2")
    url = f"file://{tmp_path}/s"
    async with lakestream.open_store(url) as one, lakestream.open_store(url) as two:
        await one.put("p/1", b"")
        await two.put("p/2", b"")
        with pytest.raises(StoreUnavailable, match="over 2 PUTs/s on 'p'"):
            await one.put("p/3", b"")
        async with lakestream.open_store(f"file://{tmp_path}/other") as other:
            await other.put("p/1", b"")  # another stream, other buckets


# -- S3's latencies ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ops", "median", "p99"),
    [(("put", "put_if_absent", "delete"), 0.060, 0.200), (("get", "get_range", "list"), 0.025, 0.100)],
)
def test_s3_latency_has_s3s_median_and_p99(ops: tuple[str, ...], median: float, p99: float) -> None:
    faults, _ = parse_faults("latency=s3")
    store = FaultyStore(MemoryStore(), rng=random.Random(1), **faults)
    for op in ops:
        draws = sorted(store._delay(op) for _ in range(20_000))
        assert statistics.median(draws) == pytest.approx(median, rel=0.15), op
        assert draws[int(0.99 * len(draws))] == pytest.approx(p99, rel=0.15), op


async def test_a_conditional_put_lands_half_way_through_its_latency() -> None:
    inner = MemoryStore()
    store = FaultyStore(inner, latency={"put_if_absent": (0.4, 0.0)})
    async with anyio.create_task_group() as tg:
        tg.start_soon(store.put_if_absent, "k", b"x")
        await anyio.sleep(0.1)
        assert await inner.list("") == []
        await anyio.sleep(0.25)
        assert await inner.list("") == ["k"]  # landed, not answered yet


# -- a real run ---------------------------------------------------------------------------------------


async def test_a_producer_and_readers_at_s3_latencies_and_throttled_read_every_sample_once(
    tmp_path: Path, no_faults: None
) -> None:
    url = f"file://{tmp_path}/s"
    stores: list[FaultyStore] = []
    inject_faults("latency=s3,get_rate=8,put_rate=4,seed=1", stores.append)
    world, batch, n = 2, 4, 48
    await lakestream.create(url, world_size=world, global_batch=batch)
    steps = n // batch
    keys: Counter[str] = Counter()

    async def produce() -> None:
        async with lakestream.open_producer(url, "p") as p:
            for i in range(n):
                await p.put({"__key__": f"s{i}", "txt": str(i)})

    async def read(rank: int) -> None:
        async with lakestream.open_reader(url, rank, poll_interval=(0.05, 0.2)) as r:
            async for b in r.steps(0, steps):
                keys.update(s["__key__"] for s in b.samples)

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            tg.start_soon(produce)
            for rank in range(world):
                tg.start_soon(read, rank)
    inject_faults(None)  # the checks below are not throttled
    assert keys == Counter(f"s{i}" for i in range(n))
    assert (await lakestream.verify(url)).ok
    assert all(s.latency == S3_LATENCY_OPS for s in stores)
    throttled = sum((s.injected for s in stores), Counter())
    assert {k for k in throttled if k.endswith(":throttled")}, throttled
    assert any(op in k for k in throttled for op in PUTS) and any(op in k for k in throttled for op in GETS), throttled
