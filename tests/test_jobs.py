"""Several training jobs on one stream: each its own checkpoints and consumption mark.

Back-pressure follows the slowest live job, GC keeps every step any job's retained checkpoints
need, a rewind is refused while another job reads, and `job --retire` releases a job's hold.
(The state machine's part: test_state.py.)
"""

from __future__ import annotations

import time

import anyio
import orjson
import pytest
from cliutil import describe, run_cli

import lakestream
from lakestream import ConfigMismatch
from lakestream._layout import consumed_key
from lakestream._manifest import Manifest
from lakestream._store import MemoryStore


async def produce(store, pid: str, n: int, **kw) -> None:
    async with lakestream.open_producer(store, pid, **kw) as p:
        for i in range(p.cursor or 0, n):
            await p.put({"__key__": f"{pid}-{i}", "txt": f"{pid}:{i}"}, cursor=i + 1)


async def test_back_pressure_follows_the_slowest_live_job() -> None:
    store = MemoryStore()
    await lakestream.create(store, world_size=1, global_batch=1, max_steps_ahead=3)
    await produce(store, "p", 3)  # steps 0..2: the limit from no mark
    m = Manifest(store)
    await m.load()
    await m.append(lambda st, _: lakestream._decisions.job(st, "eval", time.time()))
    await m.publish_consumed(10, time.time())  # main far ahead
    await m.publish_consumed(1, time.time(), "eval")  # eval at step 1, live
    async with anyio.create_task_group() as tg:
        tg.start_soon(produce, store, "p", 30)
        with anyio.fail_after(20):
            while (await lakestream.load_state(store)).head < 4:
                await anyio.sleep(0.02)
        await anyio.sleep(1.0)
        assert (await lakestream.load_state(store)).head == 4  # eval's step 1 + 3: held there
        await m.publish_consumed(1, time.time() - 120, "eval")  # eval's mark is old: it is not live
        with anyio.fail_after(20):
            while (await lakestream.load_state(store)).head < 13:
                await anyio.sleep(0.02)
        await anyio.sleep(1.0)
        assert (await lakestream.load_state(store)).head == 13  # main's step 10 + 3
        await m.publish_consumed(30, time.time())
    assert (await lakestream.load_state(store)).head == 29


async def test_each_job_checkpoints_gc_keeps_what_any_needs_and_a_rewind_waits_for_the_others() -> None:
    store = MemoryStore()
    await lakestream.create(store, world_size=1, global_batch=2, keep_checkpoints=1)
    await produce(store, "p", 20)  # steps 0..9
    async with lakestream.open_reader(store, 0, job="eval", poll_interval=(0.001, 0.01)) as r:
        assert (await lakestream.load_state(store)).jobs == ["eval"]  # a reading job is known at once
        it = r.steps(0)
        for _ in range(3):
            await it.__anext__()
        assert await r.checkpoint("c", 2, wait=True)  # same id as main's below: each job its own
        await it.aclose()
        with anyio.fail_after(10):
            while (await Manifest(store).read_consumed("eval")) is None:
                await anyio.sleep(0.05)
    assert await lakestream.checkpoint(store, "c", 7)
    assert await lakestream.checkpoint(store, "d", 8)  # main keeps one: c goes, eval's c stays
    state = await lakestream.load_state(store)
    assert [(c.job, c.id, c.step) for c in state.checkpoints] == [("eval", "c", 2), ("main", "d", 8)]
    await lakestream.gc(store, orphan_grace=0, force_grace=True)
    assert (await lakestream.load_state(store)).first_step == 2  # eval's checkpoint holds steps 2..
    with pytest.raises(ConfigMismatch, match=r"job 'eval' \(at step 1\) reads this stream too"):
        await lakestream.rewind(store, to_checkpoint="d")
    with pytest.raises(lakestream.StepUnavailable, match="no retained checkpoint 'd' of job 'eval'"):
        await lakestream.rewind(store, to_checkpoint="d", job="eval")  # main publishes no mark: not live
    assert await lakestream.retire_job(store, "eval") and not await lakestream.retire_job(store, "eval")
    assert await store.list(consumed_key("eval")) == []
    state = await lakestream.rewind(store, to_checkpoint="d")
    assert state.head == 8 and state.jobs == [] and [c.id for c in state.checkpoints] == ["d"]
    await lakestream.gc(store, orphan_grace=0, force_grace=True)
    assert (await lakestream.load_state(store)).first_step == 8


def test_jobs_on_the_command_line(stream_url: str, tmp_path) -> None:
    url = stream_url
    run_cli("init", url, "--world-size", 1, "--global-batch", 2, check=True)
    run_cli("produce", url, "--producer-id", "p", "--synthetic", 20, "--sample-size", 8, check=True)
    r = run_cli("read", url, "--rank", 0, "--job", "eval", "--to-step", 3, check=True)
    r = run_cli("checkpoint", url, "--id", "e1", "--step", 3, "--job", "eval", check=True)
    assert r.stdout.strip() == "checkpoint e1 of job eval at step 3: recorded"
    run_cli("checkpoint", url, "--id", "m1", "--step", 6, check=True)
    jobs = orjson.loads(run_cli("job", url, "--json", check=True).stdout)["jobs"]
    assert [(j["job"], [c["id"] for c in j["checkpoints"]]) for j in jobs] == [("main", ["m1"]), ("eval", ["e1"])]
    eval_job = jobs[1]
    assert eval_job["consumed"] in (2, 3) and eval_job["lag"] == 9 - eval_job["consumed"], jobs
    text = run_cli("status", url, check=True).stdout
    assert "job eval: consumed step" in text and "checkpoints e1@3" in text, text
    r = run_cli("rewind", url, "--to-checkpoint", "m1", check=False)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1 and "job 'eval'" in lines[0] and "--retire" in lines[0], describe(r)
    r = run_cli("read", url, "--rank", 0, "--job=bad/name", check=False)
    assert r.returncode == 2 and "job name" in r.stderr, describe(r)
    assert run_cli("job", url, "--retire", "eval", check=True).stdout.strip() == (
        "job eval: retired, its checkpoints dropped"
    )
    run_cli("rewind", url, "--to-checkpoint", "m1", check=True)
    state = orjson.loads(run_cli("status", url, "--json", check=True).stdout)
    assert state["head_step"] == 6 and [j["job"] for j in state["jobs"]] == ["main"]


def test_stream_dataset_and_checkpoint_hook_of_a_job(tmp_path) -> None:
    from lakestream.torch import StreamDataset, checkpoint_hook

    url = f"file://{tmp_path}/s"
    anyio.run(lambda: lakestream.create(url, world_size=1, global_batch=2))
    anyio.run(produce, url, "p", 12)
    items = list(StreamDataset(url, rank=0, world_size=1, stop=4, job="eval"))
    assert [it["step"] for it in items] == [0, 1, 2, 3]
    assert checkpoint_hook(url, rank=0, job="eval")(3, wait=True)

    async def look() -> tuple[lakestream.State, int | None]:
        return await lakestream.load_state(url), await Manifest(lakestream.open_store(url)).read_consumed("eval")

    state, mark = anyio.run(look)
    assert state.jobs == ["eval"] and [(c.job, c.id) for c in state.checkpoints] == [("eval", "step-3")]
    assert mark is not None and 2 <= mark <= 3
    with pytest.raises(ValueError, match="job name"):
        StreamDataset(url, rank=0, world_size=1, job="no/slash")
