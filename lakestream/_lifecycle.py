"""Checkpoint-aligned lifecycle: checkpoints, release, rewind, and garbage collection.

Data lives until no retained checkpoint needs it. Rank 0 records a checkpoint (id, step) once the
trainer's own checkpoint at that step is durable; the stream keeps the newest `keep_checkpoints`;
the watermark is the oldest retained checkpoint's step. Every step from the watermark on stays
readable, so the trainer can restore any retained checkpoint and replay exactly.

GC, in this order, so that nothing readable is ever deleted:

1. commit a `reclaim` record: steps below the watermark leave the manifest (readers asking for one
   get StepUnavailable naming the step and the watermark);
2. delete segments no retained step references, if they can never be committed: their producer's
   committed `seq` is at least theirs (reclaimed, discarded by a rewind, or superseded), or their
   epoch is fenced; other unreferenced segments (uploads whose commit may still be on its way) only
   once they are older than `orphan_grace`;
3. delete log versions and snapshots below a snapshot whose version was committed more than
   `lease` ago (see `_manifest` for why this cannot resurrect a version), snapshots first, keeping
   version 0 (the create record).

GC acts only on a state it could check: if loading skipped a bad snapshot, if a snapshot differs
from the replay of the retained log (`Manifest.audit_snapshots`), or if the snapshot that log
clean-up would keep (or the hint would name) fails its checks, it raises CorruptData naming it and
deletes nothing based on it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from . import _decisions as decisions
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

__all__ = ["MIN_ORPHAN_GRACE", "GcReport", "checkpoint", "gc", "release", "rewind"]


async def checkpoint(
    store: ObjectStore, checkpoint_id: str, step: int, *, wall: Callable[[], float] = time.time
) -> bool:
    """Record that the trainer's checkpoint `checkpoint_id` at `step` is durable.

    True if recorded, False if it already was (same id and step). Raises ConfigMismatch for the same
    id at another step, StepUnavailable for a step that is not committed or not retained, and
    ValueError for a step older than the newest checkpoint (`_decisions.checkpoint`).
    """
    m = Manifest(store)
    await m.load()
    result = await m.append(lambda st, _: decisions.checkpoint(st, checkpoint_id, step, wall(), store.url))
    return result.version is not None


async def release(store: ObjectStore, checkpoint_id: str, *, wall: Callable[[], float] = time.time) -> bool:
    """Drop a retained checkpoint; True if it was retained."""
    m = Manifest(store)
    await m.load()
    result = await m.append(lambda st, _: decisions.release(st, checkpoint_id, wall()))
    return result.version is not None


async def rewind(
    store: ObjectStore,
    *,
    to_checkpoint: str | None = None,
    to_step: int | None = None,
    wall: Callable[[], float] = time.time,
) -> State:
    """Discard every step after a checkpoint's step (or `to_step`) and fence every producer.

    Each producer's resume cursor becomes its cursor as of that step, so producers started again
    re-produce the source records after it into new steps. Returns the new state.
    """
    if (to_checkpoint is None) == (to_step is None):
        raise ValueError("rewind needs exactly one of to_checkpoint and to_step")
    m = Manifest(store)
    before = (await m.load()).rewinds
    await m.append(
        lambda st, _: decisions.rewind(
            st, to_checkpoint=to_checkpoint, to_step=to_step, rewinds_before=before, now=wall(), url=store.url
        )
    )
    return m.state


MIN_ORPHAN_GRACE = 300.0  # seconds; see `gc`


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


class _Progress:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __call__(self, what: str, done: int, total: int) -> None:
        if self.enabled and total:
            width = 30
            fill = width * done // total
            sys.stderr.write(f"\r{what:<18} [{'#' * fill}{'.' * (width - fill)}] {done}/{total}")
            if done == total:
                sys.stderr.write("\n")
            sys.stderr.flush()


async def _delete(store: ObjectStore, keys: list[str], what: str, progress: Callable[[str, int, int], None]) -> None:
    for i in range(0, len(keys), 1000):
        batch = keys[i : i + 1000]
        await retry(lambda: store.delete(batch))
        progress(what, min(i + 1000, len(keys)), len(keys))


async def _reclaim(m: Manifest, now: Callable[[], float]) -> State:
    await m.append(lambda st, _: decisions.reclaim(st, now()))
    return m.state


async def _delete_segments(
    store: ObjectStore,
    state: State,
    first_step: int,
    t: float,
    orphan_grace: float,
    report: GcReport,
    progress: Callable[[str, int, int], None],
) -> None:
    """Delete every listed segment that no step from `first_step` on references and that can
    never be committed, or is an upload older than the grace; add them to `report`."""
    referenced = {s.segment for s in state.steps if s.step >= first_step}
    doomed: dict[str, int] = {}
    for key, size in (await retry(lambda: store.list_sizes(SEGMENTS_PREFIX))).items():
        if key in referenced:
            continue
        parsed = parse_segment_key(key)
        if parsed is None:
            continue
        producer, epoch, seq, uploaded = parsed
        p = state.producers.get(producer)
        dead = p is not None and (seq <= p.seq or epoch < p.epoch)  # can never be committed now
        # Otherwise it may be an upload whose commit is on its way: it goes only once both it and
        # its producer's last record are older than the grace (a live producer commits, or
        # registers again, well within it; a producer gone for good stops doing either).
        last_seen = p.last_ts if p is not None else 0.0
        if not dead and t - max(uploaded, last_seen) < orphan_grace:
            report.orphans_kept += 1
            continue
        doomed[key] = size
    report.segments_deleted += len(doomed)
    report.bytes_freed += sum(doomed.values())
    report.deleted.extend(doomed)
    if not report.dry_run:
        await _delete(store, list(doomed), "segments", progress)


async def gc(
    store: ObjectStore,
    *,
    dry_run: bool = False,
    orphan_grace: float = 3600.0,
    force_grace: bool = False,
    lease: float = 600.0,
    progress: bool | None = None,
    now: Callable[[], float] = time.time,
) -> GcReport:
    """Reclaim steps below the watermark and delete what nothing can need any more.

    `orphan_grace` is how old an unreferenced upload of a live producer must be before it goes;
    below MIN_ORPHAN_GRACE it is refused unless `force_grace` says no producer is running (an
    upload may wait that long for its commit: producers re-check uploads held over a minute, and
    the commit after the re-check must land within the rest of the floor).
    A full store (StoreFull) does not stop GC: it deletes what needs no record first, then writes.
    """
    if not isinstance(orphan_grace, (int, float)) or not orphan_grace >= 0:
        raise ValueError(f"orphan grace must be a non-negative number of seconds, got {orphan_grace!r}")
    if orphan_grace < MIN_ORPHAN_GRACE and not force_grace:
        raise ValueError(
            f"orphan grace {orphan_grace:g} s is below the safe floor of {MIN_ORPHAN_GRACE:g} s: a running "
            "producer's upload may wait that long for its commit; force it only when no producer is running"
        )
    show = _Progress(sys.stderr.isatty() if progress is None else progress)
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

    # 1. the reclaim record comes first: after it, nothing below the watermark is readable
    if state.watermark > state.first_step:
        report.reclaimed_below = state.watermark
        if not dry_run:
            try:
                state = await _reclaim(m, now)
            except StoreFull:
                # Nothing can be written: free what needs no record first, then write it. Steps
                # below the watermark are needed by no retained checkpoint, and a reader that asks
                # for one meanwhile is told it was reclaimed (StepUnavailable), as after the record.
                await _delete_segments(store, state, state.watermark, now(), orphan_grace, report, show)
                state = await _reclaim(m, now)

    # 2. segments: listed after the state was read, so a segment committed meanwhile is either in
    # the state or younger than the grace period
    first_step = report.reclaimed_below if dry_run and report.reclaimed_below is not None else state.first_step
    t = now()
    await _delete_segments(store, state, first_step, t, orphan_grace, report, show)

    # 3. log versions and snapshots below a snapshot committed more than `lease` ago
    listed = await retry(lambda: store.list(SNAPSHOT_PREFIX))
    snapshots = sorted(v for k in listed if (v := version_of(k)) is not None)
    stale = not snapshots or snapshots[-1] < m.state.version - m.state.config.snapshot_every // 2  # type: ignore[union-attr]
    if stale and not dry_run:
        data = m.state.copy().to_json()
        try:
            await retry(lambda: m.write_snapshot(data, m.state.version))
            snapshots.append(m.state.version)
        except StoreFull:
            pass  # a snapshot saves readers time, never data: log clean-up waits for the next run
    horizon = None
    for v in reversed(snapshots):
        try:
            ts = decode_record(await retry(lambda: store.get(log_key(v)))).ts or t  # no time: not old
        except (RecordError, FileNotFoundError):
            continue
        if isinstance(ts, (int, float)) and t - ts > lease:
            horizon = v
            break
    try:
        # never delete the log below a snapshot that fails its checks, nor point the hint at one
        for kept in sorted({horizon, snapshots[-1]}) if horizon is not None else ():
            await m.read_snapshot(kept)
    except ObjectNotFound:
        horizon = None  # deleted meanwhile (by another gc): the clean-up is its business
    except CorruptData as e:
        raise CorruptData(f"{e}; gc refuses to delete the log below it (delete the bad snapshot)") from None
    if horizon is not None:
        old_snaps = [snapshot_key(v) for v in snapshots if v < horizon]
        logs = sorted(
            v
            for k in await retry(lambda: store.list(LOG_PREFIX))
            if (v := version_of(k)) is not None and 0 < v < horizon
        )
        report.snapshots_deleted, report.log_versions_deleted = len(old_snaps), len(logs)
        if not dry_run:
            await _delete(store, old_snaps, "snapshots", show)
            hint = orjson.dumps({"version": snapshots[-1]})
            await retry(lambda: store.put(HINT_KEY, hint))
            await _delete(store, [log_key(v) for v in logs], "log versions", show)
    return report
