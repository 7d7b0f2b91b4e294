"""Lakestream: transactional global batches on object storage.

    await lakestream.create(url, world_size=8, global_batch=1024)
    async with lakestream.open_producer(url, "tokenizer-0") as p:
        async for record in source(start=p.cursor):
            await p.put({"__key__": record.id, "txt": record.text}, cursor=record.position)
    async with lakestream.open_reader(url, rank=3) as r:
        async for batch in r.steps(start=0):
            ...

See docs/ for the guarantees and the commit protocol.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from . import _hooks
from ._errors import (
    AccessDenied,
    BucketNotFound,
    ConfigMismatch,
    CorruptData,
    InvalidSample,
    LakestreamError,
    MixChanged,
    ObjectNotFound,
    ProducerFenced,
    SegmentLost,
    StepUnavailable,
    StoreError,
    StoreFull,
    StoreUnavailable,
    StreamClosed,
    StreamInUse,
    StreamNotFound,
)
from ._gc import GcReport
from ._gc import gc as _gc
from ._lifecycle import checkpoint as _checkpoint
from ._lifecycle import close as _close
from ._lifecycle import close_when_done as _close_when_done
from ._lifecycle import delete as _delete
from ._lifecycle import fork as _fork
from ._lifecycle import mix as _mix
from ._lifecycle import release as _release
from ._lifecycle import reopen as _reopen
from ._lifecycle import reshape as _reshape
from ._lifecycle import retire_job as _retire_job
from ._lifecycle import rewind as _rewind
from ._lifecycle import unfork as _unfork
from ._manifest import Manifest, create_stream
from ._pacing import BackoffPolicy, CommitPolicy, DacPolicy, EagerPolicy, IntervalPolicy
from ._pipeline import ProduceReport, produce
from ._producer import Producer, ProducerStats
from ._reader import RankBatch, RawSlice, Reader
from ._segment import FieldRef
from ._state import Config, State, Step
from ._store import ObjectStore, open_source_store, open_store
from ._verify import VerifyReport, verify_state

__version__ = "0.1.0"

__all__ = [
    "AccessDenied",
    "BackoffPolicy",
    "BucketNotFound",
    "CommitPolicy",
    "Config",
    "ConfigMismatch",
    "CorruptData",
    "DacPolicy",
    "EagerPolicy",
    "FieldRef",
    "GcReport",
    "IntervalPolicy",
    "InvalidSample",
    "LakestreamError",
    "MixChanged",
    "ObjectNotFound",
    "ObjectStore",
    "ProduceReport",
    "Producer",
    "ProducerFenced",
    "ProducerStats",
    "RankBatch",
    "RawSlice",
    "Reader",
    "SegmentLost",
    "State",
    "Step",
    "StepUnavailable",
    "StoreError",
    "StoreFull",
    "StoreUnavailable",
    "StreamClosed",
    "StreamInUse",
    "StreamNotFound",
    "VerifyReport",
    "checkpoint",
    "close",
    "close_when_done",
    "create",
    "delete",
    "fork",
    "gc",
    "load_state",
    "mix",
    "open_producer",
    "open_reader",
    "open_store",
    "produce",
    "release",
    "reopen",
    "reshape",
    "retire_job",
    "rewind",
    "unfork",
    "verify",
]

Target = str | os.PathLike[str] | ObjectStore


@asynccontextmanager
async def _store_for(target: Target) -> AsyncIterator[ObjectStore]:
    if isinstance(target, (str, os.PathLike)):
        async with open_store(target) as store:
            yield store
    else:
        yield target


async def create(target: Target, *, world_size: int, global_batch: int, **options: Any) -> bool:
    """Create a stream (idempotent). True if created, False if it existed with the same config.

    Options: snapshot_every, keep_checkpoints, max_steps_ahead, max_sample_bytes.
    Raises ConfigMismatch if a stream exists with another config, ValueError for bad options.
    """
    config = Config(world_size=world_size, global_batch=global_batch, **options)
    async with _store_for(target) as store:
        return await create_stream(store, config)


async def load_state(target: Target) -> State:
    """The stream's current manifest state. Raises StreamNotFound."""
    async with _store_for(target) as store:
        return await Manifest(store).load()


@asynccontextmanager
async def open_producer(target: Target, producer_id: str, **options: Any) -> AsyncIterator[Producer]:
    """Register a producer (fencing older incarnations of `producer_id`) and yield it.

    Leaving the block normally commits everything put, including a final partial TGB (held back
    while other producers of the stream are producing, packed by the last one to finish); leaving it
    with an exception abandons what was not committed yet. `producer.cursor` is where to resume
    the source. Options: cost (a function of the sample: balance ranks by it), max_inflight_bytes
    (bytes of sealed TGBs not committed yet; one TGB is always let through, so a producer holds at
    most the open global batch plus the larger of this and one TGB: the stream's shape limits,
    global_batch x max_sample_bytes, bound the rest),
    policy (`"dac"` (default), `"eager"`, `"backoff"`, `"interval"` or a CommitPolicy instance),
    gc_interval (seconds: also run `gc` in the background),
    checksum (of each rank slice, named in the commit: `"xxh3-64"` (default) or `"crc32"`).
    """
    async with _store_for(target) as store, Producer(store, producer_id, **options) as producer:
        yield producer


@asynccontextmanager
async def open_reader(
    target: Target, rank: int | None, world_size: int | None = None, **options: Any
) -> AsyncIterator[Reader]:
    """A reader of `rank`'s slices (rank None: any rank, with `fetch_raw`).

    Raises StreamNotFound, ConfigMismatch (world size differs), ValueError (rank out of range).

    Options: prefetch (steps fetched ahead at least; 0: none; from a local file:// store, the next
    step fetched and the others read into the page cache), prefetch_seconds (fetch ahead what the
    consumer takes in this long at its pace; default 1; not from a local file:// store, whose reads
    have no latency to cover), max_prefetch_bytes, poll_interval, verify, raw (fields as stored bytes),
    collate, publish_consumed (publish the trainer's consumption mark, which back-pressure counts
    from; default: rank 0 does), job (the training job whose mark it publishes and whose
    checkpoints `Reader.checkpoint` records; default `main`), follower (a loaded `Manifest` shared by the readers of one node,
    so that the log is read once for all of them).
    """
    async with _store_for(target) as store, Reader(store, rank, world_size, **options) as reader:
        yield reader


async def verify(target: Target, *, progress: Callable[[str, int, int], None] | None = None) -> VerifyReport:
    """Check every invariant and every checksum of a stream, and every snapshot against a replay of the
    retained log; problems name step, rank and object. `progress(what, done, total)` is told of each
    segment checked."""
    async with _store_for(target) as store:
        m = Manifest(store)
        state = await m.load()
        async with contextlib.AsyncExitStack() as stack:
            base = None
            if state.base is not None and state.base.epochs:  # a fork: its shared steps are its source's
                base = await stack.enter_async_context(open_source_store(state.base.source, store.url))
            report = await verify_state(store, state, progress=progress, base=base)
        report.problems[:0] = m.problems + [p for p in await m.audit_snapshots() if p not in m.problems]
        return report


async def checkpoint(target: Target, checkpoint_id: str, step: int, *, job: str = "main") -> bool:
    """Record that the trainer's checkpoint `checkpoint_id` at `step` is durable (rank 0 calls it
    after saving). False if already recorded. Each training job (`job`) has its own checkpoints;
    the newest `keep_checkpoints` of each are retained; the oldest retained one's step, of any job,
    is the watermark. Raises ConfigMismatch (same id, other step), StepUnavailable (step not
    committed or not retained), ValueError (older than the job's newest)."""
    async with _store_for(target) as store:
        return await _checkpoint(store, checkpoint_id, step, job=job)


async def release(target: Target, checkpoint_id: str, *, job: str = "main") -> bool:
    """Drop a retained checkpoint of job `job`; False if it was not retained."""
    async with _store_for(target) as store:
        return await _release(store, checkpoint_id, job=job)


async def retire_job(target: Target, job: str) -> bool:
    """Forget training job `job` (not `main`): its checkpoints are dropped, so GC may reclaim what
    only they kept, and back-pressure no longer counts its consumption mark. False if it was not known."""
    async with _store_for(target) as store:
        return await _retire_job(store, job)


async def rewind(
    target: Target,
    *,
    to_checkpoint: str | None = None,
    to_step: int | None = None,
    skip: Sequence[tuple[int, int]] = (),
    job: str = "main",
) -> State:
    """Discard the steps after a retained checkpoint (or `to_step`) and fence every producer;
    each producer's resume cursor becomes its cursor as of that step. With `skip` (ranges
    (first, last) of steps after it, inclusive): replay the steps after it instead, but the skipped
    ones, whose samples are recorded as skipped; their TGBs become the next steps again (referenced,
    not copied or produced again) and producers continue where they were. `to_checkpoint` names a
    checkpoint of job `job`; ConfigMismatch while another job reads the stream (its consumption mark
    is younger than a minute). Returns the new state."""
    async with _store_for(target) as store:
        return await _rewind(
            store, to_checkpoint=to_checkpoint, to_step=to_step, skip=tuple((a, b) for a, b in skip), job=job
        )


async def close(target: Target, *, after_step: int | None = None) -> State:
    """End the stream after `after_step` (None: the head): no step past it is ever committed, so
    producers stop there (StreamClosed), and readers end once they have read it (`Reader.steps`
    with no stop, `read` without --to-step, StreamDataset with stop None). A later step closes the
    stream once the head reaches it. Raises ValueError for a step before the head, or when it is
    closed after another step. Returns the new state."""
    async with _store_for(target) as store:
        return await _close(store, after_step=after_step)


async def close_when_done(target: Target, *, waiting: Callable[[list[str]], None] | None = None) -> State:
    """Close the stream after its last step once every producer of it has finished its source and
    the short last step, if any, is committed (what `produce --close-when-done` and `fleet --close`
    do); wait, following the log, while producers are still producing (`waiting` is called with
    their ids whenever they change). One close record results however many call it, and it never
    hides a committed step. Returns the state with the close."""
    async with _store_for(target) as store:
        return await _close_when_done(store, waiting=waiting)


async def delete(target: Target, *, dry_run: bool = False) -> tuple[int, int]:
    """Delete every object of the stream (its log, snapshots and segments); returns (objects,
    bytes) it held. Refuses with StreamInUse while producers of it are live (wrote a record in the
    last two minutes), a training job published its consumption mark in the last minute, or forks
    read its steps; a fork's source stops keeping steps for it. A delete cut short leaves a valid, older stream (or none): run it again.
    With `dry_run`, only count."""
    async with _store_for(target) as store:
        return await _delete(store, dry_run=dry_run)


async def fork(source: Target, target: Target, *, at_step: int) -> State:
    """Make a stream at `target` whose steps below `at_step` are those of the stream at `source`
    (referenced, not copied: the source keeps them while the fork reads them, and refuses a rewind
    or a new global batch that would change them) and whose later steps are its own: its producers
    resume from the source's cursors at `at_step`, under its own mixture and shape. Running it
    again finishes one cut short. Raises ConfigMismatch where another stream exists at `target`,
    StepUnavailable for a step outside the source's first step .. head + 1. Returns the fork's state."""
    async with _store_for(source) as a, _store_for(target) as b:
        return await _fork(a, b, at_step=at_step)


async def unfork(target: Target) -> State:
    """Make the fork at `target` a stream of its own: the steps it shares with its source are
    dropped from it (as reclaimed), and the source no longer keeps them for it. Raises
    ConfigMismatch if `target` is not a fork. Returns its state."""
    async with _store_for(target) as store:
        return await _unfork(store)


async def reopen(target: Target) -> State:
    """Undo a close: producers may commit past it again (run them again to continue). Returns the new state."""
    async with _store_for(target) as store:
        return await _reopen(store)


async def reshape(
    target: Target, world_size: int, *, global_batch: int | None = None, from_step: int | None = None
) -> State:
    """Read every step from `from_step` (None: the step after the head) as `world_size` ranks.

    A world-size change discards nothing: steps committed for another world size are re-sliced on
    read, every rank's samples still partition each step and counts differ by at most one. A new
    `global_batch` applies from the step after the head at the latest; the steps from `from_step`
    on are discarded and every producer is fenced, as by a rewind, so they re-produce those
    samples in TGBs of the new size. Restart the trainer with the new shape from a checkpoint
    before `from_step`. Returns the new state.
    """
    async with _store_for(target) as store:
        return await _reshape(store, world_size, global_batch=global_batch, from_step=from_step)


async def mix(target: Target, weights: dict[str, float] | None, *, from_step: int | None = None) -> State:
    """From `from_step` (None: the step after the head; never a committed step) every TGB holds
    each named source's share of the global batch: the largest-remainder rounding of weight x
    global batch. Several mixes with later `from_step`s make a schedule. Producers draw from named
    sources (`produce(url, id, {"web": spec, ...})`). Returns the new state.

    `weights` None clears: from `from_step` on no mixture is in force, as before the first one
    (plain producers commit again; producers of named sources draw equal shares)."""
    async with _store_for(target) as store:
        return await _mix(store, None if weights is None else list(weights.items()), from_step=from_step)


async def gc(target: Target, **options: Any) -> GcReport:
    """Reclaim steps below the watermark, then delete unreferenced segments, old log versions and
    snapshots. Options: dry_run, orphan_grace (seconds, default 3600; at least 300 unless force_grace),
    lease, progress (a callable (what, done, total) called as deletions go)."""
    async with _store_for(target) as store:
        return await _gc(store, **options)


def _load_metrics() -> None:
    """Import `lakestream.metrics`, which installs the Prometheus recorders into the engine's hooks."""
    importlib.import_module("lakestream.metrics")


# prometheus_client costs a quarter of a second of CPU to import: only a process that records pays it.
_hooks.install_on_first_use(_load_metrics)


def __getattr__(name: str) -> Any:
    """`lakestream.metrics` without importing it first, as when `import lakestream` imported it."""
    if name == "metrics":
        return importlib.import_module("lakestream.metrics")
    raise AttributeError(f"module 'lakestream' has no attribute {name!r}")
