"""Retrying idempotent store calls that failed transiently."""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

from ._errors import StoreUnavailable

__all__ = ["retry"]

T = TypeVar("T")
_RNG = random.Random()


async def retry(
    call: Callable[[], Awaitable[T]],
    *,
    attempts: int = 6,
    base: float = 0.05,
    cap: float = 2.0,
    rng: random.Random | None = None,
    sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
) -> T:
    """`await call()`, again after StoreUnavailable with full-jitter exponential backoff.

    Only for idempotent calls (a get, a put of a fresh unique key). Raises the last error, and at
    once an error the store itself already retried.
    """
    rng = rng or _RNG
    for attempt in range(attempts):
        try:
            return await call()
        except StoreUnavailable as e:
            if e.retried or attempt == attempts - 1:
                raise
            await sleep(rng.uniform(0, min(cap, base * 2**attempt)))
    raise AssertionError("unreachable")
