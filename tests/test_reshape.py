"""Elastic world size: the pure re-slicing rule, the reshape record in the state machine, and a stream
written at one world size read at others (the reader, `lakestream read`, `StreamDataset`, the mount)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import anyio
import pytest
from cliutil import describe, run_cli, spawn_cli, wait_until
from hypothesis import assume, given
from hypothesis import strategies as st
from mountutil import MountProc, read_tree

import lakestream
from lakestream import _decisions as decisions
from lakestream._batching import assign_ranks, reslice
from lakestream._config import Config
from lakestream._records import (
    CheckpointRecord,
    CommitRecord,
    CreateRecord,
    ReclaimRecord,
    RegisterRecord,
    ReshapeRecord,
    RewindRecord,
    TgbRef,
    encode_record,
)
from lakestream._state import State

# -- the rule -----------------------------------------------------------------------------------------


def stored_counts(n: int, world: int) -> list[int]:
    return [len(r) for r in assign_ranks(None, n, world)]


@given(st.lists(st.integers(0, 40), min_size=1, max_size=24), st.integers(1, 30))
def test_reslice_partitions_in_order_with_counts_within_one(counts: list[int], world: int) -> None:
    plan = reslice(counts, world)
    assert len(plan) == world
    order = [(i, j) for i, c in enumerate(counts) for j in range(c)]
    got = [(i, j) for pieces in plan for i, lo, hi in pieces for j in range(lo, hi)]
    if len(counts) != world:
        assert sorted(got) == order  # each sample once
        sizes = [sum(hi - lo for _, lo, hi in p) for p in plan]
        assert max(sizes) - min(sizes) <= 1
        assert all(p == sorted(p) for p in plan)  # a rank's pieces in stored order
        assert reslice(counts, world) == plan  # deterministic
    else:
        assert sorted(got) == order and all(
            p == ([(r, 0, c)] if c else []) for r, (p, c) in enumerate(zip(plan, counts))
        )
    for pieces in plan:
        assert all(0 <= lo < hi <= counts[i] for i, lo, hi in pieces)


@given(st.integers(1, 8), st.integers(1, 8), st.integers(0, 600))
def test_reslice_reads_whole_slices_once_when_the_new_world_divides_the_old(k: int, w2: int, n: int) -> None:
    w = k * w2
    counts = stored_counts(n, w)  # as sealed: counts within one, larger first
    plan = reslice(counts, w2)
    for r, pieces in enumerate(plan):
        assert pieces == [(i, 0, counts[i]) for i in range(r, w, w2) if counts[i]]  # whole slices, dealt
    assert sorted(i for p in plan for i, _, _ in p) == [i for i in range(w) if counts[i]]  # each read once


@given(st.integers(1, 8), st.integers(1, 8), st.integers(0, 600))
def test_reslice_reads_one_slice_a_rank_when_the_old_world_divides_the_new(w: int, k: int, n: int) -> None:
    counts = stored_counts(n, w)
    plan = reslice(counts, w * k)
    assert all(len(p) <= 1 and all(i == r // k for i, _, _ in p) for r, p in enumerate(plan))


@given(st.lists(st.integers(0, 50), min_size=2, max_size=12), st.integers(1, 12))
def test_reslice_of_unequal_counts_still_partitions_and_balances(counts: list[int], world: int) -> None:
    assume(world != len(counts))  # read as sealed: each rank its own slice, whatever its count
    plan = reslice(counts, world)  # counts a sealing producer would not write: the consecutive rule
    sizes = [sum(hi - lo for _, lo, hi in p) for p in plan]
    assert sum(sizes) == sum(counts) and max(sizes) - min(sizes) <= 1
    assert sorted((i, j) for p in plan for i, lo, hi in p for j in range(lo, hi)) == [
        (i, j) for i, c in enumerate(counts) for j in range(c)
    ]


@given(st.integers(1, 16), st.integers(1, 16), st.integers(1, 400))
def test_reslice_reads_each_stored_slice_at_most_twice_overall_within_the_bound(w: int, w2: int, extra: int) -> None:
    n = w * w2 + extra  # at least one sample a rank either way
    counts = stored_counts(n, w)
    touched = sum(len(p) for p in reslice(counts, w2))
    assert touched <= w + w2 - 1  # the cuts: every new boundary splits at most one stored slice
    assert all(c >= 1 for c in counts)


# -- the record in the state machine ------------------------------------------------------------------


def fresh_state(world: int = 4, batch: int = 12) -> State:
    s = State()
    assert s.apply(0, encode_record(CreateRecord(Config(world, batch)))) is None
    return s


def test_reshape_records_make_a_history_that_world_at_reads_and_snapshots_keep() -> None:
    s = fresh_state()
    assert s.world_at(0) == 4 and s.world_at(10**9) == 4
    for record in (decisions.reshape(s, 3, from_step=5, now=1.0), decisions.reshape(s, 2, from_step=9, now=2.0)):
        assert record is not None and s.apply(s.version + 1, encode_record(record)) is None
        assert s.check_last_record(encode_record(record)) is None
    assert [s.world_at(i) for i in (0, 4, 5, 8, 9, 100)] == [4, 4, 3, 3, 2, 2]
    assert decisions.reshape(s, 2, from_step=9, now=3.0) is None  # already in force: nothing to write
    record = decisions.reshape(s, 6, from_step=7, now=3.0)  # replaces every shape from 7 on
    assert record is not None and s.apply(s.version + 1, encode_record(record)) is None
    assert s.shapes == [(5, 3, 12), (7, 6, 12)] and s.world_at(100) == 6
    again = State.from_json(s.to_json())
    assert again.shapes == s.shapes and again.to_dict() == s.to_dict()
    assert "shapes" not in fresh_state().to_dict()  # a stream never reshaped keeps its snapshot format


@pytest.mark.parametrize(
    ("world", "batch", "why"),
    [(0, 12, "bad world size"), (13, 12, "global batch 12 for world size 13"), (1 << 17, 1 << 17, "above the limit"),
     (2, 0, "bad global batch"), (2, 1 << 25, "global batch")],
)  # fmt: skip
def test_a_reshape_to_an_impossible_shape_is_a_no_op(world: int, batch: int, why: str) -> None:
    s = fresh_state()
    reason = s.apply(1, encode_record(ReshapeRecord(0, world, batch)))
    assert reason is not None and why in reason and s.shapes == []
    with pytest.raises(ValueError, match=r"world size|global batch"):
        decisions.reshape(s, world, global_batch=batch, now=0.0)


def test_a_new_global_batch_discards_the_steps_from_its_step_and_fences_producers() -> None:
    s = fresh_state(2, 8)
    for version, record in enumerate(
        [RegisterRecord("a", 1, "t"), *[commit_record("a", 1, seq, 8, 2) for seq in range(5)]], start=1
    ):
        assert s.apply(version, encode_record(record)) is None
    with pytest.raises(ValueError, match="at the latest"):
        decisions.reshape(s, 2, global_batch=6, from_step=9, now=0.0)  # a future batch change
    record = decisions.reshape(s, 3, global_batch=6, from_step=3, now=1.0)
    assert record is not None and s.apply(s.version + 1, encode_record(record)) is None
    assert s.head == 2 and s.rewinds == 1 and s.producers["a"].epoch == 2 and s.producers["a"].cursor == 3
    assert s.check_last_record(encode_record(record)) is None
    assert s.apply(s.version + 1, encode_record(RegisterRecord("a", 3, "u"))) is None
    too_big = commit_record("a", 3, 5, 8, 2)  # sealed for the old batch: never committed
    reason = s.apply(s.version + 1, encode_record(too_big))
    assert reason is not None and "global batch 6" in reason
    assert s.apply(s.version + 1, encode_record(commit_record("a", 3, 5, 6, 3))) is None
    assert s.head == 3 and s.batch_at(3) == 6 and s.world_at(3) == 3 and s.batch_at(2) == 8


@st.composite
def reshape_histories(draw: st.DrawFn) -> list[tuple[Any, ...]]:
    """Commits of whole or short TGBs, reshapes (through the decision, or records as any writer may
    put them) with or without a new global batch, from reclaimed to future steps, and rewinds."""
    ops: list[tuple[Any, ...]] = []
    for _ in range(draw(st.integers(1, 30))):
        op = draw(st.sampled_from(["commit", "commit", "reshape", "record", "rewind", "reclaim"]))
        if op == "commit":
            ops.append((op, draw(st.integers(1, 12))))
        elif op in ("reshape", "record"):
            world = draw(st.integers(1, 4))
            batch = draw(st.none() | st.integers(world, 12)) if op == "reshape" else draw(st.integers(world, 12))
            ops.append((op, draw(st.integers(-2, 4)), world, batch))  # from step: head + that
        else:
            ops.append((op, draw(st.integers(0, 3))))  # steps back from the head
    return ops


@given(reshape_histories())
def test_after_any_reshapes_every_committed_step_keeps_the_batch_it_was_sealed_with(ops: list[tuple[Any, ...]]) -> None:
    """Whatever reshapes land, the global batch in force at each retained step is the one its TGB
    was sealed for (so verify holds), a reshape that changes a committed step's batch discards it,
    and a world size alone never discards a step."""
    s = fresh_state(2, 8)
    assert s.apply(1, encode_record(RegisterRecord("a", 1, "t"))) is None
    sealed: dict[int, int] = {}  # step -> the global batch its TGB was sealed for
    seq = 0

    def put(record: Any) -> str | None:
        return s.apply(s.version + 1, encode_record(record))

    for op in ops:
        if op[0] == "commit":
            p = s.producers["a"]
            if not p.token:  # fenced: a new incarnation
                assert put(RegisterRecord("a", p.epoch + 1, f"t{p.epoch + 1}")) is None
            batch, world = s.batch_at(s.head + 1), s.world_at(s.head + 1)
            assert put(commit_record("a", s.producers["a"].epoch, seq, min(op[1], batch), world)) is None
            sealed[s.head], seq = batch, seq + 1
        elif op[0] in ("reshape", "record"):
            start, world, batch = s.head + op[1], op[2], op[3]
            head, first = s.head, s.first_step
            if op[0] == "reshape":
                try:
                    record = decisions.reshape(s, world, global_batch=batch, from_step=start, now=0.0)
                except (ValueError, lakestream.StepUnavailable):
                    continue
                if record is None:
                    continue
                assert put(record) is None
                if batch is None:
                    assert s.head == head, "a world size alone discarded steps"
            elif start < 0 or put(ReshapeRecord(start, world, batch)) is not None:
                continue
            assert s.world_at(max(start, first)) == world
        elif op[0] == "rewind":
            if s.head - op[1] >= s.first_step - 1:
                assert put(RewindRecord(s.head - op[1])) is None
        else:  # reclaim below a checkpoint
            step = s.head - op[1]
            if step >= max(s.first_step, s.checkpoints[-1].step if s.checkpoints else 0):
                assert put(CheckpointRecord(f"c{s.version}", step)) is None
            if s.watermark > s.first_step:
                assert put(ReclaimRecord(s.watermark)) is None
        for step in range(s.first_step, s.head + 1):
            entry = s.step(step)
            assert entry is not None and s.batch_at(step) == sealed[step], (step, s.shapes, sealed)
            assert entry.samples <= s.batch_at(step)
        assert State.from_json(s.to_json()).to_dict() == s.to_dict()


def test_a_world_size_alone_never_undoes_a_later_global_batch() -> None:
    """Created at W2 B8, B10 from step 5: a world size alone from step 0 would make steps 5.. B8
    again; it is refused. Given the batch, it is a batch change from step 5: those steps go."""
    s = fresh_state(2, 8)
    records = [RegisterRecord("a", 1, "t"), *[commit_record("a", 1, seq, 8, 2) for seq in range(5)]]
    for version, record in enumerate(records, start=1):
        assert s.apply(version, encode_record(record)) is None
    assert s.apply(s.version + 1, encode_record(ReshapeRecord(5, 2, 10))) is None  # discards nothing: head 4
    assert s.apply(s.version + 1, encode_record(RegisterRecord("a", 3, "u"))) is None
    for seq in range(5, 8):
        assert s.apply(s.version + 1, encode_record(commit_record("a", 3, seq, 10, 2))) is None
    assert s.head == 7 and s.batch_at(7) == 10
    with pytest.raises(ValueError, match="global batch is 10 from step 5"):
        decisions.reshape(s, 2, from_step=0, now=0.0)
    assert decisions.reshape(s, 4, from_step=5, now=0.0) is not None  # from the change on: a world size alone
    record = decisions.reshape(s, 2, global_batch=8, from_step=0, now=0.0)
    assert record == ReshapeRecord(0, 2, 8, 0.0)
    assert s.apply(s.version + 1, encode_record(record)) is None
    assert s.head == 4 and s.rewinds == 2 and s.producers["a"].epoch == 4 and s.producers["a"].cursor == 5
    assert all(s.batch_at(step) == 8 for step in range(10))
    assert s.check_last_record(encode_record(record)) is None
    # Written by hand where the change would be after the step after the head: a no-op.
    s2 = fresh_state(2, 8)
    assert s2.apply(1, encode_record(ReshapeRecord(0, 2, 8))) is None
    assert s2.apply(2, encode_record(ReshapeRecord(0, 2, 10))) is None
    assert s2.apply(3, encode_record(ReshapeRecord(3, 2, 8))) is not None  # step 3 is in the future


def test_reshape_refuses_a_world_size_alone_that_would_change_a_later_batch(tmp_path: Path) -> None:
    """`init` W2 B8, produce, `reshape` B10, produce, `reshape --world-size 2 --from-step 0`: refused
    in one line, the stream still verifies; with --global-batch 8 the B10 steps are re-produced."""
    url = f"file://{tmp_path}/s"
    run_cli("init", url, "--world-size", 2, "--global-batch", 8, check=True)
    produce = ["produce", url, "--producer-id", "a", "--sample-size", 16, "--synthetic"]
    run_cli(*produce, 40, check=True)  # steps 0..4
    run_cli("reshape", url, "--world-size", 2, "--global-batch", 10, check=True)
    run_cli(*produce, 80, check=True)  # steps 5..8 of 10
    r = run_cli("reshape", url, "--world-size", 2, "--from-step", 0, check=False)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "global batch is 10 from step 5" in r.stderr, describe(r)
    assert run_cli("verify", url).returncode == 0
    r = run_cli("reshape", url, "--world-size", 2, "--global-batch", 8, "--from-step", 0, check=True)
    assert anyio.run(lakestream.load_state, url).head == 4
    run_cli(*produce, 80, check=True)  # the B10 steps again, as B8
    steps = keys_by_step(url)
    assert [len(steps[s]) for s in sorted(steps)] == [8] * 10
    assert sorted(k for keys in steps.values() for k in keys) == [f"a-{i:09d}" for i in range(80)]
    assert run_cli("verify", url).returncode == 0


def commit_record(pid: str, epoch: int, seq: int, samples: int, world: int) -> CommitRecord:
    counts = [len(r) for r in assign_ranks(None, samples, world)]
    ranks = tuple((10 * i, 10, 0, c) for i, c in enumerate(counts))
    return CommitRecord(pid, epoch, seq, (TgbRef(f"segments/{pid}/{epoch}-{seq}-x.tgb", ranks, seq + 1),))


def test_a_snapshot_with_shapes_out_of_order_is_refused() -> None:
    s = fresh_state()
    d = s.to_dict() | {"shapes": [[5, 2, 12], [3, 4, 12]]}
    with pytest.raises(ValueError, match="out of order"):
        from lakestream._state import _state_from_dict

        _state_from_dict(d)


# -- a stream written at W=4, read at 3, 2 and 4 again --------------------------------------------------

STEPS, BATCH = 8, 13  # 13 samples a step: no world size here divides it, so counts differ by one


def sample(i: int, prefix: str = "k") -> dict[str, Any]:
    return {"__key__": f"{prefix}{i:04d}", "bin": bytes([i % 251]) * (100 + i % 50), "n": i}


async def write_stream(url: str, n: int, pid: str = "p") -> None:
    async with lakestream.open_producer(url, pid) as p:
        for i in range(n):
            await p.put(sample(i, "k" if pid == "p" else pid), cursor=i + 1)


async def read_rank(url: str, rank: int, world: int | None, start: int, stop: int) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    async with lakestream.open_reader(url, rank, world, prefetch=3) as r:
        async for b in r.steps(start, stop):
            out[b.step] = [s["__key__"] for s in b.samples]
    return out


def check_partition(url: str, world: int, start: int, stop: int, want: dict[int, list[str]]) -> None:
    per_rank = [anyio.run(read_rank, url, r, world, start, stop) for r in range(world)]
    for step in range(start, stop):
        parts = [per_rank[r][step] for r in range(world)]
        assert sorted(k for p in parts for k in p) == sorted(want[step]), f"step {step} at world {world}"
        assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_a_stream_written_at_4_reads_at_3_and_2_and_4_again(stream_url: str, tmp_path: Path) -> None:
    url = stream_url
    anyio.run(lambda: lakestream.create(url, world_size=4, global_batch=BATCH))
    anyio.run(write_stream, url, STEPS * BATCH)
    at4 = {step: [] for step in range(STEPS)}  # type: dict[int, list[str]]
    for r in range(4):
        for step, keys in anyio.run(read_rank, url, r, 4, 0, STEPS).items():
            at4[step] += keys

    proc = run_cli("reshape", url, "--world-size", "3", "--from-step", "2")
    assert proc.returncode == 0, describe(proc)
    assert "from 2 on are read as 3 ranks" in proc.stdout
    assert run_cli("reshape", url, "--world-size", "2", "--from-step", "5").returncode == 0
    check_partition(url, 4, 0, 2, at4)
    check_partition(url, 3, 2, 5, at4)
    check_partition(url, 2, 5, STEPS, at4)
    with pytest.raises(lakestream.ConfigMismatch, match="reshaped"):  # a 4-rank trainer stops at the reshape
        anyio.run(read_rank, url, 0, 4, 0, STEPS)

    status = json.loads(run_cli("status", url, "--json").stdout)
    assert status["world_size"] == 2
    assert [(s["from_step"], s["world_size"]) for s in status["shapes"]] == [(0, 4), (2, 3), (5, 2)]

    # Steps committed now are sealed for 2 ranks; back to 4 from step 6 re-slices them and 6, 7 again.
    anyio.run(write_stream, url, 2 * BATCH, "q")
    state = anyio.run(lakestream.load_state, url)
    assert [len(state.step(s).ranks) for s in (STEPS - 1, STEPS, STEPS + 1)] == [4, 2, 2]  # type: ignore[union-attr]
    for step in (STEPS, STEPS + 1):
        at4[step] = [k for r in range(2) for k in anyio.run(read_rank, url, r, 2, step, step + 1)[step]]
    assert run_cli("reshape", url, "--world-size", "4", "--from-step", "6").returncode == 0
    check_partition(url, 4, 6, STEPS + 2, at4)
    with pytest.raises(lakestream.ConfigMismatch, match="no rank 3"):  # world None: each step's own shape
        anyio.run(read_rank, url, 3, None, 5, 6)

    # `lakestream read` and StreamDataset take each step's shape from the manifest too.
    out = tmp_path / "out"
    proc = run_cli("read", url, "--rank", "2", "--from-step", "2", "--to-step", "4", "--out", str(out))
    assert proc.returncode == 0, describe(proc)
    from lakestream.torch import StreamDataset

    seen = [
        [s["__key__"] for s in item["samples"]] for item in StreamDataset(url, rank=2, world_size=3, start=2, stop=5)
    ]
    assert sorted(
        p.name.split(".")[0] for d in out.iterdir() for p in d.iterdir() if p.name.endswith(".bin")
    ) == sorted(k for keys in seen for k in keys)
    assert run_cli("verify", url).returncode == 0


def test_the_mount_serves_the_ranks_of_a_reshaped_stream(stream_url: str, tmp_path: Path) -> None:
    url = stream_url
    anyio.run(lambda: lakestream.create(url, world_size=4, global_batch=BATCH))
    anyio.run(write_stream, url, 3 * BATCH)
    at4 = {s: sorted(k for r in range(4) for k in anyio.run(read_rank, url, r, 4, s, s + 1)[s]) for s in range(3)}
    assert run_cli("reshape", url, "--world-size", "3", "--from-step", "0").returncode == 0
    mount = MountProc(url, tmp_path / "mnt", tmp_path / "mount.log").start().wait_ready()
    try:
        tree = read_tree(str(mount.mountpoint), [0, 1, 2], 3)
        for step in range(3):
            keys = [n.split(".")[0] for r in range(3) for n in tree[r, step] if n.endswith(".bin")]
            assert sorted(keys) == at4[step]
            meta = [json.loads(tree[r, step]["_meta.json"]) for r in range(3)]
            assert [m["samples"] for m in meta] == [5, 4, 4]  # 13 samples stored as 4+3+3+3, served as 5+4+4
            for r in range(3):
                for key in meta[r]["keys"]:
                    assert tree[r, step][f"{key}.bin"] == sample(int(key[1:]))["bin"]
    finally:
        mount.stop()


def test_a_mounted_stream_follows_reshapes_while_it_serves(tmp_path: Path) -> None:
    """Mounted at 4 ranks; reshaped to 3 from step 1 and then to 6 from step 3 while mounted: the
    root shows the ranks in force, a rank directory lists the steps that have that rank, files
    read after a reshape hold the re-sliced samples, and a node `--ranks 1,3` serves only those."""
    url = f"file://{tmp_path}/s"
    anyio.run(lambda: lakestream.create(url, world_size=4, global_batch=BATCH))
    anyio.run(write_stream, url, 4 * BATCH)
    want = {s: sorted(k for r in range(4) for k in anyio.run(read_rank, url, r, 4, s, s + 1)[s]) for s in range(4)}
    mnt = tmp_path / "mnt"
    mount = MountProc(url, mnt, tmp_path / "mount.log")
    part = MountProc(url, tmp_path / "part", tmp_path / "part.log", "--ranks", "1,3")

    def served(root: Path) -> dict[str, list[str]]:
        return {d: sorted(os.listdir(root / d)) for d in sorted(os.listdir(root)) if d.startswith("rank-")}

    def keys(root: Path, rank: int, step: int) -> list[str]:
        meta = json.loads((root / f"rank-{rank}" / f"{step:012d}" / "_meta.json").read_bytes())
        for key in meta["keys"]:  # each file's bytes are the sample's
            assert (root / f"rank-{rank}" / f"{step:012d}" / f"{key}.bin").read_bytes() == sample(int(key[1:]))["bin"]
        return list(meta["keys"])

    steps = [f"{s:012d}" for s in range(4)]
    try:
        mount.start().wait_ready()
        part.start().wait_ready()
        assert served(mnt) == {f"rank-{r}": [*steps, "latest"] for r in range(4)}
        before = keys(mnt, 0, 2)
        held = open(mnt / "rank-0" / f"{2:012d}" / f"{before[0]}.bin", "rb")  # noqa: SIM115
        assert run_cli("reshape", url, "--world-size", "3", "--from-step", "1").returncode == 0
        wait_until(lambda: json.loads((mnt / "_status.json").read_bytes())["world_size"] == 3, what="the reshape")
        # rank 3 still has step 0 (read as 4 ranks); steps 1.. are read as 3
        assert served(mnt) == {**{f"rank-{r}": [*steps, "latest"] for r in range(3)}, "rank-3": [steps[0], "latest"]}
        for step in range(4):
            world = 4 if step == 0 else 3
            assert sorted(k for r in range(world) for k in keys(mnt, r, step)) == want[step], step
        assert keys(mnt, 0, 2) != before  # the same step, read as 3 ranks, holds other samples per rank
        try:  # a file opened before reads its own bytes or is stale
            assert held.read() == sample(int(before[0][1:]))["bin"]
        except OSError as e:
            assert e.errno == errno.ESTALE
        finally:
            held.close()

        assert run_cli("reshape", url, "--world-size", "6", "--from-step", "3").returncode == 0
        wait_until(lambda: json.loads((mnt / "_status.json").read_bytes())["world_size"] == 6, what="the reshape")
        assert sorted(served(mnt)) == [f"rank-{r}" for r in range(6)]
        assert served(mnt)["rank-5"] == [steps[3], "latest"] and served(mnt)["rank-3"] == [steps[0], steps[3], "latest"]
        assert sorted(k for r in range(6) for k in keys(mnt, r, 3)) == want[3]
        wait_until(lambda: json.loads((tmp_path / "part" / "_status.json").read_bytes())["world_size"] == 6, what="it")
        assert served(tmp_path / "part") == {"rank-1": [*steps, "latest"], "rank-3": [steps[0], steps[3], "latest"]}
        assert keys(tmp_path / "part", 3, 3) == keys(mnt, 3, 3)
        assert not (tmp_path / "part" / "rank-0").exists()
    finally:
        for m in (part, mount):
            if m.proc is not None:
                m.stop()


def test_cost_balancing_by_the_cost_field_and_after_a_reshape_that_divides_the_world(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/s"
    anyio.run(lambda: lakestream.create(url, world_size=4, global_batch=16))
    costs = [1 + (i * 37) % 100 for i in range(32)]

    async def put_all() -> None:
        async with lakestream.open_producer(url, "p") as p:
            for i, c in enumerate(costs):
                await p.put({"__key__": f"k{i}", "x": b"x", "__cost__": c}, cursor=i + 1)

    anyio.run(put_all)
    cost_of = {f"k{i}": c for i, c in enumerate(costs)}
    for world in (4, 2):
        if world == 2:
            assert run_cli("reshape", url, "--world-size", "2", "--from-step", "0").returncode == 0
        for step in range(2):
            ranks = [anyio.run(read_rank, url, r, world, step, step + 1)[step] for r in range(world)]
            loads = [sum(cost_of[k] for k in keys) for keys in ranks]
            biggest = max(cost_of[k] for keys in ranks for k in keys)
            assert max(loads) - min(loads) <= 2 * biggest  # 4 ranks: LPT; 2 ranks: two balanced slices each
            assert max(map(len, ranks)) - min(map(len, ranks)) <= 1

    async def fields() -> set[str]:
        async with lakestream.open_reader(url, 0, 2) as r:
            return {f for s in (await r.read_step(0)).samples for f in s}

    assert anyio.run(fields) == {"__key__", "x"}  # the cost balanced the ranks; it is not stored


def test_verify_checks_every_step_against_the_shape_history(tmp_path: Path) -> None:
    """A state whose shape history says a smaller global batch than its steps hold (which the
    manifest never lets happen: a new batch discards the steps from its step) is reported."""
    from lakestream._store import open_store
    from lakestream._verify import verify_state

    url = f"file://{tmp_path}/s"
    anyio.run(lambda: lakestream.create(url, world_size=2, global_batch=BATCH))
    anyio.run(write_stream, url, 3 * BATCH)
    assert run_cli("reshape", url, "--world-size", "3", "--from-step", "1").returncode == 0

    async def check(shapes: list[tuple[int, int, int]] | None) -> list[str]:
        state = await lakestream.load_state(url)
        if shapes is not None:
            state.shapes = shapes
        async with open_store(url) as store:
            return (await verify_state(store, state)).problems

    assert anyio.run(check, None) == []
    problems = anyio.run(check, [(1, 3, BATCH), (2, 3, BATCH - 1)])
    assert len(problems) == 1 and "step 2 object" in problems[0], problems
    assert f"{BATCH} samples, more than the global batch {BATCH - 1} in force" in problems[0]


def keys_by_step(url: str) -> dict[int, list[str]]:
    state = anyio.run(lakestream.load_state, url)
    return {
        s: [k for r in range(state.world_at(s)) for k in anyio.run(read_rank, url, r, None, s, s + 1)[s]]
        for s in range(state.first_step, state.head + 1)
    }


@pytest.mark.parametrize("kill", [False, True])
def test_a_new_global_batch_while_a_producer_runs_is_re_produced_exactly_once(
    stream_url: str, tmp_path: Path, kill: bool
) -> None:
    """A reshape to a new global batch lands while a producer commits: the producer is fenced (or
    SIGKILLed around it), the run again resumes from its cursor as of the step before, and every
    sample is in the stream once, the later steps in TGBs of the new size."""
    url = stream_url
    n = 400
    anyio.run(lambda: lakestream.create(url, world_size=2, global_batch=8))
    # 25 s at this rate: the reshape (a CLI start, seconds on a busy machine) lands while it runs
    produce = ["produce", url, "--producer-id", "a", "--synthetic", n, "--sample-size", 32, "--rate", 16]
    proc = spawn_cli(*produce)
    try:
        wait_until(lambda: anyio.run(lakestream.load_state, url).head >= 10, what="10 steps")
        proc_rc = None
        if kill:
            proc.kill()
            proc_rc = proc.wait(30)
        r = run_cli("reshape", url, "--world-size", "3", "--global-batch", "6", "--from-step", "6")
        assert r.returncode == 0, describe(r)
        assert "global batch 6" in r.stdout
        _, err = proc.communicate(timeout=60)
        assert (proc_rc if kill else proc.returncode) != 0  # fenced by the reshape, or killed
        if not kill:
            assert "fenced" in err.lower(), err
    finally:
        if proc.poll() is None:
            proc.kill()
    state = anyio.run(lakestream.load_state, url)
    assert state.head == 5 and state.producers["a"].cursor == 48
    run_cli(*produce[:-2], check=True)  # the same command again, at full speed
    steps = keys_by_step(url)
    keys = [k for s in sorted(steps) for k in steps[s]]
    assert sorted(keys) == sorted(f"a-{i:09d}" for i in range(n)) and len(set(keys)) == n
    assert all(len(steps[s]) == 8 for s in range(6)) and all(len(steps[s]) <= 6 for s in steps if s >= 6)
    assert run_cli("verify", url).returncode == 0


def test_a_new_global_batch_with_two_producers_one_sigkilled_is_re_produced_exactly_once(tmp_path: Path) -> None:
    """Two producers commit; one is SIGKILLed, and a new global batch from a committed step lands
    while the other runs (it is fenced). Both run again: every sample of both is in the stream once,
    the steps before the change in TGBs of the old size, those after in TGBs of the new."""
    url = f"file://{tmp_path}/s"
    n = 300
    anyio.run(lambda: lakestream.create(url, world_size=2, global_batch=8))

    def produce(pid: str) -> list[Any]:
        return ["produce", url, "--producer-id", pid, "--synthetic", n, "--sample-size", 32]

    a, b = spawn_cli(*produce("a"), "--rate", 30), spawn_cli(*produce("b"), "--rate", 30)
    try:
        wait_until(lambda: anyio.run(lakestream.load_state, url).head >= 12, what="13 steps")
        a.kill()
        a.communicate(timeout=30)
        head = anyio.run(lakestream.load_state, url).head
        r = run_cli("reshape", url, "--world-size", "3", "--global-batch", "6", "--from-step", head - 4)
        assert r.returncode == 0, describe(r)
        _, err = b.communicate(timeout=60)
        assert b.returncode != 0 and "fenced" in err.lower(), err
    finally:
        for proc in (a, b):
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)
    assert anyio.run(lakestream.load_state, url).head == head - 5
    for pid in ("a", "b"):
        run_cli(*produce(pid), check=True)  # the same commands again, at full speed
    steps = keys_by_step(url)
    keys = [k for s in sorted(steps) for k in steps[s]]
    want = sorted(f"{pid}-{i:09d}" for pid in "ab" for i in range(n))
    assert sorted(keys) == want and len(set(keys)) == len(keys)
    assert all(len(steps[s]) == 8 for s in range(head - 4)) and all(len(steps[s]) <= 6 for s in steps if s >= head - 4)
    assert run_cli("verify", url).returncode == 0
