"""The backoff policy and the one retry loop, on a fake clock, a fake sleep and a fixed random source:
nothing here really sleeps. The S3 store's retries run against a real refused connection."""

from __future__ import annotations

import logging
import math
import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lakestream import StoreUnavailable
from lakestream._retry import STORE_BACKOFF, Backoff, retry
from lakestream._store._obstore import ObstoreS3Store
from lakestream._store._s3 import S3_BACKOFF, S3Store

S3_STORES = [S3Store, ObstoreS3Store]  # each S3 client's store


class FakeTime:
    """A clock that moves only when slept on, and a record of every sleep."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class Fixed:
    """A random source that always draws `value`."""

    def __init__(self, value: float) -> None:
        self.value = value

    def random(self) -> float:
        return self.value


class Failing:
    """A call that fails with `errors` in turn, then returns 'ok'."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


def down(n: int, *, retried: bool = False) -> list[Exception]:
    return [StoreUnavailable(f"outage {i}", retried=retried) for i in range(n)]


# -- the policy --------------------------------------------------------------------------------


@given(
    first=st.floats(1e-6, 1e3),
    factor=st.floats(1, 1e6),
    jitter=st.floats(0, 1),
    n=st.integers(1, 10**18),
    u=st.floats(0, 1, exclude_max=True),
)
def test_every_delay_lies_within_its_jittered_ceiling_and_the_cap(
    first: float, factor: float, jitter: float, n: int, u: float
) -> None:
    b = Backoff(first=first, cap=first * factor, jitter=jitter)
    c = b.ceiling(n)
    assert first <= c <= b.cap
    assert c == min(b.cap, first * 2.0 ** min(n - 1, 1023))
    d = b.delay(n, Fixed(u))
    assert (1 - jitter) * c * (1 - 1e-12) <= d <= c
    assert b.ceiling(n) <= b.ceiling(n + 1)


@given(first=st.floats(1e-6, 1e3), factor=st.floats(1, 1e6), n=st.integers(100, 10**30))
def test_the_ceiling_reaches_the_cap_and_never_overflows(first: float, factor: float, n: int) -> None:
    b = Backoff(first=first, cap=first * factor)
    assert b.ceiling(n) == b.cap
    assert b.delay(n) < b.cap


def test_full_jitter_spans_zero_to_the_ceiling_and_half_jitter_keeps_half() -> None:
    assert STORE_BACKOFF.delay(1, Fixed(0.0)) == 0.0
    assert STORE_BACKOFF.delay(3, Fixed(0.5)) == pytest.approx(0.2)
    assert S3_BACKOFF.delay(1, Fixed(0.0)) == pytest.approx(0.05)
    assert S3_BACKOFF.delay(5, Fixed(0.0)) == pytest.approx(0.8)
    assert S3_BACKOFF.delay(6, Fixed(0.0)) == pytest.approx(1.0)  # capped at 2 s, half kept
    assert Backoff(first=1, cap=8, jitter=0).delay(3, Fixed(0.9)) == 4.0


@pytest.mark.parametrize(
    "kwargs",
    [{"first": 0}, {"first": -1}, {"first": math.nan}, {"first": 2, "cap": 1}, {"cap": math.inf}, {"jitter": 1.5}],
)
def test_a_backoff_that_makes_no_sense_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="backoff"):
        Backoff(**kwargs)


def test_failures_are_counted_from_one() -> None:
    with pytest.raises(ValueError, match="from 1"):
        STORE_BACKOFF.delay(0)


# -- the loop ----------------------------------------------------------------------------------


async def test_a_call_that_recovers_returns_after_one_backoff_wait_per_failure() -> None:
    t, call = FakeTime(), Failing(*down(3))
    got = await retry(call, backoff=Backoff(first=1, cap=100, jitter=0.5), clock=t.clock, sleep=t.sleep, rng=Fixed(0))
    assert got == "ok" and call.calls == 4
    assert t.sleeps == [0.5, 1.0, 2.0]


async def test_attempts_bound_the_calls_and_the_last_error_is_raised() -> None:
    t, errors = FakeTime(), down(10)
    call = Failing(*errors)
    with pytest.raises(StoreUnavailable) as info:
        await retry(call, attempts=4, clock=t.clock, sleep=t.sleep, rng=Fixed(0.5))
    assert info.value is errors[3] and call.calls == 4 and len(t.sleeps) == 3


async def test_an_error_the_store_already_retried_ends_a_bounded_retry_at_once_but_not_an_unbounded_one() -> None:
    t = FakeTime()
    call = Failing(*down(3, retried=True))
    with pytest.raises(StoreUnavailable):
        await retry(call, attempts=6, clock=t.clock, sleep=t.sleep)
    assert call.calls == 1 and t.sleeps == []
    call = Failing(*down(3, retried=True))
    assert await retry(call, attempts=None, clock=t.clock, sleep=t.sleep) == "ok"
    assert call.calls == 4


async def test_a_permanent_error_is_raised_at_once() -> None:
    t, call = FakeTime(), Failing(KeyError("k"), *down(2))
    with pytest.raises(KeyError):
        await retry(call, attempts=None, clock=t.clock, sleep=t.sleep)
    assert call.calls == 1 and t.sleeps == []


async def test_a_wait_that_would_end_past_the_timeout_is_not_started() -> None:
    t, call = FakeTime(), Failing(*down(50))
    backoff = Backoff(first=1, cap=100, jitter=0)  # waits 1, 2, 4, 8, …
    with pytest.raises(StoreUnavailable):
        await retry(call, attempts=None, timeout=10, backoff=backoff, clock=t.clock, sleep=t.sleep)
    assert t.sleeps == [1, 2, 4] and call.calls == 4  # 7 s slept; 7 + 8 > 10


async def test_the_transient_predicate_decides_what_is_retried() -> None:
    t, call = FakeTime(), Failing(ConnectionError("reset"), ConnectionError("reset"))
    transient = lambda e: isinstance(e, ConnectionError)  # noqa: E731
    assert await retry(call, transient=transient, clock=t.clock, sleep=t.sleep) == "ok"
    assert call.calls == 3


async def test_an_unbounded_retry_outlasts_thousands_of_failures_and_warns_at_most_every_ten_seconds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    t, call = FakeTime(), Failing(*down(3000))
    with caplog.at_level(logging.WARNING, logger="lakestream.store"):
        assert await retry(call, attempts=None, clock=t.clock, sleep=t.sleep, rng=Fixed(0.5)) == "ok"
    warnings = [r for r in caplog.records if "still retrying" in r.getMessage()]
    slept = sum(t.sleeps)  # 0.05 + 0.1 + … then 1 s a wait: about 3000 s
    assert call.calls == 3001 and slept > 2900
    assert slept / 10 - 1 <= len(warnings) <= slept / 10 + 1
    assert "attempt 1)" in warnings[0].getMessage()


async def test_retry_refuses_a_budget_of_no_attempts() -> None:
    with pytest.raises(ValueError, match="attempts"):
        await retry(Failing(), attempts=0)


# -- the S3 store's retries ----------------------------------------------------------------------


def refused_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def s3_store(cls: type[S3Store | ObstoreS3Store], t: FakeTime, **options: float) -> S3Store | ObstoreS3Store:
    return cls(
        "bucket",
        endpoint_url=refused_endpoint(),
        aws_access_key_id="k",
        aws_secret_access_key="s",
        region_name="us-east-1",
        clock=t.clock,
        sleep=t.sleep,
        rng=Fixed(0.0),
        **options,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("cls", S3_STORES)
async def test_s3_gives_up_after_max_attempts(cls: type[S3Store | ObstoreS3Store]) -> None:
    t = FakeTime()
    async with s3_store(cls, t, max_attempts=4, retry_timeout=1000) as store:
        with pytest.raises(StoreUnavailable, match="4 attempts") as info:
            await store.get("k")
    assert info.value.retried and store.requests == 4
    assert t.sleeps == pytest.approx([0.05, 0.1, 0.2])


@pytest.mark.parametrize("cls", S3_STORES)
async def test_s3_gives_up_when_the_next_wait_would_pass_the_retry_timeout(cls: type[S3Store | ObstoreS3Store]) -> None:
    t = FakeTime()
    async with s3_store(cls, t, max_attempts=50, retry_timeout=1.0) as store:
        with pytest.raises(StoreUnavailable, match=r"5 attempts in 0\.[78]s") as info:
            await store.list("")
    assert info.value.retried and store.requests == 5
    assert t.sleeps == pytest.approx([0.05, 0.1, 0.2, 0.4])  # 0.75 s; another 0.8 would pass 1.0


# -- the request budget ---------------------------------------------------------------------------


async def test_a_request_budget_keeps_its_rate_halves_on_throttling_and_recovers() -> None:
    from lakestream._store._budget import RequestBudget

    t = FakeTime()
    b = RequestBudget(get_rate=100, put_rate=10, clock=t.clock, sleep=t.sleep)
    start = t.now
    for _ in range(110):
        await b.acquire("get")
    assert 0.95 <= t.now - start <= 1.05  # 10 at once (a tenth of a second of burst), then 100 a second
    for _ in range(3):
        await b.acquire("put")  # its own bucket
    assert b.rate("list") == 100 and b.rate("put") == 10
    b.throttled("get")
    b.throttled("get_range")  # the same burst of 503s: halved once
    assert b.rate("get") == pytest.approx(50, abs=0.1) and b.halvings == 1
    t.now += 1.0
    assert b.rate("get") == pytest.approx(55, abs=0.1)  # 5% of the budget back per second
    for _ in range(8):
        t.now += HALF
        b.throttled("get")
    assert b.rate("get") >= 1.0  # never below one a second
    t.now += 60
    assert b.rate("get") == 100
    with pytest.raises(ValueError, match="get_rate"):
        RequestBudget(get_rate=0)


HALF = 0.1


@pytest.mark.parametrize("cls", S3_STORES)
async def test_s3_slows_down_on_the_log_prefix_when_the_store_pushes_back(cls: type[S3Store | ObstoreS3Store]) -> None:
    from lakestream._store._budget import RequestBudget

    t = FakeTime()
    budget = RequestBudget(get_rate=1000, put_rate=1000, clock=t.clock, sleep=t.sleep)
    async with s3_store(cls, t, max_attempts=6, retry_timeout=1000, budget=budget) as store:  # type: ignore[arg-type]
        with pytest.raises(StoreUnavailable):
            await store.get("_lakestream/log/00000000000000000001.json")
        assert budget.rate("get") < 1000 / 4 and budget.halvings >= 3
        with pytest.raises(StoreUnavailable):
            await store.get("segments/p/1-0-x.tgb")  # data is not budgeted
        assert budget.halvings <= 6
