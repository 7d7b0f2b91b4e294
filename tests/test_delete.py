"""`lakestream delete URL --yes`: every object of the stream goes, in an order that leaves a valid
older stream (or none) at every moment; it refuses while producers are live."""

from __future__ import annotations

import pytest
from cliutil import describe, run_cli

import lakestream
from lakestream import StreamInUse, StreamNotFound
from lakestream._layout import LOG_PREFIX, SEGMENTS_PREFIX
from lakestream._store import MemoryStore, open_store


async def test_delete_on_the_command_line(stream_url: str) -> None:
    url = stream_url
    run_cli("init", url, "--world-size", 2, "--global-batch", 4, check=True)
    run_cli("produce", url, "--producer-id", "p", "--synthetic", 40, "--sample-size", 64, check=True)
    r = run_cli("delete", url, check=False)
    assert r.returncode == 2 and "holds" in r.stderr and "run again with --yes" in r.stderr, describe(r)
    assert (await lakestream.load_state(url)).head == 9  # nothing deleted
    r = run_cli("delete", url, "--yes", check=True)
    assert r.stdout.startswith(f"deleted {url}: ") and " objects (" in r.stdout
    async with open_store(url) as store:
        assert await store.list("") == []
    r = run_cli("status", url, check=False)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "no stream here" in r.stderr, describe(r)
    r = run_cli("delete", url, "--yes", check=True)  # nothing left: nothing to do
    assert r.stdout.strip() == f"deleted {url}: 0 objects (0.0 MB)"
    run_cli("init", url, "--world-size", 2, "--global-batch", 4, check=True)  # a new stream where it was
    assert (await lakestream.load_state(url)).head == -1


async def test_delete_refuses_while_a_producer_is_live_and_a_delete_cut_short_leaves_a_valid_stream() -> None:
    store = MemoryStore()
    await lakestream.create(store, world_size=1, global_batch=2, snapshot_every=3)
    async with lakestream.open_producer(store, "p") as p:
        for i in range(20):
            await p.put({"__key__": f"k{i}", "txt": b"x"}, cursor=i + 1)
        with pytest.raises(StreamInUse, match="producers p wrote records in the last 120 s"):
            await lakestream.delete(store)
    assert (await lakestream.load_state(store)).producers["p"].finished  # closed: its source ended, it is done

    from lakestream._lifecycle import delete

    log = sorted(await store.list(LOG_PREFIX))
    assert len(log) > 3 and await store.list(SEGMENTS_PREFIX)
    # A delete that stops after any part of its work leaves a valid stream (or none).
    real = store.delete
    calls = 0

    async def cut_short(keys: list[str]) -> None:
        nonlocal calls
        calls += 1
        for k in keys[:1] if calls > 2 else keys:  # the third request on removes one key, then it stops
            await real([k])
        if calls > 2:
            raise KeyboardInterrupt

    for _ in range(len(log) + 3):
        store.delete = cut_short  # type: ignore[method-assign]
        calls = 0
        try:
            await delete(store)
            break
        except KeyboardInterrupt:
            pass
        finally:
            store.delete = real  # type: ignore[method-assign]
        try:
            state = await lakestream.load_state(store)
        except StreamNotFound:
            continue
        assert (await lakestream.verify(store)).ok, "what a delete cut short left is not a valid stream"
        assert state.head <= 9
    assert await store.list("") == []


async def test_delete_refuses_while_a_training_job_reads_the_stream() -> None:
    import time

    from lakestream._lifecycle import delete

    store = MemoryStore()
    await lakestream.create(store, world_size=1, global_batch=2)
    async with lakestream.open_producer(store, "p") as p:
        for i in range(4):
            await p.put({"__key__": f"k{i}", "txt": b"x"}, cursor=i + 1)
    async with lakestream.open_reader(store, 0, job="eval") as r:
        async for _ in r.steps(0, 2):
            pass
    with pytest.raises(StreamInUse, match=r"training jobs read it within the last 60 s: 'eval' \("):
        await lakestream.delete(store)
    assert await store.list(SEGMENTS_PREFIX)
    await delete(store, wall=lambda: time.time() + 61)  # a minute later the job is not live
    assert await store.list("") == []
