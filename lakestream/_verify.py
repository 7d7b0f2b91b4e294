"""`verify`: check every invariant of a stream and every checksum.

Besides what `apply` already enforces, verify reads back every retained segment and reports what
only a whole-stream view can see: a segment that two steps share, a sample key that occurs in more
than one step or rank (a source that produced a sample twice), log versions past a hole in the
log (which no reader ever applies, so they are reported rather than silently ignored), and the
held leftovers (their segments checked against their finish records, and their keys counted with
the steps' for exactly once), and the shape and mixture history against the samples themselves: every step holds at most the global batch
in force at it, and under a mixture its samples' `__source__` fields hold the mix's shares.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio

from ._batching import mix_counts
from ._errors import CorruptData, ObjectNotFound
from ._layout import LOG_PREFIX, SOURCE_FIELD, version_of
from ._retry import retry
from ._segment import check_slice, decode_value, index_slice
from ._state import Leftover, State, Step
from ._store import ObjectStore
from ._tasks import task_group

__all__ = ["VerifyReport", "verify_state"]

MAX_LISTED = 20  # problems of one kind listed one by one; the rest are counted


@dataclass(slots=True)
class VerifyReport:
    url: str
    version: int = -1
    first_step: int = 0
    head: int = -1
    steps: int = 0
    samples: int = 0
    held: int = 0  # samples of held leftovers (committed by their producers' finish, not in a step yet)
    skipped: int = 0  # samples of TGBs a replay skipped (`State.skipped`), still recorded
    bytes: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


async def _check_step(
    store: ObjectStore, url: str, s: Step, report: VerifyReport, keys: dict[str, tuple[int, int]]
) -> Counter[str] | None:
    """Check one step's segment; the step's samples per `__source__` value (None if unreadable)."""
    # A TGB holds the slices of the world size it was sealed for; a step read as another one is
    # re-sliced by sample counts (`_batching.reslice`), which is why the counts are checked here.
    where = f"{url} step {s.step}"
    world = len(s.ranks)
    try:
        data = await retry(lambda: store.get(s.segment))
    except ObjectNotFound:
        report.problems.append(f"{where} ranks 0..{world - 1} object {s.segment}: segment object is missing")
        return None
    sources: Counter[str] = Counter()
    offset = 0
    for rank, r in enumerate(s.ranks):
        at = f"{where} rank {rank} object {s.segment}"
        if r.offset != offset:
            report.problems.append(f"{at}: slice starts at {r.offset}, expected {offset} (slices must be contiguous)")
        offset = r.offset + r.length
        if offset > len(data):
            report.problems.append(f"{at}: slice ends at {offset}, past the segment's {len(data)} bytes")
            continue
        view = memoryview(data)[r.offset : offset]
        try:
            check_slice(view, r.digest, at, s.checksum)
            refs = index_slice(view, at)  # every name checked as on put
        except CorruptData as e:
            report.problems.append(str(e))
            continue
        for ref in refs:
            if ref.field == SOURCE_FIELD:
                value = decode_value(ref.tag, bytes(view[ref.offset : ref.offset + ref.length]))
                sources[value if isinstance(value, str) else repr(value)] += 1
        slice_keys = list(dict.fromkeys(ref.key for ref in refs))
        if len(slice_keys) != r.samples:
            report.problems.append(f"{at}: {len(slice_keys)} samples in the slice, the manifest says {r.samples}")
        for key in slice_keys:
            first = keys.setdefault(key, (s.step, rank))
            if first != (s.step, rank):
                report.problems.append(
                    f"{at}: sample key {key!r} also occurs at step {first[0]} rank {first[1]} (produced twice)"
                )
        report.samples += len(slice_keys)
    if offset != len(data):
        report.problems.append(f"{where} object {s.segment}: slices cover {offset} of {len(data)} bytes")
    report.bytes += len(data)
    return sources


def _check_shape(state: State, s: Step, sources: Counter[str], report: VerifyReport) -> None:
    """The step against the shape and mixture in force at it (`reshape` and `mix` records)."""
    where = f"{report.url} step {s.step} object {s.segment}"
    batch = state.batch_at(s.step)
    if s.samples > batch:
        report.problems.append(f"{where}: {s.samples} samples, more than the global batch {batch} in force")
    m = state.mix_at(s.step)
    if m is None:  # without a mixture, `__source__` is a field like any other
        return
    shares = {n: c for n, c in mix_counts(m.weights, batch).items() if c}
    full = s.samples == batch
    if sum(sources.values()) != s.samples or any(
        sources[n] > shares.get(n, 0) or (full and sources[n] != shares.get(n, 0)) for n in sources.keys() | shares
    ):
        report.problems.append(
            f"{where}: samples per source {dict(sources)!r:.200} are not the shares {shares!r:.200} "
            f"of mix version {m.version}"
        )


async def _check_leftover(
    store: ObjectStore, pid: str, h: Leftover, report: VerifyReport, keys: dict[str, tuple[int, int]]
) -> None:
    """A held leftover's segment: its slice and cursors against the finish record, its keys once in the stream."""
    at = f"{store.url} leftover of producer {pid} object {h.ref.segment}"
    offset, length, crc, n = h.ref.ranks[0]
    try:
        data = await retry(lambda: store.get(h.ref.segment))
    except ObjectNotFound:
        report.problems.append(f"{at}: segment object is missing")
        return
    if len(data) != h.cursors[0] + h.cursors[1] or offset + length != h.cursors[0]:
        report.problems.append(f"{at}: {len(data)} bytes, the finish record says {h.cursors[0] + h.cursors[1]}")
        return
    view = memoryview(data)
    try:
        check_slice(view[offset : offset + length], crc, at, h.ref.checksum)
        check_slice(view[h.cursors[0] :], h.cursors[2], f"{at} (cursors)")
        refs = index_slice(view[offset : offset + length], at)
    except CorruptData as e:
        report.problems.append(str(e))
        return
    held = list(dict.fromkeys(ref.key for ref in refs))
    if len(held) != n:
        report.problems.append(f"{at}: {len(held)} samples in the slice, the finish record says {n}")
    for key in held:
        first = keys.setdefault(key, (-1, -1))
        if first != (-1, -1):
            report.problems.append(
                f"{at}: sample key {key!r} also occurs at step {first[0]} rank {first[1]} (produced twice)"
            )
    report.held += len(held)
    report.bytes += len(data)


async def _check_log_tail(store: ObjectStore, state: State, report: VerifyReport) -> None:
    """Log versions past the tail sit behind a hole: every reader stops at the first missing one."""
    beyond = sorted(
        v for k in await retry(lambda: store.list(LOG_PREFIX)) if (v := version_of(k)) is not None and v > state.version
    )
    if beyond:
        report.problems.append(
            f"{store.url}: log versions {beyond[0]}..{beyond[-1]} ({len(beyond)}) lie past a hole at version "
            f"{state.version + 1} and are ignored by every reader (planted or left by a broken writer)"
        )


async def verify_state(
    store: ObjectStore,
    state: State,
    *,
    concurrency: int = 16,
    progress: Callable[[str, int, int], None] | None = None,
    base: ObjectStore | None = None,
) -> VerifyReport:
    """Check the manifest's invariants and read back every retained segment; `progress(what, done,
    total)` is called as segments are checked (the CLI draws a bar with it). `base`: a fork's
    source's store, where the steps it shares with it are read."""
    report = VerifyReport(store.url, state.version, state.first_step, state.head, len(state.steps))
    report.skipped = sum(k.step.samples for k in state.skipped)
    for version, why in state.rejected:
        report.problems.append(
            f"{store.url}: log version {version} is malformed or invalid (applied as a no-op): {why}"
        )
    await _check_log_tail(store, state, report)
    if state.config is None:
        report.problems.append(f"{store.url}: no valid create record")
        return report
    for i, s in enumerate(state.steps):
        if s.step != state.first_step + i:
            report.problems.append(f"{store.url}: step {s.step} found at position of step {state.first_step + i} (gap)")
    last_seq: dict[str, int] = {}
    segments: dict[str, int] = {}
    for s in state.steps:
        if s.seq <= last_seq.get(s.producer, -1):
            report.problems.append(f"{store.url} step {s.step}: producer {s.producer} seq {s.seq} is not increasing")
        last_seq[s.producer] = s.seq
        first = segments.setdefault(s.segment, s.step)
        if first != s.step:
            report.problems.append(
                f"{store.url} step {s.step} object {s.segment}: the segment of step {first} again (its samples twice)"
            )
    limiter = anyio.Semaphore(concurrency)
    keys: dict[str, tuple[int, int]] = {}
    unique = [s for s in state.steps if segments[s.segment] == s.step]

    checked = 0

    async def one(s: Step) -> None:
        nonlocal checked
        async with limiter:
            at = base if state.base is not None and state.base.holds(s) else store
            if at is None:
                raise ValueError(f"{store.url}: verifying a fork takes its source's store (`base`)")
            sources = await _check_step(at, store.url, s, report, keys)
        if sources is not None:
            _check_shape(state, s, sources, report)
        checked += 1
        if progress is not None:
            progress("segments checked", checked, len(unique))

    async with task_group() as tg:
        for s in unique:
            tg.start_soon(one, s)
    for pid, h in sorted(state.leftovers.items()):  # after the steps: a key in both is reported here
        await _check_leftover(store, pid, h, report, keys)
    report.problems = _condense(sorted(report.problems))
    return report


def _condense(problems: list[str]) -> list[str]:
    """At most MAX_LISTED problems of each kind (the text after the location), then a count."""
    out: list[str] = []
    seen: dict[str, int] = {}
    for p in problems:
        kind = p.split(": ", 1)[-1].split("'", 1)[0]
        seen[kind] = seen.get(kind, 0) + 1
        if seen[kind] <= MAX_LISTED:
            out.append(p)
    out.extend(f"… and {n - MAX_LISTED} more like: {k}" for k, n in seen.items() if n > MAX_LISTED)
    return out
