"""A store wrapper that injects faults, for tests and benchmarks.

Faults are decided by an injectable `random.Random`, so a run is reproducible:

* `ambiguous_put`: the probability that a put or put_if_absent lands and then raises
  StoreUnavailable as if the answer had been lost;
* `fail_before`: the probability that a call raises StoreUnavailable without doing anything;
* `hook`: an async callable run before every operation (`hook(op, key)`), to stall, count, or
  raise at chosen moments.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Awaitable, Callable

from .._errors import StoreUnavailable
from ._base import ObjectStore

__all__ = ["FaultyStore"]


class FaultyStore:
    def __init__(
        self,
        inner: ObjectStore,
        *,
        ambiguous_put: float = 0.0,
        fail_before: float = 0.0,
        only: Callable[[str, str], bool] | None = None,
        hook: Callable[[str, str], Awaitable[None]] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.inner = inner
        self.url = inner.url
        self.ambiguous_put = ambiguous_put
        self.fail_before = fail_before
        self.only = only or (lambda op, key: True)
        self.hook = hook
        self.rng = rng or random.Random(0)
        self.calls: Counter[str] = Counter()
        self.injected: Counter[str] = Counter()

    async def _before(self, op: str, key: str) -> bool:
        """Run the hook; raise a clean failure; tell whether to make this call ambiguous."""
        self.calls[op] += 1
        if self.hook is not None:
            await self.hook(op, key)
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

    async def get(self, key: str) -> bytes:
        await self._before("get", key)
        return await self.inner.get(key)

    async def get_range(self, key: str, offset: int, length: int) -> bytes:
        await self._before("get_range", key)
        return await self.inner.get_range(key, offset, length)

    async def put(self, key: str, data: bytes) -> None:
        ambiguous = await self._before("put", key)
        await self.inner.put(key, data)
        if ambiguous:
            raise self._lost("put", key)

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        ambiguous = await self._before("put_if_absent", key)
        won = await self.inner.put_if_absent(key, data)
        if ambiguous:
            raise self._lost("put_if_absent", key)
        return won

    async def list(self, prefix: str) -> list[str]:
        await self._before("list", prefix)
        return await self.inner.list(prefix)

    async def delete(self, keys: list[str]) -> None:
        await self._before("delete", ",".join(keys))
        await self.inner.delete(keys)

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def __aenter__(self) -> FaultyStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
