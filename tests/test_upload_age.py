"""No commit names an upload GC may be deleting as an orphan.

GC deletes an unreferenced upload of a live producer once it is older than the orphan grace; it
plans on the log as it is after listing the segments. Committers never name an upload older than
`MAX_UPLOAD_AGE` (well within the grace), and producers upload again what waits half as long. The
torture run found the race this closes: a combiner's commit landing between GC's read of the log
and its listing, of uploads held long enough to look like orphans."""

from __future__ import annotations

import time
from typing import Any

import anyio
from hypothesis import given, settings
from hypothesis import strategies as st

import lakestream
from lakestream import Config, State
from lakestream import _combine as combine_module
from lakestream import _decisions as decisions
from lakestream._combine import Combiner
from lakestream._layout import SEGMENTS_PREFIX, intent_key, segment_key
from lakestream._manifest import AppendResult, Manifest
from lakestream._pacing import IntervalPolicy
from lakestream._records import CommitRecord, CreateRecord, RegisterRecord, TgbRef, encode_record
from lakestream._store import MemoryStore

NOW = 1_000_000.0


def ref(pid: str, epoch: int, seq: int, uploaded: float) -> TgbRef:
    return TgbRef(segment_key(pid, epoch, seq, uploaded), ((0, 10, 1, 1),), [pid, seq])


def stream(*pids: str) -> State:
    s = State()
    s.apply(0, encode_record(CreateRecord(Config(world_size=1, global_batch=1))))
    for pid in pids:
        s.apply(s.version + 1, encode_record(RegisterRecord(pid, 1, "t-" + pid)))
    return s


ages = st.lists(st.floats(0, 2 * decisions.MAX_UPLOAD_AGE), min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(ages)
def test_a_commit_takes_the_uploads_before_the_first_stale_one(upload_ages: list[float]) -> None:
    state = stream("p")
    pending = [decisions.PendingTgb(i, ref("p", 1, i, NOW - a)) for i, a in enumerate(upload_ages)]
    record = decisions.commit(state, "p", 1, pending, 0, NOW)
    young = next((i for i, a in enumerate(upload_ages) if a > decisions.MAX_UPLOAD_AGE), len(upload_ages))
    assert (len(record.tgbs) if record else 0) == young
    assert record is None or not any(decisions.stale(t, NOW) for t in record.tgbs)


@settings(max_examples=200, deadline=None)
@given(ages, st.integers(0, 7))
def test_a_group_takes_stale_uploads_from_the_intent_that_declared_them_again(
    upload_ages: list[float], again: int
) -> None:
    """A producer's old intent holds its TGBs as first uploaded; it declared those from `again` on
    again, uploaded again (just now): the group never takes a stale one, takes every TGB that has
    a young upload in some intent, in sequence order, each once."""
    state = stream("p")
    again = min(again, len(upload_ages) - 1)
    old = CommitRecord("p", 1, 0, tuple(ref("p", 1, i, NOW - a) for i, a in enumerate(upload_ages)), 0, NOW - 200)
    n = len(upload_ages)
    fresh = CommitRecord("p", 1, again, tuple(ref("p", 1, i, NOW - 1) for i in range(again, n)), 0, NOW - 1)
    group = decisions.combine(state, [old, fresh], now=NOW)
    taken = [t for r in (group.records if group else ()) if isinstance(r, CommitRecord) for t in r.tgbs]
    assert not any(decisions.stale(t, NOW) for t in taken)
    first_stale = next((i for i, a in enumerate(upload_ages) if a > decisions.MAX_UPLOAD_AGE), n)
    # the old intent's young prefix, then the fresh intent's from where it stopped (if it reaches)
    expected = first_stale if first_stale < again else n
    assert len(taken) == expected
    assert [int(t.segment.split("/")[2].split("-")[1]) for t in taken] == list(range(expected))


def landed(result: AppendResult | None) -> bool:
    return result is not None and result.version is not None


class ListingHook(MemoryStore):
    """A store that runs `before_listing` once, when GC lists the segments."""

    before_listing: Any = None

    async def list_sizes(self, prefix: str) -> dict[str, int]:
        if prefix == SEGMENTS_PREFIX and (hook := self.before_listing) is not None:
            self.before_listing = None
            await hook()
        return await super().list_sizes(prefix)


async def test_gc_keeps_an_old_upload_committed_between_its_read_of_the_log_and_its_listing() -> None:
    """The race the torture run hit: GC reads the log, a commit lands naming an upload that looks
    like an orphan (old, its producer's last record old), then GC lists the segments. GC plans on
    the log as it is after the listing, so it keeps the segment."""
    store = ListingHook()
    await lakestream.create(store, world_size=1, global_batch=1)
    p = lakestream.Producer(store, "p", policy=IntervalPolicy(interval=3600))
    async with p:
        await p.put({"txt": "0"}, cursor=1)  # uploaded; its commit waits for the interval
        with anyio.fail_after(10):
            while not await store.list(SEGMENTS_PREFIX):
                await anyio.sleep(0.01)
        store.before_listing = p.flush  # it lands after GC read the log, before the listing
        later = time.time() + 1000  # GC's clock: the upload and the producer's register look old
        report = await lakestream.gc(store, orphan_grace=300, now=lambda: later)
        assert store.before_listing is None and report.segments_deleted == 0
    state = await lakestream.load_state(store)
    assert state.head == 0 and await store.list(SEGMENTS_PREFIX) == [state.steps[0].segment]
    assert (await lakestream.verify(store)).ok


async def test_a_producer_uploads_again_what_waited_too_long() -> None:
    """A TGB held uncommitted for an hour (its commit policy here; back-pressure or an outage
    alike) is uploaded again before its commit: GC may have deleted the first upload as an orphan
    (here it did), and the commit names the new one."""
    store = MemoryStore()
    await lakestream.create(store, world_size=1, global_batch=1)
    wall = [time.time()]
    p = lakestream.Producer(store, "p", policy=IntervalPolicy(interval=3600), wall=lambda: wall[0])
    async with p:
        await p.put({"txt": "0"}, cursor=1)
        await p.flush()
        await p.put({"txt": "1"}, cursor=2)  # uploaded; its commit waits for the interval
        with anyio.fail_after(10):
            while len(await store.list(SEGMENTS_PREFIX)) < 2:
                await anyio.sleep(0.01)
        first = (await lakestream.load_state(store)).steps[0].segment
        held = [k for k in await store.list(SEGMENTS_PREFIX) if k != first]
        await store.delete(held)  # what GC does to an orphan older than its grace
        wall[0] += 3600
        with anyio.fail_after(10):
            await p.flush()
    state = await lakestream.load_state(store)
    assert state.head == 1 and state.producers["p"].cursor == 2
    assert state.steps[1].segment not in held
    assert not decisions.stale(TgbRef(state.steps[1].segment, ()), wall[0])
    report = await lakestream.verify(store)
    assert report.ok and report.samples == 2, report.problems


async def test_a_combiner_fetches_again_an_intent_too_old_to_commit() -> None:
    """An intent whose upload is too old is not committed; its producer declares it again under
    the same key, uploaded again, and the combiner fetches it again and commits that one."""
    store = MemoryStore()
    await lakestream.create(store, world_size=1, global_batch=1)
    m = Manifest(store)
    await m.load()
    await m.append(lambda st, _: decisions.register(st, "p", "t", 0.0))
    wall = [time.time()]
    c = Combiner(m, wall=lambda: wall[0])
    first = ref("p", 1, 0, wall[0])
    await store.put(first.segment, b"x")
    await store.put(intent_key("p", 1, 0), encode_record(CommitRecord("p", 1, 0, (first,), 0, wall[0])))
    wall[0] += decisions.MAX_UPLOAD_AGE + 1  # held (no room, say) until it is too old
    assert not landed(await c.round(None))  # held, fetched: too old to commit
    again = ref("p", 1, 0, wall[0])
    await store.put(intent_key("p", 1, 0), encode_record(CommitRecord("p", 1, 0, (again,), 0, wall[0])))
    assert not landed(await c.round(None))  # fetched again only every REFETCH_STALE
    wall[0] += combine_module.REFETCH_STALE + 1
    assert landed(await c.round(None))
    assert m.state.head == 0 and m.state.steps[0].segment == again.segment


class SlowUpload(MemoryStore):
    """A store whose first segment put takes `delay` seconds of the producer's wall clock."""

    def __init__(self, wall: list[float], delay: float) -> None:
        super().__init__()
        self.wall, self.delay = wall, delay

    async def put(self, key: str, data: bytes) -> None:
        await super().put(key, data)
        if key.startswith(SEGMENTS_PREFIX) and self.delay:
            self.wall[0] += self.delay
            self.delay = 0.0


async def test_a_leftover_uploaded_too_long_before_its_finish_record_is_uploaded_again() -> None:
    """A finish record never names an upload too old to commit either (its append may retry
    through a long outage): the leftover is uploaded again and the record names that one."""
    wall = [time.time()]
    store = SlowUpload(wall, decisions.MAX_UPLOAD_AGE + 1)
    await lakestream.create(store, world_size=1, global_batch=2)
    m = Manifest(store)
    await m.load()
    await m.append(lambda st, _: decisions.register(st, "b", "t", 0.0))  # still producing: "a"'s leftover is held
    async with lakestream.open_producer(store, "a", wall=lambda: wall[0]) as p:
        await p.put({"txt": "0"}, cursor=1)  # a partial global batch: the leftover
    state = await lakestream.load_state(store)
    held = state.leftovers["a"].ref
    assert not decisions.stale(held, wall[0]) and held.segment in await store.list(SEGMENTS_PREFIX)
    assert len(await store.list(SEGMENTS_PREFIX)) == 2  # the first upload is an orphan for GC
