"""End of stream: a close record ends it after a step; producers stop there, readers end there."""

from __future__ import annotations

import time

import anyio
import orjson
import pytest
from cliutil import describe, run_cli, spawn_cli, wait_until

import lakestream
from lakestream import StreamClosed
from lakestream import _decisions as decisions
from lakestream._layout import segment_key
from lakestream._records import CommitRecord, RegisterRecord, TgbRef, encode_record
from lakestream._state import Config, State
from lakestream._store import FileStore


def pending(seqs: range) -> list[decisions.PendingTgb]:
    return [decisions.PendingTgb(i, TgbRef(segment_key("p", 1, i, 0.0), ((0, 1, 0, 1),), i + 1)) for i in seqs]


def stream(steps: int) -> State:
    """A stream of one producer `p` (epoch 1) that committed `steps` steps of one sample."""
    state = State()
    state.apply(0, encode_record(decisions.create(Config(world_size=1, global_batch=1), 0.0)))
    state.apply(1, encode_record(RegisterRecord("p", 1, "t", 0.0)))
    if steps:
        state.apply(2, encode_record(CommitRecord("p", 1, 0, tuple(t.ref for t in pending(range(steps))), 0, 0.0)))
    return state


def append(state: State, record: object) -> None:
    assert record is not None
    assert state.apply(state.version + 1, encode_record(record)) is None  # type: ignore[arg-type]


def test_close_and_reopen_decisions() -> None:
    state = stream(3)
    with pytest.raises(ValueError, match="steps up to 2 are committed"):
        decisions.close(state, 1, 0.0)
    append(state, decisions.close(state, None, 0.0))  # at the head
    assert state.closed_after == 2 and state.ended
    assert decisions.close(state, None, 0.0) is None and decisions.close(state, 2, 0.0) is None  # closed there
    with pytest.raises(ValueError, match="closed already after step 2; reopen"):
        decisions.close(state, 5, 0.0)
    append(state, decisions.reopen(state, 0.0))
    assert state.closed_after is None and decisions.reopen(state, 0.0) is None
    assert decisions.close(stream(0), -1, 0.0) is not None  # an empty stream, closed before step 0
    append(state, decisions.close(state, 4, 0.0))
    assert state.closed_after == 4 and not state.ended


def test_a_producer_commits_up_to_the_close_and_then_is_told() -> None:
    state = stream(3)
    append(state, decisions.close(state, 4, 0.0))
    record = decisions.commit(state, "p", 1, pending(range(3, 8)), 0, 0.0)
    assert record is not None and [record.seq, len(record.tgbs)] == [3, 2]  # steps 3 and 4, not past the close
    append(state, record)
    assert state.head == 4 and state.ended
    with pytest.raises(StreamClosed, match="closed after step 4: producer 'p' stops"):
        decisions.commit(state, "p", 1, pending(range(5, 8)), 0, 0.0)
    assert decisions.commit(state, "p", 1, pending(range(3, 5)), 0, 0.0) is None  # all landed: nothing to say


def test_combining_leaves_out_what_is_past_the_close() -> None:
    state = stream(3)
    append(state, decisions.close(state, 4, 0.0))
    intents = [CommitRecord("p", 1, 3, tuple(t.ref for t in pending(range(3, 8))), 0, 0.0)]
    group = decisions.combine(state, intents, now=0.0)
    assert group is not None and state.check(group) is None
    append(state, group)
    assert state.head == 4 and decisions.combine(state, intents, now=0.0) is None


# -- the API and the command line --------------------------------------------------------------


async def test_a_producer_after_the_close_is_told_and_continues_after_a_reopen(tmp_path) -> None:
    store = FileStore(tmp_path / "s", durable=False)
    await lakestream.create(store, world_size=1, global_batch=2)
    async with lakestream.open_producer(store, "p") as p:
        for i in range(6):
            await p.put({"__key__": f"k{i}", "txt": b"x"}, cursor=i + 1)
    state = await lakestream.close(store)
    assert state.closed_after == 2 and state.ended
    assert (await lakestream.close(store, after_step=2)).version == state.version  # closed there already
    with pytest.raises(ValueError, match="closed already after step 2"):
        await lakestream.close(store, after_step=3)
    with pytest.raises(StreamClosed, match="closed after step 2: producer 'p' stops"):
        async with lakestream.open_producer(store, "p") as p:
            for i in range(p.cursor, 8):
                await p.put({"__key__": f"k{i}", "txt": b"x"}, cursor=i + 1)
    state = await lakestream.load_state(store)
    assert state.head == 2 and state.producers["p"].cursor == 6 and not state.rejected
    assert (await lakestream.reopen(store)).closed_after is None
    async with lakestream.open_producer(store, "p") as p:
        for i in range(p.cursor, 8):
            await p.put({"__key__": f"k{i}", "txt": b"x"}, cursor=i + 1)
    state = await lakestream.load_state(store)
    assert state.head == 3 and state.producers["p"].cursor == 8


async def test_a_combining_producer_after_the_close_is_told(tmp_path) -> None:
    """Its declared TGBs are never combined past the close; it finds out when it catches up with the log."""
    store = FileStore(tmp_path / "s", durable=False)
    await lakestream.create(store, world_size=1, global_batch=2)
    async with lakestream.open_producer(store, "p") as p:
        for i in range(4):
            await p.put({"__key__": f"k{i}", "txt": b"x"}, cursor=i + 1)
    await lakestream.close(store, after_step=2)
    with anyio.fail_after(60), pytest.raises(StreamClosed, match="producer 'q' stops"):
        async with lakestream.open_producer(store, "q", combine=True) as p:
            for i in range(10):
                await p.put({"__key__": f"q{i}", "txt": b"x"}, cursor=i + 1)
    state = await lakestream.load_state(store)
    assert state.head == 2 and state.producers["q"].seq == 0 and not state.rejected


def test_close_reopen_status_and_produce_on_the_command_line(tmp_path) -> None:
    url = f"file://{tmp_path}/s"
    run_cli("init", url, "--world-size", 1, "--global-batch", 4, check=True)
    run_cli("produce", url, "--producer-id", "p", "--synthetic", 8, "--sample-size", 8, check=True)
    r = run_cli("close", url, "--after-step", 2, check=True)
    assert r.stdout.strip() == f"closed {url} after step 2 (it ends once the head, now step 1, reaches it); " \
        "nothing past it is committed"  # fmt: skip
    assert "closed after step 2: ends once the head reaches step 2" in run_cli("status", url, check=True).stdout
    r = run_cli("produce", url, "--producer-id", "q", "--synthetic", 8, "--sample-size", 8, check=False)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "the stream is closed after step 2: producer 'q' stops" in lines[0], describe(r)
    assert "closed after step 2: ended" in run_cli("status", url, check=True).stdout
    assert orjson.loads(run_cli("status", url, "--json", check=True).stdout)["closed_after"] == 2
    r = run_cli("close", url, check=True)  # at the head, 2: closed there already
    assert r.stdout.strip() == f"closed {url} after step 2; nothing past it is committed"
    r = run_cli("close", url, "--after-step", 5, check=False)
    assert r.stderr.strip().endswith("closed already after step 2; reopen it to close it after step 5"), describe(r)
    assert (
        run_cli("reopen", url, check=True).stdout.strip() == f"reopened {url}: producers may commit past the head again"
    )
    run_cli("produce", url, "--producer-id", "q", "--synthetic", 8, "--sample-size", 8, check=True)
    state = orjson.loads(run_cli("status", url, "--json", check=True).stdout)
    assert state["head_step"] == 3 and state["closed_after"] is None


# -- readers end -----------------------------------------------------------------------------------


@pytest.fixture
async def closing(stream_url: str):
    """A stream of world size 1 and global batch 2 at `stream_url`, and `put(n)`: commit steps up to n - 1."""
    await lakestream.create(stream_url, world_size=1, global_batch=2)

    async def put(n: int) -> None:
        async with lakestream.open_producer(stream_url, "p") as p:
            for i in range(p.cursor or 0, 2 * n):
                await p.put({"__key__": f"k{i}", "txt": b"x"}, cursor=i + 1)

    return stream_url, put


async def test_a_reader_with_no_stop_ends_after_the_close(closing) -> None:
    url, put = closing
    await put(2)
    with anyio.fail_after(60):
        async with lakestream.open_reader(url, 0, poll_interval=(0.01, 0.05)) as r:
            got: list[int] = []

            async def read() -> None:
                async for batch in r.steps(0):
                    got.append(batch.step)

            async with anyio.create_task_group() as tg:
                tg.start_soon(read)
                await lakestream.close(url, after_step=4)  # the head is 1: ends once it reaches 4
                await put(4)
                await anyio.sleep(0.3)
                assert got == [0, 1, 2, 3]  # still waiting for step 4
                with pytest.raises(StreamClosed):
                    await put(7)  # step 4 lands, the rest does not
            assert got == [0, 1, 2, 3, 4]
            assert [b.step async for b in r.steps(3)] == [3, 4]
            assert [b.step async for b in r.steps(5)] == []


def test_read_without_to_step_ends_at_the_close(tmp_path) -> None:
    url = f"file://{tmp_path}/s"
    run_cli("init", url, "--world-size", 1, "--global-batch", 4, check=True)
    run_cli("produce", url, "--producer-id", "p", "--synthetic", 12, "--sample-size", 8, check=True)
    run_cli("close", url, "--after-step", 3, check=True)
    reader = spawn_cli("read", url, "--rank", 0, "--json")
    try:
        time.sleep(1)
        assert reader.poll() is None  # waits for step 3
        run_cli("produce", url, "--producer-id", "q", "--synthetic", 4, "--sample-size", 8, check=True)
        out, err = reader.communicate(timeout=60)
    finally:
        reader.kill()
    lines = [orjson.loads(line) for line in out.splitlines()]
    assert [x["step"] for x in lines[:-1]] == [0, 1, 2, 3] and lines[-1]["to_step"] == 3, err
    assert reader.returncode == 0, err


def test_a_stream_dataset_with_no_stop_ends_at_the_close(tmp_path) -> None:
    torch_ = pytest.importorskip("torch")
    from lakestream.torch import StreamDataset

    url = f"file://{tmp_path}/s"
    run_cli("init", url, "--world-size", 1, "--global-batch", 4, check=True)
    run_cli("produce", url, "--producer-id", "p", "--synthetic", 12, "--sample-size", 8, check=True)
    run_cli("close", url, check=True)
    ds = StreamDataset(url, rank=0, world_size=1)
    assert [item["step"] for item in torch_.utils.data.DataLoader(ds, batch_size=None)] == [0, 1, 2]
    assert ds.state_dict() == {"next_step": 3, "done": True}
    loader = torch_.utils.data.DataLoader(StreamDataset(url, rank=0, world_size=1), batch_size=None, num_workers=2)
    assert sorted(item["step"] for item in loader) == [0, 1, 2]  # each worker's share ends


# -- closing once every producer has finished ------------------------------------------------------


async def log_records(url: str) -> list[object]:
    """Every record of the stream's log, in order."""
    from lakestream._manifest import Manifest
    from lakestream._records import decode_record

    async with lakestream.open_store(url) as store:
        m = Manifest(store)
        await m.load()
        out = []
        for v in range(m.state.version + 1):
            data = await m.read_version(v)
            assert data is not None, v
            out.append(decode_record(data))
        return out


async def test_close_when_done_waits_for_every_producer_and_closes_once(closing) -> None:
    """Three callers wait while producer q produces; once it has finished and packed its short last
    step, exactly one close record lands, after that step."""
    url, put = closing
    await put(2)  # producer p: steps 0 and 1, then it finishes
    waited: list[list[str]] = []
    closed: list[State] = []

    async def close_when_done() -> None:
        closed.append(await lakestream.close_when_done(url, waiting=waited.append))

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg, lakestream.open_producer(url, "q") as q:
            for _ in range(3):
                tg.start_soon(close_when_done)
            await anyio.sleep(0.5)
            assert not closed and ["q"] in waited  # q is still producing
            for i in range(5):  # steps 2 and 3, and one sample left for a short step 4
                await q.put({"__key__": f"q{i}", "txt": b"x"}, cursor=i + 1)
            await anyio.sleep(0.3)
            assert not closed
    state = await lakestream.load_state(url)
    assert [s.closed_after for s in closed] == [4, 4, 4] and state.closed_after == 4 and state.ended
    assert state.step(4).ranks[0].samples == 1  # the short last step
    records = await log_records(url)
    closes = [i for i, r in enumerate(records) if type(r).__name__ == "CloseRecord"]
    assert closes == [len(records) - 1], records[-3:]  # one close, the last record
    assert (await lakestream.close_when_done(url)).version == state.version  # closed already: nothing to add


def test_produce_close_when_done_waits_for_the_other_producers(stream_url: str) -> None:
    """p (with the flag) finishes first and waits for q (without it); when q has finished, p closes
    the stream after the short last step that q packed."""
    url = stream_url
    run_cli("init", url, "--world-size", 1, "--global-batch", 4, check=True)
    q = spawn_cli(
        "produce", url, "--producer-id", "q", "--synthetic", 100, "--sample-size", 8, "--rate", 10
    )  # 10 s: p starts and finishes meanwhile, even on a loaded machine
    p = None
    try:
        wait_until(lambda: "q" in anyio.run(lakestream.load_state, url).producers, 30, "q registered")
        p = spawn_cli("produce", url, "--producer-id", "p", "--synthetic", 7, "--sample-size", 8,
                      "--close-when-done")  # fmt: skip
        wait_until(lambda: anyio.run(lakestream.load_state, url).producers.get("p", None) is not None
                   and anyio.run(lakestream.load_state, url).producers["p"].finished, 30, "p finished")  # fmt: skip
        assert q.poll() is None and p.poll() is None  # p waits for q
        assert anyio.run(lakestream.load_state, url).closed_after is None
        _, q_err = q.communicate(timeout=60)
        assert q.returncode == 0, q_err
        out, err = p.communicate(timeout=60)
    finally:
        for proc in (q, p):
            if proc is not None:
                proc.kill()
    assert p.returncode == 0, err
    assert f"lakestream produce: waiting for producer q to finish before closing {url}" in err
    state = anyio.run(lakestream.load_state, url)
    assert out.strip().splitlines()[-1] == f"every producer has finished: {url} is closed after step {state.head}"
    assert state.closed_after == state.head == 26 and state.ended  # 107 samples: 26 steps of 4, a short one of 3
    assert state.step(26).ranks[0].samples == 3 and not state.leftovers
    records = anyio.run(log_records, url)
    assert [type(r).__name__ for r in records].count("CloseRecord") == 1
    assert type(records[-1]).__name__ == "CloseRecord"


def test_producers_all_closing_when_done_close_once(stream_url: str) -> None:
    """Three producers, registered before any starts (as a fleet's are), all with the flag."""
    from lakestream.ray import _register

    url = stream_url
    run_cli("init", url, "--world-size", 2, "--global-batch", 4, check=True)
    anyio.run(_register, url, ["p0", "p1", "p2"])
    procs = [
        spawn_cli("produce", url, "--producer-id", f"p{i}", "--synthetic", n, "--sample-size", 8, "--close-when-done")
        for i, n in enumerate([9, 14, 3])
    ]
    try:
        results = [(proc.communicate(timeout=120), proc.returncode) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    assert all(rc == 0 for _, rc in results), results
    state = anyio.run(lakestream.load_state, url)
    assert state.closed_after == state.head == 6 and state.ended  # 26 samples: 6 steps of 4, a short one of 2
    assert sum(r.samples for r in state.step(6).ranks) == 2 and not state.leftovers
    for (out, _), _ in results:
        assert out.strip().splitlines()[-1] == f"every producer has finished: {url} is closed after step 6"
    records = anyio.run(log_records, url)
    assert [type(r).__name__ for r in records].count("CloseRecord") == 1
    assert type(records[-1]).__name__ == "CloseRecord"  # nothing committed after it
