"""The producer pipeline: a source, an optional transform, a producer; what `lakestream produce` runs.

    report = await lakestream.produce(url, "enc-0", "wds:/data/train-{000..127}.tar",
                                      shard=(0, 8), map=decode_and_crop, workers=4)

The source is opened at the producer's committed cursor (through `source_cursor` when a record was
expanded by the transform), so running the same pipeline again after a crash continues exactly.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio

from . import _hooks
from ._batching import mix_counts
from ._errors import ConfigMismatch, MixChanged
from ._layout import KEY_FIELD, SOURCE_FIELD
from ._producer import Producer, ProducerStats
from ._records import check_source_name
from ._transform import MapFunction, MapStats, source_cursor, transform
from .sources import Source, WdsSource, open_source
from .sources._synthetic import synthetic_source

log = logging.getLogger(__name__)

__all__ = ["ProduceReport", "SyntheticSource", "produce"]


@dataclass(frozen=True, slots=True)
class SyntheticSource:
    """`n` synthetic samples of `size` bytes keyed `<prefix><i>`; the cursor is the count consumed."""

    n: int
    size: int
    prefix: str = "s"
    work_ms: float = 0.0

    def iterate(self, cursor: Any = None) -> Iterator[tuple[dict[str, Any], Any]]:
        if not isinstance(cursor, int | None) or isinstance(cursor, bool):
            raise ValueError(f"resuming at {cursor!r}, which is not a synthetic position")
        return synthetic_source(self.n, self.size, start=cursor or 0, prefix=self.prefix, work_ms=self.work_ms)


@dataclass
class ProduceReport:
    """What one run of `produce` did (this incarnation only)."""

    producer: str
    epoch: int
    resumed_at: Any
    seconds: float
    stats: ProducerStats
    held_back: int = 0  # samples of a partial last global batch kept back by drop_last
    map: MapStats | None = None  # with a transform: records read, outputs, dropped, skipped keys
    policy: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    ended: tuple[str, ...] = ()  # named sources read to their end, in that order
    unread: tuple[str, ...] = ()  # named sources with samples left unread when the run stopped


async def produce(
    target: Any,
    producer_id: str,
    source: str | Source | Mapping[str, str | Source],
    *,
    shard: tuple[int, int] = (0, 1),
    key_column: str | None = None,
    split: str | None = None,
    epochs: int = 1,
    shuffle_seed: int | None = None,
    map: str | MapFunction | None = None,
    workers: int = 0,
    on_error: str = "fail",
    drop_last: bool = False,
    on_source_end: str = "stop",
    rate: float = 0.0,
    on_open: Callable[[Producer], None] | None = None,
    **options: Any,
) -> ProduceReport:
    """Produce every sample of `source` (a spec for `open_source`, or a Source) into the stream.

    `source` may also map source names to sources: the producer then draws from all of them, each
    global batch holding each source's share by the mixture in force (`lakestream mix`; equal
    shares before any), every sample keyed `<name>-<key>` with a `__source__` field naming its
    source, and the cursor
    `{"sources": {name: cursor}}`. When a mix record changes the weights at the step its sealed
    TGBs would take, the producer starts again from its committed cursors (MixChanged): those TGBs
    are resealed from the source, never committed.

    `on_source_end`, when a named source ends: `"stop"` ends the run (its last TGB holds at most
    each share); `"renormalize"` seals the open batch short, records the mixture in force without
    the source from the next step (`Producer.drop_source`; under no mixture the others simply get
    equal shares) and goes on until every source the mixture draws from ended. The report names
    the sources that ended (`ended`) and those with samples left unread (`unread`).

    `map`: a function (or `MODULE:FUNCTION`) from a sample to a sample, None (dropped) or a list of
    samples, run in `workers` processes when > 0, order preserved (see `lakestream._transform`);
    `on_error`: `"fail"` (MapError naming the record) or `"skip"` (counted in the report).
    `drop_last`: commit whole global batches only; the rest is left for a later run.
    `rate`: samples per second at most (0: as fast as possible). `on_open` is called with the
    producer once it is registered. Other options go to `open_producer`.
    """
    from . import open_producer  # the public entry point; imported here to keep the package import acyclic

    if on_error not in ("fail", "skip"):
        raise ValueError(f"on_error {on_error!r}: expected fail or skip")
    if map is None and (workers or on_error != "fail"):
        raise ValueError("--workers and --on-error apply to --map")
    if on_source_end not in ("stop", "renormalize"):
        raise ValueError(f"on_source_end {on_source_end!r}: expected stop or renormalize")
    if on_source_end != "stop" and not isinstance(source, Mapping):
        raise ValueError("--on-source-end applies to named sources")
    order: dict[str, Any] = {
        "shard": shard,
        "key_column": key_column,
        "split": split,
        "epochs": epochs,
        "shuffle_seed": shuffle_seed,
    }
    named = dict(source) if isinstance(source, Mapping) else None
    if named is not None:
        if not named:
            raise ValueError("no sources")
        for name in named:
            check_source_name(name)  # so that the keys `<name>-<key>` of two sources never collide
        if drop_last:
            raise ValueError("--drop-last applies to a single source")
        sources = {n: open_source(s, **order) if isinstance(s, str) else s for n, s in named.items()}
    else:
        single: Source = open_source(source, **order) if isinstance(source, str) else source  # type: ignore[assignment]
    t0 = time.perf_counter()
    mapped = MapStats() if map is not None else None
    stats, restarts = ProducerStats(), 0
    ended: list[str] = []
    unread: tuple[str, ...] = ()
    while True:
        try:
            async with open_producer(target, producer_id, **options) as p:
                if on_open is not None:
                    on_open(p)
                _hooks.track_map(p.store.url, producer_id, mapped)
                start = p.cursor
                for src in [single] if named is None else sources.values():
                    if isinstance(src, WdsSource):  # refuses a sample over the limit before reading it
                        src.max_sample_bytes = p.config.max_sample_bytes
                if named is None:
                    if p.mix_now()[1] is not None:
                        raise ConfigMismatch(
                            f"{p.manifest.url}: the stream is under a mixture; give this producer its named sources"
                        )
                    it = single.iterate(source_cursor(start, mapped=map is not None))
                    if map is not None:
                        it = transform(it, map, start=start, workers=workers, on_error=on_error, stats=mapped)
                    held = await _feed(p, it, p.global_batch if drop_last else 1, rate, t0)
                else:
                    held = 0
                    unread = await _feed_mixed(
                        p, sources, start, map, workers, on_error, mapped, rate, t0, on_source_end, ended
                    )
            _add(stats, p.stats)
            break
        except MixChanged as e:
            _add(stats, p.stats)
            restarts += 1
            log.info("%s", e)
    report = ProduceReport(producer_id, p.epoch, start, time.perf_counter() - t0, stats, held, mapped, p.policy_name)
    report.extra["mix_restarts"] = restarts
    report.ended, report.unread = tuple(ended), unread
    return report


def _add(total: ProducerStats, one: ProducerStats) -> None:
    for name in ("samples", "tgbs_committed", "bytes_uploaded", "commits", "commit_attempts", "conflicts"):
        setattr(total, name, getattr(total, name) + getattr(one, name))
    total.backpressure_waits += one.backpressure_waits
    total.ready_to_visible += one.ready_to_visible


async def _feed_mixed(
    p: Producer,
    sources: dict[str, Source],
    start: Any,
    map: str | MapFunction | None,
    workers: int,
    on_error: str,
    mapped: MapStats | None,
    rate: float,
    t0: float,
    on_source_end: str,
    ended: list[str],
) -> tuple[str, ...]:
    """Put global batches composed by the mixture in force (equal shares under none) until a source it
    draws from ends: then stop (`stop`), or drop the source and go on (`renormalize`). Nothing is held
    back. Adds the sources that ended to `ended`; returns those with samples left unread.

    Each source is read ahead in a thread of its own (`_ReadAhead`); a share takes exactly its count
    from its source, and what was read beyond it waits there for the next batch. Every batch but the
    last and those where a source ended is whole, so each is composed for the mix in force at its step."""
    if start is not None and not (isinstance(start, dict) and isinstance(start.get("sources"), dict)):
        raise ConfigMismatch(f"{p.manifest.url}: producer {p.id!r} resumes at {start!r}, not a cursor of named sources")
    cursors: dict[str, Any] = dict(start["sources"]) if start is not None else {}
    if unknown := set(cursors) - set(sources):
        raise ConfigMismatch(f"{p.manifest.url}: producer {p.id!r} has cursors of sources {sorted(unknown)} not given")
    its: dict[str, Iterator[Any]] = {}
    for name, src in sources.items():
        at = cursors.get(name)
        it = src.iterate(source_cursor(at, mapped=map is not None))
        its[name] = transform(it, map, start=at, workers=workers, on_error=on_error, stats=mapped) if map else it
    aheads: dict[str, _ReadAhead] = {}
    gone: set[str] = set()  # the sources this incarnation read to their end
    n = 0
    try:
        for name, it in its.items():
            aheads[name] = _ReadAhead(it, name=f"lakestream-source-{name}")
        last: str | None = None  # the source that ended while the open batch was composed
        while True:
            if last is not None and on_source_end == "stop":
                break  # the open batch is the last TGB: it holds at most each share
            version, weights = p.mix_now()
            if weights is None:  # no mixture in force: equal shares of the sources not ended
                weights = tuple((name, 1.0) for name in sources if name not in gone)
                if not weights:
                    break  # every source ended
            counts = mix_counts(weights, p.global_batch)
            if missing := [name for name, c in counts.items() if c and name not in its]:
                raise ConfigMismatch(f"{p.manifest.url}: the mixture in force draws from {missing}, not given")
            drawn = [name for name, c in counts.items() if c and name in gone]
            if last is not None or drawn:
                if not sum(w for name, w in weights if name not in gone):
                    break  # every source the mixture draws from ended
                dropped = drawn[0] if drawn else last
                assert dropped is not None
                await p.drop_source(dropped)  # seals the open batch short
                last = None
                continue
            for name, c in counts.items():
                while c > 0 and last is None:
                    items = await aheads[name].take(c)
                    if items is None:
                        log.info("%s: producer %s: source %s ended", p.manifest.url, p.id, name)
                        gone.add(name)
                        if name not in ended:
                            ended.append(name)
                        last = name
                        break
                    c -= len(items)
                    for sample, cursors[name] in items:
                        doc = {"sources": dict(cursors)}
                        key = f"{name}-{sample.get(KEY_FIELD, n)}"  # keys of different sources never collide
                        await p.put(
                            {**sample, KEY_FIELD: key, SOURCE_FIELD: name}, cursor=doc, source=name, mix=version
                        )
                        n += 1
                        if rate > 0 and (ahead := t0 + n / rate - time.perf_counter()) > 0:
                            await anyio.sleep(ahead)
                if last is not None:
                    break
        return tuple([name for name in sources if name not in gone and await aheads[name].more()])
    finally:
        with anyio.CancelScope(shield=True):  # every source stopped, even when stopping one fails
            failed: BaseException | None = None
            for name, it in its.items():
                stop = aheads[name].stop if name in aheads else getattr(it, "close", None)
                try:
                    if stop is not None:
                        await anyio.to_thread.run_sync(stop)
                except BaseException as e:
                    failed = failed or e
            if failed is not None:
                raise failed


async def _feed(p: Producer, it: Iterator[Any], batch: int, rate: float, t0: float) -> int:
    """Put every sample of `it`, `batch` at a time (1, or a global batch for drop_last). The samples held back."""
    held: list[tuple[Any, Any]] = []
    n = 0
    reader = _ReadAhead(it, name="lakestream-source")
    try:
        # Waiting, take what completes the open global batch at once (it is sealed no sooner), not
        # a sample a thread hop: with a slow source (a decode), a hop a sample cost more than the put.
        while (items := await reader.take(max(1, p.global_batch - p.open_samples), gather=FILL_WAIT)) is not None:
            for item in items:
                held.append(item)
                if len(held) < batch:
                    continue
                for sample, cursor in held:
                    await p.put(sample, cursor=cursor)
                    n += 1
                    if rate > 0 and (ahead := t0 + n / rate - time.perf_counter()) > 0:
                        await anyio.sleep(ahead)
                held = []
    finally:
        with anyio.CancelScope(shield=True):  # stop a transform's worker processes with the pipeline
            await anyio.to_thread.run_sync(reader.stop)
    return len(held)


READ_AHEAD = 32
"""The most samples a source is read ahead of the samples the producer has taken from it."""

GATHER = 0.002
"""Seconds the producer, once a sample is ready after it had to wait, waits for more of them to take
at once (up to READ_AHEAD): one wait in a thread for several samples of a source a little slower
than the producer, a sample of a slow one delayed by this much at most."""

FILL_WAIT = 0.25
"""Seconds a producer's feed, once a sample is ready after it had to wait, waits for the rest of
its open global batch (which is sealed no sooner) to take them at once."""


STOP_GRACE = 0.2  # seconds a stopping source may take to finish the sample it reads before it is aborted


class _ReadAhead:
    """Reads (sample, cursor) pairs from an iterator in a thread of its own, up to `limit` ahead.

    Why: pulling each sample through its own thread hop (`to_thread.run_sync(next, it)`) costs
    60-125 µs a sample, more than most sources take to read one. Here the thread reads while the
    event loop puts, and the event loop takes every pair that is ready at once (`take`), waiting in
    a thread only when none is, then for up to GATHER seconds more to take several. A slow source is
    never waited on for more than one sample.

    Exactly once: reading ahead advances no cursor, since a cursor is committed only with a sample
    that was put. Pairs read ahead and not taken when the run stops are dropped here and read again
    by the next run, which starts from the committed cursor. An error of the iterator is raised by
    `take` in its place, after every pair read before it was taken. The iterator is run and closed
    (`stop`) only in the reading thread.
    """

    def __init__(self, it: Iterator[Any], *, limit: int | None = None, name: str = "lakestream-source") -> None:
        limit = READ_AHEAD if limit is None else limit
        if limit < 1:
            raise ValueError(f"read-ahead limit {limit}: expected >= 1")
        self._it = it
        self._limit = limit
        self._items: collections.deque[Any] = collections.deque()
        self._cond = threading.Condition()
        self._error: BaseException | None = None  # what the iterator raised, once the pairs before it are taken
        self._close_error: BaseException | None = None
        self._done = False  # the thread reads no more: the iterator ended, failed, or was stopped
        self._want = 0  # the pairs `take` waits for (0: it does not wait)
        self._stopping = False
        self._thread = threading.Thread(target=self._read, name=name, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        it, cond, items = self._it, self._cond, self._items
        try:
            while True:
                with cond:
                    while len(items) >= self._limit and not self._stopping:
                        cond.wait()
                    if self._stopping:
                        return
                try:
                    item = next(it)
                except StopIteration:
                    return
                except BaseException as e:
                    with cond:
                        self._error = e
                    return
                with cond:
                    items.append(item)
                    if self._want and len(items) >= self._want:
                        cond.notify_all()
        finally:
            try:
                if (close := getattr(it, "close", None)) is not None:
                    close()  # a transform stops its worker processes
            except BaseException as e:
                self._close_error = e
            finally:
                with cond:
                    self._done = True
                    cond.notify_all()

    def _ready(self, most: int) -> list[Any] | None:
        """Up to `most` pairs read, [] when none is yet; None at the end. Raises the iterator's error."""
        with self._cond:
            if self._items:
                k = min(most, len(self._items))
                out = [self._items.popleft() for _ in range(k)]
                self._cond.notify_all()
                return out
            if not self._done:
                return []
            if self._error is not None:
                raise self._error
            return None

    def _wait(self, want: int, gather: float = GATHER) -> None:
        """Until a pair is ready (or the reading ended), then until `want` are or `gather` seconds passed."""
        cond, items = self._cond, self._items
        with cond:
            self._want = 1
            while not items and not self._done:
                cond.wait()
            self._want = want
            deadline = time.monotonic() + gather
            while len(items) < want and not self._done and (left := deadline - time.monotonic()) > 0:
                cond.wait(left)
            self._want = 0

    async def take(self, most: int = 1 << 30, *, gather: float = GATHER) -> list[Any] | None:
        """The next pairs read, at least one and at most `most`, waiting for one if none is ready yet
        and then up to `gather` seconds for `most`; None once the iterator ended. Raises the
        iterator's error once the pairs before it are taken."""
        out = self._ready(most)
        if out == []:
            await anyio.to_thread.run_sync(self._wait, min(most, self._limit), gather, abandon_on_cancel=True)
            out = self._ready(most)
        return out

    async def more(self) -> bool:
        """Whether a pair is left to take, waiting for one if none is read yet (True too if the
        iterator failed before its end)."""
        await anyio.to_thread.run_sync(self._wait, 1, abandon_on_cancel=True)
        with self._cond:
            return bool(self._items) or self._error is not None

    def stop(self) -> None:
        """Read no more, wait for the sample being read, close the iterator (blocks: run it in a thread).
        Raises what closing the iterator raised."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(STOP_GRACE)
        if self._thread.is_alive() and (abort := getattr(self._it, "abort", None)) is not None:
            abort()  # a transform stuck in its function: kill its workers (what they were doing is not wanted)
        self._thread.join()
        if self._close_error is not None:
            raise self._close_error
