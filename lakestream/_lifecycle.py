"""Checkpoint-aligned lifecycle: checkpoints, release and rewind (garbage collection: `_gc`); the
end of a stream (close, reopen) and its deletion.

Data lives until no retained checkpoint needs it. Rank 0 records a checkpoint (id, step) once the
trainer's own checkpoint at that step is durable; the stream keeps the newest `keep_checkpoints`;
the watermark is the oldest retained checkpoint's step. Every step from the watermark on stays
readable, so the trainer can restore any retained checkpoint and replay exactly.

Each operation is one decision (`_decisions`) appended by `Manifest.append`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import anyio

from . import _decisions as decisions
from ._errors import ConfigMismatch, ObjectNotFound, StreamInUse, StreamNotFound
from ._layout import LOG_PREFIX, SEGMENTS_PREFIX, consumed_key, log_key, version_of
from ._manifest import Manifest
from ._records import MAIN_JOB, CloseRecord, CreateRecord, ForkBase, encode_record
from ._retry import retry
from ._state import State
from ._store import ObjectStore, open_store

__all__ = [
    "checkpoint", "close", "close_when_done", "delete", "fork", "jobs", "mix", "release", "reopen", "reshape",
    "retire_job", "rewind", "unfork",
]  # fmt: skip

JOB_LIVE = 60.0  # seconds: a job whose consumption mark is older is not live (a rewind does not wait for it)
LIVE_WITHIN = 120.0  # seconds: a producer that wrote a record this lately is live (`delete` refuses)
DELETE_BATCH = 1000  # keys a delete request names (S3's DeleteObjects limit)


async def checkpoint(
    store: ObjectStore,
    checkpoint_id: str,
    step: int,
    *,
    manifest: Manifest | None = None,
    wall: Callable[[], float] = time.time,
    job: str = MAIN_JOB,
) -> bool:
    """Record that training job `job`'s checkpoint `checkpoint_id` at `step` is durable.

    `manifest`: a view of the stream that is followed already (a reader's): it is caught up and
    appended to, instead of loading the log afresh. A throttled or unreachable store is retried
    for as long as it takes, as every reader does.

    True if recorded, False if it already was (same id and step). Raises ConfigMismatch for the same
    id at another step, StepUnavailable for a step that is not committed or not retained, and
    ValueError for a step older than the newest checkpoint (`_decisions.checkpoint`).
    """
    m = manifest
    if m is None:
        m = Manifest(store, retries=None)
        await m.load()
    else:
        await m.refresh()
    result = await m.append(lambda st, _: decisions.checkpoint(st, checkpoint_id, step, wall(), store.url, job))
    return result.version is not None


async def release(
    store: ObjectStore, checkpoint_id: str, *, job: str = MAIN_JOB, wall: Callable[[], float] = time.time
) -> bool:
    """Drop a retained checkpoint of job `job`; True if it was retained."""
    m = Manifest(store)
    await m.load()
    result = await m.append(lambda st, _: decisions.release(st, checkpoint_id, wall(), job))
    return result.version is not None


async def retire_job(store: ObjectStore, job: str, *, wall: Callable[[], float] = time.time) -> bool:
    """Forget training job `job`: its checkpoints are dropped (GC may reclaim what only they kept)
    and back-pressure no longer counts its consumption mark. True if it was known."""
    m = Manifest(store)
    await m.load()
    result = await m.append(lambda st, _: decisions.job(st, job, wall(), retire=True, url=store.url))
    if result.version is not None:
        with contextlib.suppress(ObjectNotFound):
            await retry(lambda: store.delete([consumed_key(job)]))
    return result.version is not None


async def jobs(store: ObjectStore, state: State) -> list[tuple[str, int | None, float | None]]:
    """(job, step its mark says it consumed last, when it published it) of every job of the stream."""
    m = Manifest(store)
    out: list[tuple[str, int | None, float | None]] = []
    for job in [MAIN_JOB, *state.jobs]:
        mark = await retry(lambda job=job: m.read_mark(job))  # type: ignore[misc]
        out.append((job, None, None) if mark is None else (job, *mark))
    return out


async def rewind(
    store: ObjectStore,
    *,
    to_checkpoint: str | None = None,
    to_step: int | None = None,
    skip: tuple[tuple[int, int], ...] = (),
    job: str = MAIN_JOB,
    live_within: float = JOB_LIVE,
    wall: Callable[[], float] = time.time,
) -> State:
    """Discard every step after a checkpoint's step (or `to_step`) and fence every producer.

    Each producer's resume cursor becomes its cursor as of that step, so producers started again
    re-produce the source records after it into new steps. With `skip` (ranges of steps after it,
    first and last inclusive) the steps after it are replayed instead, but the skipped ones: their
    TGBs become the next steps again, by reference, and producers continue where they were (see
    `State`). `to_checkpoint` names a checkpoint of job `job`. Refuses (ConfigMismatch) while
    another job of the stream is live (published its consumption mark within `live_within` s):
    the rewind would change the steps it reads. Returns the new state.
    """
    if (to_checkpoint is None) == (to_step is None):
        raise ValueError("rewind needs exactly one of to_checkpoint and to_step")
    m = Manifest(store)
    state = await m.load()
    before = state.rewinds
    now = wall()
    live = [
        (j, step) for j, step, ts in await jobs(store, state) if j != job and ts is not None and now - ts < live_within
    ]
    if live:
        names = ", ".join(f"{j!r} (at step {step})" for j, step in live)
        raise ConfigMismatch(
            f"{store.url}: job{'s' if len(live) > 1 else ''} {names} read{'' if len(live) > 1 else 's'} this stream "
            f"too: a rewind would change its steps; stop it and retire it (`lakestream job URL --retire NAME`) first"
        )
    await m.append(
        lambda st, _: decisions.rewind(
            st,
            to_checkpoint=to_checkpoint,
            to_step=to_step,
            rewinds_before=before,
            now=wall(),
            url=store.url,
            skip=skip,
            job=job,
        )  # fmt: skip
    )
    return m.state


async def close(store: ObjectStore, *, after_step: int | None = None, wall: Callable[[], float] = time.time) -> State:
    """End the stream after `after_step` (None: the head as the record lands): no step past it is
    committed, and readers end once they read it (`_decisions.close`). Returns the new state."""
    m = Manifest(store)
    await m.load()
    await m.append(lambda st, _: decisions.close(st, after_step, wall(), store.url))
    return m.state


async def close_when_done(
    store: ObjectStore,
    *,
    waiting: Callable[[list[str]], None] | None = None,
    poll: tuple[float, float] = (0.05, 2.0),
    wall: Callable[[], float] = time.time,
) -> State:
    """Close the stream after its head once every producer of it has finished (a `finish` record
    since it last registered) and their held leftovers are packed into the short last step: the
    end of a finite dataset. Until then it follows the log (polling from `poll[0]` up to `poll[1]`
    seconds), calling `waiting(producers)` whenever the producers still producing change (an empty
    list: leftovers wait to be packed). The close is decided on the state its record follows, so it
    never lands while a producer may still commit, nor before a step committed meanwhile; of
    several callers, one appends it. Returns the state with the close (the same if the stream was
    closed already, perhaps after a later step)."""
    m = Manifest(store, retries=None)  # a store outage is waited out, as producers do
    await m.load()

    def decide(st: State, _: int) -> CloseRecord | None:
        if st.closed_after is not None or st.unfinished() or st.leftovers:
            return None
        return decisions.close(st, None, wall(), store.url)

    delay, version, shown = poll[0], m.state.version, None
    while True:
        await m.append(decide, fresh=True)
        st = m.state
        if st.closed_after is not None:
            return st
        busy = st.unfinished()
        if waiting is not None and busy != shown:
            waiting(busy)
        shown = busy
        delay = poll[0] if st.version != version else min(delay * 2, poll[1])
        version = st.version
        await anyio.sleep(delay)


async def reopen(store: ObjectStore, *, wall: Callable[[], float] = time.time) -> State:
    """Undo a close: steps may be committed past it again. Returns the new state."""
    m = Manifest(store)
    await m.load()
    await m.append(lambda st, _: decisions.reopen(st, wall()))
    return m.state


async def reshape(
    store: ObjectStore,
    world_size: int,
    *,
    global_batch: int | None = None,
    from_step: int | None = None,
    wall: Callable[[], float] = time.time,
) -> State:
    """From `from_step` (None: the step after the head) read steps as `world_size` ranks of
    `global_batch` samples (`_decisions.reshape`). Returns the new state (unchanged when that shape
    was already recorded from that step)."""
    m = Manifest(store)
    await m.load()
    await m.append(
        lambda st, _: decisions.reshape(
            st, world_size, global_batch=global_batch, from_step=from_step, now=wall(), url=store.url
        )
    )
    return m.state


async def mix(
    store: ObjectStore,
    weights: list[tuple[str, float]] | None,
    *,
    from_step: int | None = None,
    wall: Callable[[], float] = time.time,
) -> State:
    """From `from_step` (None: the step after the head) every TGB holds each named source's share
    of the global batch by `weights`, or none with `weights` None (`_decisions.mix`). Returns the
    new state."""
    m = Manifest(store)
    await m.load()
    await m.append(lambda st, _: decisions.mix(st, weights, from_step=from_step, now=wall(), url=store.url))
    return m.state


async def delete(
    store: ObjectStore,
    *,
    dry_run: bool = False,
    live_within: float = LIVE_WITHIN,
    wall: Callable[[], float] = time.time,
) -> tuple[int, int]:
    """Delete every object of the stream; (objects, bytes) it held. With `dry_run`, delete nothing.

    Refuses (StreamInUse) while a producer that has not finished wrote a record within
    `live_within` seconds, a training job published its consumption mark within JOB_LIVE seconds,
    or forks read its steps. In this order, so that what is left at any moment (a delete cut short)
    is a valid stream, an older one, whose segments are all there, and running it again finishes:
    snapshots, hints, intents and everything else outside the log and the segments first, then the
    log from its newest version down to version 0 (the stream is gone then: StreamNotFound), then
    the segments.
    """
    state: State | None = None
    try:
        state = await Manifest(store).load()
    except StreamNotFound:
        pass  # what a delete cut short after version 0 left: the rest goes
    if state is not None and state.forks:
        names = ", ".join(f.url for f in state.forks[:3]) + (" …" if len(state.forks) > 3 else "")
        raise StreamInUse(f"{store.url}: forks read its steps ({names}): unfork or delete them first")
    if state is not None and not dry_run:
        now = wall()
        live = sorted(pid for pid, p in state.producers.items()
                      if p.token and not p.finished and now - p.last_ts < live_within)  # fmt: skip
        if live:
            raise StreamInUse(
                f"{store.url}: producers {', '.join(live[:5])}{' …' if len(live) > 5 else ''} wrote records in the "
                f"last {live_within:.0f} s: stop them first (or wait), then delete"
            )
        reading = [(j, ts) for j, _, ts in await jobs(store, state) if ts is not None and now - ts < JOB_LIVE]
        if reading:
            names = ", ".join(f"{j!r} ({now - ts:.0f} s ago)" for j, ts in reading[:5])
            raise StreamInUse(
                f"{store.url}: training jobs read it within the last {JOB_LIVE:.0f} s: {names}; stop their readers "
                "first (or wait), then delete"
            )
        if state.base is not None:  # a fork: its source need not keep what it shares with it
            await _release_fork(state.base.source, store.url, wall)
    sizes = await retry(lambda: store.list_sizes(""))
    if dry_run:
        return len(sizes), sum(sizes.values())
    log = sorted((k for k in sizes if k.startswith(LOG_PREFIX)), key=lambda k: version_of(k) or 0, reverse=True)
    segments = [k for k in sizes if k.startswith(SEGMENTS_PREFIX)]
    rest = [k for k in sizes if not k.startswith((LOG_PREFIX, SEGMENTS_PREFIX))]
    for keys in (rest, log, segments):
        for i in range(0, len(keys), DELETE_BATCH):
            batch = keys[i : i + DELETE_BATCH]
            await retry(lambda batch=batch: store.delete(batch))  # type: ignore[misc]
    return len(sizes), sum(sizes.values())


async def fork(
    source: ObjectStore, target: ObjectStore, *, at_step: int, wall: Callable[[], float] = time.time
) -> State:
    """Make the stream at `target` a fork of `source` at `at_step`: its steps below `at_step` are
    the source's, by reference (no byte is copied), and what follows is its own, from producers that
    resume from the source's cursors there. Returns the fork's state.

    First the source records the fork (from then on it keeps those steps and refuses a rewind or a
    new global batch that would change them), then the fork's version 0 is written. Running it
    again after it was cut short finishes it. Raises ConfigMismatch where a stream exists at `target`
    that is not this fork, or the fork is recorded at another step; StepUnavailable for a step
    outside the source's first step .. head + 1; ValueError where one URL lies inside the other.
    """
    a, b = source.url.rstrip("/") + "/", target.url.rstrip("/") + "/"
    if a.startswith(b) or b.startswith(a):
        raise ValueError(f"{target.url}: a fork cannot lie inside its source {source.url} or hold it")
    m = Manifest(source)
    await m.load()
    await m.append(lambda st, _: decisions.fork(st, target.url, at_step, wall(), source.url))
    state = m.state
    config = state.config
    assert config is not None
    record = CreateRecord(config, wall(), ForkBase(source.url, at_step, state.fork_at(at_step).to_dict()))
    if not await retry(lambda: target.put_if_absent(log_key(0), encode_record(record))):
        have = await Manifest(target).load()
        if have.base is None or (have.base.source, have.base.at_step) != (source.url, at_step):
            raise ConfigMismatch(f"{target.url}: a stream exists here that is not a fork of {source.url} at {at_step}")
    return await Manifest(target).load()


async def unfork(target: ObjectStore, *, wall: Callable[[], float] = time.time) -> State:
    """Make the fork at `target` a stream of its own: the steps it shares with its source leave its
    manifest (as reclaimed), then the source no longer keeps them for it. Returns the fork's state.
    Running it again after it was cut short finishes it. Raises ConfigMismatch if `target` is not a fork."""
    m = Manifest(target)
    state = await m.load()
    if state.base is None:
        raise ConfigMismatch(f"{target.url}: not a fork")
    await m.append(lambda st, _: decisions.detach(st, wall()))
    await _release_fork(state.base.source, target.url, wall)
    return m.state


async def _release_fork(source_url: str, url: str, wall: Callable[[], float]) -> None:
    """The source at `source_url` no longer keeps steps for the fork at `url` (nothing if it is gone)."""
    async with open_store(source_url) as source:
        m = Manifest(source)
        try:
            await m.load()
        except StreamNotFound:
            return
        await m.append(lambda st, _: decisions.unfork(st, url, wall()))
