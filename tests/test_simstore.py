"""The simulated S3 (`lakestream.testing.SimulatedS3`) under trio's mock clock: latencies, the first
conditional PUT to arrive wins, per-prefix token buckets answering 503, retried as S3Store does."""

from __future__ import annotations

import math
import random
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
import trio.testing

from lakestream import ObjectNotFound, StoreUnavailable
from lakestream.testing import SimulatedS3


def simulate(main: Callable[[], Awaitable[Any]]) -> Any:
    return anyio.run(main, backend="trio", backend_options={"clock": trio.testing.MockClock(autojump_threshold=0)})


class Scripted(random.Random):
    """Normal draws from a script (each request's latency), uniform draws fixed at 0.5."""

    def __init__(self, normals: list[float]) -> None:
        super().__init__(0)
        self.normals = list(normals)

    def gauss(self, mu: float = 0.0, sigma: float = 1.0) -> float:
        return self.normals.pop(0)

    def random(self) -> float:
        return 0.5


def test_latency_distribution_matches_the_model() -> None:
    bucket = SimulatedS3(rng=random.Random(7))
    puts = sorted(bucket.delay("put") for _ in range(20_000))
    gets = sorted(bucket.delay("get") for _ in range(20_000))
    assert puts[10_000] == pytest.approx(0.060, rel=0.05)
    assert puts[19_800] == pytest.approx(0.200, rel=0.1)
    assert gets[10_000] == pytest.approx(0.025, rel=0.05)
    assert gets[19_800] == pytest.approx(0.100, rel=0.1)


def test_first_conditional_put_to_arrive_wins_and_calls_take_their_time() -> None:
    z99 = 2.3263478740408408  # a draw at the 99th percentile: 200 ms; at the 1st: 60 * 60 / 200 = 18 ms
    bucket = SimulatedS3(rng=Scripted([z99, -z99, 0.0]))
    store = bucket.client("w")
    answers: dict[str, tuple[bool, float]] = {}

    async def write(who: str, after: float) -> None:
        await anyio.sleep(after)
        won = await store.put_if_absent("_lakestream/log/1", who.encode())
        answers[who] = (won, anyio.current_time())

    async def main() -> bytes:
        async with anyio.create_task_group() as tg:
            tg.start_soon(write, "slow", 0.0)  # 200 ms: arrives at 100 ms
            tg.start_soon(write, "fast", 0.01)  # 60 * (60/200) = 18 ms: arrives at 19 ms
        return await store.get("_lakestream/log/1")  # 25 ms

    assert simulate(main) == b"fast"
    assert answers["fast"][0] and not answers["slow"][0]  # the slow one started first, and lost
    assert answers["slow"][1] == pytest.approx(0.200)
    assert answers["fast"][1] == pytest.approx(0.01 + 0.018)
    assert bucket.requests[("w", "put_if_absent", "_lakestream/log/")] == 2
    assert bucket.requests[("w", "get", "_lakestream/log/")] == 1


def test_token_bucket_answers_503_per_prefix_and_kind() -> None:
    bucket = SimulatedS3(rates={"_lakestream/": (10.0, math.inf)}, retries=False, rng=random.Random(1))
    store = bucket.client("p")
    outcomes: list[str] = []

    async def put(key: str) -> None:
        try:
            await store.put(key, b"x")
            outcomes.append("ok")
        except StoreUnavailable as e:
            assert not e.retried and "503 SlowDown" in str(e)
            outcomes.append("503")

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for i in range(25):
                tg.start_soon(put, f"_lakestream/log/{i}")
            for i in range(25):
                tg.start_soon(put, f"segments/p/{i}")  # no limit on data prefixes
        for i in range(25):  # GETs have their own (here unlimited) bucket
            await store.get(f"segments/p/{i}")

    simulate(main)
    assert outcomes.count("503") == 15  # a second's burst of 10 tokens; 25 puts arrive within 0.2 s
    assert bucket.throttled[("p", "put", "_lakestream/log/")] == 15
    assert bucket.throttled[("p", "put", "segments/")] == 0


def test_throttled_calls_are_retried_like_s3store_then_raise_retried() -> None:
    bucket = SimulatedS3(rates={"_lakestream/": (5.0, 5.0)}, burst=1.0, rng=random.Random(2))
    store = bucket.client("p")
    done: list[float] = []
    failed: list[StoreUnavailable] = []

    async def put(i: int) -> None:
        try:
            await store.put(f"_lakestream/log/{i}", b"x")
            done.append(anyio.current_time())
        except StoreUnavailable as e:
            failed.append(e)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for i in range(20):  # 5 at once, then 5 a second: all within the 10 s retry window
                tg.start_soon(put, i)

    simulate(main)
    assert len(done) == 20 and not failed
    assert sum(bucket.requests.values()) > 20  # retries are requests too
    assert sum(bucket.throttled.values()) == sum(bucket.requests.values()) - 20
    assert max(done) > 2.0  # the bucket paced them

    over = SimulatedS3(rates={"_lakestream/": (1.0, 1.0)}, retry_timeout=3.0, rng=random.Random(3))
    late: list[BaseException] = []

    async def flood() -> None:
        async def one(i: int) -> None:
            try:
                await over.client().put(f"_lakestream/x{i}", b"x")
            except StoreUnavailable as e:
                late.append(e)

        async with anyio.create_task_group() as tg:
            for i in range(50):
                tg.start_soon(one, i)

    simulate(flood)
    assert late and all(isinstance(e, StoreUnavailable) and e.retried for e in late)


def test_missing_objects_and_listing() -> None:
    bucket = SimulatedS3(rng=random.Random(4))
    store = bucket.client("r")

    async def main() -> None:
        with pytest.raises(ObjectNotFound):
            await store.get("_lakestream/log/00000000000000000001.json")
        await store.put("segments/a/1", b"abcdef")
        await store.put("segments/b/2", b"xy")
        assert await store.list("segments/") == ["segments/a/1", "segments/b/2"]
        assert await store.list_sizes("segments/a") == {"segments/a/1": 6}
        assert await store.get_range("segments/a/1", 2, 3) == b"cde"
        await store.delete(["segments/a/1", "segments/none"])
        assert await store.list("segments/") == ["segments/b/2"]

    simulate(main)
    assert bucket.not_found[("r", "get", "_lakestream/log/")] == 1
