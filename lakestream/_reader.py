"""Readers: one rank's slice of every committed step, in order, exactly once.

A reader follows the manifest log (a GET of the next version; "not found" means "not yet"),
polling with an interval that doubles while nothing arrives and resets when something does. For
each step it fetches only its rank's slice with one range GET, checks the checksum the commit record
holds, and decodes it (with `collate`, into columns: an array field stored as a block is one view
of the fetched bytes). Committed steps are fetched ahead: as many as the consumer takes in
`prefetch_seconds` at the pace it has been taking them, at least `prefetch` (0: none), at most
`PREFETCH_MAX_STEPS`, within a byte bound. From a local `file://` store, `prefetch`: the next step
fetched, the others only read into the page cache.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import numpy as np

from . import _decisions as decisions
from . import _hooks
from ._batching import reslice
from ._buffers import pool
from ._errors import ConfigMismatch, CorruptData, ObjectNotFound, StepUnavailable
from ._lifecycle import checkpoint as _checkpoint
from ._manifest import Manifest
from ._pacing import StepPace
from ._records import MAIN_JOB, check_job
from ._retry import retry
from ._segment import (
    Block,
    ChecksumMismatch,
    FieldInfo,
    FieldRef,
    check_slice,
    decode_columns,
    decode_part,
    describe_part,
    join_samples,
    parse_slice,
)
from ._state import State, Step
from ._store import ObjectStore, open_source_store
from ._tasks import INLINE_ITEMS, cancel_task_group, enter_task_group, event_class, run_sync

__all__ = ["RankBatch", "RawSlice", "Reader"]

# Seconds between puts of the consumption mark while it moves, on a stream with back-pressure:
# producers are held `max_steps_ahead` steps past it, so its age costs a fast trainer steps (at 30
# steps/s, 0.5 s is 15 of 32; a producer's own view of it is up to half a second old as well).
# Without back-pressure the mark only tells `lakestream job` and a rewind where the trainer is, and
# is put every PUBLISH_IDLE: a trainer at 10 steps/s saves nine PUTs a second, which on a store that
# serves its producers too cost them as much CPU as the trainer.
PUBLISH_EVERY = 0.1
PUBLISH_IDLE = 1.0

log = logging.getLogger("lakestream.reader")


@dataclass(frozen=True, slots=True)
class RankBatch:
    """One rank's samples of one step: `samples`, or with a reader's `collate`, `columns` (and
    `samples` empty): `{"keys": [key, …], field: array or list, …}`, where a field stored as an
    array block (the same dtype and shape in every sample of the slice) is one `(n, *shape)`
    numpy array, a view of the fetched slice (one copy of it, made writable), and any other field
    a list of each sample's value (None where a sample has no such field)."""

    step: int
    rank: int
    samples: list[dict[str, Any]]
    version: int  # manifest version that committed the step
    producer: str
    nbytes: int  # bytes of the rank slice as stored
    columns: dict[str, Any] | None = None

    def __len__(self) -> int:
        return len(self.samples) if self.columns is None else len(self.columns["keys"])


@dataclass(frozen=True, slots=True)
class RawSlice:
    """One rank's slice of one step (checked), with where each field's bytes are in `data`, and
    its array blocks by field. A field of a block (tag `a`) is its sample's row of the block: the
    array's data, with no `.npy` header (`npy_header(block.dtype, block.shape)` is the one a
    `.npy` file of it starts with); the block is `block.array(data)`, all rows back to back.
    `data` is `bytes` or a buffer nothing else writes to (an S3 response's, a pooled read)."""

    entry: Step
    rank: int
    data: bytes
    files: list[FieldRef]
    blocks: dict[str, Block] = field(default_factory=dict)

    @property
    def step(self) -> int:
        return self.entry.step


@dataclass(slots=True)
class _Checkpoint:
    id: str
    step: int
    recorded: bool = False
    done: anyio.Event = field(default_factory=anyio.Event)


@dataclass(slots=True)
class _Fetch:
    nbytes: int
    done: anyio.Event
    result: RankBatch | None = None
    error: BaseException | None = None


PREFETCH_MAX_STEPS = 128  # steps fetched ahead at most, however fast the consumer (bounds the requests in flight)
LOCAL_FETCH_AHEAD = 1  # steps fetched ahead into memory from a local file:// store (the rest: page cache)
# ... for a consumer away from the reader at least this long a step (smoothed): one back sooner has
# no time in which to read a slice ahead (a page-cached 2.35 MB one takes ~150 µs), and the fetch
# ahead only costs it the bookkeeping (`Reader.steps` over bench/ingest.py's floor stream: 11 µs of
# ~270 a step, and as much again for the task switches `_read_here` saves).
LOCAL_AHEAD_AWAY = 100e-6
# Steps looked at in a row (`FileStore.in_page_cache`: an open and a one-byte read, ~12 µs) that
# the page cache held, after which none is until a read of the store waits for its disk again.
ADVISE_HOT = 4
READ_AHEAD_EVERY = 0.1  # seconds between reads of the log ahead of a fast consumer, per view of it
STEP_TIME_WEIGHT = 0.2  # weight of the newest step in the consumer's smoothed time per step


class _Ended(Exception):
    """The stream is closed before the step waited for."""


class Reader:
    """Reads one rank's slices. Create with `lakestream.open_reader`."""

    def __init__(
        self,
        store: ObjectStore,
        rank: int | None,
        world_size: int | None = None,
        *,
        prefetch: int = 4,
        prefetch_seconds: float = 1.0,
        max_prefetch_bytes: int = 512 << 20,
        poll_interval: tuple[float, float] = (0.005, 0.5),
        verify: bool = True,
        raw: bool = False,
        collate: bool = False,
        publish_consumed: bool | None = None,
        follower: Manifest | None = None,
        clock: Callable[[], float] = time.monotonic,
        job: str = MAIN_JOB,
    ) -> None:
        if rank is not None and (type(rank) is not int or rank < 0):
            raise ValueError(f"rank must be a non-negative integer, got {rank!r}")
        self.job = check_job(job)
        self.store = store
        # A fork's source (URL, store), opened on its first shared step.
        self._base: tuple[str, ObjectStore] | None = None
        self.rank = rank
        self.world_size = world_size
        self._expect = world_size  # the world size the caller asked for (None: whatever each step has)
        # One view of the log per reader, or one `follower` shared by the readers of a node (each
        # version is then read once for all of them: `Manifest.follow`).
        self.manifest = follower or Manifest(store, clock=clock, retries=None)  # an outage never stops a reader
        self.prefetch = max(0, prefetch)
        self.prefetch_seconds = max(0.0, prefetch_seconds)
        self.max_prefetch_bytes = max_prefetch_bytes
        self.step_time: float | None = None  # the consumer's smoothed time per step: yield to next ask
        # Set by a consumer that asks for each step before it has used the last (StreamDataset):
        # `steps` can then not tell its stalls or pace, and the consumer reports them (`paced`).
        self.consumer_paced = False
        self.poll_min, self.poll_max = poll_interval
        self.verify = verify
        self.raw = raw
        self.collate = collate
        if raw and collate:
            raise ValueError("a reader decodes fields either raw or collated, not both")
        # The trainer's consumption mark, which back-pressure counts from: rank 0 publishes it.
        self.publish_consumed = rank == 0 if publish_consumed is None else publish_consumed
        self.consumed = -1  # the last step `steps` yielded whose next step was then asked for
        self._published = -1  # the consumption mark last published
        # Set to have the read-ahead task read the log on; set while it does (then replaced).
        self._read_ahead_idle: anyio.Event | None = None
        # Prefetches: (the rules they were started under, the step asked for then, the last started,
        # the last read into the page cache).
        self._ahead: tuple[Any, int, int, int] = (None, -1, -1, -1)
        # Steps looked at in a row that the page cache held (`_will_need`), and the store's reads
        # that had waited for the disk then: ADVISE_HOT at first, so that none is looked at before one has.
        self._cached, self._waits = ADVISE_HOT, 0
        self._checkpoints: deque[_Checkpoint] = deque()  # asked for, not recorded yet; the first in progress
        self._checkpoint_error: Exception | None = None
        self.bytes_fetched = 0
        self.requests = 0
        self._fetches: dict[tuple[int, int, int], _Fetch] = {}  # see _key
        self._queued: deque[tuple[Step, _Fetch]] = deque()  # fetches started, not taken by a fetcher yet
        self._idle: deque[anyio.Event] = deque()  # fetchers waiting for one, each woken by its own event
        self._spawning = False  # a fetcher is started and has not begun yet
        self._inflight_bytes = 0
        self._pace = StepPace()  # when the steps waited for arrived
        self._tg: anyio.abc.TaskGroup | None = None
        self._event: Callable[[], anyio.Event] = anyio.Event
        # Every store read from is a local file:// one (FileStore.local): a fork's source counts too.
        self._local: bool = getattr(store, "local", False)
        self._metrics = _hooks.reader(self)

    @property
    def state(self) -> State:
        return self.manifest.state

    @property
    def url(self) -> str:
        return self.store.url

    async def __aenter__(self) -> Reader:
        state = self.manifest.state if self.manifest.state.version >= 0 else await self.manifest.load()
        assert state.config is not None
        worlds = {state.config.world_size} | {w for _, w, _ in state.shapes}
        w = state.world_at(state.head + 1) if self.world_size is None else self.world_size
        if w not in worlds:
            raise ConfigMismatch(
                f"{self.url}: reader expects world size {w}, the stream has {'/'.join(map(str, sorted(worlds)))}"
            )
        if self.rank is not None and self.rank >= w:
            raise ValueError(f"{self.url}: rank {self.rank} is out of range for world size {w}")
        self.world_size = w
        self._event = event_class()
        self._tg = await enter_task_group()
        self._read_ahead_idle = self._event()
        self._tg.start_soon(self._read_ahead, self._read_ahead_idle)
        if self.publish_consumed:
            if not state.knows_job(self.job):  # so that producers count its mark (back-pressure)
                await self.manifest.append(lambda st, _: decisions.job(st, self.job, time.time(), url=self.url))
            self._tg.start_soon(self._publish)
        return self

    async def _publish(self) -> None:
        """Publish the consumption mark while it moves (one small blind PUT; a failure is retried at the
        next turn, never fatal): every PUBLISH_EVERY seconds (start to start) on a stream with
        back-pressure, else every PUBLISH_IDLE; the first at once."""
        clock = self.manifest.clock
        last = -math.inf
        while True:
            started = clock()
            config = self.manifest.state.config
            every = PUBLISH_EVERY if config is not None and config.max_steps_ahead else PUBLISH_IDLE
            if started - last >= every - PUBLISH_EVERY / 2 and await self._publish_once():
                last = started
            await anyio.sleep(max(0.0, started + PUBLISH_EVERY - clock()))

    async def _publish_once(self) -> bool:
        """Put the mark if it moved since it was last put; whether it was."""
        if self.consumed == self._published:
            return False
        step = self.consumed
        try:
            await self.manifest.publish_consumed(step, time.time(), self.job)
        except Exception as e:
            log.debug("%s: publishing the consumption mark failed: %s", self.url, e)
            return False
        self._published = step
        return True

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        tg, self._tg = self._tg, None
        await cancel_task_group(tg)
        self._fetches.clear()
        self._queued.clear()
        self._idle.clear()
        base, self._base = self._base, None
        if base is not None:
            await base[1].aclose()
        if tg is not None and self.publish_consumed:  # where it stopped, for back-pressure and `lakestream job`
            with anyio.move_on_after(PUBLISH_EVERY, shield=True):
                await self._publish_once()

    # -- checkpoints ---------------------------------------------------------------------------

    async def checkpoint(self, checkpoint_id: str, step: int, *, wait: bool = False) -> bool:
        """Record the trainer's checkpoint `checkpoint_id` at `step` (`lakestream.checkpoint`) on
        this reader's view of the log, which is followed already: no reload of the log. Without
        `wait` it is recorded in the background and returns True at once, so a training step is
        not held up; checkpoints are recorded in the order asked, and an error surfaces at the
        next `steps` iteration, `read_step` or `checkpoint`. With `wait`, after every earlier one,
        what `lakestream.checkpoint` returns and raises."""
        self._raise_checkpoint_error()
        if self._tg is None:
            raise RuntimeError("reader is closed")
        turn = _Checkpoint(checkpoint_id, step)
        self._checkpoints.append(turn)
        if len(self._checkpoints) == 1:
            self._tg.start_soon(self._record_checkpoints)
        if not wait:
            return True
        await turn.done.wait()
        self._raise_checkpoint_error()
        return turn.recorded

    async def _record_checkpoints(self) -> None:
        while self._checkpoints:
            turn = self._checkpoints[0]
            try:
                if self._checkpoint_error is None:
                    turn.recorded = await _checkpoint(
                        self.store, turn.id, turn.step, manifest=self.manifest, job=self.job
                    )
            except Exception as e:
                self._checkpoint_error = e
            finally:
                self._checkpoints.popleft()
                turn.done.set()

    def _raise_checkpoint_error(self) -> None:
        if (e := self._checkpoint_error) is not None:
            self._checkpoint_error = None
            raise e

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
        clock = self.manifest.clock
        started = clock()
        deadline = math.inf if timeout is None else started + timeout
        empty = 0  # looks in a row that found the log ends before the step (after the first, 1 again once it moved)
        while True:
            entry = self._entry(step)
            if entry is not None:
                if empty:
                    self._pace.arrived(step, self.manifest.found_at)
                return entry
            if empty or not self._just_confirmed() or deadline - clock() <= self.poll_min:
                applied = await self.manifest.follow(enough=lambda: self.state.step(step) is not None)
                if check is not None:
                    check()
                if applied:
                    empty = min(empty, 1)
                    continue
            left = deadline - clock()
            if left <= 0:
                raise TimeoutError(f"{self.url}: step {step} not committed within {timeout} s")
            empty += 1  # the first: look again when it is due at the stream's pace
            now = clock()
            await anyio.sleep(
                min(self._pace.delay(step, empty, now, now - started, self.poll_min, self.poll_max), left)
            )

    async def wait_for_step_or_end(self, step: int, *, check: Callable[[], None] | None = None) -> Step | None:
        """The manifest entry of `step`, waiting until it is committed; None once the stream is
        closed before it (`lakestream close`): no such step will ever be committed."""

        def ended() -> None:
            if check is not None:
                check()
            if self.state.closed_after is not None and step > self.state.closed_after:
                raise _Ended

        try:
            if self.state.step(step) is None:
                ended()
            return await self.wait_for_step(step, check=ended)
        except _Ended:
            return None

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
        self._raise_checkpoint_error()
        entry = await self.wait_for_step(step, timeout=timeout)
        fetch = self._start(entry)
        await fetch.done.wait()
        self._let_go(step)
        if self._fetches.get(key := self._key(entry)) is fetch:  # behind one still in flight (after a rewind)
            del self._fetches[key]
        if fetch.error is not None:
            raise fetch.error
        assert fetch.result is not None
        return fetch.result

    def _let_go(self, step: int) -> None:
        """Let go of the fetches of `step` and before it that are done (ones for a shape or TGB no
        longer in force): from the oldest on (fetches are started in step order), up to one not
        done yet or of a later step, so that a step costs O(1) however many are prefetched."""
        fetches = self._fetches
        while fetches and (k := next(iter(fetches)))[0] <= step and fetches[k].done.is_set():
            del fetches[k]

    async def _read_here(self, entry: Step) -> RankBatch:
        """`read_step` of a committed step that is not being fetched, from a local store, by the
        calling task, at once where it takes no wait (`_fetch_now`): a fetcher task would only add
        two task switches to a page-cached read, ~11 µs of a 270 µs step. A checkpoint, as a wait is."""
        self._raise_checkpoint_error()
        batch = self._fetch_now(entry)
        if batch is None:
            batch = await self.fetch_slice(entry)
        self._let_go(entry.step)
        await anyio.lowlevel.checkpoint()
        return batch

    async def steps(self, start: int = 0, stop: int | None = None) -> AsyncIterator[RankBatch]:
        """Every step from `start` up to `stop` (exclusive; None: until the stream ends), in order.

        Waits for steps not committed yet. With no `stop` it ends after the last step of a closed
        stream (`lakestream close`), and waits for ever on one that is not closed. Raises StepUnavailable for a reclaimed step or when a
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

        yielded: float | None = None
        while stop is None or step < stop:
            asked = time.perf_counter()  # the consumer waits from here until the yield: its stall
            if yielded is not None and not self.consumer_paced:
                self.paced(self.manifest.clock() - yielded)
            if stop is None:
                found = await self.wait_for_step_or_end(step, check=check)
                if found is None:
                    return
                entry = found
            else:
                entry = await self.wait_for_step(step, check=check)
            check()
            if self._local and self._key(entry) not in self._fetches:
                batch = await self._read_here(entry)
                self._prefetch_after(step, stop)
            elif last is None:  # the first batch first: fetched alone, before any prefetch competes with it
                batch = await self.read_step(step)
                self._prefetch_after(step, stop)
            else:
                self._start(entry)  # this step's own fetch ahead of the prefetches it starts
                self._prefetch_after(step, stop)
                batch = await self.read_step(step)
            last = entry
            if not self.consumer_paced:
                self._metrics.stalled(time.perf_counter() - asked)
            yielded = self.manifest.clock()
            yield batch
            self.consumed = step
            step += 1

    def paced(self, took: float) -> None:
        """The consumer took `took` seconds over a step, from having it to asking for the next."""
        took, w = max(0.0, took), STEP_TIME_WEIGHT
        self.step_time = took if self.step_time is None else (1 - w) * self.step_time + w * took

    def prefetch_depth(self) -> int:
        """Steps to fetch ahead of the one asked for: what the consumer takes in `prefetch_seconds`
        at its smoothed pace (a fast trainer is not left waiting on the slowest of a step's GETs),
        at least `prefetch`, at most PREFETCH_MAX_STEPS; none when `prefetch` is 0. From a local
        `file://` store, `prefetch`, of which only the first LOCAL_FETCH_AHEAD are fetched into
        memory and the rest read into the page cache (`_prefetch_after`)."""
        if self.prefetch == 0 or self.prefetch_seconds == 0 or self.step_time is None or self._local:
            return self.prefetch
        if self.step_time * PREFETCH_MAX_STEPS <= self.prefetch_seconds:
            return max(self.prefetch, PREFETCH_MAX_STEPS)
        return max(self.prefetch, math.ceil(self.prefetch_seconds / self.step_time))

    def _prefetch_after(self, step: int, stop: int | None) -> None:
        depth = self.prefetch_depth()
        known = stop is not None and self.state.head >= stop - 1  # every step asked for is in the log read
        idle = self._read_ahead_idle
        if idle is not None and not idle.is_set() and not known and self._read_ahead_due(step, depth):
            idle.set()
        last = min(self.state.head, step + depth)
        if stop is not None:
            last = min(last, stop - 1)
        # From a local store the reads have no latency to cover, only a disk's: the next step is
        # fetched (ready for a consumer that asks while it works on this one), and the steps after
        # it are only read into the page cache, so that each is copied into memory just before it is
        # used. Fetched far ahead, a slice only held memory, and was copied into a block long out of
        # the CPU's cache (`Reader.steps` over bench/ingest.py's floor stream: 338 against 305 µs a
        # step at prefetch 4 and 1; 410 against 367 beside a memory-bound process).
        fetch_last = min(last, step + self._local_ahead()) if self._local else last
        # Steps up to the last started (and advised) were so already, unless a rewind or reshape
        # (or a new view of the log) changed what they are, or an earlier step is asked for
        # (fetches up to the step asked for are let go): each step is looked at once, not once
        # per step asked.
        state = self.state
        rules = (id(state), state.rewinds, state.shapes[-1] if state.shapes else None)
        was, asked, started, advised = self._ahead
        same = was == rules and step >= asked
        n = max(step + 1, started + 1) if same else step + 1
        while n <= fetch_last:
            entry = state.step(n)
            if entry is None:
                break
            if self._key(entry) not in self._fetches:
                assert self.rank is not None
                try:
                    size = self._nbytes(entry, self.rank)
                except ConfigMismatch:
                    break  # reading that step raises it
                if self._inflight_bytes + size > self.max_prefetch_bytes:
                    break
                self._start(entry)
            n += 1
        k = max(n, advised + 1) if same else n
        while self._local and k <= last and (entry := state.step(k)) is not None and self._will_need(entry):
            k += 1
        self._ahead = (rules, step, n - 1, k - 1)

    def _local_ahead(self) -> int:
        """Steps to fetch into memory ahead from a local store: LOCAL_FETCH_AHEAD, unless the
        consumer is known to be back for the next step within LOCAL_AHEAD_AWAY."""
        return LOCAL_FETCH_AHEAD if self.step_time is not None and self.step_time >= LOCAL_AHEAD_AWAY else 0

    def _will_need(self, entry: Step) -> bool:
        """Have the page cache read this rank's slices of `entry` ahead, in a worker thread, those
        it does not hold (`FileStore.in_page_cache`, `will_need`); False if the step cannot be
        read as this reader's (its fetch will say why). Where the store's reads of its slices tell
        when they wait for the disk (`FileStore.reads_tell`), a step is looked at only from such a
        read on, until ADVISE_HOT in a row were held: a stream in the page cache costs no look."""
        assert self.rank is not None
        store: Any = self._opened_store_of(entry)  # a fork's source: opened by a fetch, not here
        if not hasattr(store, "will_need") or self._tg is None:
            return True
        try:
            pieces = self.plan(entry, self.rank)
        except ConfigMismatch:
            return False
        if store.waits != self._waits:  # a read waited for the disk: look at every step again
            self._cached, self._waits = 0, store.waits
        elif self._cached >= ADVISE_HOT and all(store.reads_tell(entry.ranks[i].length) for i, _, _ in pieces):
            return True
        cold = False
        for i, _, _ in pieces:
            r = entry.ranks[i]
            if not store.in_page_cache(entry.segment, r.offset, r.length):
                cold = True
                self._tg.start_soon(anyio.to_thread.run_sync, store.will_need, entry.segment, r.offset, r.length)
        self._cached = 0 if cold else self._cached + 1
        return True

    def _read_ahead_due(self, step: int, depth: int) -> bool:
        """Whether to read the log on in the background, so that the next steps are known (and
        fetched) before they are asked for, not one round trip after: at once within `prefetch`
        steps of the known head (unless a read just found the log's end); within the adaptive
        depth, once the tail was last confirmed READ_AHEAD_EVERY ago (a fast consumer learns of a
        version about that soon after it lands, at a bounded rate of log reads per view, shared by
        the ranks following it)."""
        head = self.state.head
        if head < step + self.prefetch:
            return not self._just_confirmed()
        return head < step + depth and self.manifest.clock() - self.manifest.confirmed_at >= READ_AHEAD_EVERY

    def _just_confirmed(self) -> bool:
        """Whether a read of the log found its end less than `poll_min` ago (the read that found
        the step before goes on to the end): reading it again now would find what that read found,
        so a wait counts that read as its first look (unless its timeout ends sooner: it then looks
        once before it gives up), and no read ahead is started."""
        return self.manifest.clock() - self.manifest.confirmed_at < self.poll_min

    async def _read_ahead(self, idle: anyio.Event) -> None:
        """Read the log on each time `_prefetch_after` asks (sets `_read_ahead_idle`): one task
        for the reader's life, started with it (a `start_soon` costs ~50 µs, a wake a few)."""
        while True:
            await idle.wait()
            try:
                await self.manifest.follow()
            except Exception as e:  # the next wait_for_step reads the log again and raises what persists
                log.debug("%s: reading the log ahead failed: %s", self.url, e)
            self._read_ahead_idle = idle = self._event()

    def _key(self, entry: Step) -> tuple[int, int, int]:
        # A rewind gives a step a new TGB at a new version; a reshape gives it a new world size.
        return entry.step, entry.version, self.state.world_at(entry.step)

    def _start(self, entry: Step) -> _Fetch:
        fetch = self._fetches.get(self._key(entry))
        if fetch is None:
            if self._tg is None:
                raise RuntimeError("reader is closed")
            assert self.rank is not None, "a reader opened with rank=None reads with fetch_raw only"
            fetch = self._fetches[self._key(entry)] = _Fetch(self._nbytes(entry, self.rank), self._event())
            self._inflight_bytes += fetch.nbytes
            self._queued.append((entry, fetch))
            if self._idle:
                self._idle.popleft().set()
            elif not self._spawning:
                self._spawn_fetcher()
        return fetch

    def _spawn_fetcher(self) -> None:
        if self._tg is not None:  # else the reader is closing: what is queued is let go
            self._spawning = True
            self._tg.start_soon(self._fetcher)

    async def _fetcher(self) -> None:
        """Run started fetches, oldest first, while the reader is open. A fetcher is started only
        when every other one is busy (a fetch in flight), so as many fetches run at once as were
        started, as with a task each; but a task spawned per fetch cost more CPU than a small
        page-cached read (anyio's `start_soon`, about 40 µs; waking an idle fetcher, a few). One is
        started at a time, by the last to begin a fetch with more queued: fetches that end without
        waiting (a page-cached `file://` read) are all run by the first, not by one task each."""
        self._spawning = False
        while True:
            while self._queued:
                entry, fetch = self._queued.popleft()
                if self._queued and not self._idle and not self._spawning:
                    self._spawn_fetcher()  # for the rest, should this fetch wait on the store
                await self._fetch(entry, fetch)
            wake = self._event()
            self._idle.append(wake)
            await wake.wait()

    async def _fetch(self, entry: Step, fetch: _Fetch) -> None:
        try:
            fetch.result = await self.fetch_slice(entry)
        except Exception as e:
            fetch.error = e
        finally:
            self._inflight_bytes -= fetch.nbytes
            fetch.done.set()

    def plan(self, entry: Step, rank: int) -> list[tuple[int, int, int]]:
        """Where `rank`'s samples of `entry` are: (stored slice, first sample, end sample) pieces.

        The step is read as the world size in force at it (`State.world_at`); a TGB stored for
        another world size is re-sliced (`_batching.reslice`). Raises ConfigMismatch when the step
        is read as another world size than the reader was opened for, or has no rank `rank`.
        """
        w = self.state.world_at(entry.step)
        if self._expect is not None and w != self._expect:
            raise ConfigMismatch(
                f"{self.url}: step {entry.step} is read as {w} ranks (reshaped), this reader is for world size "
                f"{self._expect}: restart the trainer with the new world size"
            )
        if not 0 <= rank < w:
            raise ConfigMismatch(f"{self.url}: step {entry.step} is read as {w} ranks, so it has no rank {rank}")
        if len(entry.ranks) == w:
            return [(rank, 0, entry.ranks[rank].samples)]
        return reslice([r.samples for r in entry.ranks], w)[rank]

    def _nbytes(self, entry: Step, rank: int) -> int:
        return sum(entry.ranks[i].length for i, _, _ in self.plan(entry, rank))

    async def fetch_slice(self, entry: Step) -> RankBatch:
        """Fetch, check and decode this rank's samples of a committed step: one range GET per stored
        slice they are in (one, unless the step was reshaped to a world size it was not sealed for)."""
        assert self.rank is not None, "a reader opened with rank=None reads with fetch_raw only"
        pieces = self.plan(entry, self.rank)
        parts = []
        for i, lo, hi in pieces:
            data = await self._get_slice(entry, i)
            whole = len(pieces) == 1
            parts.append(
                await run_sync(
                    self._decode, entry, i, data, lo, hi, whole, nbytes=len(data), items=entry.ranks[i].samples
                )
            )
        return self._batch(entry, pieces, parts)

    def _fetch_now(self, entry: Step) -> RankBatch | None:
        """`fetch_slice` with no await, where it takes no wait: this rank's samples are one stored
        slice of at most INLINE_ITEMS samples that the store reads on the calling thread (a local
        store's, page-cached: `FileStore.read_here`), checked and decoded here. Else None. The
        awaits of `fetch_slice` (the store's, `run_sync`'s) cost ~11 µs of a 270 µs step."""
        assert self.rank is not None
        pieces = self.plan(entry, self.rank)
        store: Any = self._opened_store_of(entry)
        if len(pieces) != 1 or not hasattr(store, "read_here"):
            return None
        ((i, lo, hi),) = pieces
        r = entry.ranks[i]
        if r.samples > INLINE_ITEMS:
            return None
        try:
            data = store.read_here(entry.segment, r.offset, r.length)
        except ObjectNotFound:  # `_get_slice` says why
            return None
        if data is None:
            return None
        return self._batch(entry, pieces, [self._decode(entry, i, self._got(entry, i, data), lo, hi, True)])

    def _decode(self, entry: Step, i: int, data: Any, lo: int, hi: int, whole: bool) -> Any:
        """Check stored slice `i` of `entry` and decode its samples lo..hi: (keys, columns) with the
        reader's `collate` (`whole`: they are the batch), else a list of samples. CorruptData if
        it fails its checksum or holds another number of samples than the manifest says."""
        r, where = entry.ranks[i], self._where(entry, i)
        digest = r.digest if self.verify else None
        part: Any
        try:
            if self.collate:
                n, keys, columns = _columns(data, digest, entry.checksum, where, lo, hi, whole)
                part = (keys, columns)
            else:
                n, part = decode_part(data, digest, where, lo, hi, raw=self.raw, kind=entry.checksum)
        except ChecksumMismatch:
            self._metrics.checksum_failed()
            raise
        if n != r.samples:  # what re-slicing counts on; the checksum covers the bytes, not the manifest
            raise CorruptData(f"{where}: the slice holds {n} samples, the manifest says {r.samples}")
        return part

    def _batch(self, entry: Step, pieces: list[tuple[int, int, int]], parts: list[Any]) -> RankBatch:
        """The RankBatch of `entry` from the decoded `parts` of its `pieces` (`plan`)."""
        assert self.rank is not None
        nbytes = sum(entry.ranks[i].length for i, _, _ in pieces)
        if not self.collate:
            samples = [s for part in parts for s in part]
            return RankBatch(entry.step, self.rank, samples, entry.version, entry.producer, nbytes)
        columns = {"keys": parts[0][0]} | parts[0][1] if len(parts) == 1 else _merge(parts)
        return RankBatch(entry.step, self.rank, [], entry.version, entry.producer, nbytes, columns)

    async def fetch_rank_raw(self, entry: Step, rank: int) -> RawSlice:
        """`rank`'s samples of a committed step as one checked, indexed RawSlice (see `plan`): the
        stored slice itself, or for a re-sliced step its samples copied into one buffer
        (`join_samples`: a block field of one dtype and shape in every piece stays one block)."""
        pieces = self.plan(entry, rank)
        if len(pieces) == 1 and rank < len(entry.ranks) and pieces[0] == (rank, 0, entry.ranks[rank].samples):
            return await self.fetch_raw(entry, rank)
        parts: list[tuple[Any, list[list[FieldRef]], dict[str, Block]]] = []
        for i, lo, hi in pieces:
            raw = await self.fetch_raw(entry, i)
            groups = _samples_of(raw.files)
            if len(groups) != entry.ranks[i].samples:
                raise CorruptData(
                    f"{self._where(entry, i)}: the slice holds {len(groups)} samples (by key), "
                    f"the manifest says {entry.ranks[i].samples}"
                )
            parts.append((raw.data, groups[lo:hi], raw.blocks))  # only this rank's bytes are kept
        nbytes, items = sum(len(data) for data, _, _ in parts), sum(len(groups) for _, groups, _ in parts)
        return RawSlice(entry, rank, *await run_sync(join_samples, parts, nbytes=nbytes, items=items))

    async def describe_rank(self, entry: Step, rank: int) -> list[tuple[str, list[FieldInfo]]]:
        """`rank`'s samples of a committed step (see `plan`), each as its key and its fields described
        (`describe_part`): one range GET per stored slice they are in, checksums checked, nothing
        decoded but `.npy` headers."""
        samples: list[tuple[str, list[FieldInfo]]] = []
        for i, lo, hi in self.plan(entry, rank):
            data = await self._get_slice(entry, i)
            try:
                n, got = await run_sync(
                    self._describe, entry, i, data, lo, hi, nbytes=len(data), items=entry.ranks[i].samples
                )
            except ChecksumMismatch:
                self._metrics.checksum_failed()
                raise
            if n != entry.ranks[i].samples:
                raise CorruptData(
                    f"{self._where(entry, i)}: the slice holds {n} samples, the manifest says {entry.ranks[i].samples}"
                )
            samples += got
        return samples

    def _describe(
        self, entry: Step, rank: int, data: bytes, lo: int, hi: int
    ) -> tuple[int, list[tuple[str, list[FieldInfo]]]]:
        where = self._where(entry, rank)
        if self.verify:
            check_slice(data, entry.ranks[rank].digest, where, entry.checksum)
        return describe_part(data, where, lo, hi)

    async def fetch_raw(self, entry: Step, rank: int) -> RawSlice:
        """Any rank's slice of a committed step, checked and indexed but not decoded: the store's
        buffer itself (`bytes`, an S3 response's buffer, a store's pooled read),
        which nothing else writes to."""
        if not 0 <= rank < len(entry.ranks):
            raise ValueError(f"{self.url}: rank {rank} is out of range for world size {len(entry.ranks)}")
        data = await self._get_slice(entry, rank)
        where = self._where(entry, rank)

        def check() -> tuple[bytes, list[FieldRef], dict[str, Block]]:
            if self.verify:
                check_slice(data, entry.ranks[rank].digest, where, entry.checksum)
            index = parse_slice(data, where)
            return data, index.refs, index.blocks

        try:
            return RawSlice(entry, rank, *await run_sync(check, nbytes=len(data), items=entry.ranks[rank].samples))
        except ChecksumMismatch:
            self._metrics.checksum_failed()
            raise

    def _where(self, entry: Step, rank: int) -> str:  # `rank`: the stored slice
        base = self.state.base
        at = f" of {base.source}" if base is not None and base.holds(entry) else ""
        return f"{self.url} step {entry.step} rank {rank} object {entry.segment}{at}"

    def _opened_store_of(self, entry: Step) -> ObjectStore | None:
        """The store holding `entry`'s segment if it is open: this reader's, or a fork's source
        once a fetch of a shared step opened it (`_store_of`); else None."""
        base = self.state.base
        if base is None or not base.holds(entry):
            return self.store
        if self._base is None or self._base[0] != base.source:
            return None
        return self._base[1]

    async def _store_of(self, entry: Step, rank: int) -> ObjectStore:
        """The store holding `entry`'s segment: a fork's shared steps are its source's (a URL read
        from the store: CorruptData naming the step if it is not one this library opens)."""
        opened = self._opened_store_of(entry)
        if opened is not None:
            return opened
        base = self.state.base
        assert base is not None
        store = open_source_store(base.source, self._where(entry, rank))  # read for segments named alike only
        self._local = self._local and getattr(store, "local", False)  # its reads may have latency to cover
        old, self._base = self._base, (base.source, store)
        if old is not None:
            await old[1].aclose()
        return store

    async def _get_slice(self, entry: Step, rank: int) -> bytes:
        r = entry.ranks[rank]
        store = await self._store_of(entry, rank)
        try:
            data = await retry(lambda: store.get_range(entry.segment, r.offset, r.length), attempts=None)
        except ObjectNotFound:
            await self.manifest.refresh()  # reclaimed or discarded since we looked?
            if self.state.first_step > entry.step or entry.step < self.state.watermark:  # GC on a full store
                raise StepUnavailable(f"{self.url}: step {entry.step} was reclaimed while being read") from None
            if self.state.step(entry.step) != entry:
                raise StepUnavailable(
                    f"{self.url}: step {entry.step} was discarded by a rewind while being read"
                ) from None
            raise CorruptData(f"{self._where(entry, rank)}: the segment of a committed step is missing") from None
        return self._got(entry, rank, data)

    def _got(self, entry: Step, rank: int, data: bytes) -> bytes:
        """`data`, read as stored slice `rank` of `entry`, counted; CorruptData if its length is not
        the manifest's (the store returns only what exists: a lying length costs nothing)."""
        r = entry.ranks[rank]
        if len(data) != r.length:
            raise CorruptData(
                f"{self._where(entry, rank)}: the segment holds {len(data)} bytes at offset {r.offset}, "
                f"the manifest says {r.length}"
            )
        self.requests += 1
        self.bytes_fetched += len(data)
        self._metrics.fetched(len(data))
        return data


def _samples_of(files: list[FieldRef]) -> list[list[FieldRef]]:
    """A slice's field refs grouped by sample (a sample's fields are adjacent, under one key)."""
    groups: list[list[FieldRef]] = []
    for f in files:
        if groups and groups[-1][0].key == f.key:
            groups[-1].append(f)
        else:
            groups.append([f])
    return groups


def _columns(
    data: Any, digest: int | None, checksum: str, where: str, lo: int, hi: int, whole: bool
) -> tuple[int, list[str], dict[str, Any]]:
    """`decode_columns` of a slice checked against `digest` (None: not checked). With `whole`
    (the columns are the batch), a read-only buffer with array blocks is copied once, into pooled
    memory, so that the arrays handed out are writable views of that copy."""
    index = parse_slice(data, where)
    if whole and index.blocks and memoryview(data).readonly:
        data = pool.copy(data)
    if digest is not None:
        check_slice(data, digest, where, checksum)
    n, keys, columns = decode_columns(data, where, lo, hi, index)
    if "keys" in columns:
        raise ValueError(f"{where}: a field named 'keys' cannot be collated: read with collate=False")
    return n, keys, columns


def _merge(parts: list[tuple[list[str], dict[str, Any]]]) -> dict[str, Any]:
    """The columns of several pieces (a re-sliced step) as one: an array field that is one array
    of one dtype and row shape in every piece is concatenated (its one copy), any other a list."""
    keys = [k for ks, _ in parts for k in ks]
    merged: dict[str, Any] = {}
    for name in dict.fromkeys(name for _, columns in parts for name in columns):
        got = [columns.get(name) for _, columns in parts]
        arrays = [a for a in got if isinstance(a, np.ndarray)]
        if len(arrays) == len(got) and len({(a.dtype, a.shape[1:]) for a in arrays}) == 1:
            merged[name] = np.concatenate(arrays)
            continue
        column: list[Any] = []
        for (ks, _), a in zip(parts, got):
            if a is None:
                column += [None] * len(ks)
            elif isinstance(a, np.ndarray):
                column += [a[j, ...].copy() for j in range(len(a))]
            else:
                column += a
        merged[name] = column
    return {"keys": keys} | merged
