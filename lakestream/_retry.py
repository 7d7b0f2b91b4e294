"""Retrying idempotent store calls that failed transiently."""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

from ._errors import StoreUnavailable

__all__ = ["retry"]

T = TypeVar("T")
_RNG = random.Random()
log = logging.getLogger("lakestream.store")
WARN_EVERY = 10.0  # seconds between warnings of one call that keeps failing


async def retry(
    call: Callable[[], Awaitable[T]],
    *,
    attempts: int | None = 6,
    base: float = 0.05,
    cap: float = 2.0,
    rng: random.Random | None = None,
    sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
) -> T:
    """`await call()`, again after StoreUnavailable with full-jitter exponential backoff.

    Only for idempotent calls (a get, a put of a fresh unique key). With a number of `attempts`
    (one-shot commands), raises the last error, and at once an error the store itself already
    retried. With `attempts=None` (producers, readers, the mount: a store outage must never stop
    them for good) it retries for as long as it takes, backing off to `cap` and logging a warning
    every WARN_EVERY seconds; only a permanent error (anything but StoreUnavailable) ends it.
    """
    rng = rng or _RNG
    attempt = 0
    warned = -math.inf
    while True:
        try:
            return await call()
        except StoreUnavailable as e:
            attempt += 1
            if attempts is not None and (e.retried or attempt >= attempts):
                raise
            if attempts is None and time.monotonic() - warned > WARN_EVERY:
                warned = -math.inf
                log.warning("store unavailable, still retrying (attempt %d): %s", attempt, e)
        await sleep(rng.uniform(0, min(cap, base * 2 ** min(attempt, 32))))
