"""Readers: one rank's slice of every committed step, in order, exactly once.

A reader follows the manifest log (a GET of the next version; "not found" means "not yet"),
polling with an interval that doubles while nothing arrives and resets when something does. For
each step it fetches only its rank's slice with one range GET, checks the CRC-32 the commit record
holds, and decodes it. The next `prefetch` committed steps are fetched ahead, within a byte bound.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.to_thread

from ._errors import ConfigMismatch, CorruptData, ObjectNotFound, StepUnavailable
from ._manifest import Manifest
from ._retry import retry
from ._segment import FieldRef, check_slice, decode_slice, index_slice
from ._state import State, Step
from ._store import ObjectStore
from ._tasks import cancel_task_group, enter_task_group

__all__ = ["RankBatch", "RawSlice", "Reader"]


@dataclass(frozen=True, slots=True)
class RankBatch:
    """One rank's samples of one step."""

    step: int
    rank: int
    samples: list[dict[str, Any]]
    version: int  # manifest version that committed the step
    producer: str
    nbytes: int  # bytes of the rank slice as stored

    def __len__(self) -> int:
        return len(self.samples)


@dataclass(frozen=True, slots=True)
class RawSlice:
    """One rank's slice of one step as stored (checked), with where each field's bytes are."""

    entry: Step
    rank: int
    data: bytes
    files: list[FieldRef]

    @property
    def step(self) -> int:
        return self.entry.step


@dataclass(slots=True)
class _Fetch:
    nbytes: int
    done: anyio.Event = field(default_factory=anyio.Event)
    result: RankBatch | None = None
    error: BaseException | None = None


class Reader:
    """Reads one rank's slices. Create with `lakestream.open_reader`."""

    def __init__(
        self,
        store: ObjectStore,
        rank: int | None,
        world_size: int | None = None,
        *,
        prefetch: int = 4,
        max_prefetch_bytes: int = 512 << 20,
        poll_interval: tuple[float, float] = (0.005, 0.5),
        verify: bool = True,
        raw: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if rank is not None and (type(rank) is not int or rank < 0):
            raise ValueError(f"rank must be a non-negative integer, got {rank!r}")
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.manifest = Manifest(store, clock=clock, retries=None)  # an outage never stops a reader
        self.prefetch = max(0, prefetch)
        self.max_prefetch_bytes = max_prefetch_bytes
        self.poll_min, self.poll_max = poll_interval
        self.verify = verify
        self.raw = raw
        self.bytes_fetched = 0
        self.requests = 0
        self._fetches: dict[tuple[int, int], _Fetch] = {}  # (step, version): a rewind reuses steps
        self._inflight_bytes = 0
        self._tg: anyio.abc.TaskGroup | None = None

    @property
    def state(self) -> State:
        return self.manifest.state

    @property
    def url(self) -> str:
        return self.store.url

    async def __aenter__(self) -> Reader:
        state = await self.manifest.load()
        assert state.config is not None
        w = state.config.world_size
        if self.world_size is not None and self.world_size != w:
            raise ConfigMismatch(f"{self.url}: reader expects world size {self.world_size}, the stream has {w}")
        if self.rank is not None and self.rank >= w:
            raise ValueError(f"{self.url}: rank {self.rank} is out of range for world size {w}")
        self.world_size = w
        self._tg = await enter_task_group()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        tg, self._tg = self._tg, None
        await cancel_task_group(tg)
        self._fetches.clear()

    # -- following the log ---------------------------------------------------------------------

    async def refresh(self) -> State:
        """Catch up with the log now."""
        await self.manifest.refresh()
        return self.state

    async def wait_for_step(
        self, step: int, *, timeout: float | None = None, check: Callable[[], None] | None = None
    ) -> Step:
        """The manifest entry of `step`, waiting until it is committed.

        Raises StepUnavailable if it was reclaimed or discarded, TimeoutError after `timeout`;
        `check` runs after every read of the log and may raise.
        """
        deadline = math.inf if timeout is None else self.manifest.clock() + timeout
        interval = self.poll_min
        while True:
            entry = self._entry(step)
            if entry is not None:
                return entry
            applied = await self.manifest.refresh()
            if check is not None:
                check()
            if applied:
                interval = self.poll_min
                continue
            left = deadline - self.manifest.clock()
            if left <= 0:
                raise TimeoutError(f"{self.url}: step {step} not committed within {timeout} s")
            await anyio.sleep(min(interval, left))
            interval = min(interval * 2, self.poll_max)

    def _entry(self, step: int) -> Step | None:
        s = self.state
        if step < s.first_step:
            raise StepUnavailable(
                f"{self.url}: step {step} was reclaimed (first readable step {s.first_step}, watermark {s.watermark})"
            )
        return s.step(step)

    # -- fetching ------------------------------------------------------------------------------

    async def read_step(self, step: int, *, timeout: float | None = None) -> RankBatch:
        """This rank's samples of `step`, waiting for it to be committed."""
        entry = await self.wait_for_step(step, timeout=timeout)
        fetch = self._start(entry)
        await fetch.done.wait()
        self._fetches.pop((entry.step, entry.version), None)
        if fetch.error is not None:
            raise fetch.error
        assert fetch.result is not None
        return fetch.result

    async def steps(self, start: int = 0, stop: int | None = None) -> AsyncIterator[RankBatch]:
        """Every step from `start` up to `stop` (exclusive; None: forever), in order.

        Waits for steps not committed yet. Raises StepUnavailable for a reclaimed step or when a
        rewind discarded a step already yielded, and CorruptData for a slice that fails its checksum.
        """
        step = start
        last: Step | None = None
        rewinds = self.state.rewinds

        def check() -> None:
            if self.state.rewinds != rewinds and last is not None and self.state.step(last.step) != last:
                raise StepUnavailable(
                    f"{self.url}: step {last.step}, already read, was discarded by a rewind: "
                    "restart reading from the restored checkpoint"
                )

        while stop is None or step < stop:
            entry = await self.wait_for_step(step, check=check)
            check()
            self._prefetch_after(step, stop)
            batch = await self.read_step(step)
            last = entry
            yield batch
            step += 1

    def _prefetch_after(self, step: int, stop: int | None) -> None:
        last = min(self.state.head, step + self.prefetch)
        if stop is not None:
            last = min(last, stop - 1)
        for n in range(step + 1, last + 1):
            entry = self.state.step(n)
            if entry is None:
                break
            assert self.rank is not None
            size = entry.ranks[self.rank].length
            if (n, entry.version) not in self._fetches and self._inflight_bytes + size > self.max_prefetch_bytes:
                break
            self._start(entry)

    def _start(self, entry: Step) -> _Fetch:
        fetch = self._fetches.get((entry.step, entry.version))
        if fetch is None:
            if self._tg is None:
                raise RuntimeError("reader is closed")
            assert self.rank is not None, "a reader opened with rank=None reads with fetch_raw only"
            fetch = self._fetches[(entry.step, entry.version)] = _Fetch(entry.ranks[self.rank].length)
            self._inflight_bytes += fetch.nbytes
            self._tg.start_soon(self._fetch, entry, fetch)
        return fetch

    async def _fetch(self, entry: Step, fetch: _Fetch) -> None:
        try:
            fetch.result = await self.fetch_slice(entry)
        except Exception as e:
            fetch.error = e
        finally:
            self._inflight_bytes -= fetch.nbytes
            fetch.done.set()

    async def fetch_slice(self, entry: Step) -> RankBatch:
        """Fetch, check and decode this rank's slice of a committed step: one range GET."""
        assert self.rank is not None, "a reader opened with rank=None reads with fetch_raw only"
        data = await self._get_slice(entry, self.rank)
        r = entry.ranks[self.rank]
        where = self._where(entry, self.rank)
        samples = await anyio.to_thread.run_sync(
            lambda: decode_slice(data, r.crc32 if self.verify else None, where, raw=self.raw)
        )
        return RankBatch(entry.step, self.rank, samples, entry.version, entry.producer, r.length)

    async def fetch_raw(self, entry: Step, rank: int) -> RawSlice:
        """Any rank's slice of a committed step, checked and indexed but not decoded."""
        if not 0 <= rank < len(entry.ranks):
            raise ValueError(f"{self.url}: rank {rank} is out of range for world size {len(entry.ranks)}")
        data = await self._get_slice(entry, rank)
        if not isinstance(data, bytes):  # a mapped file can change after the check: check and keep a copy
            data = await anyio.to_thread.run_sync(bytes, data)
        where = self._where(entry, rank)

        def check() -> list[FieldRef]:
            if self.verify:
                check_slice(data, entry.ranks[rank].crc32, where)
            return index_slice(data, where)

        return RawSlice(entry, rank, data, await anyio.to_thread.run_sync(check))

    def _where(self, entry: Step, rank: int) -> str:
        return f"{self.url} step {entry.step} rank {rank} object {entry.segment}"

    async def _get_slice(self, entry: Step, rank: int) -> bytes:
        r = entry.ranks[rank]
        try:
            data = await retry(lambda: self.store.get_range(entry.segment, r.offset, r.length), attempts=None)
        except ObjectNotFound:
            await self.manifest.refresh()  # reclaimed or discarded since we looked?
            if self.state.first_step > entry.step or entry.step < self.state.watermark:  # GC on a full store
                raise StepUnavailable(f"{self.url}: step {entry.step} was reclaimed while being read") from None
            if self.state.step(entry.step) != entry:
                raise StepUnavailable(
                    f"{self.url}: step {entry.step} was discarded by a rewind while being read"
                ) from None
            raise CorruptData(f"{self._where(entry, rank)}: the segment of a committed step is missing") from None
        if len(data) != r.length:  # the store returns only what exists: a lying length costs nothing
            raise CorruptData(
                f"{self._where(entry, rank)}: the segment holds {len(data)} bytes at offset {r.offset}, "
                f"the manifest says {r.length}"
            )
        self.requests += 1
        self.bytes_fetched += len(data)
        return data
