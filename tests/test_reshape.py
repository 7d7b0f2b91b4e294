"""Elastic world size: the pure re-slicing rule, the reshape record in the state machine, and a stream
written at one world size read at others (the reader, `lakestream read`, `StreamDataset`, the mount)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest
from cliutil import describe, run_cli
from hypothesis import given
from hypothesis import strategies as st
from mountutil import MountProc, read_tree

import lakestream
from lakestream import _decisions as decisions
from lakestream._batching import assign_ranks, reslice
from lakestream._config import Config
from lakestream._records import CreateRecord, ReshapeRecord, encode_record
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
        assert got == order  # consecutive runs of the slices in rank order: each sample once
        sizes = [sum(hi - lo for _, lo, hi in p) for p in plan]
        assert max(sizes) - min(sizes) <= 1
    else:
        assert sorted(got) == order and all(
            p == ([(r, 0, c)] if c else []) for r, (p, c) in enumerate(zip(plan, counts))
        )
    for pieces in plan:
        assert all(0 <= lo < hi <= counts[i] for i, lo, hi in pieces)


@given(st.integers(1, 8), st.integers(1, 8), st.integers(1, 64))
def test_reslice_reads_whole_slices_when_the_new_world_divides_the_old(k: int, w2: int, per: int) -> None:
    w = k * w2
    plan = reslice([per] * w, w2)
    for r, pieces in enumerate(plan):
        assert pieces == [(i, 0, per) for i in range(r * k, (r + 1) * k)]


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
    assert s.shapes == [(5, 3), (7, 6)] and s.world_at(100) == 6
    again = State.from_json(s.to_json())
    assert again.shapes == s.shapes and again.to_dict() == s.to_dict()
    assert "shapes" not in fresh_state().to_dict()  # a stream never reshaped keeps its snapshot format


@pytest.mark.parametrize(
    ("world", "why"),
    [(0, "bad world size"), (13, "above the global batch"), (1 << 17, "above the limit")],
)
def test_a_reshape_to_an_impossible_world_is_a_no_op(world: int, why: str) -> None:
    s = fresh_state()
    reason = s.apply(1, encode_record(ReshapeRecord(0, world)))
    assert reason is not None and why in reason and s.shapes == []
    with pytest.raises(ValueError, match="world size"):
        decisions.reshape(s, world, now=0.0)


def test_a_snapshot_with_shapes_out_of_order_is_refused() -> None:
    s = fresh_state()
    d = s.to_dict() | {"shapes": [[5, 2], [3, 4]]}
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


def test_a_stream_written_at_4_reads_at_3_and_2_and_4_again(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/s"
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


def test_the_mount_serves_the_ranks_of_a_reshaped_stream(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/s"
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
