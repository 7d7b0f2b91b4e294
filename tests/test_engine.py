"""Producers and readers racing real coroutines, with faults injected through a wrapping store."""

from __future__ import annotations

import os
import random
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import lakestream
from lakestream import (
    ConfigMismatch,
    CorruptData,
    InvalidSample,
    ProducerFenced,
    StreamNotFound,
)
from lakestream._manifest import Manifest, log_key, snapshot_key
from lakestream._producer import Producer
from lakestream._records import RegisterRecord
from lakestream._store import FileStore, MemoryStore
from lakestream.testing import FaultyStore

W, B = 3, 6


@pytest.fixture(params=["memory", "file"])
async def store(request: pytest.FixtureRequest, tmp_path):
    s = MemoryStore() if request.param == "memory" else FileStore(tmp_path / "stream", durable=False)
    await lakestream.create(s, world_size=W, global_batch=B, snapshot_every=7)
    yield s


async def produce(store, pid: str, n: int, *, flush_every: int = 0, **kw) -> Producer:
    async with lakestream.open_producer(store, pid, **kw) as p:
        for i in range(p.cursor or 0, n):
            await p.put({"__key__": f"{pid}-{i}", "txt": f"{pid} {i}", "arr": np.full(3, i)}, cursor=i + 1)
            if flush_every and (i + 1) % flush_every == 0:
                await p.flush()
    return p


async def read_all(store, rank: int) -> list[lakestream.RankBatch]:
    state = await lakestream.load_state(store)
    async with lakestream.open_reader(store, rank) as r:
        return [b async for b in r.steps(state.first_step, state.head + 1)]


async def test_every_sample_once_and_ranks_agree(store) -> None:
    # All four register before any puts: a producer that ran through its source before the others
    # registered would be the last to finish, as far as the stream knew, and pack its leftover alone.
    registered, go = [0], anyio.Event()

    async def one(pid: str) -> None:
        async with lakestream.open_producer(store, pid) as p:
            registered[0] += 1
            if registered[0] == 4:
                go.set()
            await go.wait()
            for i in range(40):
                await p.put({"__key__": f"{pid}-{i}", "txt": f"{pid} {i}", "arr": np.full(3, i)}, cursor=i + 1)

    async with anyio.create_task_group() as tg:
        for k in range(4):
            tg.start_soon(one, f"p{k}")
    state = await lakestream.load_state(store)
    # 6 full TGBs each, then the last to finish packs the 4 x 4 left over: 2 whole global batches and a short last one
    assert state.head == 4 * 6 + 3 - 1
    assert [s.samples for s in state.steps if s.samples < B] == [4] and state.steps[-1].samples == 4
    per_rank = [await read_all(store, r) for r in range(W)]
    keys = Counter(s["__key__"] for batches in per_rank for b in batches for s in b.samples)
    assert keys == Counter(f"p{k}-{i}" for k in range(4) for i in range(40))
    for batches in per_rank:
        assert [b.step for b in batches] == list(range(state.head + 1))
        assert [(b.producer, b.version) for b in batches] == [(b.producer, b.version) for b in per_rank[0]]
    # one TGB per step: all of its samples come from one producer (or the leftovers it packs)
    for step in range(state.head + 1):
        owners = {s["__key__"].split("-")[0] for batches in per_rank for s in batches[step].samples}
        packed = state.step(step).packed
        assert owners == ({pid for pid, _, _ in packed} if packed else {state.step(step).producer})
    assert (await lakestream.verify(store)).ok


async def test_the_first_step_is_fetched_alone_then_each_step_ahead_of_its_prefetches() -> None:
    """The first batch has the store to itself (no prefetch competes with it); after it, a step's
    own fetch starts before the prefetches it triggers."""
    store = MemoryStore()
    await lakestream.create(store, world_size=W, global_batch=B)
    await produce(store, "p", 8 * B)
    segments = {s.segment: s.step for s in (await lakestream.load_state(store)).steps}
    events: list[tuple[str, int]] = []
    get_range = store.get_range

    async def logged(key: str, offset: int, length: int) -> bytes:
        events.append(("start", segments[key]))
        await anyio.sleep(0.01)
        data = await get_range(key, offset, length)
        events.append(("end", segments[key]))
        return data

    store.get_range = logged  # type: ignore[method-assign]
    async with lakestream.open_reader(store, 0, prefetch=3) as r:
        got = [b.step async for b in r.steps(0, 8)]
    assert got == list(range(8))
    assert events[:3] == [("start", 0), ("end", 0), ("start", 1)], events
    starts = [step for what, step in events if what == "start"]
    assert starts == sorted(starts), events  # each step's fetch starts before any later step's


async def test_started_fetches_run_at_once_on_a_slow_store_and_on_one_task_where_none_waits() -> None:
    """As many fetches are in flight as were started when the store makes them wait; when none waits
    (a page-cached read) one fetcher task runs them all, not a task started per fetch."""
    store = MemoryStore()
    await lakestream.create(store, world_size=W, global_batch=B)
    await produce(store, "p", 40 * B)
    get_range = store.get_range
    delay = [0.05]
    flight, tasks = [0, 0], set()

    async def logged(key: str, offset: int, length: int) -> bytes:
        tasks.add(anyio.get_current_task().id)
        flight[0] += 1
        flight[1] = max(flight)
        if delay[0]:
            await anyio.sleep(delay[0])
        flight[0] -= 1
        return await get_range(key, offset, length)

    store.get_range = logged  # type: ignore[method-assign]
    async with lakestream.open_reader(store, 0, prefetch=6, prefetch_seconds=0) as r:
        assert [b.step async for b in r.steps(0, 12)] == list(range(12))
    assert flight[1] == 7, flight  # the step asked for and the 6 after it
    delay[0] = 0
    flight[1] = 0
    tasks.clear()
    async with lakestream.open_reader(store, 0, prefetch=6, prefetch_seconds=0) as r:
        assert [b.step async for b in r.steps(0, 40)] == list(range(40))
    assert flight[1] == 1 and len(tasks) <= 2, (flight, tasks)


async def test_a_reader_closed_while_a_fetch_finishes_past_its_cancellation_closes_cleanly() -> None:
    """Fetches queued as the reader closes, with a fetcher just started for them and fetches in
    flight that cannot be cancelled (a read in a worker thread): no fetcher is started once the
    reader is closing, and the close raises nothing."""
    store = MemoryStore()
    await lakestream.create(store, world_size=W, global_batch=B)
    await produce(store, "p", 20 * B)
    get_range = store.get_range

    async def uncancellable(key: str, offset: int, length: int) -> bytes:
        with anyio.CancelScope(shield=True):
            await anyio.sleep(0.05)
        return await get_range(key, offset, length)

    store.get_range = uncancellable  # type: ignore[method-assign]
    async with lakestream.open_reader(store, 0, prefetch=1, prefetch_seconds=0) as r:
        r.max_prefetch_bytes = 1 << 40
        first = await r.read_step(0)
        for step in range(1, 12):
            r._start(r.state.step(step))  # queued, a fetcher started for them: the close begins first
    assert first.step == 0


async def _ahead_when_asked(
    step_time: float, store: Any = None, advised: list[int] | None = None, cold: bool = False, **options: Any
) -> list[int]:
    """How far past each step asked for (after the first) the reader had started fetching, for a
    consumer that takes `step_time` seconds of the reader's clock per step; with `advised`, how
    far it had looked to have the page cache read ahead (`FileStore.in_page_cache`) is appended
    to it. `cold`: the stream's segments are dropped from the page cache first (a FileStore's)."""
    store = store or MemoryStore()
    await lakestream.create(store, world_size=W, global_batch=B)
    await produce(store, "p", 60 * B)
    segments = {s.segment: s.step for s in (await lakestream.load_state(store)).steps}
    for key in segments if cold else ():
        fd = os.open(store.root / key, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # written and fsynced: clean pages, dropped
        finally:
            os.close(fd)
    started: set[int] = set()
    cached: set[int] = set()
    get_range = store.get_range

    async def logged(key: str, offset: int, length: int) -> bytes:
        started.add(segments[key])
        return await get_range(key, offset, length)

    store.get_range = logged  # type: ignore[method-assign]
    if hasattr(store, "read_here"):  # a FileStore's reads made at once
        read_here = store.read_here

        def logged_here(key: str, offset: int, length: int) -> bytes | None:
            data = read_here(key, offset, length)
            if data is not None and key in segments:  # not a read of the log
                started.add(segments[key])
            return data

        store.read_here = logged_here
    if advised is not None:
        in_page_cache = store.in_page_cache

        def noted(key: str, offset: int, length: int) -> bool:
            cached.add(segments[key])
            return bool(in_page_cache(key, offset, length))

        store.in_page_cache = noted
    t = [0.0]
    ahead: list[int] = []
    async with lakestream.open_reader(store, 0, clock=lambda: t[0], **options) as r:
        async for b in r.steps(0, 40):
            if b.step > 0:
                ahead.append(max(started) - b.step)
                if advised is not None:
                    advised.append(max(cached, default=b.step) - b.step)  # 0: none
            t[0] += step_time
    return ahead


async def test_prefetch_keeps_about_a_second_of_a_fast_consumers_steps_in_flight() -> None:
    """At 20 steps a second the reader fetches ~20 steps ahead, not just `prefetch` (2), so a step's
    slowest GET has a second to land; a consumer at 1 step a second keeps `prefetch` ahead."""
    fast = await _ahead_when_asked(0.05, prefetch=2)
    assert 18 <= max(fast) <= 20, fast
    assert max(await _ahead_when_asked(1.0, prefetch=2)) == 2
    assert max(await _ahead_when_asked(0.05, prefetch=2, prefetch_seconds=0)) == 2  # adaptation off
    assert max(await _ahead_when_asked(0.05, prefetch=0)) == 0  # no prefetch at all


@pytest.mark.parametrize(("prefetch", "step_time"), [(2, 0.05), (5, 0.05), (5, 1.0), (0, 0.05)])
async def test_a_local_file_store_fetches_the_next_step_and_reads_the_rest_into_the_page_cache(
    prefetch: int, step_time: float, tmp_path: Path
) -> None:
    """A local `file://` store's reads have no latency to cover but a disk's: a consumer, fast or
    slow, has the next step fetched into memory there and, once a read waited for the disk, the
    `prefetch` steps past the one asked for read into the page cache, not a second's worth
    fetched (slices that only hold memory, copied long before they are read); with `prefetch=0`,
    neither."""
    store = FileStore(tmp_path / "s")
    if not store.reads_tell(1 << 20):
        pytest.skip(f"{tmp_path} is not on a local disk (a memory filesystem has no page cache to read ahead into)")
    advised: list[int] = []
    ahead = await _ahead_when_asked(step_time, store, advised, cold=True, prefetch=prefetch)
    assert max(ahead) == min(prefetch, 1), ahead
    assert max(advised) == (prefetch if prefetch > 1 else 0), advised
    assert store.waits >= 1  # the first read: the page cache had been emptied of the stream


async def test_a_stream_in_the_page_cache_is_read_without_a_look_at_it(tmp_path: Path) -> None:
    """Where every read of a local disk finds the page cache holding its slice, the reader never
    looks at what it holds (an open and a read a step); a consumer back for each step at once
    (here within 50 µs) has no step fetched into memory ahead: it could not use one."""
    store = FileStore(tmp_path / "s")
    advised: list[int] = []
    ahead = await _ahead_when_asked(50e-6, store, advised, prefetch=4)
    assert store.waits == 0 and max(advised) == 0 and max(ahead) == 0, (store.waits, advised, ahead)
    slow = FileStore(tmp_path / "slow")
    assert max(await _ahead_when_asked(0.01, slow, prefetch=4)) == 1


async def test_a_local_fork_of_a_remote_stream_prefetches_a_seconds_worth(tmp_path: Path, s3_url: str) -> None:
    """A `file://` fork reads its shared steps from its source: from S3 those have latency to
    cover, so once it reads one it fetches a second of a fast consumer's steps ahead again."""
    await lakestream.create(s3_url, world_size=W, global_batch=B)
    await produce(s3_url, "p", 30 * B)
    fork = f"file://{tmp_path / 'fork'}"
    await lakestream.fork(s3_url, fork, at_step=20)
    t = [0.0]
    async with lakestream.open_reader(fork, 0, prefetch=2, clock=lambda: t[0]) as r:
        assert r._local  # before any shared step is read
        async for _ in r.steps(0, 15):
            t[0] += 0.05
        assert not r._local and r.prefetch_depth() > 2


async def test_a_reader_lets_go_of_each_fetch_once_its_step_is_read() -> None:
    """The fetches a reader holds are the steps prefetched past the one read, never the ones read
    (their slices would stay in memory): after each step, none at or below it, at most the
    prefetch depth above it; a step read again is fetched again."""
    store = MemoryStore()
    await lakestream.create(store, world_size=W, global_batch=B)
    await produce(store, "p", 60 * B)
    t = [0.0]
    async with lakestream.open_reader(store, 0, prefetch=2, clock=lambda: t[0]) as r:
        async for b in r.steps(0, 50):
            held = sorted(k[0] for k in r._fetches)
            assert all(s > b.step for s in held), (b.step, held)
            assert len(held) <= r.prefetch_depth() + 1, (b.step, held)
            t[0] += 0.05
        requests = r.requests
        again = await r.read_step(10)
        assert again.step == 10 and r.requests == requests + 1
        assert not any(k[0] <= 10 for k in r._fetches)


async def test_values_round_trip(store) -> None:
    async with lakestream.open_producer(store, "p") as p:
        await p.put({"__key__": "a", "txt": "héllo", "bin": b"\x00\x01", "npy": np.eye(2), "json": {"x": [1, 2]}})
    (batch,) = await read_all(store, 0)
    (s,) = batch.samples
    assert s["txt"] == "héllo" and s["bin"] == b"\x00\x01" and s["json"] == {"x": [1, 2]}
    assert (s["npy"] == np.eye(2)).all()


async def test_reader_waits_for_steps_committed_later(store) -> None:
    got: list[int] = []

    async def read() -> None:
        async with lakestream.open_reader(store, 1, poll_interval=(0.001, 0.01)) as r:
            async for b in r.steps(0, 5):
                got.append(b.step)

    async with anyio.create_task_group() as tg:
        tg.start_soon(read)
        await anyio.sleep(0.05)
        assert got == []
        await produce(store, "p", 5 * B)
    assert got == [0, 1, 2, 3, 4]


async def test_nothing_visible_before_the_commit_record(tmp_path) -> None:
    inner = MemoryStore()
    await lakestream.create(inner, world_size=W, global_batch=B)
    gate = anyio.Event()
    reached = anyio.Event()

    async def hook(op: str, key: str) -> None:
        segments = any(k.startswith("segments/") for k in inner.objects)
        if op == "put_if_absent" and key.startswith("_lakestream/log/") and segments and not gate.is_set():
            reached.set()
            await gate.wait()

    store = FaultyStore(inner, hook=hook)
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: produce(store, "p", B))
        await reached.wait()
        # the segment is uploaded and the commit is about to be put: readers see nothing yet
        assert (await lakestream.load_state(inner)).head == -1
        async with lakestream.open_reader(inner, 0) as r:
            with pytest.raises(TimeoutError):
                await r.wait_for_step(0, timeout=0.05)
        gate.set()
    state = await lakestream.load_state(inner)
    assert state.head == 0 and state.step(0).samples == B


async def test_a_wait_whose_timeout_ends_before_its_next_look_looks_once_however_fresh_the_view() -> None:
    """A read that just found the log's end counts as a wait's first look (no second read moments
    later), but a wait whose timeout ends before it would look again still looks once: a step
    committed since is found, not reported missing."""
    inner = MemoryStore()
    await lakestream.create(inner, world_size=1, global_batch=B)
    await produce(inner, "p", B)  # step 0
    t = [0.0]  # the reader's clock, still: every read of the log it makes is "just now"
    async with lakestream.open_reader(inner, 0, 1, clock=lambda: t[0]) as r:
        assert (await r.read_step(0)).step == 0
        reads = r.manifest.requests
        await produce(inner, "p", 2 * B)  # step 1, committed after the reader's view was confirmed
        entry = await r.wait_for_step(1, timeout=0)  # looks once although the view is fresh
        assert entry.step == 1 and r.manifest.requests > reads


async def test_ambiguous_commits_are_not_duplicated() -> None:
    inner = MemoryStore()
    await lakestream.create(inner, world_size=W, global_batch=B)
    store = FaultyStore(inner, ambiguous_put=0.4, only=lambda op, key: key.startswith("_lakestream/log/"))
    async with anyio.create_task_group() as tg:
        for k in range(3):
            tg.start_soon(lambda k=k: produce(store, f"p{k}", 10 * B, flush_every=B))
    assert store.injected["put_if_absent:ambiguous"] >= 5
    state = await lakestream.load_state(inner)
    assert state.head == 30 - 1 and not state.rejected
    batches = [b for r in range(W) for b in await read_all(inner, r)]
    keys = Counter(s["__key__"] for b in batches for s in b.samples)
    assert set(keys.values()) == {1} and len(keys) == 30 * B


async def test_transient_failures_are_retried() -> None:
    inner = MemoryStore()
    await lakestream.create(inner, world_size=W, global_batch=B)
    store = FaultyStore(inner, fail_before=0.2, rng=random.Random(3))
    await produce(store, "p", 8 * B)
    async with lakestream.open_reader(store, 2) as r:
        assert len([b async for b in r.steps(0, 8)]) == 8
    assert sum(store.injected.values()) >= 5


async def test_a_newer_incarnation_fences_the_older(store) -> None:
    old = Producer(store, "p")
    await old.__aenter__()
    try:
        for i in range(B):
            await old.put({"txt": str(i)}, cursor=i + 1)
        await old.flush()
        new = await produce(store, "p", 2 * B)  # resumes at cursor B, commits one more TGB
        assert new.epoch == old.epoch + 1
        with pytest.raises(ProducerFenced, match="another process registered as producer 'p'"):
            for i in range(B, 2 * B):
                await old.put({"txt": str(i)}, cursor=i + 1)
            await old.close()
    finally:
        await old.aclose()
    state = await lakestream.load_state(store)
    assert [s.epoch for s in state.steps] == [1, 2] and state.producers["p"].cursor == 2 * B


async def test_resume_cursor_and_partial_batches(store) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        async with lakestream.open_producer(store, "p") as p:
            for i in range(B + 2):
                await p.put({"txt": str(i)}, cursor=i + 1)
            await p.flush()
            raise RuntimeError("boom")
    state = await lakestream.load_state(store)
    assert state.head == 0 and state.producers["p"].cursor == B  # the partial TGB was abandoned
    p = await produce(store, "p", B + 2)
    assert p.stats.samples == 2
    state = await lakestream.load_state(store)
    assert state.head == 1 and state.step(1).samples == 2 and state.producers["p"].cursor == B + 2


async def test_snapshots_are_written_and_equal_replay(store) -> None:
    await produce(store, "p", 20 * B, flush_every=B)
    keys = await store.list("_lakestream/snapshots/")
    assert snapshot_key(7) in keys and snapshot_key(14) in keys
    # a reader starts from the newest snapshot; the state equals a full replay from version 0
    loaded = await Manifest(store).load()
    replayed = lakestream.State()
    for v in range(loaded.version + 1):
        replayed.apply(v, await store.get(log_key(v)))
    assert loaded.to_json() == replayed.to_json()


async def test_a_refresh_in_another_task_while_appending() -> None:
    """Back-pressure refreshes the producer's manifest from the putting task while the committer
    appends: a refresh may apply the version the append just won before the append does."""
    inner = MemoryStore()
    await lakestream.create(inner, world_size=1, global_batch=1)
    lat = {op: (0.002, 0.5) for op in ("get", "put", "put_if_absent")}
    store = FaultyStore(inner, latency=lat, rng=random.Random(3))
    m, other = Manifest(store), Manifest(store)
    await m.load()
    await other.load()
    done = anyio.Event()

    async def refresher() -> None:
        while not done.is_set():
            await m.refresh()

    async with anyio.create_task_group() as tg:
        tg.start_soon(refresher)
        for i in range(40):
            await m.append(lambda st, _, i=i: RegisterRecord("p", i + 1, "t"))
            await other.append(lambda st, _, i=i: RegisterRecord("q", i + 1, "t"))
        done.set()
    await m.refresh()
    assert m.state.producers["p"].epoch == 40 and m.state.producers["q"].epoch == 40 and not m.state.rejected


async def test_on_apply_sees_a_step_that_a_rewind_discards_in_the_same_refresh() -> None:
    store = MemoryStore()
    await lakestream.create(store, world_size=1, global_batch=1)
    m = Manifest(store)
    await m.load()
    async with lakestream.open_producer(store, "p") as p:
        for i in range(3):
            await p.put({"__key__": f"k{i}", "txt": "x"}, cursor=i + 1)
        await p.flush()
    await lakestream.checkpoint(store, "c", 0)
    await lakestream.rewind(store, to_step=0)
    seen: set[tuple[int, int]] = set()
    m.on_apply = lambda st: seen.update((s.step, s.version) for s in st.steps)
    await m.refresh()  # the commits and the rewind in one refresh
    assert m.state.head == 0 and {s for s, _ in seen} == {0, 1, 2}


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def _gc_log(store, manifest: Manifest) -> int:
    """What GC will do: snapshot the tail, point the hint at it, delete the log below it."""
    await manifest.refresh()
    v = manifest.state.version
    await manifest.write_snapshot(manifest.state.to_json(), v)
    await store.delete([log_key(i) for i in range(1, v)])
    return v


async def test_a_stalled_writer_cannot_resurrect_a_deleted_version() -> None:
    """ABA: the writer's put of version v+1 lands after v+1 was written by others and deleted."""
    store = MemoryStore()
    await lakestream.create(store, world_size=W, global_batch=B)
    clock = FakeClock()
    stalled = Manifest(store, clock=clock, lease=10.0)
    p = Producer(store, "zombie-free", manifest=stalled, clock=clock)
    await p.__aenter__()
    fired = False

    async def stall(op: str, key: str) -> None:
        nonlocal fired
        if op == "put_if_absent" and key.startswith("_lakestream/log/") and not fired:
            fired = True
            # while this put is on its way: others commit, GC truncates the log, a lease passes
            await produce(store, "other", 5 * B)
            await _gc_log(store, Manifest(store))
            clock.now += 100
            assert key not in store.objects  # the version it targets is gone: a put would land

    try:
        p.store = p.manifest.store = FaultyStore(store, hook=stall)
        for i in range(B):
            await p.put({"txt": str(i)}, cursor=i + 1)
        await p.close()
    finally:
        await p.aclose()
    assert fired
    state = await Manifest(store).load()
    mine = [s for s in state.steps if s.producer == "zombie-free"]
    assert len(mine) == 1 and state.producers["zombie-free"].cursor == B
    assert len(state.steps) == 6 and not state.rejected


async def test_a_long_stalled_writer_reloads_before_it_puts() -> None:
    store = MemoryStore()
    await lakestream.create(store, world_size=W, global_batch=B)
    clock = FakeClock()
    writer = Manifest(store, clock=clock, lease=10.0)
    await writer.load()
    await produce(store, "other", 3 * B)
    top = await _gc_log(store, Manifest(store))
    clock.now += 100
    result = await writer.append(lambda s, _: RegisterRecord("late", 1, "t"))
    assert result.version == top + 1
    assert (await Manifest(store).load()).producers["late"].epoch == 1


# -- bad input -----------------------------------------------------------------------------------


async def test_missing_stream(tmp_path) -> None:
    with pytest.raises(StreamNotFound, match="no stream"):
        async with lakestream.open_reader(tmp_path / "none", 0):
            pass
    with pytest.raises(StreamNotFound):
        async with lakestream.open_producer(tmp_path / "none", "p"):
            pass


async def test_config_mismatch(store) -> None:
    assert await lakestream.create(store, world_size=W, global_batch=B, snapshot_every=7) is False
    with pytest.raises(ConfigMismatch, match="world_size: stream has 3, asked for 4"):
        await lakestream.create(store, world_size=4, global_batch=B)
    with pytest.raises(ConfigMismatch, match="world size 5"):
        async with lakestream.open_reader(store, 0, world_size=5):
            pass
    with pytest.raises(ValueError, match="rank 3 is out of range"):
        async with lakestream.open_reader(store, 3):
            pass


async def test_bad_samples_commit_nothing_and_keep_the_producer_usable(store) -> None:
    async with lakestream.open_producer(store, "p") as p:
        with pytest.raises(InvalidSample, match="cursor"):
            await p.put({"txt": "x"}, cursor=object())
        await p.put({"__key__": "dup", "txt": "x"})
        with pytest.raises(InvalidSample, match="appears twice"):
            await p.put({"__key__": "dup", "txt": "y"})
        with pytest.raises(InvalidSample, match="'a/b'"):
            await p.put({"a/b": b""})
    state = await lakestream.load_state(store)
    assert state.head == 0 and state.step(0).samples == 1
    async with lakestream.open_producer(store, "c", cost=lambda s: float("nan")) as p:
        with pytest.raises(InvalidSample, match="cost of sample"):
            await p.put({"txt": "z"})


async def test_balanced_producer_evens_out_cost(store) -> None:
    async with lakestream.open_producer(store, "p", cost=lambda s: len(s["txt"])) as p:
        for n in [100, 1, 100, 1, 100, 1]:
            await p.put({"txt": "x" * n})
    loads = [sum(len(s["txt"]) for s in (await read_all(store, r))[0].samples) for r in range(W)]
    assert sorted(loads) == [101, 101, 101]


async def test_corrupted_segment_names_stream_step_rank_and_object(store) -> None:
    await produce(store, "p", B)
    state = await lakestream.load_state(store)
    seg = state.step(0).segment
    data = bytearray(await store.get(seg))
    r1 = state.step(0).ranks[1]
    data[r1.offset + r1.length - 1] ^= 0xFF
    await store.put(seg, bytes(data))
    async with lakestream.open_reader(store, 0) as r:
        assert len(await r.read_step(0)) == 2  # rank 0's slice is intact
    async with lakestream.open_reader(store, 1) as r:
        with pytest.raises(CorruptData) as e:
            await r.read_step(0)
    assert f"{store.url} step 0 rank 1 object {seg}" in str(e.value)
    report = await lakestream.verify(store)
    assert not report.ok and any("step 0 rank 1" in p and seg in p for p in report.problems)


async def test_malformed_log_record_is_skipped_by_everyone(store) -> None:
    await produce(store, "p", B)
    v = (await lakestream.load_state(store)).version
    await store.put(log_key(v + 1), b"{garbage")
    await produce(store, "q", B)
    state = await lakestream.load_state(store)
    assert state.head == 1 and [x[0] for x in state.rejected] == [v + 1]
    assert [len(b) for b in await read_all(store, 0)] == [2, 2]
    report = await lakestream.verify(store)
    assert not report.ok and f"log version {v + 1} is malformed" in report.problems[0]
