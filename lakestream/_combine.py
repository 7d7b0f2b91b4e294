"""Combining: producers declare what they want committed; a combiner commits all of it in one version.

    producer: upload segment -> put intent (_lakestream/intents/<producer>/<epoch>-<seq>.json)
    combiner: list intents -> get the new ones -> group record of every valid one -> put version -> delete them

(A register intent, `r-<token>.json`, says all it has to say in its key; its body is not read.)

One log version then carries many producers' TGBs (and registers), so the log's few versions a
second at S3's latencies carry any number of TGBs, and a producer never reads the log to commit:
it learns that its TGBs landed from the tail hint and the versions written since it declared them
(`Producer`). What a group may hold is decided on the state it follows (`_decisions.combine`);
what it means, for every reader alike, by `State.apply`. An intent is untrusted: its key must name
what it holds, and one that is not a register or commit record of that producer is deleted.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Coroutine
from typing import Any

import anyio

from . import _decisions as decisions
from ._errors import ObjectNotFound
from ._layout import INTENTS_PREFIX, parse_intent_key
from ._manifest import AppendResult, Manifest
from ._records import CommitRecord, RecordError, RegisterRecord, decode_record
from ._retry import retry
from ._state import State

__all__ = ["Combiner"]

log = logging.getLogger("lakestream.producer")

FETCH_CONCURRENCY = 64  # intents fetched at once
REFETCH_STALE = 30.0  # seconds between fetches of an intent holding a TGB too old to commit


class Combiner:
    """One combiner's view of the declared intents (each fetched once) and its commit rounds."""

    def __init__(
        self,
        manifest: Manifest,
        spawn: Callable[[Callable[[], Coroutine[Any, Any, None]]], bool] | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.manifest = manifest
        self._intents: dict[str, RegisterRecord | CommitRecord] = {}
        # Runs work in the background (False: not now): intents that landed are deleted off the
        # path from one version to the next.
        self._spawn = spawn
        self._wall = wall  # record times; the age of uploads (`_decisions.stale`)
        self._refetched: dict[str, float] = {}  # intents held stale: when each was last fetched

    async def round(self, consumed: int | None, *, relist: bool = True) -> AppendResult | None:
        """Commit every valid declared intent in one version (None: nothing was declared).
        `relist=False`: only those it holds already, without reading the log or the intents first
        (a round for held TGBs that the consumption mark just made room for; the append reads the
        log on if another writer got there first)."""
        m = self.manifest
        now = self._wall()
        if not relist and self._intents:
            return await self._commit(consumed, [])
        await m.refresh()
        listed = set(await retry(lambda: m.store.list(INTENTS_PREFIX), attempts=None))
        m.requests += 1
        for key in [k for k in self._intents if k not in listed]:
            del self._intents[key]  # committed and deleted by another combiner
        self._forget_stale(listed, now)
        done = [k for k in listed if self._done(m.state, k)]
        new = [k for k in listed if k not in self._intents and parse_intent_key(k) is not None and k not in done]
        for key in new:
            parsed = parse_intent_key(key)
            if parsed is not None and len(parsed) == 2:  # a register is all in its key: no GET
                self._intents[key] = RegisterRecord(parsed[0], 1, parsed[1], now)
        new = [k for k in new if k not in self._intents]
        bad: list[str] = []
        limiter = anyio.CapacityLimiter(FETCH_CONCURRENCY)

        async def fetch(key: str) -> None:
            async with limiter:
                try:
                    data = await retry(lambda: m.store.get(key), attempts=None)
                except ObjectNotFound:
                    return  # committed and deleted meanwhile
            m.requests += 1
            record = _intent(key, data)
            if record is None:
                bad.append(key)
            else:
                self._intents[key] = record
                if _stale(record, now):
                    self._refetched[key] = now

        async with anyio.create_task_group() as tg:
            for key in new:
                tg.start_soon(fetch, key)
        if not self._intents:
            await self._delete(done + bad)
            return None
        return await self._commit(consumed, done + bad)

    def _forget_stale(self, listed: set[str], now: float) -> None:
        """Intents held with a TGB too old to commit are fetched again: their producer declares
        them again, uploaded again, under the same key (each at most every REFETCH_STALE)."""
        self._refetched = {k: t for k, t in self._refetched.items() if k in listed}
        for key, r in list(self._intents.items()):
            if _stale(r, now) and now - self._refetched.get(key, -math.inf) > REFETCH_STALE:
                del self._intents[key]

    async def _commit(self, consumed: int | None, done: list[str]) -> AppendResult | None:
        """Append one group of the intents held (`done`: intent keys to delete besides those it lands);
        decided at the time of each attempt, so that no TGB committed is `stale` then."""
        m = self.manifest
        intents = list(self._intents.values())
        result = await m.append(lambda st, _: decisions.combine(st, intents, consumed=consumed, now=self._wall()))
        done += [k for k in self._intents if self._done(m.state, k)]
        for key in done:
            self._intents.pop(key, None)
        await self._delete(done)
        return result

    def waiting(self, state: State) -> int:
        """TGBs declared, fetched and not landed on `state` (what back-pressure may be holding)."""
        n = 0
        for r in self._intents.values():
            p = state.producers.get(r.producer)
            if isinstance(r, CommitRecord) and p is not None and p.epoch == r.epoch:
                n += max(0, r.seq + len(r.tgbs) - 1 - p.seq)
        return n

    def _done(self, state: State, key: str) -> bool:
        """Whether the intent at `key` can never be committed again: it landed, or was fenced."""
        parsed = parse_intent_key(key)
        if parsed is None:
            return False
        p = state.producers.get(parsed[0])
        if p is None:
            return False
        if len(parsed) == 2:
            return p.token == parsed[1]
        record = self._intents.get(key)
        if p.epoch != parsed[1] or not isinstance(record, CommitRecord):
            return p.epoch > parsed[1]  # how many TGBs it holds is known once it was fetched
        return record.seq + len(record.tgbs) - 1 <= p.seq

    async def _delete(self, keys: list[str]) -> None:
        if not keys:
            return
        if self._spawn is not None and self._spawn(lambda: self._delete_now(keys)):
            return
        await self._delete_now(keys)

    async def _delete_now(self, keys: list[str]) -> None:
        try:
            await self.manifest.store.delete(keys)
            self.manifest.requests += 1
        except Exception as e:  # best effort: the next round (or GC) deletes them
            log.debug("%s: deleting %d intents failed: %s", self.manifest.url, len(keys), e)


def _intent(key: str, data: bytes) -> RegisterRecord | CommitRecord | None:
    """The record of the intent at `key`, if it is what its key says; else None (with a warning)."""
    parsed = parse_intent_key(key)
    try:
        r = decode_record(data)
    except RecordError as e:
        log.warning("intent %s is not a record (%s): deleting it", key, e)
        return None
    if isinstance(r, RegisterRecord) and parsed == (r.producer, r.token):
        return r
    if isinstance(r, CommitRecord) and not r.packs and parsed == (r.producer, r.epoch, r.seq):
        return r
    log.warning("intent %s does not hold what its key names: deleting it", key)
    return None


def _stale(r: RegisterRecord | CommitRecord, now: float) -> bool:
    """Whether intent `r` holds a TGB too old to commit (`_decisions.stale`)."""
    return isinstance(r, CommitRecord) and any(decisions.stale(t, now) for t in r.tgbs)
