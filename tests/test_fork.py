"""Forks: `lakestream fork URL NEW_URL --at-step S` and `lakestream unfork NEW_URL`.

A fork's steps below S are its source's, referenced (no byte copied); its producers resume from the
source's cursors at S. The source keeps those steps while the fork reads them and refuses what would
change them; `gc` on either side is safe; `unfork` (or deleting the fork) releases them. The state
machine's part is checked against random histories (replays, rewinds, reclaims) here too.
"""

from __future__ import annotations

import random
import signal
from pathlib import Path

import orjson
import pytest
from cliutil import describe, make_source_dir, run_cli, spawn_cli, wait_until
from hypothesis import given, settings
from hypothesis import strategies as st
from test_state import build_history, history_ops, register, replay

import lakestream
from lakestream import ConfigMismatch, StreamInUse
from lakestream._layout import SEGMENTS_PREFIX
from lakestream._records import (
    CheckpointRecord,
    CommitRecord,
    CreateRecord,
    DetachRecord,
    ForkBase,
    ForkRecord,
    ReclaimRecord,
    RewindRecord,
    TgbRef,
    UnforkRecord,
    encode_record,
)
from lakestream._state import State, _in_order
from lakestream._store import open_store

WORLD, BATCH = 2, 4


# -- the state machine ----------------------------------------------------------------------------


def fork_log(source: State, at: int, url: str = "s3://b/src") -> list[bytes]:
    assert source.config is not None
    return [encode_record(CreateRecord(source.config, 1.0, ForkBase(url, at, source.fork_at(at).to_dict())))]


@settings(max_examples=200)
@given(history_ops, st.data())
def test_a_fork_starts_from_its_source_below_its_step_and_its_source_keeps_those_steps(
    ops_: list[tuple], data: st.DataObject
) -> None:
    log = build_history(ops_)
    src = replay(log)
    at = data.draw(st.integers(src.first_step, src.head + 1), label="at_step")
    assert src.apply(len(log), encode_record(ForkRecord("s3://b/f", at))) is None
    fork = replay(fork_log(src, at))
    assert not fork.rejected and fork.base is not None and fork.head == at - 1 and fork.first_step == src.first_step
    # The same TGBs below the fork step, each the source's; every producer fenced, resuming from
    # its cursor after its last TGB there (or the reclaimed ones').
    same = ("segment", "producer", "epoch", "seq", "ranks", "cursor", "packed")
    below = [s for s in src.steps if s.step < at]
    assert [[getattr(s, k) for k in same] for s in fork.steps] == [[getattr(s, k) for k in same] for s in below]
    assert all(fork.base.holds(s) for s in fork.steps) and all(s.version == 0 for s in fork.steps)
    last: dict[str, object] = {}
    for s in _in_order(below, [k for k in src.skipped if k.at < at - 1]):
        last.update(s.cursors())
    for pid, p in src.producers.items():
        q = fork.producers[pid]
        assert (q.epoch, q.token, q.cursor) == (p.epoch + 1, "", last.get(pid, p.base_cursor)), pid
    assert State.from_json(fork.to_json()).to_json() == fork.to_json()
    # The fork's own commits are its own; a snapshot at any version replays to the same state.
    flog = fork_log(src, at)
    pid = sorted(src.producers)[0]
    epoch = fork.producers[pid].epoch + 1
    seq = fork.producers[pid].seq + 1
    for rec in (
        register(pid, epoch),
        encode_record(CommitRecord(pid, epoch, seq, (TgbRef(f"segments/{pid}/{epoch}-{seq}-y.tgb", ((0, 9, 1, 2),)),))),
    ):  # fmt: skip
        assert fork.apply(len(flog), rec) is None, fork.rejected
        flog.append(rec)
    assert not fork.base.holds(fork.steps[-1]) and fork.steps[-1].step == at
    assert State.from_json(replay(flog[:2]).to_json()).to_json() == replay(flog[:2]).to_json()
    # The source refuses to change the fork's steps, and keeps them from GC.
    if at - 2 >= src.first_step - 1:
        assert src.check(RewindRecord(at - 2)) is not None
        assert src.check(RewindRecord(at - 2, skip=((at - 1, at - 1),))) is not None
    assert src.check(RewindRecord(max(at - 1, src.first_step - 1))) is None
    assert src.reclaimable <= src.first_step if src.checkpoints else src.reclaimable == -1
    if src.head >= src.first_step:
        v = src.version + 1
        src.apply(v, encode_record(CheckpointRecord("late", src.head)))
        assert src.reclaimable == src.forks[0].hold <= src.first_step  # held from the first step it had
        assert src.check(ReclaimRecord(src.first_step + 1)) is not None
        src.apply(v + 1, encode_record(UnforkRecord("s3://b/f")))
        assert not src.forks and src.reclaimable == src.watermark
    # Detached, the fork's shared steps are gone (as reclaimed) and its own stay.
    assert fork.apply(len(flog), encode_record(DetachRecord())) is None
    assert fork.first_step == at and [s.step for s in fork.steps] == [at] and not fork.base.epochs
    assert State.from_json(fork.to_json()).to_json() == fork.to_json()


def test_a_fork_record_naming_an_unknown_step_or_a_fork_of_a_fork_is_a_noop() -> None:
    src = replay(build_history([("commit", "a", 3)]))
    v = src.version + 1
    assert src.apply(v, encode_record(ForkRecord("file:///f", src.head + 2))) is not None
    assert src.apply(v + 1, encode_record(ForkRecord("file:///f", 1))) is None
    assert src.apply(v + 2, encode_record(ForkRecord("file:///f", 2))) is not None  # that URL forks already
    fork = replay(fork_log(src, 2))
    assert fork.apply(1, encode_record(ForkRecord("file:///g", 1))) is not None  # it reads its source
    # A create record whose fork state is not a fenced state at version 0 with its own config is a no-op.
    state = src.fork_at(2).to_dict()
    assert src.config is not None
    for bad in ({**state, "version": 3}, {**state, "checkpoints": [["c", 0, 0]]}, {**state, "first_step": 5}):
        rec = encode_record(CreateRecord(src.config, 1.0, ForkBase("file:///s", 2, bad)))
        s = State()
        assert s.apply(0, rec) is not None and s.config is None


# -- on a store ----------------------------------------------------------------------------------


def status(url: str) -> dict:
    return orjson.loads(run_cli("status", url, "--json", check=True).stdout)


async def keys_of(url: str) -> dict[int, list[str]]:
    state = await lakestream.load_state(url)
    async with lakestream.open_reader(url, None) as r:
        return {
            s.step: sorted({f.key for rank in range(WORLD) for f in (await r.fetch_raw(s, rank)).files})
            for s in state.steps
        }


async def test_fork_and_unfork_on_the_command_line(stream_url: str, tmp_path: Path) -> None:
    src, new = stream_url, stream_url.rstrip("/") + "-fork"
    make_source_dir(tmp_path / "d", "a", 10 * BATCH, random.Random(3))
    run_cli("init", src, "--world-size", WORLD, "--global-batch", BATCH, check=True)
    run_cli("produce", src, "--producer-id", "a", "--from-dir", tmp_path / "d", check=True)  # steps 0..9
    before = await keys_of(src)
    r = run_cli("fork", src, new, "--at-step", 12, check=False)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "cannot fork at step 12" in r.stderr
    r = run_cli("fork", src, src + "/inner", "--at-step", 4, check=False)
    assert r.returncode != 0 and "cannot lie inside its source" in r.stderr, describe(r)
    r = run_cli("fork", src, new, "--at-step", 4, check=True)
    assert r.stdout.strip() == (
        f"forked {src} at step 4 to {new}: steps 0..3 are the source's, by reference; its producers continue from step 4"
    )
    run_cli("fork", src, new, "--at-step", 4, check=True)  # again: nothing more
    async with open_store(new) as store:
        assert await store.list(SEGMENTS_PREFIX) == []  # nothing copied
    # The fork's producer continues the same source exactly where the source's was at step 4.
    run_cli("produce", new, "--producer-id", "a", "--from-dir", tmp_path / "d", check=True)
    after = await keys_of(new)
    assert after == before and sorted(k for ks in after.values() for k in ks) == [f"a-{i:05d}" for i in range(40)]
    async with open_store(new) as store:
        assert len(await store.list(SEGMENTS_PREFIX)) == 6  # steps 4..9, its own
    assert "40 samples" in run_cli("verify", new, check=True).stdout
    d = status(src)
    assert d["forks"] == [{"url": new, "at_step": 4, "holds_from": 0}] and status(new)["fork_of"] == {
        "url": src, "at_step": 4, "reads_it": True,
    }  # fmt: skip
    # The source keeps the fork's steps: no rewind below them, no delete, GC keeps them.
    run_cli("checkpoint", src, "--id", "c9", "--step", 9, check=True)
    r = run_cli("rewind", src, "--to-step", 2, check=False)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, describe(r)
    assert f"cannot rewind to step 2: fork {new} (at step 4) reads the steps up to 3" in r.stderr, describe(r)
    r = run_cli("delete", src, "--yes", check=False)
    assert r.returncode != 0 and f"forks read its steps ({new})" in r.stderr, describe(r)
    run_cli("gc", src, "--orphan-grace", 300, check=True)
    assert status(src)["first_step"] == 0 and await keys_of(new) == before
    run_cli("gc", new, "--orphan-grace", 300, check=True)
    assert await keys_of(new) == before and (await lakestream.verify(src)).ok
    # Unforked, the fork's steps are its own, and the source reclaims what only the fork held.
    r = run_cli("unfork", new, check=True)
    assert r.stdout.strip() == f"unforked {new}: its steps are its own, from step 4"
    assert status(src)["forks"] == [] and status(new)["fork_of"]["reads_it"] is False
    run_cli("gc", src, "--orphan-grace", 300, check=True)
    assert status(src)["first_step"] == 9
    assert await keys_of(new) == {s: before[s] for s in range(4, 10)}
    assert "24 samples" in run_cli("verify", new, check=True).stdout
    run_cli("unfork", new, check=True)  # again: nothing more


async def test_a_fork_producer_killed_and_run_again_commits_each_sample_once(stream_url: str, tmp_path: Path) -> None:
    """The fork's producer is SIGKILLed mid-way and run again: the fork holds every source sample once;
    deleting the fork releases the source's steps."""
    src, new = stream_url, stream_url.rstrip("/") + "-fork"
    n = 40 * BATCH
    make_source_dir(tmp_path / "d", "a", n, random.Random(4))
    await lakestream.create(src, world_size=WORLD, global_batch=BATCH)
    run_cli("produce", src, "--producer-id", "a", "--from-dir", tmp_path / "d", check=True)  # steps 0..39
    state = await lakestream.fork(src, new, at_step=8)
    assert state.head == 7 and state.base is not None
    with pytest.raises(ConfigMismatch, match=r"is a fork of this stream at step 8, not 6"):
        await lakestream.fork(src, new, at_step=6)
    producer = spawn_cli("produce", new, "--producer-id", "a", "--from-dir", tmp_path / "d", "--rate", 8)
    try:
        wait_until(lambda: status(new)["head_step"] >= 12, timeout=60, what="the fork's steps 8..12")
        producer.send_signal(signal.SIGKILL)
        producer.wait(timeout=30)
    finally:
        producer.kill()
        producer.communicate()
    run_cli("produce", new, "--producer-id", "a", "--from-dir", tmp_path / "d", check=True)
    keys = [k for ks in (await keys_of(new)).values() for k in ks]
    assert sorted(keys) == [f"a-{i:05d}" for i in range(n)]
    assert (await lakestream.verify(new)).ok and (await lakestream.verify(src)).ok
    assert (await lakestream.load_state(src)).head == 39  # the source's steps stay as they were
    with pytest.raises(StreamInUse, match="forks read its steps"):
        await lakestream.delete(src)
    await lakestream.delete(new)
    assert (await lakestream.load_state(src)).forks == []
    await lakestream.delete(src)


async def test_a_fork_goes_on_under_the_mixture_it_inherited_then_its_own_mixture_and_shape(tmp_path: Path) -> None:
    src, new = f"file://{tmp_path}/s", f"file://{tmp_path}/f"
    await lakestream.create(src, world_size=2, global_batch=4)
    await lakestream.mix(src, {"a": 3, "b": 1})

    async def write(url: str, steps: int, run: str, shares: dict[str, int]) -> None:
        async with lakestream.open_producer(url, "p") as p:
            for n in range(steps):
                version, _ = p.mix_now()
                for name, k in shares.items():
                    for i in range(k):
                        key = f"{name}-{run}-{n}-{i}"
                        await p.put({"__key__": key, "__source__": name}, cursor=key, source=name, mix=version)

    await write(src, 3, "src", {"a": 3, "b": 1})
    await lakestream.fork(src, new, at_step=2)
    await write(new, 2, "fork", {"a": 3, "b": 1})  # under the mixture it inherited (version 0)
    state = await lakestream.load_state(new)
    assert state.mix_at(state.head) is not None and state.mix_at(state.head).version == 0 and state.head == 3
    await lakestream.mix(new, {"a": 1, "b": 1})
    await lakestream.reshape(new, 1, global_batch=2)
    await write(new, 2, "own", {"a": 1, "b": 1})
    state = await lakestream.load_state(new)
    assert state.head == 5 and [s.samples for s in state.steps] == [4, 4, 4, 4, 2, 2]
    assert (await lakestream.verify(new)).ok and (await lakestream.verify(src)).ok
    assert (await lakestream.load_state(src)).mixes[-1].weights == (("a", 3.0), ("b", 1.0))  # the source's own


async def test_a_fork_whose_manifest_names_a_source_no_store_opens_is_corrupt_data_naming_the_step(
    tmp_path: Path,
) -> None:
    src, new = f"file://{tmp_path}/s", f"file://{tmp_path}/f"
    await lakestream.create(src, world_size=1, global_batch=2)
    async with lakestream.open_producer(src, "p") as p:
        for i in range(4):
            await p.put({"__key__": f"k{i}", "txt": b"x"}, cursor=i + 1)
    await lakestream.fork(src, new, at_step=1)
    log0 = tmp_path / "f" / "_lakestream" / "log" / f"{0:020d}.json"
    record = orjson.loads(log0.read_bytes())
    record["fork"]["source"] = "ftp://elsewhere/s"  # a URL of no store this library opens
    log0.write_bytes(orjson.dumps(record))
    state = await lakestream.load_state(new)
    assert state.base is not None and state.base.source == "ftp://elsewhere/s"
    async with lakestream.open_reader(new, 0) as r:
        with pytest.raises(lakestream.CorruptData, match=r"step 0 rank 0 object segments/.* the fork's source cannot"):
            await r.fetch_raw(state.steps[0], 0)
    with pytest.raises(lakestream.CorruptData, match="the fork's source cannot be opened"):
        await lakestream.verify(new)
    r2 = run_cli("verify", new, check=False)
    assert r2.returncode != 0 and len(r2.stderr.strip().splitlines()) == 1, describe(r2)
