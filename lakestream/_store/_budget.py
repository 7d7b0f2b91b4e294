"""A process's request budget on a store's log prefix: token buckets that halve on throttling.

S3 answers 503 SlowDown once one prefix gets more than ~3,500 PUTs or ~5,500 GETs a second, and a
throttled prefix stays throttled while its clients keep retrying into it. So each process keeps
under a budget (by default S3's own rates; set a share of them where many processes share one
stream) and slows down when the store pushes back: AIMD, as TCP does. A throttled or failed
request halves the rate of its kind (at most once per `HALVE_EVERY`, so one burst of 503s halves
it once); each second without one gives back `RECOVER` of the budget. Requests wait for a token;
none is refused.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import anyio

__all__ = ["GET_OPS", "RequestBudget", "budget_for"]

GET_OPS = frozenset({"get", "get_range", "list", "head"})  # the rest are PUT-class (put, delete …)
HALVE_EVERY = 0.1  # seconds
RECOVER = 0.05  # of the budget, per second without throttling
FLOOR = 1.0  # requests per second, at least
MIN_WAIT = 1e-3  # seconds: a wait shorter than the clock's resolution would never end


class _Bucket:
    def __init__(self, budget: float, now: float) -> None:
        self.budget = budget
        self.rate = budget
        self.tokens = max(1.0, budget * 0.1)  # a tenth of a second of burst
        self.last = now
        self.halved = -HALVE_EVERY

    def refill(self, now: float) -> None:
        elapsed = max(0.0, now - self.last)
        self.last = now
        self.rate = min(self.budget, self.rate + RECOVER * self.budget * elapsed)
        self.tokens = min(max(1.0, self.rate * 0.1), self.tokens + elapsed * self.rate)


class RequestBudget:
    """GET-class and PUT-class requests per second, at most `get_rate` and `put_rate` (AIMD below)."""

    def __init__(
        self,
        get_rate: float = 5500.0,
        put_rate: float = 3500.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
    ) -> None:
        for name, rate in (("get_rate", get_rate), ("put_rate", put_rate)):
            if not rate > 0:
                raise ValueError(f"{name} must be a number of requests per second > 0, not {rate!r}")
        self.clock, self.sleep = clock, sleep
        now = clock()
        self._buckets = {"get": _Bucket(float(get_rate), now), "put": _Bucket(float(put_rate), now)}
        self.waited = 0.0  # seconds requests spent waiting for a token
        self.halvings = 0

    def rate(self, op: str) -> float:
        """The current rate of `op`'s kind (requests per second)."""
        b = self._bucket(op)
        b.refill(self.clock())
        return b.rate

    def _bucket(self, op: str) -> _Bucket:
        return self._buckets["get" if op in GET_OPS else "put"]

    async def acquire(self, op: str) -> None:
        """Wait for a token of `op`'s kind."""
        b = self._bucket(op)
        while True:
            b.refill(self.clock())
            if b.tokens >= 1:
                b.tokens -= 1
                return
            wait = max((1 - b.tokens) / max(b.rate, FLOOR), MIN_WAIT)
            self.waited += wait
            await self.sleep(wait)

    def throttled(self, op: str) -> None:
        """The store pushed back on an `op` (503, 5xx, a timeout): halve the rate of its kind."""
        b = self._bucket(op)
        now = self.clock()
        b.refill(now)
        if now - b.halved >= HALVE_EVERY:
            b.rate, b.halved = max(FLOOR, b.rate / 2), now
            b.tokens = min(b.tokens, max(1.0, b.rate * 0.1))
            self.halvings += 1


_BUDGETS: dict[tuple[str, float, float], RequestBudget] = {}


def budget_for(url: str, get_rate: float, put_rate: float) -> RequestBudget:
    """The process's budget for the stream at `url` (one, whatever the number of stores opened on it)."""
    key = (url, get_rate, put_rate)
    if key not in _BUDGETS:
        _BUDGETS[key] = RequestBudget(get_rate, put_rate)
    return _BUDGETS[key]
