"""Hostile streams and hostile values: whatever a store holds or a caller passes, the answer is a
typed error naming what is wrong (step, rank, object), never a wrong answer, a write outside a
directory or an allocation that follows a number read from the store."""

from __future__ import annotations

import json
import math
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from cliutil import describe, run_cli

import lakestream
from lakestream import CorruptData, InvalidSample, StoreUnavailable
from lakestream._manifest import log_key
from lakestream._records import CommitRecord, Record, RewindRecord, TgbRef, encode_record
from lakestream._segment import MAGIC
from lakestream._store import MemoryStore

W, B = 2, 4


def raw_slice(header: list[Any], payload: bytes) -> bytes:
    """A rank slice with any header at all (the documented format: magic, u32 length, JSON)."""
    head = orjson.dumps(header)
    return MAGIC + struct.pack("<I", len(head)) + head + payload


async def make_stream(root: Path, steps: int = 2, producer: str = "a") -> str:
    url = f"file://{root}"
    await lakestream.create(url, world_size=W, global_batch=B)
    async with lakestream.open_producer(url, producer) as p:
        for i in range(steps * B):
            await p.put({"__key__": f"{producer}{i:04d}", "txt": f"sample {i}"}, cursor=i + 1)
    return url


def plant(root: Path, record: Record) -> int:
    """Write `record` at the next log version by hand; the version."""
    log = root / "_lakestream" / "log"
    version = max(int(p.stem) for p in log.glob("*.json")) + 1
    (root / log_key(version)).write_bytes(encode_record(record))
    return version


def commit_of(
    root: Path,
    slices: list[bytes],
    *,
    lengths: dict[int, int] | None = None,
) -> CommitRecord:
    """A commit record for producer a's next seq holding one TGB made of `slices` (one per rank), in
    segment `segments/a/<epoch>-<seq>-hostile.tgb`; `lengths` overrides what the record claims for
    some ranks' lengths."""
    state = json.loads(run_cli("status", f"file://{root}", "--json", check=True).stdout)
    a = state["producers"]["a"]
    segment = f"segments/a/{a['epoch']}-{a['seq'] + 1}-hostile.tgb"
    path = root / segment
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(slices))
    ranks, offset = [], 0
    for rank, data in enumerate(slices):
        ranks.append((offset, (lengths or {}).get(rank, len(data)), zlib.crc32(data), 1))
        offset += len(data)
    return CommitRecord("a", a["epoch"], a["seq"] + 1, (TgbRef(segment, tuple(ranks), 999),))


# -- 1. names stored in a segment --------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "field"),
    [(".", "/../../escape/PWNED"), ("..", "txt"), ("k", "../../PWNED"), ("_meta", "json"), ("k", ""), ("a/b", "x")],
)
async def test_hostile_names_in_a_segment_are_refused_everywhere(tmp_path: Path, key: str, field: str) -> None:
    root = tmp_path / "s"
    url = await make_stream(root)
    good = raw_slice([["ok", [["txt", "b", 2]]]], b"hi")
    step = plant(root, commit_of(root, [raw_slice([[key, [[field, "b", 5]]]], b"PWNED"), good]))
    head = (await lakestream.load_state(url)).head

    async with lakestream.open_reader(url, 0, raw=True) as r:
        with pytest.raises(CorruptData, match=rf"step {head} rank 0 object segments/a/\d+-\d+-hostile.tgb"):
            await r.read_step(head)
    out = tmp_path / "deep" / "er" / "out"
    res = run_cli("read", url, "--rank", 0, "--out", out)
    assert res.returncode == 1 and "Traceback" not in res.stderr, describe(res)
    assert f"step {head} rank 0" in res.stderr, describe(res)
    assert not list(tmp_path.rglob("PWNED")), "a stored name became a path"
    report = await lakestream.verify(url)
    assert any(f"step {head} rank 0" in p and "malformed slice" in p for p in report.problems), report.problems
    assert step > 0


async def test_a_slice_with_duplicate_keys_or_fields_is_corrupt(tmp_path: Path) -> None:
    root = tmp_path / "s"
    url = await make_stream(root)
    dup_key = raw_slice([["k", [["a", "b", 1]]], ["k", [["b", "b", 1]]]], b"xy")
    dup_field = raw_slice([["k", [["a", "b", 1], ["a", "b", 1]]]], b"xy")
    plant(root, commit_of(root, [dup_key, dup_field]))
    head = (await lakestream.load_state(url)).head
    async with lakestream.open_reader(url, None) as r:
        entry = r.state.step(head)
        assert entry is not None
        for rank, what in ((0, "appears twice"), (1, "appears twice")):
            with pytest.raises(CorruptData, match=f"rank {rank} .*{what}"):
                await r.fetch_raw(entry, rank)


# -- 12. numbers read from the store ------------------------------------------------------------


async def test_a_slice_claiming_more_bytes_than_its_segment_holds_allocates_nothing(tmp_path: Path) -> None:
    root = tmp_path / "s"
    url = await make_stream(root)
    slices = [raw_slice([["k", [["a", "b", 1]]]], b"x"), raw_slice([["l", [["a", "b", 1]]]], b"y")]
    record = commit_of(root, slices, lengths={1: 10**12})  # rank 1 claims a terabyte of a 60-byte object
    plant(root, record)
    head = (await lakestream.load_state(url)).head
    async with lakestream.open_reader(url, 1) as r:
        with pytest.raises(CorruptData, match=rf"step {head} rank 1 .*holds \d+ bytes .* says 1000000000000"):
            await r.read_step(head)


async def test_a_slice_that_does_not_follow_the_previous_one_is_a_rejected_record(tmp_path: Path) -> None:
    root = tmp_path / "s"
    url = await make_stream(root)
    before = await lakestream.load_state(url)
    record = commit_of(root, [raw_slice([["k", [["a", "b", 1]]]], b"x")] * 2)
    (first, second) = record.tgbs[0].ranks
    both_at_0 = TgbRef(record.tgbs[0].segment, (first, (0, *second[1:])), None)  # both claim the same bytes
    version = plant(root, CommitRecord("a", record.epoch, record.seq, (both_at_0,)))
    state = await lakestream.load_state(url)
    assert state.head == before.head and [v for v, _ in state.rejected] == [version]


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"world_size": 10**9, "global_batch": 10**9}, "world_size must be an integer from 1 to 65536"),
        ({"world_size": 8, "global_batch": 10**12}, "global_batch must be an integer from 1 to 16777216"),
        ({"world_size": 4096, "global_batch": 1}, "smaller than world_size"),
        ({"world_size": 2, "global_batch": 4, "max_sample_bytes": 1 << 40}, "max_sample_bytes"),
    ],
)
async def test_shapes_past_the_documented_limits_are_refused_at_create(
    tmp_path: Path, options: dict[str, int], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        await lakestream.create(f"file://{tmp_path}/s", **options)
    assert not (tmp_path / "s" / "_lakestream").exists()


def test_init_refuses_a_global_batch_smaller_than_the_world_size(tmp_path: Path) -> None:
    r = run_cli("init", tmp_path / "s", "--world-size", 4096, "--global-batch", 1, check=False)
    assert r.stderr.count("\n") == 1 and "smaller than world_size" in r.stderr, describe(r)


# -- 13. values that cannot be stored as they are -----------------------------------------------


@pytest.mark.parametrize(
    ("sample", "match"),
    [
        ({"x": math.nan}, "NaN"),
        ({"x": {"a": [1.0, math.inf]}}, "NaN and infinities"),
        ({"x": [np.float32("nan")]}, "NaN"),
        ({"x": np.array([1, "a", None], dtype=object)}, "numpy arrays of Python objects"),
        ({"__key__": "bad\udcff", "x": b""}, "not valid UTF-8"),
        ({"f\udcff": b""}, "not valid UTF-8"),
        ({"txt": "text \ud800"}, "not valid UTF-8"),
    ],
)
async def test_values_that_cannot_round_trip_are_invalid_samples(sample: dict[str, Any], match: str) -> None:
    store = MemoryStore("t")
    await lakestream.create(store, world_size=1, global_batch=1)
    async with lakestream.open_producer(store, "p") as p:
        with pytest.raises(InvalidSample, match=match):
            await p.put(sample)
        await p.put({"ok": np.array([1.5, 2.5])}, cursor=1)  # the producer goes on
    assert (await lakestream.load_state(store)).head == 0


@pytest.mark.parametrize("cursor", [math.nan, {"pos": math.inf}, [1, -math.inf]])
async def test_a_cursor_with_nan_is_refused_not_rewritten_to_null(cursor: Any) -> None:
    store = MemoryStore("t")
    await lakestream.create(store, world_size=1, global_batch=1)
    async with lakestream.open_producer(store, "p") as p:
        with pytest.raises(InvalidSample, match="cursor"):
            await p.put({"x": b"1"}, cursor=cursor)
    assert (await lakestream.load_state(store)).producers["p"].cursor is None


# -- 7. verify sees crafted records ----------------------------------------------------------------


async def test_a_commit_that_reuses_another_steps_segment_is_a_noop_before_and_after_gc(tmp_path: Path) -> None:
    """A commit record naming step 0's segment (as the producer's next seq, current epoch) is a
    no-op: `read` never serves step 0's samples at a later step, `verify` reports the record. Once
    GC reclaimed step 0 the segment is still spent."""
    root = tmp_path / "s"
    url = await make_stream(root, steps=3)
    state = await lakestream.load_state(url)
    old = state.step(0)
    assert old is not None
    ranks = tuple((r.offset, r.length, r.digest, r.samples) for r in old.ranks)

    async def reuse() -> int:
        a = (await lakestream.load_state(url)).producers["a"]
        return plant(
            root, CommitRecord("a", a.epoch, a.seq + 1, (TgbRef(old.segment, ranks, 1, checksum=old.checksum),))
        )

    version = await reuse()
    after = await lakestream.load_state(url)
    assert after.head == state.head and after.rejected[-1][0] == version
    r = run_cli("read", url, "--rank", 0, "--json", check=True)
    keys = [k for line in r.stdout.splitlines() for k in json.loads(line).get("keys", [])]
    assert len(keys) == len(set(keys)) == 3 * B // W, describe(r)
    r = run_cli("verify", url, check=False)
    assert "FAILED" in r.stdout and f"log version {version} " in r.stdout and "not a key of its TGB" in r.stdout

    assert await lakestream.checkpoint(url, "c", 1)
    await lakestream.gc(url)
    assert (await lakestream.load_state(url)).first_step == 1
    version = await reuse()
    after = await lakestream.load_state(url)
    assert after.head == state.head and after.rejected[-1][0] == version


async def test_verify_reports_sample_keys_produced_twice(tmp_path: Path) -> None:
    root = tmp_path / "s"
    url = await make_stream(root, steps=1)
    async with lakestream.open_producer(url, "b") as p:  # a second producer re-produces a0001
        for i in range(B):
            await p.put({"__key__": f"a{i + 1:04d}" if i == 0 else f"b{i}", "txt": "again"})
    report = await lakestream.verify(url)
    assert [p for p in report.problems if "a0001" in p and "produced twice" in p], report.problems


@pytest.mark.parametrize("snapshots", [False, True])
async def test_verify_reports_a_record_planted_after_a_hole_in_the_log(tmp_path: Path, snapshots: bool) -> None:
    root = tmp_path / "s"
    url = f"file://{root}"
    await lakestream.create(url, world_size=1, global_batch=1)
    async with lakestream.open_producer(url, "a") as p:
        for i in range(5):
            await p.put({"__key__": f"k{i}", "txt": "x"}, cursor=i + 1)
    if snapshots:
        await lakestream.gc(url)  # writes a snapshot of the tail
        assert list((root / "_lakestream" / "snapshots").iterdir())
    state = await lakestream.load_state(url)
    (root / log_key(state.version + 2)).write_bytes(encode_record(RewindRecord(-1)))
    if not snapshots:  # read from version 0, the loader itself sees versions past where it stopped
        with pytest.raises(CorruptData, match=f"hole: version {state.version + 1} "):
            await lakestream.verify(url)
        return
    after = await lakestream.load_state(url)
    assert after.head == state.head  # never applied
    report = await lakestream.verify(url)
    assert any(f"past a hole at version {state.version + 1}" in p for p in report.problems), report.problems


# -- 9. errors come out as the documented types ---------------------------------------------------


class Unreachable(MemoryStore):
    """A store whose every log read fails as an unreachable endpoint would (after its retries)."""

    async def get(self, key: str) -> bytes:
        if key.startswith("_lakestream/log/") and key != log_key(0):
            raise StoreUnavailable(f"{self.url}: unreachable", retried=True)
        return await super().get(key)


async def test_an_unreachable_store_raises_store_unavailable_not_an_exception_group() -> None:
    store = Unreachable("t")
    await lakestream.create(store, world_size=1, global_batch=1)
    for call in (lakestream.load_state, lakestream.verify):
        with pytest.raises(StoreUnavailable):
            await call(store)


async def test_a_directory_at_the_next_log_version_is_corrupt_data(tmp_path: Path) -> None:
    root = tmp_path / "s"
    url = await make_stream(root)
    state = await lakestream.load_state(url)
    (root / log_key(state.version + 1)).mkdir()
    with pytest.raises(CorruptData, match=f"{state.version + 1:020d}.json.*a directory"):
        await lakestream.load_state(url)
    r = run_cli("status", url, check=False)
    assert r.stderr.count("\n") == 1 and "a directory" in r.stderr, describe(r)
