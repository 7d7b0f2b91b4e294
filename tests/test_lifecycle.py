"""Checkpoints, retention, GC, back-pressure and rewind."""

from __future__ import annotations

import time

import anyio
import orjson
import pytest

import lakestream
from lakestream import ConfigMismatch, ProducerFenced, StepUnavailable
from lakestream._cli import status_dict
from lakestream._layout import segment_key
from lakestream._manifest import LOG_PREFIX, SNAPSHOT_PREFIX, Manifest, log_key
from lakestream._store import FileStore, MemoryStore

B = 4


@pytest.fixture(params=["memory", "file"])
async def store(request: pytest.FixtureRequest, tmp_path):
    s = MemoryStore() if request.param == "memory" else FileStore(tmp_path / "stream", durable=False)
    await lakestream.create(s, world_size=2, global_batch=B, keep_checkpoints=2, snapshot_every=5)
    yield s


async def produce(store, pid: str, n: int, **kw) -> lakestream.Producer:
    """Put records 0..n-1 of a deterministic source, resuming at the committed cursor."""
    async with lakestream.open_producer(store, pid, **kw) as p:
        for i in range(p.cursor or 0, n):
            await p.put({"__key__": f"{pid}-{i}", "txt": f"{pid}:{i}"}, cursor=i + 1)
            if (i + 1) % B == 0:
                await p.flush()
    return p


async def keys_by_step(store) -> dict[int, list[str]]:
    state = await lakestream.load_state(store)
    out: dict[int, list[str]] = {}
    async with lakestream.open_reader(store, None) as r:
        for s in state.steps:
            out[s.step] = [f.key for rank in range(2) for f in (await r.fetch_raw(s, rank)).files if f.field == "txt"]
    return out


async def test_checkpoints_retention_and_watermark(store) -> None:
    await produce(store, "p", 10 * B)
    assert (await lakestream.load_state(store)).watermark == -1
    assert await lakestream.checkpoint(store, "c1", 2)
    assert not await lakestream.checkpoint(store, "c1", 2)  # same id and step: no-op
    with pytest.raises(ConfigMismatch, match="'c1' is at step 2, not 3"):
        await lakestream.checkpoint(store, "c1", 3)
    with pytest.raises(StepUnavailable, match=r"readable steps are 0\.\.9"):
        await lakestream.checkpoint(store, "c9", 10)
    await lakestream.checkpoint(store, "c2", 5)
    await lakestream.checkpoint(store, "c3", 7)  # keep 2: c1 drops out
    with pytest.raises(ValueError, match="older than the newest"):
        await lakestream.checkpoint(store, "c0", 6)
    state = await lakestream.load_state(store)
    assert [(c.id, c.step) for c in state.checkpoints] == [("c2", 5), ("c3", 7)]
    assert state.watermark == 5
    assert await lakestream.release(store, "c2") and not await lakestream.release(store, "c2")
    assert (await lakestream.load_state(store)).watermark == 7


async def test_gc_reclaims_below_the_watermark_only(store) -> None:
    await produce(store, "p", 10 * B)
    report = await lakestream.gc(store)
    assert report.reclaimed_below is None and report.segments_deleted == 0  # no checkpoint: keep all
    await lakestream.checkpoint(store, "c", 6)
    dry = await lakestream.gc(store, dry_run=True)
    assert dry.reclaimed_below == 6 and dry.segments_deleted == 6
    assert len(await store.list("segments/")) == 10
    report = await lakestream.gc(store)
    assert report.reclaimed_below == 6 and report.segments_deleted == 6 and "steps below 6" in report.summary()
    state = await lakestream.load_state(store)
    assert state.first_step == 6 and state.head == 9
    assert sorted(await store.list("segments/")) == sorted(s.segment for s in state.steps)
    async with lakestream.open_reader(store, 0) as r:
        with pytest.raises(StepUnavailable, match=r"step 5 was reclaimed .*watermark 6"):
            await r.read_step(5)
        assert [b.step async for b in r.steps(6, 10)] == [6, 7, 8, 9]
    assert (await lakestream.verify(store)).ok


async def test_gc_deletes_orphans_by_rule(store) -> None:
    await produce(store, "p", 2 * B)
    state = await lakestream.load_state(store)
    epoch, seq = state.producers["p"].epoch, state.producers["p"].seq
    now = time.time()
    fenced = segment_key("p", epoch - 1 if epoch > 1 else 0, seq + 1, now)
    superseded = segment_key("p", epoch, seq, now)
    in_flight = segment_key("p", epoch, seq + 1, now)
    stale = segment_key("p", epoch, seq + 2, now - 7200)
    for key in (fenced, superseded, in_flight, stale):
        await store.put(key, b"x")
    report = await lakestream.gc(store)
    left = set(await store.list("segments/"))
    # an old upload of a producer that committed recently may still be on its way: kept
    assert {in_flight, stale} <= left and {fenced, superseded}.isdisjoint(left)
    assert report.orphans_kept == 2 and report.segments_deleted == 2
    # once the producer, too, has been silent for longer than the grace, both go
    report = await lakestream.gc(store, now=lambda: time.time() + 7200)
    assert report.segments_deleted == 2 and {in_flight, stale}.isdisjoint(await store.list("segments/"))
    assert (await lakestream.verify(store)).ok


async def test_gc_truncates_the_log_and_readers_still_load(store) -> None:
    await produce(store, "p", 12 * B)
    before = (await lakestream.load_state(store)).to_json()
    await lakestream.gc(store, lease=3600)  # nothing is old enough: the log stays whole
    assert log_key(1) in await store.list(LOG_PREFIX)
    report = await lakestream.gc(store, lease=0.0)
    assert report.log_versions_deleted > 0
    logs = await store.list(LOG_PREFIX)
    assert log_key(0) in logs and log_key(1) not in logs
    assert len(await store.list(SNAPSHOT_PREFIX)) >= 1
    assert (await Manifest(store).load()).to_json() == before
    await produce(store, "p", 14 * B)  # and writers carry on after it
    assert (await lakestream.load_state(store)).head == 13


async def test_back_pressure_holds_producers_until_a_checkpoint(tmp_path) -> None:
    store = MemoryStore()
    await lakestream.create(store, world_size=1, global_batch=1, max_steps_ahead=3, keep_checkpoints=1)

    async def head_settles_at(n: int) -> None:
        with anyio.fail_after(10):
            while (await lakestream.load_state(store)).head < n:
                await anyio.sleep(0.01)
        await anyio.sleep(0.3)
        assert (await lakestream.load_state(store)).head == n

    async with anyio.create_task_group() as tg:
        tg.start_soon(produce, store, "p", 10)
        await head_settles_at(2)  # no checkpoint: 3 steps (0..2) ahead of nothing
        await lakestream.checkpoint(store, "c", 2)
        await head_settles_at(5)  # head - watermark < 3
        await lakestream.checkpoint(store, "c2", 5)
        await head_settles_at(8)
        await lakestream.checkpoint(store, "c3", 8)
    assert (await lakestream.load_state(store)).head == 9


def test_room_counts_from_the_newest_of_the_consumption_mark_and_the_oldest_checkpoint() -> None:
    from lakestream import _decisions as decisions
    from lakestream._records import CheckpointRecord, CommitRecord, RegisterRecord, TgbRef, encode_record
    from lakestream._state import Config, State

    state = State()
    state.apply(0, encode_record(decisions.create(Config(world_size=1, global_batch=1, max_steps_ahead=4), 0.0)))
    state.apply(1, encode_record(RegisterRecord("p", 1, "t", 0.0)))
    assert decisions.room(state) == decisions.room(state, -1) == 4  # nothing committed, nothing consumed
    refs = tuple(TgbRef(segment_key("p", 1, i, 0.0), ((0, 1, 0, 1),), i + 1) for i in range(10))
    state.apply(2, encode_record(CommitRecord("p", 1, 0, refs, 0, 0.0)))  # steps 0..9
    assert decisions.room(state) == 4 - 10  # no mark, no checkpoint: counted from the first step
    assert decisions.room(state, 7) == 4 - 2
    assert decisions.room(state, 10**18) == 4  # a mark past the head counts as the head
    state.apply(3, encode_record(CheckpointRecord("c", 8, 0.0)))
    assert decisions.room(state, 7) == decisions.room(state, None) == 4 - 1  # the checkpoint is newer
    assert decisions.room(state, 9) == 4
    p = [
        decisions.PendingTgb(10 + i, TgbRef(segment_key("p", 1, 10 + i, 0.0), ((0, 1, 0, 1),), 11 + i))
        for i in range(5)
    ]
    record = decisions.commit(state, "p", 1, p, 0, 0.0, consumed=8)
    assert record is not None and len(record.tgbs) == 3  # what room leaves, in sequence order
    state.apply(4, encode_record(decisions.commit(state, "p", 1, p, 0, 0.0, consumed=8)))  # type: ignore[arg-type]
    assert decisions.commit(state, "p", 1, p, 0, 0.0, consumed=8) is None  # no room left


async def test_back_pressure_follows_the_trainers_consumption_mark(tmp_path) -> None:
    """No checkpoint at all: rank 0's reader publishes what it consumed, and producers are held to
    max_steps_ahead past it, checked at commit, so the head never runs further ahead."""
    store = FileStore(tmp_path / "stream", durable=False)
    limit = 3
    await lakestream.create(store, world_size=1, global_batch=1, max_steps_ahead=limit)
    worst = 0
    with anyio.fail_after(30):  # without the mark, producers wait for a checkpoint for good
        async with anyio.create_task_group() as tg, lakestream.open_reader(store, 0) as r:
            tg.start_soon(produce, store, "p", 30)
            async for batch in r.steps(0, 30):
                await anyio.sleep(0.05)
                worst = max(worst, (await lakestream.load_state(store)).head - batch.step)
    assert worst <= limit
    assert (await lakestream.load_state(store)).head == 29
    assert orjson.loads(await store.get("_lakestream/consumed"))["step"] >= 0


@pytest.mark.parametrize("mark", [b"", b"not json", b'{"step": "9"}', b'{"step": -5}', b"[1]", b'{"step": 1e300}'])
async def test_an_unreadable_consumption_mark_is_ignored(mark: bytes, caplog) -> None:
    store = MemoryStore()
    await lakestream.create(store, world_size=1, global_batch=1)
    await store.put("_lakestream/consumed", mark)
    m = Manifest(store)
    assert await m.read_consumed() is None
    assert "ignoring the unreadable _lakestream/consumed" in caplog.text


async def test_a_reader_records_checkpoints_in_the_background_and_raises_their_errors_later(store) -> None:
    await produce(store, "p", 4 * B)
    async with lakestream.open_reader(store, 0) as r:
        async for batch in r.steps(0, 2):
            assert await r.checkpoint(f"c{batch.step}", batch.step) is True  # at once
        assert await r.checkpoint("c1", 1, wait=True) is False  # after c0 and c1: recorded already
        assert [(c.id, c.step) for c in (await lakestream.load_state(store)).checkpoints] == [("c0", 0), ("c1", 1)]
        await r.checkpoint("late", 0)  # older than the newest: fails in the background
        with pytest.raises(ValueError, match="older than the newest checkpoint"):
            with anyio.fail_after(10):
                while True:
                    await r.read_step(2)
                    await anyio.sleep(0.01)
        assert (await r.read_step(2)).step == 2  # raised once


async def test_rewind_replays_exactly_once_into_the_new_history(store) -> None:
    await produce(store, "a", 6 * B)
    await produce(store, "b", 6 * B)
    await lakestream.checkpoint(store, "c", 5)
    before = await keys_by_step(store)
    old = lakestream.Producer(store, "a")
    await old.__aenter__()
    try:
        state = await lakestream.rewind(store, to_checkpoint="c")
        assert state.head == 5 and state.rewinds == 1
        # steps 0..5 are a's; b's steps 6..11 are gone, and b resumes from the start
        assert state.producers["b"].cursor is None and state.producers["a"].cursor == 6 * B
        with pytest.raises(ProducerFenced):
            await old.put({"txt": "zombie"}, cursor=1)
            await old.close()
    finally:
        await old.aclose()
    await produce(store, "b", 6 * B)
    after = await keys_by_step(store)
    assert [after[s] for s in range(6)] == [before[s] for s in range(6)]
    b_keys = [k for s in range(6, 12) for k in after[s]]
    assert sorted(b_keys) == sorted(f"b-{i}" for i in range(6 * B))
    assert (await lakestream.verify(store)).ok


async def test_a_replay_without_bad_steps_references_the_rest_and_producers_go_on(store) -> None:
    """`rewind(to_checkpoint, skip=...)`: the steps after the checkpoint are the old ones but the
    skipped, in order and by reference; a producer with samples in hand when it lands is not fenced
    and commits them next; the skipped samples are recorded, kept until a reclaim passes them, and
    every sample is in a step or skipped, once."""
    await produce(store, "a", 6 * B)
    await produce(store, "b", 6 * B)  # steps 0..5 a's, 6..11 b's
    await lakestream.checkpoint(store, "c", 3)
    before = await keys_by_step(store)
    old = (await lakestream.load_state(store)).steps
    async with lakestream.open_reader(store, 0, poll_interval=(0.001, 0.01)) as r:
        it = r.steps(0)
        assert [(await it.__anext__()).step for _ in range(6)] == list(range(6))
        live = lakestream.Producer(store, "a")
        await live.__aenter__()
        try:
            # In hand when the rewind lands: all but the last sample of its next TGB (a full one is
            # sealed, and may be committed before the rewind, as step 12, replayed as step 9).
            for i in range(6 * B, 7 * B - 1):
                await live.put({"__key__": f"a-{i}", "txt": f"a:{i}"}, cursor=i + 1)
            state = await lakestream.rewind(store, to_checkpoint="c", skip=[(5, 6), (9, 9)])
            await live.put({"__key__": f"a-{7 * B - 1}", "txt": f"a:{7 * B - 1}"}, cursor=7 * B)
            await live.flush()  # not fenced: its TGB is the next step
        finally:
            await live.aclose()
        with pytest.raises(StepUnavailable, match="already read, was discarded by a rewind"):
            for _ in range(8):  # it learns of it when it next reads the log (see the test below)
                await it.__anext__()  # read past the checkpoint: restart from it, like any rewind
        await it.aclose()
    assert state.head == 8 and state.rewinds == 1 and state.checkpoints[-1].id == "c"
    replayed = [4, 7, 8, 10, 11]
    assert [(s.segment, s.step) for s in state.steps[4:]] == [(old[n].segment, 4 + i) for i, n in enumerate(replayed)]
    assert [(k.at, k.step.step) for k in state.skipped] == [(4, 5), (4, 6), (6, 9)]
    after = await keys_by_step(store)
    assert [after[s] for s in range(4, 9)] == [before[n] for n in replayed]
    assert sorted(after[9]) == [f"a-{i}" for i in range(24, 28)]
    skipped = [k for n in (5, 6, 9) for k in before[n]]
    status = status_dict(await lakestream.load_state(store))
    assert [(k["was_step"], k["samples"]) for k in status["skipped"]] == [(5, B), (6, B), (9, B)]
    await produce(store, "b", 7 * B)  # b goes on after its last TGB, the skipped step 9 included
    every = [k for keys in (await keys_by_step(store)).values() for k in keys] + skipped
    assert sorted(every) == sorted([f"a-{i}" for i in range(7 * B)] + [f"b-{i}" for i in range(7 * B)])
    report = await lakestream.verify(store)
    assert report.ok and report.skipped == 3 * B, report.problems
    # The skipped TGBs' segments stay until a reclaim passes them, then go like the steps before it.
    segs = {k.step.segment for k in state.skipped}
    await lakestream.checkpoint(store, "d", 5)
    await lakestream.checkpoint(store, "e", 6)  # the stream keeps two: the watermark is step 5
    await lakestream.gc(store, orphan_grace=0, force_grace=True)
    state = await lakestream.load_state(store)
    listed = set(await store.list("segments/"))
    assert state.first_step == 5 and [k.step.step for k in state.skipped] == [9]
    assert state.skipped[0].step.segment in listed and not (segs - {state.skipped[0].step.segment}) & listed
    assert (await lakestream.verify(store)).ok


async def test_a_reader_past_a_rewind_is_told(store) -> None:
    await produce(store, "a", 4 * B)
    async with lakestream.open_reader(store, 0, poll_interval=(0.001, 0.01)) as r:
        it = r.steps(0)
        assert [(await it.__anext__()).step for _ in range(3)] == [0, 1, 2]
        await lakestream.rewind(store, to_step=1)
        await produce(store, "a", 6 * B)
        # the reader learns of the rewind when it next reads the log: at the latest when it runs
        # out of the steps it already knew of (here step 3)
        with pytest.raises(StepUnavailable, match="already read, was discarded by a rewind"):
            for _ in range(2):
                await it.__anext__()
        await it.aclose()


async def test_producers_can_collect_garbage_in_the_background() -> None:
    store = MemoryStore()
    await lakestream.create(store, world_size=1, global_batch=1, keep_checkpoints=1)
    async with lakestream.open_producer(store, "p", gc_interval=0.05) as p:
        for i in range(6):
            await p.put({"txt": str(i)}, cursor=i + 1)
        await p.flush()
        await lakestream.checkpoint(store, "c", 4)
        with anyio.fail_after(10):
            while (await lakestream.load_state(store)).first_step != 4 or len(await store.list("segments/")) != 2:
                await anyio.sleep(0.02)
    state = await lakestream.load_state(store)
    assert sorted(await store.list("segments/")) == sorted(s.segment for s in state.steps)
