"""Backoff and retries: one policy, one loop; the clock, the sleep and the random source injected.

`Backoff` is a pure policy: the n-th wait after a failure is drawn from [(1 - jitter)·c, c), with
c = min(cap, first·2^(n-1)). `jitter=1` is full jitter (AWS's name: anywhere from zero up to c),
which spreads callers that failed together; `jitter=0.5` keeps at least half of c. The exponent is
bounded, so the thousandth failure is as cheap to compute as the first and never overflows.

`retry` is the one loop that awaits a call again after a transient failure, giving up when either
of its budgets runs out: `attempts` (calls made) or `timeout` (seconds since the first call, by
`clock`; a wait that would end past it is not started). Without an attempt budget it is for callers
a store outage must never stop for good (producers, readers, the mount): it logs a warning at most
every `warn_every` seconds while it keeps trying. Loops that are not "call until it works" (the
mount's manifest follower, `Manifest.append`, which also loses races) draw their waits from
`Backoff.delay` themselves.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import anyio

from ._errors import StoreUnavailable

__all__ = ["STORE_BACKOFF", "Backoff", "RandomSource", "retry"]

T = TypeVar("T")
_RNG = random.Random()
log = logging.getLogger("lakestream.store")
WARN_EVERY = 10.0  # seconds between warnings of one call that keeps failing
_MAX_DOUBLINGS = 1023  # 2.0 ** 1024 overflows; any sane policy reached its cap long before


class RandomSource(Protocol):
    """Where jitter comes from: `random.Random` or anything with its `random()` in [0, 1)."""

    def random(self) -> float: ...


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with jitter: `first` seconds, doubling up to `cap`, `jitter` ∈ [0, 1]."""

    first: float = 0.1
    cap: float = 2.0
    jitter: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.first) and self.first > 0):
            raise ValueError(f"backoff: first must be a positive number of seconds, got {self.first}")
        if not (math.isfinite(self.cap) and self.cap >= self.first):
            raise ValueError(f"backoff: cap must be at least first ({self.first}), got {self.cap}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"backoff: jitter must be in [0, 1], got {self.jitter}")

    def ceiling(self, n: int) -> float:
        """The longest wait after the `n`-th failure (n ≥ 1): min(cap, first·2^(n-1))."""
        if n < 1:
            raise ValueError(f"backoff: failures are counted from 1, got {n}")
        return min(self.cap, self.first * 2.0 ** min(n - 1, _MAX_DOUBLINGS))

    def delay(self, n: int, rng: RandomSource | None = None) -> float:
        """The wait after the `n`-th failure, drawn from [(1 - jitter)·ceiling(n), ceiling(n))."""
        c = self.ceiling(n)
        return c * (1 - self.jitter * (1 - (rng or _RNG).random()))


STORE_BACKOFF = Backoff(first=0.1, cap=2.0, jitter=1.0)  # retrying a store call that failed


def _store_transient(attempts: int | None) -> Callable[[Exception], bool]:
    """StoreUnavailable; with an attempt budget, not one the store itself already retried."""
    return lambda e: isinstance(e, StoreUnavailable) and (attempts is None or not e.retried)


async def retry(
    call: Callable[[], Awaitable[T]],
    *,
    attempts: int | None = 6,
    timeout: float | None = None,
    backoff: Backoff = STORE_BACKOFF,
    transient: Callable[[Exception], bool] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
    rng: RandomSource | None = None,
    warn_every: float = WARN_EVERY,
    on_error: Callable[[Exception], None] | None = None,
) -> T:
    """`await call()`, again after a transient failure, waiting `backoff.delay(n)` after the n-th.

    Only for idempotent calls (a get, a put of a fresh unique key). `transient(e)` says which
    errors are worth another call; by default StoreUnavailable, and with a number of `attempts`
    (one-shot commands) not one the store itself already retried (`retried`), which is raised at
    once. Any other error is raised as it is, and so is the last one when `attempts` calls have
    failed or the next wait would end more than `timeout` seconds after the first call. With
    `attempts=None` (producers, readers, the mount: a store outage must never stop them for good)
    it retries for as long as it takes (or `timeout`), logging a warning at most every
    `warn_every` seconds. `on_error(e)` is told of every failed call (metrics count them).
    Blocks in `call` and in `sleep`.
    """
    if attempts is not None and attempts < 1:
        raise ValueError(f"retry: attempts must be at least 1 or None, got {attempts}")
    is_transient = transient or _store_transient(attempts)
    start = clock()
    warned = -math.inf
    n = 0
    while True:
        try:
            return await call()
        except Exception as e:
            n += 1
            if on_error is not None:
                on_error(e)
            if not is_transient(e) or (attempts is not None and n >= attempts):
                raise
            wait = backoff.delay(n, rng)
            now = clock()
            if timeout is not None and now - start + wait > timeout:
                raise
            if attempts is None and now - warned >= warn_every:
                warned = now
                log.warning("store unavailable, still retrying (attempt %d): %s", n, e)
        await sleep(wait)
