"""The torture test, short version (the harness is the package `tests/torture/`; run it standalone
for a long run: `.venv/bin/python tests/torture.py --minutes 10`).

4 producer processes killed at random, Python and FUSE-mount readers of both ranks killed at random,
the mount daemon killed, GC every few seconds, checkpoints, one rewind, injected store faults —
all at once against the real S3 server — then every source record must be in exactly one step of
the final history, every reader must have seen the same history, and the bytes left after a final
GC must match the retained steps. The second test makes that rewind a replay (`rewind
--skip-steps`): a record may then be in one skipped TGB instead, and no producer is fenced; and
it forks the stream after the replay (`lakestream fork`) and runs the producers on the fork too:
the fork's history is the source's below the fork step and its own after, every source record in
exactly one step of it. See the harness's docstring (tests/torture/__init__.py) for the details,
and tests/torture/checker.py for each check.

Below it, fast in-memory reproductions of library bugs the torture test found.
"""

from __future__ import annotations

import os
import re

import anyio
import pytest
import torture

import lakestream
from lakestream._store import MemoryStore
from lakestream.testing import FaultyStore, log_key

MOUNT = os.path.exists("/dev/fuse") and os.access("/dev/fuse", os.R_OK | os.W_OK)


def _count(figure: str, label: str) -> int:
    m = re.search(rf"{label} (\d+)", figure)
    assert m is not None, (label, figure)
    return int(m[1])


@pytest.mark.s3
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_torture(s3_server, s3_url, tmp_path):  # type: ignore[no-untyped-def]
    cfg = torture.Config(seconds=45, seed=20241129, rate=10.0, mount=MOUNT)
    report = torture.run(cfg, s3_url, s3_server.env(), tmp_path)
    print("\n" + report.summary())
    assert report.ok, "\n".join(report.failures)
    f = report.figures
    # the chaos really happened
    assert _count(f["kills"], "producers") >= 5, f["kills"]
    assert _count(f["kills"], "Python readers") + _count(f["kills"], "mount readers") >= 1, f["kills"]
    if MOUNT:
        assert _count(f["kills"], "mount daemons") >= 1, f["kills"]
    assert f["rewinds"].startswith("1 "), f["rewinds"]
    assert int(f["fenced"].split()[0]) >= 1, f["fenced"]  # producers fenced by the rewind
    assert int(f["gc_runs"].split()[0]) >= 3, f["gc_runs"]
    assert int(f["faults_injected"].split()[0]) >= 50, f["faults_injected"]
    reclaimed = int(re.search(r"\((\d+) reclaimed", f["steps"])[1])  # type: ignore[index]
    assert reclaimed > 0, f["steps"]
    assert f["checkpoints"] >= 5


@pytest.mark.s3
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_torture_with_a_replay(s3_server, s3_url, tmp_path):  # type: ignore[no-untyped-def]
    """The same, shorter, with the half-way rewind a replay (`rewind --skip-steps`): no producer is
    fenced, every source record is in one step or in one skipped TGB, the rest replayed in order.
    After it, a fork at the next checkpoint with the producers run on it too (killed as well)."""
    cfg = torture.Config(seconds=30, seed=20241202, rate=10.0, mount=MOUNT, replay=True, fork=True)
    report = torture.run(cfg, s3_url, s3_server.env(), tmp_path)
    print("\n" + report.summary())
    assert report.ok, "\n".join(report.failures)
    f = report.figures
    assert f["rewinds"].startswith("1 ") and "'skip'" in f["rewinds"], f["rewinds"]
    assert int(f["skipped"].split()[0]) >= 1, f["skipped"]
    assert int(f["fenced"].split()[0]) == 0, f["fenced"]
    assert _count(f["kills"], "producers") >= 3, f["kills"]
    assert f["fork"].startswith("at step ") and "4 first resumes at the fork step checked" in f["fork"], f["fork"]
    assert int(re.search(r"(\d+) SIGKILLs", f["fork"])[1]) >= 1, f["fork"]  # type: ignore[index]
    assert "forks read its steps" in f["fork"] and "unfork (and gc): the source's first step" in f["fork"], f["fork"]


# -- bugs found by the torture test, reproduced in memory --------------------------------------------


async def test_gc_keeps_the_uploads_of_a_producer_held_by_back_pressure() -> None:
    """Found with a 1 s orphan grace: a TGB uploaded, then held by back-pressure past the grace,
    was deleted by GC as an orphan and then committed. Back-pressure now holds the source before
    the upload: nothing waits uploaded, and nothing is stored beyond `max_steps_ahead`."""
    store = MemoryStore("bp")
    await lakestream.create(store, world_size=1, global_batch=1, max_steps_ahead=1)

    def segments() -> int:
        return sum(1 for k in store.objects if k.startswith("segments/"))

    async with lakestream.open_producer(store, "p") as p:
        await p.put({"__key__": "k0", "txt": "a"}, cursor=1)
        await p.flush()  # step 0 committed: head - base == max_steps_ahead, no room
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: p.put({"__key__": "k1", "txt": "b"}, cursor=2))  # held: no room
            await anyio.sleep(1.2)
            assert segments() == 1 and p.stats.backpressure_waits > 0  # k1 not uploaded
            await lakestream.gc(store, orphan_grace=1.0, force_grace=True)  # below the floor on purpose
            await lakestream.checkpoint(store, "c0", 0)  # room again: k1 is uploaded and committed
        await p.flush()
    report = await lakestream.verify(store)
    assert report.ok, report.problems
    assert report.samples == 2


async def test_reader_survives_two_fetches_that_refresh_at_once() -> None:
    inner = MemoryStore("race")
    await lakestream.create(inner, world_size=1, global_batch=1)
    async with lakestream.open_producer(inner, "p") as p:
        for i in range(3):
            await p.put({"__key__": f"k{i}", "txt": "x"}, cursor=i + 1)
    st = await lakestream.load_state(inner)
    slow = log_key(st.version + 1)

    async def hook(op: str, key: str) -> None:  # each GET of the next log version takes a while
        if op == "get" and key == slow:
            await anyio.sleep(0.2)

    async with lakestream.open_reader(FaultyStore(inner, hook=hook), 0, prefetch=4) as r:
        await lakestream.checkpoint(inner, "c", 0)  # a version the reader has not seen yet
        await inner.delete([st.step(1).segment, st.step(2).segment])  # type: ignore[union-attr]
        it = r.steps(0)
        await it.__anext__()  # prefetches steps 1 and 2: both fail, both refresh the manifest
        for step in (1, 2):
            with pytest.raises((lakestream.CorruptData, lakestream.StepUnavailable)):
                await r.read_step(step)  # step 2: ValueError: apply: version N does not follow N


@pytest.mark.parametrize("skip", [(), ((2, 2),)], ids=["rewind", "replay"])
async def test_rewind_is_applied_once_when_its_put_is_ambiguous(skip: tuple[tuple[int, int], ...]) -> None:
    inner = MemoryStore("rw")
    await lakestream.create(inner, world_size=1, global_batch=1)
    async with lakestream.open_producer(inner, "p") as p:
        for i in range(4):
            await p.put({"__key__": f"k{i}", "txt": "x"}, cursor=i + 1)
    await lakestream.checkpoint(inner, "c1", 1)
    calls = 0

    def first_log_put(op: str, key: str) -> bool:
        nonlocal calls
        if op == "put_if_absent" and key.startswith("_lakestream/log/"):
            calls += 1
            return calls == 1
        return False

    faulty = FaultyStore(inner, ambiguous_put=1.0, only=first_log_put)
    state = await lakestream.rewind(faulty, to_checkpoint="c1", skip=skip)
    assert state.rewinds == 1  # 2: the retry did not recognise its own landed record
    if skip:  # a replay: steps 2 and 3 again but step 2, nobody fenced
        assert state.head == 2 and [k.step.step for k in state.skipped] == [2] and state.producers["p"].epoch == 1
    else:
        assert state.producers["p"].epoch == 2


async def test_reader_raises_at_once_when_a_rewind_discards_what_it_read() -> None:
    store = MemoryStore("rr")
    await lakestream.create(store, world_size=1, global_batch=1)
    async with lakestream.open_producer(store, "p") as p:
        for i in range(10):
            await p.put({"__key__": f"k{i}", "txt": "x"}, cursor=i + 1)
    await lakestream.checkpoint(store, "c", 4)
    async with lakestream.open_reader(store, 0, poll_interval=(0.005, 0.05)) as r:
        it = r.steps(0)
        for _ in range(10):
            await it.__anext__()  # steps 0..9
        await lakestream.rewind(store, to_checkpoint="c")  # discards 5..9, read already
        with anyio.fail_after(2), pytest.raises(lakestream.StepUnavailable):
            await it.__anext__()  # waits for step 10 instead


async def test_reader_of_a_discarded_step_collected_by_gc_gets_step_unavailable() -> None:
    store = MemoryStore("dg")
    await lakestream.create(store, world_size=1, global_batch=1)
    async with lakestream.open_producer(store, "p") as p:
        for i in range(10):
            await p.put({"__key__": f"k{i}", "txt": "x"}, cursor=i + 1)
    await lakestream.checkpoint(store, "c", 4)
    async with lakestream.open_reader(store, 0, prefetch=0) as r:
        it = r.steps(0)
        for _ in range(7):
            await it.__anext__()  # steps 0..6; the reader knows of 7..9
        await lakestream.rewind(store, to_checkpoint="c")  # discards 5..9
        await lakestream.gc(store)  # their segments can never be committed: deleted
        with pytest.raises(lakestream.StepUnavailable):
            await it.__anext__()  # step 7 of the discarded history: CorruptData "segment ... missing"
