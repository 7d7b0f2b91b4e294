"""An in-process model of S3 for simulations: every call takes (simulated) time and may be throttled.

    bucket = SimulatedS3(rng=random.Random(1))
    store = bucket.client("producer")        # an ObjectStore; requests are counted under its label

Objects live in memory (real bytes). Every request, retries included, is timed with `anyio.sleep`,
so under a mock clock (trio's `MockClock(autojump_threshold=0)`) a run of thousands of clients
costs CPU, not wall-clock time, and under a real event loop it is a slow local S3:

* Latency: log-normal per request, given as (median, p99) seconds: PUTs (put, put_if_absent,
  delete) 60 ms / 200 ms, GETs (get, get_range, list) 25 ms / 100 ms.
* A request takes effect when it arrives, half-way through its latency, and is answered after the
  other half: of concurrent conditional PUTs of one key the first to arrive wins, and a GET sees
  what had arrived before it. (A range GET outside `_lakestream/`, of segment data written once
  before anything names it, is timed as one sleep of its whole latency: what it returns cannot
  depend on when it takes effect.)
* Throttling: a token bucket per configured prefix and kind (`rates`: prefix -> (PUTs/s, GETs/s);
  by default S3's 3,500 / 5,500 per second on `_lakestream/`, and no limit elsewhere), holding
  `burst` seconds of tokens. A request that arrives at an empty bucket is answered 503 SlowDown.
* As the S3 backend (`S3Store`) does, a 503 is retried inside the store with the same jittered
  backoff (waits of 0.05-0.1 s doubling to 1-2 s) for up to `retry_attempts` requests and
  `retry_timeout` seconds, then raised as StoreUnavailable(retried=True). With `retries=False`
  each 503 is raised at once as StoreUnavailable(retried=False).
* Counters: `requests`, `throttled` and `not_found`, keyed (client label, operation, area), the
  area being `_lakestream/log/`, `_lakestream/snapshots/`, `_lakestream/` (the snapshot hint) or
  the first component of any other key (`segments/`).

`created[key]` is the simulated time an object was last written, and `on_write(key, data, t)` is
called as each write takes effect: how a simulation sees when a log version became visible.
Everything random comes from one `random.Random`. Not modelled: bandwidth (objects are assumed
small), request timeouts and connection limits, S3's gradual prefix scaling, other error kinds.
"""

from __future__ import annotations

import functools
import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TypeVar

import anyio

from .._errors import ObjectNotFound, StoreUnavailable
from .._retry import Backoff, retry
from .._store import Data

__all__ = ["S3_LATENCY", "S3_RATES", "SimulatedS3", "SimulatedStore"]

T = TypeVar("T")

Z99 = 2.3263478740408408  # the standard normal's 99th percentile
S3_LATENCY = {"put": (0.060, 0.200), "get": (0.025, 0.100)}  # kind -> (median, p99) seconds
S3_RATES = {"_lakestream/": (3500.0, 5500.0)}  # prefix -> (PUTs, GETs) per second, as S3 allows a prefix
S3_RETRY_BACKOFF = Backoff(first=0.1, cap=2.0, jitter=0.5)  # as `S3Store` retries a 503

_KIND = {
    "get": "get",
    "get_range": "get",
    "list": "get",
    "put": "put",
    "put_if_absent": "put",
    "delete": "put",
}


class _SlowDown(Exception):
    """A 503 SlowDown answer, inside the store's own retries."""


_LAKESTREAM = "_lakestream/"


def _area(key: str) -> str:
    parts = key.split("/")
    if parts[0] == "_lakestream":
        return "/".join(parts[:2]) + "/" if len(parts) > 2 else "_lakestream/"
    return parts[0] + "/" if len(parts) > 1 else ""


class SimulatedS3:
    """One bucket shared by every client of a simulation. See the module docstring."""

    def __init__(
        self,
        *,
        rng: random.Random | None = None,
        latency: dict[str, tuple[float, float]] | None = None,
        rates: dict[str, tuple[float, float]] | None = None,
        burst: float = 1.0,
        retries: bool = True,
        retry_attempts: int = 50,
        retry_timeout: float = 10.0,
        url: str = "sim://bucket",
    ) -> None:
        self.url = url
        self.rng = rng or random.Random(0)
        self._latency: dict[str, tuple[float, float]] = {}
        for kind, (median, p99) in {**S3_LATENCY, **(latency or {})}.items():
            if not 0 < median <= p99:
                raise ValueError(f"latency of {kind}: need 0 < median <= p99, got {median}, {p99}")
            self._latency[kind] = (math.log(median), math.log(p99 / median) / Z99)
        self.rates = dict(S3_RATES if rates is None else rates)
        self.burst = burst
        self.retries = retries
        self.retry_attempts = retry_attempts
        self.retry_timeout = retry_timeout
        self.objects: dict[str, bytes] = {}
        self.created: dict[str, float] = {}
        self.requests: Counter[tuple[str, str, str]] = Counter()
        self.throttled: Counter[tuple[str, str, str]] = Counter()
        self.not_found: Counter[tuple[str, str, str]] = Counter()
        self.on_write: Callable[[str, bytes, float], None] | None = None
        self._buckets: dict[tuple[str, str], tuple[float, float]] = {}  # (prefix, kind) -> (tokens, at)
        self._areas: dict[str, set[str]] = {}  # `_area` -> the keys in it (LIST reads one area, not the bucket)

    def client(self, label: str = "") -> SimulatedStore:
        """An ObjectStore on this bucket whose requests are counted under `label`."""
        return SimulatedStore(self, label)

    def delay(self, kind: str) -> float:
        mu, sigma = self._latency[kind]
        return math.exp(mu + sigma * self.rng.gauss(0.0, 1.0)) if sigma else math.exp(mu)

    def _admit(self, kind: str, key: str) -> bool:
        """Take a token from the bucket of the longest configured prefix of `key`, if it has one."""
        prefix = max((p for p in self.rates if key.startswith(p)), key=len, default=None)
        if prefix is None:
            return True
        rate = self.rates[prefix][0 if kind == "put" else 1]
        if math.isinf(rate):
            return True
        now = anyio.current_time()
        tokens, at = self._buckets.get((prefix, kind), (rate * self.burst, now))
        tokens = min(rate * self.burst, tokens + (now - at) * rate)
        admitted = tokens >= 1
        self._buckets[(prefix, kind)] = (tokens - admitted, now)
        return admitted

    async def call(self, label: str, op: str, key: str, act: Callable[[], T]) -> T:
        """One store call: `act()` runs when the request arrives; 503s are retried as S3Store does."""
        kind = _KIND[op]
        counted = (label, op, _area(key))

        async def once() -> T:
            self.requests[counted] += 1
            d = self.delay(kind)
            # Arrival half-way, the answer after the other half. Segment data is written once,
            # before anything names it: when a range GET of it takes effect cannot change what it
            # returns, so it is one sleep, not two (the readers' range GETs are most of a
            # simulation's requests; where a rate applies there, the token is taken at the end).
            before = d if op == "get_range" and not key.startswith(_LAKESTREAM) else d / 2
            after = d - before
            await anyio.sleep(before)
            if not self._admit(kind, key):
                self.throttled[counted] += 1
                if after:
                    await anyio.sleep(after)
                raise _SlowDown
            try:
                result = act()
            except ObjectNotFound:
                self.not_found[counted] += 1
                if after:
                    await anyio.sleep(after)
                raise
            if after:
                await anyio.sleep(after)
            return result

        start = anyio.current_time()
        try:
            if not self.retries:
                return await once()
            return await retry(
                once,
                attempts=self.retry_attempts,
                timeout=self.retry_timeout,
                backoff=S3_RETRY_BACKOFF,
                transient=lambda e: isinstance(e, _SlowDown),
                clock=anyio.current_time,
                rng=self.rng,
            )
        except _SlowDown:
            took = anyio.current_time() - start
            raise StoreUnavailable(
                f"{self.url}: {op} {key!r} kept failing ({took:.1f}s): 503 SlowDown", retried=self.retries
            ) from None

    # -- what requests do on arrival -------------------------------------------------------------

    def _write(self, key: str, data: bytes) -> None:
        self.objects[key] = data
        self._areas.setdefault(_area(key), set()).add(key)
        now = self.created[key] = anyio.current_time()
        if self.on_write is not None:
            self.on_write(key, data, now)

    def _get(self, key: str) -> bytes:
        try:
            return self.objects[key]
        except KeyError:
            raise ObjectNotFound(f"{self.url}: no object {key!r}") from None

    def _put_if_absent(self, key: str, data: bytes) -> bool:
        if key in self.objects:
            return False
        self._write(key, data)
        return True

    def _list(self, prefix: str) -> list[str]:
        area = _area(prefix)  # where every key under `prefix` is, unless the prefix ends before one is named
        keys = self.objects if area in ("", _LAKESTREAM) else self._areas.get(area, ())
        return sorted(k for k in keys if k.startswith(prefix))

    def _delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            if self.objects.pop(key, None) is not None:
                self._areas[_area(key)].discard(key)
            self.created.pop(key, None)


class SimulatedStore:
    """One client of a `SimulatedS3` (an ObjectStore)."""

    def __init__(self, bucket: SimulatedS3, label: str) -> None:
        self.bucket = bucket
        self.label = label
        self.url = bucket.url

    async def get(self, key: str) -> bytes:
        b = self.bucket
        return await b.call(self.label, "get", key, lambda: b._get(key))

    async def get_range(self, key: str, offset: int, length: int) -> bytes:
        b = self.bucket
        return await b.call(self.label, "get_range", key, lambda: b._get(key)[offset : offset + length])

    async def put(self, key: str, data: Data) -> None:
        b = self.bucket
        await b.call(self.label, "put", key, lambda: b._write(key, bytes(data)))

    async def put_if_absent(self, key: str, data: Data) -> bool:
        b = self.bucket
        return await b.call(self.label, "put_if_absent", key, lambda: b._put_if_absent(key, bytes(data)))

    async def list(self, prefix: str) -> list[str]:
        b = self.bucket
        return await b.call(self.label, "list", prefix, lambda: b._list(prefix))

    async def list_sizes(self, prefix: str) -> dict[str, int]:
        b = self.bucket
        return await b.call(self.label, "list", prefix, lambda: {k: len(b.objects[k]) for k in b._list(prefix)})

    async def delete(self, keys: Sequence[str]) -> None:
        b = self.bucket
        keys = list(keys)
        for i in range(0, len(keys), 1000):  # one request per 1,000 keys, as DeleteObjects
            batch = keys[i : i + 1000]
            await b.call(self.label, "delete", batch[0], functools.partial(b._delete, batch))

    async def aclose(self) -> None:
        pass

    async def __aenter__(self) -> SimulatedStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
