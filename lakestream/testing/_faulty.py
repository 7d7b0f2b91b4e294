"""A store wrapper that injects latency, throttling and faults, for tests and benchmarks.

Everything random is drawn from an injectable `random.Random`, so a run is reproducible:

* `latency`: per operation (`get`, `get_range`, `put`, `put_if_absent`, `list` (list and
  list_sizes), `delete`), a log-normal distribution given as (median seconds, sigma), plus
  `bandwidth` bytes per second for the bytes moved. A put_if_absent takes effect half-way through
  its latency, so concurrent writers race as they do against a real store. `S3_LATENCY_OPS` is
  S3's: PUTs (put, put_if_absent, delete) median 60 ms and p99 200 ms, GETs (get, get_range,
  list) median 25 ms and p99 100 ms; `S3_LIKE` an older, faster profile;
* `get_rate`, `put_rate`: GETs (get, get_range, list, list_sizes) and PUTs (put, put_if_absent,
  delete) per second per prefix (the key, or the listed prefix, up to its last '/'; a delete's
  first key) before the store answers 503 SlowDown (StoreUnavailable), as S3 does; a token bucket
  per stream, prefix and kind with one second of burst, refilled by `clock` (seconds), kept in
  `buckets` (a dict that FaultyStores may share, as `inject_faults` shares one per process);
  `write_rate` is the older name of `put_rate`;

* `ambiguous_put`: the probability that a put or put_if_absent lands and then raises
  StoreUnavailable as if the answer had been lost;
* `fail_before`: the probability that a call raises StoreUnavailable without doing anything;
* `hook`: an async callable run before every operation (`hook(op, key)`), to stall, count, or
  raise at chosen moments.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence

import anyio

from .._errors import StoreUnavailable
from .._store import Data, ObjectStore
from ._simstore import _KIND, S3_LATENCY, Z99

__all__ = ["S3_LATENCY_OPS", "S3_LIKE", "FaultyStore"]

# An S3-like profile: conditional PUT ~25 ms p50, GET ~10 ms p50, long tails.
S3_LIKE: dict[str, tuple[float, float]] = {
    "get": (0.010, 0.5),
    "get_range": (0.010, 0.5),
    "put": (0.025, 0.5),
    "put_if_absent": (0.025, 0.5),
    "list": (0.030, 0.5),
    "delete": (0.020, 0.5),
}

# S3's latencies per operation as (median, sigma), from `S3_LATENCY`'s (median, p99) per kind.
S3_LATENCY_OPS: dict[str, tuple[float, float]] = {
    op: (S3_LATENCY[kind][0], math.log(S3_LATENCY[kind][1] / S3_LATENCY[kind][0]) / Z99) for op, kind in _KIND.items()
}


Buckets = dict[tuple[str, str, str], tuple[float, float]]  # (url, kind, prefix) -> (tokens, last refill)


class FaultyStore:
    def __init__(
        self,
        inner: ObjectStore,
        *,
        ambiguous_put: float = 0.0,
        fail_before: float = 0.0,
        only: Callable[[str, str], bool] | None = None,
        hook: Callable[[str, str], Awaitable[None]] | None = None,
        latency: dict[str, tuple[float, float]] | None = None,
        bandwidth: float = math.inf,
        get_rate: float = math.inf,
        put_rate: float = math.inf,
        write_rate: float = math.inf,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        buckets: Buckets | None = None,
    ) -> None:
        self.inner = inner
        self.url = inner.url
        self.ambiguous_put = ambiguous_put
        self.fail_before = fail_before
        self.only = only or (lambda op, key: True)
        self.hook = hook
        self.rng = rng or random.Random(0)
        self.latency = latency or {}
        self.bandwidth = bandwidth
        self.rates = {"get": get_rate, "put": min(put_rate, write_rate)}  # kind -> requests/s per prefix
        self.clock = clock
        self.calls: Counter[str] = Counter()
        self.injected: Counter[str] = Counter()
        self.buckets: Buckets = {} if buckets is None else buckets

    def _delay(self, op: str, nbytes: int = 0) -> float:
        median, sigma = self.latency.get(op, (0.0, 0.0))
        d = median * math.exp(sigma * self.rng.gauss(0, 1)) if median else 0.0
        return d + nbytes / self.bandwidth

    def _throttle(self, op: str, key: str) -> None:
        kind = _KIND[op]
        rate = self.rates[kind]
        if rate == math.inf:
            return
        prefix = key.rpartition("/")[0]
        bucket = (self.url, kind, prefix)
        now = self.clock()
        tokens, last = self.buckets.get(bucket, (rate, now))
        tokens = min(rate, tokens + (now - last) * rate)
        if tokens < 1:
            self.buckets[bucket] = (tokens, now)
            self.injected[f"{op}:throttled"] += 1
            raise StoreUnavailable(f"{self.url}: 503 SlowDown: over {rate:g} {kind.upper()}s/s on {prefix!r}")
        self.buckets[bucket] = (tokens - 1, now)

    async def _before(self, op: str, key: str, throttle_key: str | None = None) -> bool:
        """Run the hook; throttle; raise a clean failure; tell whether to make this call ambiguous."""
        self.calls[op] += 1
        if self.hook is not None:
            await self.hook(op, key)
        self._throttle(op, key if throttle_key is None else throttle_key)
        if not self.only(op, key):
            return False
        if self.fail_before and self.rng.random() < self.fail_before:
            self.injected[f"{op}:fail"] += 1
            raise StoreUnavailable(f"{self.url}: injected failure of {op} {key!r}")
        if op.startswith("put") and self.ambiguous_put and self.rng.random() < self.ambiguous_put:
            self.injected[f"{op}:ambiguous"] += 1
            return True
        return False

    def _lost(self, op: str, key: str) -> StoreUnavailable:
        return StoreUnavailable(f"{self.url}: injected lost answer of {op} {key!r} (it landed)")

    async def _sleep(self, seconds: float) -> None:
        if seconds > 0:
            await anyio.sleep(seconds)

    async def get(self, key: str) -> bytes:
        await self._before("get", key)
        await self._sleep(self._delay("get"))
        data = await self.inner.get(key)  # a miss costs a round trip too
        await self._sleep(len(data) / self.bandwidth)
        return data

    async def get_range(self, key: str, offset: int, length: int) -> bytes:
        await self._before("get_range", key)
        await self._sleep(self._delay("get_range", length))
        return await self.inner.get_range(key, offset, length)

    async def put(self, key: str, data: Data) -> None:
        ambiguous = await self._before("put", key)
        await self._sleep(self._delay("put", len(data)))
        await self.inner.put(key, data)
        if ambiguous:
            raise self._lost("put", key)

    async def put_if_absent(self, key: str, data: Data) -> bool:
        ambiguous = await self._before("put_if_absent", key)
        d = self._delay("put_if_absent", len(data))
        await self._sleep(d / 2)
        won = await self.inner.put_if_absent(key, data)
        await self._sleep(d / 2)
        if ambiguous:
            raise self._lost("put_if_absent", key)
        return won

    async def list(self, prefix: str) -> list[str]:
        await self._before("list", prefix)
        await self._sleep(self._delay("list"))
        return await self.inner.list(prefix)

    async def list_sizes(self, prefix: str) -> dict[str, int]:
        await self._before("list", prefix)
        await self._sleep(self._delay("list"))
        return await self.inner.list_sizes(prefix)

    async def delete(self, keys: Sequence[str]) -> None:
        await self._before("delete", ",".join(keys), keys[0] if keys else "")
        await self._sleep(self._delay("delete"))
        await self.inner.delete(keys)

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def __aenter__(self) -> FaultyStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
