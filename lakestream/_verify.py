"""`verify`: check every invariant of a stream and every checksum."""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio

from ._errors import CorruptData, ObjectNotFound
from ._manifest import State, Step
from ._segment import check_slice, index_slice
from ._store import ObjectStore

__all__ = ["VerifyReport", "verify_state"]


@dataclass(slots=True)
class VerifyReport:
    url: str
    version: int = -1
    first_step: int = 0
    head: int = -1
    steps: int = 0
    samples: int = 0
    bytes: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


async def _check_step(store: ObjectStore, url: str, s: Step, world: int, report: VerifyReport) -> None:
    where = f"{url} step {s.step}"
    if len(s.ranks) != world:
        report.problems.append(f"{where}: {len(s.ranks)} rank slices for world size {world}")
        return
    try:
        data = await store.get(s.segment)
    except ObjectNotFound:
        report.problems.append(f"{where} ranks 0..{world - 1} object {s.segment}: segment object is missing")
        return
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
            check_slice(view, r.crc32, at)
            refs = index_slice(view, at)
        except CorruptData as e:
            report.problems.append(str(e))
            continue
        keys = []
        for ref in refs:
            if not keys or keys[-1] != ref.key:
                keys.append(ref.key)
        if len(keys) != r.samples:
            report.problems.append(f"{at}: {len(keys)} samples in the slice, the manifest says {r.samples}")
        if len(set(keys)) != len(keys):
            report.problems.append(f"{at}: duplicate sample keys")
        report.samples += len(keys)
    if offset != len(data):
        report.problems.append(f"{where} object {s.segment}: slices cover {offset} of {len(data)} bytes")
    report.bytes += len(data)


async def verify_state(store: ObjectStore, state: State, *, concurrency: int = 16) -> VerifyReport:
    """Check the manifest's invariants and read back every retained segment."""
    report = VerifyReport(store.url, state.version, state.first_step, state.head, len(state.steps))
    for version, why in state.rejected:
        report.problems.append(f"{store.url}: log version {version} is malformed or invalid (applied as a no-op): {why}")
    if state.config is None:
        report.problems.append(f"{store.url}: no valid create record")
        return report
    for i, s in enumerate(state.steps):
        if s.step != state.first_step + i:
            report.problems.append(f"{store.url}: step {s.step} found at position of step {state.first_step + i} (gap)")
    last_seq: dict[str, int] = {}
    for s in state.steps:
        if s.seq <= last_seq.get(s.producer, -1):
            report.problems.append(f"{store.url} step {s.step}: producer {s.producer} seq {s.seq} is not increasing")
        last_seq[s.producer] = s.seq
    limiter = anyio.Semaphore(concurrency)

    async def one(s: Step) -> None:
        async with limiter:
            await _check_step(store, store.url, s, state.config.world_size, report)  # type: ignore[union-attr]

    async with anyio.create_task_group() as tg:
        for s in state.steps:
            tg.start_soon(one, s)
    report.problems.sort()
    return report
