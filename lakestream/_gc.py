"""Garbage collection: list, plan, execute. The plan is a pure function (`plan_gc`).

In this order, so that nothing readable is ever deleted:

1. a `reclaim` record (`_decisions.reclaim`): steps below the watermark leave the manifest
   (readers asking for one get StepUnavailable naming the step and the watermark);
2. segments no retained step, held leftover nor retained skipped TGB (`State.skipped`) references, if they can never be committed: their producer's
   committed `seq` is at least theirs (reclaimed, discarded by a rewind, or superseded), or their
   epoch is fenced; other unreferenced segments (uploads whose commit may still be on its way) only
   once both they and their producer's last record are older than the orphan grace. The state is
   read to the log's tail after the listing, so a segment committed before the listing is in it,
   and one committed later was younger than `_decisions.MAX_UPLOAD_AGE` then, well within the grace;
3. log versions and snapshots below a snapshot whose log record is older than the lease (see
   `_manifest` for why this cannot resurrect a version), snapshots first, then the hint, then the
   log in ascending order, keeping version 0 (the create record).

GC acts only on a state it could check: if loading skipped a bad snapshot, if a snapshot differs
from the replay of the retained log (`Manifest.audit_snapshots`), or if the snapshot that log
clean-up would keep (or the hint would name) fails its checks, it raises CorruptData naming it and
deletes nothing based on it. A full store (StoreFull) does not stop it: it deletes what needs no
record first (the segments below the watermark), then writes.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ParamSpec

import orjson

from . import _decisions as decisions
from . import _hooks
from ._errors import CorruptData, ObjectNotFound, StoreFull
from ._layout import (
    HINT_KEY,
    LOG_PREFIX,
    SEGMENTS_PREFIX,
    SNAPSHOT_PREFIX,
    log_key,
    parse_segment_key,
    snapshot_key,
    version_of,
)
from ._manifest import Manifest
from ._records import RecordError, decode_record
from ._retry import retry
from ._state import State
from ._store import ObjectStore

__all__ = ["MIN_ORPHAN_GRACE", "GcPlan", "GcReport", "Progress", "gc", "plan_gc", "plan_segments"]

MIN_ORPHAN_GRACE = 300.0  # seconds; see `gc`
Progress = Callable[[str, int, int], None]  # (what, done, total), called as deletions go


# -- the plan: pure ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SegmentPlan:
    delete: dict[str, int]  # key -> listed size
    kept_uploads: int  # unreferenced uploads younger than the grace


def plan_segments(state: State, segments: Mapping[str, int], *, below: int, now: float, grace: float) -> SegmentPlan:
    """Which listed `segments` (key -> size) may go, with steps below `below` taken as reclaimed.

    Never one that a step from `below` on references or a held leftover, nor one that can still be committed (its
    producer's current epoch, a sequence number above the committed one) unless both it and its
    producer's last record are older than `grace`. Keys that are not segment keys are left alone.
    """
    referenced = {s.segment for s in state.steps if s.step >= below} | {h.ref.segment for h in state.leftovers.values()}
    referenced |= {k.step.segment for k in state.skipped if k.at >= below}  # a replay's skipped TGBs, to inspect
    delete: dict[str, int] = {}
    kept = 0
    for key, size in segments.items():
        parsed = parse_segment_key(key)
        if key in referenced or parsed is None:
            continue
        producer, epoch, seq, uploaded = parsed
        p = state.producers.get(producer)
        dead = p is not None and (seq <= p.seq or epoch < p.epoch)  # can never be committed now
        # Otherwise it may be an upload whose commit is on its way: a live producer commits, or
        # registers again, well within the grace; a producer gone for good stops doing either.
        last_seen = p.last_ts if p is not None else 0.0
        if not dead and now - max(uploaded, last_seen) < grace:
            kept += 1
            continue
        delete[key] = size
    return SegmentPlan(delete, kept)


@dataclass(frozen=True, slots=True)
class LogPlan:
    write_snapshot: bool  # snapshot the current state first (none is recent enough)
    snapshots: list[int]  # versions whose snapshots to delete
    log_versions: list[int]  # log versions to delete, ascending
    hint: int | None  # the snapshot the hint then names (None: leave the hint)
    horizon: int | None  # the snapshot below which the log goes


def plan_log(
    state: State, snapshots: Sequence[int], log_versions: Sequence[int], snapshot_times: Mapping[int, float],
    *, now: float, lease: float,
) -> LogPlan:  # fmt: skip
    """Log versions and snapshots below the newest snapshot whose log record is older than `lease`.

    `snapshot_times` holds the time of the log record at each listed snapshot's version (missing:
    unknown, so not old). Version 0 and the snapshots from the horizon on are never in the plan.
    """
    assert state.config is not None
    listed = sorted(snapshots)
    write = not listed or listed[-1] < state.version - state.config.snapshot_every // 2
    horizon = next((v for v in reversed(listed) if now - snapshot_times.get(v, now) > lease), None)
    if horizon is None:
        return LogPlan(write, [], [], None, None)
    newest = state.version if write else listed[-1]
    old_snapshots = [v for v in listed if v < horizon]
    old_log = sorted(v for v in log_versions if 0 < v < horizon)
    return LogPlan(write, old_snapshots, old_log, newest, horizon)


@dataclass(frozen=True, slots=True)
class GcPlan:
    reclaim_below: int | None  # the watermark (or a fork's hold), if steps below it are to be reclaimed
    segments: SegmentPlan
    log: LogPlan


def plan_gc(
    state: State, segments: Mapping[str, int], snapshots: Sequence[int], log_versions: Sequence[int],
    snapshot_times: Mapping[int, float], *, now: float, grace: float, lease: float,
) -> GcPlan:  # fmt: skip
    """The whole plan on one state and listing: what a dry run reports (`gc` executes it in
    steps, planning segments again on the state after its reclaim record)."""
    below = max(state.reclaimable, state.first_step)
    return GcPlan(
        below if below > state.first_step else None,
        plan_segments(state, segments, below=below, now=now, grace=grace),
        plan_log(state, snapshots, log_versions, snapshot_times, now=now, lease=lease),
    )


# -- the report ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class GcReport:
    url: str
    dry_run: bool
    reclaimed_below: int | None = None
    segments_deleted: int = 0  # every segment deleted: of reclaimed steps and orphans
    bytes_freed: int = 0  # their bytes and the temporary files', as the store listed them
    orphans_kept: int = 0
    temporaries_deleted: int = 0  # files of interrupted puts (file:// stores)
    log_versions_deleted: int = 0
    snapshots_deleted: int = 0
    deleted: list[str] = field(default_factory=list)

    def summary(self) -> str:
        would = "would " if self.dry_run else ""
        below = "nothing" if self.reclaimed_below is None else f"steps below {self.reclaimed_below}"
        temporaries = f", {self.temporaries_deleted} temporary files" if self.temporaries_deleted else ""
        return (
            f"gc {self.url}: {would}reclaim {below}; {would}delete {self.segments_deleted} segments "
            f"({self.orphans_kept} recent uploads kept){temporaries}, {self.log_versions_deleted} log versions, "
            f"{self.snapshots_deleted} snapshots; {would}free {self.bytes_freed / 1e6:.1f} MB"
        )

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}

    def add(self, plan: SegmentPlan) -> None:
        self.segments_deleted += len(plan.delete)
        self.bytes_freed += sum(plan.delete.values())
        self.orphans_kept = plan.kept_uploads
        self.deleted.extend(plan.delete)


# -- execution: list, plan, execute -------------------------------------------------------------------


def _no_progress(what: str, done: int, total: int) -> None:
    pass


async def _delete(store: ObjectStore, keys: list[str], what: str, progress: Progress) -> None:
    for i in range(0, len(keys), 1000):
        batch = keys[i : i + 1000]
        await retry(lambda: store.delete(batch))
        progress(what, min(i + 1000, len(keys)), len(keys))


async def _segments(m: Manifest, report: GcReport, progress: Progress, *, below: int, now: float, grace: float) -> None:
    """Delete the segments `plan_segments` gives up, planned on the log as it is after the listing:
    a segment committed before the listing is referenced, and one committed after it was young
    when committed (`_decisions.stale`), so younger than the grace."""
    store = m.store
    listed = await retry(lambda: store.list_sizes(SEGMENTS_PREFIX))
    await retry(m.refresh)
    plan = plan_segments(m.state, listed, below=max(below, m.state.first_step), now=now, grace=grace)
    report.add(plan)
    if not report.dry_run:
        await _delete(store, list(plan.delete), "segments", progress)


async def _snapshot_times(store: ObjectStore, versions: Sequence[int], now: float, lease: float) -> dict[int, float]:
    """The time of the log record at each snapshot's version, newest first, down to the first
    that is older than the lease (the horizon: nothing below it is needed)."""
    times: dict[int, float] = {}
    for v in sorted(versions, reverse=True):
        try:
            ts = decode_record(await retry(lambda: store.get(log_key(v)))).ts
        except (RecordError, ObjectNotFound):
            continue
        if ts:  # no time: unknown, so not old
            times[v] = ts
            if now - ts > lease:
                break
    return times


P = ParamSpec("P")


def _counted(fn: Callable[P, Awaitable[GcReport]]) -> Callable[P, Coroutine[Any, Any, GcReport]]:
    """`fn`, with each report it returns counted in the GC metrics."""

    @functools.wraps(fn)
    async def run(*args: P.args, **kwargs: P.kwargs) -> GcReport:
        report = await fn(*args, **kwargs)
        _hooks.gc_done(report)
        return report

    return run


@_counted
async def gc(
    store: ObjectStore,
    *,
    dry_run: bool = False,
    orphan_grace: float = 3600.0,
    force_grace: bool = False,
    lease: float = 600.0,
    progress: Progress | None = None,
    now: Callable[[], float] = time.time,
) -> GcReport:
    """Reclaim steps below the watermark and delete what nothing can need any more.

    `orphan_grace` is how old an unreferenced upload of a live producer must be before it goes;
    below MIN_ORPHAN_GRACE it is refused unless `force_grace` says no producer is running (a commit
    may name an upload up to `_decisions.MAX_UPLOAD_AGE` old, and its put may be in flight a while;
    producers upload again what waits half as long). `progress(what, done,
    total)` is called as deletions go (the CLI draws a bar with it).
    """
    if not isinstance(orphan_grace, (int, float)) or not orphan_grace >= 0:
        raise ValueError(f"orphan grace must be a non-negative number of seconds, got {orphan_grace!r}")
    if orphan_grace < MIN_ORPHAN_GRACE and not force_grace:
        raise ValueError(
            f"orphan grace {orphan_grace:g} s is below the safe floor of {MIN_ORPHAN_GRACE:g} s: a running "
            "producer's upload may wait that long for its commit; force it only when no producer is running"
        )
    show = progress or _no_progress
    report = GcReport(store.url, dry_run)
    m = Manifest(store, lease=lease)
    state = await m.load()
    if m.problems:
        raise CorruptData(
            f"{store.url}: gc refuses to run while a snapshot fails its checks ({'; '.join(m.problems)}); "
            "readers use an older snapshot or the log meanwhile; delete the bad snapshot to let gc run again"
        )
    # Snapshots pass cheap checks on load; what segments may go is decided only on one that the
    # retained log, replayed, confirms (O(retained log) GETs: log clean-up keeps it short).
    if audit := await m.audit_snapshots():
        raise CorruptData(f"{store.url}: gc refuses to run: {'; '.join(audit)}; delete the bad snapshot")

    remove_temporaries = getattr(store, "remove_temporaries", None)
    if remove_temporaries is not None and not dry_run:
        report.temporaries_deleted, report.bytes_freed = await remove_temporaries(orphan_grace)

    # 1. the reclaim record first: after it, nothing below the watermark is readable
    below = state.first_step
    if (record := decisions.reclaim(state, now())) is not None:
        report.reclaimed_below = below = record.below
        if not dry_run:
            try:
                await m.append(lambda st, _: decisions.reclaim(st, now()))
            except StoreFull:
                # Nothing can be written: free what needs no record first, then write it. Steps
                # below the watermark are needed by no retained checkpoint, and a reader that asks
                # for one meanwhile is told it was reclaimed (StepUnavailable), as after the record.
                await _segments(m, report, show, below=below, now=now(), grace=orphan_grace)
                await m.append(lambda st, _: decisions.reclaim(st, now()))
            state = m.state
            below = state.first_step

    # 2. segments, on the state after the reclaim (a dry run: as if it had landed)
    await _segments(m, report, show, below=below, now=now(), grace=orphan_grace)

    # 3. log versions and snapshots
    snapshots = [v for k in await retry(lambda: store.list(SNAPSHOT_PREFIX)) if (v := version_of(k)) is not None]
    logs = [v for k in await retry(lambda: store.list(LOG_PREFIX)) if (v := version_of(k)) is not None]
    t = now()
    times = await _snapshot_times(store, snapshots, t, lease)
    plan = plan_log(m.state, snapshots, logs, times, now=t, lease=lease)
    newest = max(snapshots, default=None)
    if plan.write_snapshot and not dry_run:
        data = m.state.copy().to_json()
        try:
            await retry(lambda: m.write_snapshot(data, m.state.version))
            newest = plan.hint
        except StoreFull:
            pass  # a snapshot saves readers time, never data: the hint keeps naming an older one
    if plan.horizon is None or newest is None:
        return report
    try:  # never delete the log below a snapshot that fails its checks, nor point the hint at one
        for kept in sorted({plan.horizon, newest}):
            await m.read_snapshot(kept)
    except ObjectNotFound:
        return report  # deleted meanwhile (by another gc): the clean-up is its business
    except CorruptData as e:
        raise CorruptData(f"{e}; gc refuses to delete the log below it (delete the bad snapshot)") from None
    report.snapshots_deleted, report.log_versions_deleted = len(plan.snapshots), len(plan.log_versions)
    if not dry_run:
        await _delete(store, [snapshot_key(v) for v in plan.snapshots], "snapshots", show)
        hint = orjson.dumps({"version": newest})
        await retry(lambda: store.put(HINT_KEY, hint))
        await _delete(store, [log_key(v) for v in plan.log_versions], "log versions", show)
    return report
