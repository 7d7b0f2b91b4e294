"""Snapshots are checked, cross-checked against the log, and skipped when bad (issue 8, item 5).

Every scenario edits store objects by hand, as the documented layout allows (docs/architecture.md):
a snapshot is the state as JSON plus a `sha256` member over the rest as compact sorted JSON.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest
from cliutil import read_out_dir, run_cli
from hypothesis import given, settings
from hypothesis import strategies as st
from mountutil import MountProc, read_tree

import lakestream
from lakestream import Config, CorruptData, State
from lakestream._manifest import HINT_KEY, LOG_PREFIX, Manifest, log_key, snapshot_key
from lakestream._records import (
    CheckpointRecord,
    CommitRecord,
    CreateRecord,
    ReclaimRecord,
    RegisterRecord,
    RewindRecord,
    TgbRef,
    encode_record,
)

W, B = 2, 4


@pytest.fixture
def file_url(tmp_path: Path) -> str:
    return f"file://{tmp_path}/stream"


@pytest.fixture(params=["file", "s3"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return f"file://{tmp_path}/stream" if request.param == "file" else request.getfixturevalue("s3_url")


async def produce(url: str, n: int, pid: str = "p") -> None:
    """Put records 0..n-1 of a deterministic source, one step per B records, resuming at the cursor."""
    async with lakestream.open_producer(url, pid) as p:
        for i in range(p.cursor or 0, n):
            await p.put({"__key__": f"{pid}-{i}", "txt": f"{pid}:{i}"}, cursor=i + 1)
            if (i + 1) % B == 0:
                await p.flush()


async def new_stream(url: str, steps: int) -> None:
    await lakestream.create(url, world_size=W, global_batch=B, snapshot_every=1000)
    await produce(url, steps * B)


async def write_snapshot(url: str) -> int:
    """Snapshot the tail as a producer or GC does; its version."""
    async with lakestream.open_store(url) as store:
        m = Manifest(store)
        await m.load()
        await m.write_snapshot(m.state.to_json(), m.state.version)
        return m.state.version


async def clean_log(url: str, below: int) -> None:
    """Delete log versions 1..below-1, as GC's log clean-up does below a snapshot at `below`."""
    async with lakestream.open_store(url) as store:
        await store.delete([log_key(v) for v in range(1, below)])


def seal(d: dict[str, Any]) -> bytes:
    """A snapshot with its checksum recomputed exactly as docs/architecture.md says, written in
    another JSON formatting (which must not matter)."""
    body = {k: v for k, v in d.items() if k != "sha256"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    return json.dumps({**body, "sha256": hashlib.sha256(canonical).hexdigest()}, indent=1).encode()


async def edit_snapshot(url: str, version: int, edit: Callable[[dict[str, Any]], None], *, reseal: bool) -> None:
    async with lakestream.open_store(url) as store:
        d = json.loads(await store.get(snapshot_key(version)))
        edit(d)
        await store.put(snapshot_key(version), seal(d) if reseal else json.dumps(d).encode())


async def read_keys(url: str) -> dict[int, list[str]]:
    """Every step's sample keys, rank by rank, as the reader returns them."""
    state = await lakestream.load_state(url)
    out: dict[int, list[str]] = {}
    for rank in range(W):
        async with lakestream.open_reader(url, rank) as r:
            async for b in r.steps(state.first_step, state.head + 1):
                out.setdefault(b.step, []).extend(s["__key__"] for s in b.samples)
    return out


async def listing(url: str, prefix: str) -> list[str]:
    async with lakestream.open_store(url) as store:
        return await store.list(prefix)


async def resumed_cursor(url: str) -> Any:
    async with lakestream.open_producer(url, "p") as p:
        return p.cursor


def warned_about(caplog: pytest.LogCaptureFixture, key: str) -> bool:
    return any(r.levelno == logging.WARNING and key in r.getMessage() for r in caplog.records)


# -- the format --------------------------------------------------------------------------------


async def test_a_snapshot_is_sealed_as_documented_and_an_unsealed_one_still_loads(file_url: str) -> None:
    await new_stream(file_url, 6)
    v = await write_snapshot(file_url)
    before = await lakestream.load_state(file_url)
    async with lakestream.open_store(file_url) as store:
        data = await store.get(snapshot_key(v))
    d = json.loads(data)
    assert d["version"] == v and json.loads(seal(d))["sha256"] == d["sha256"]  # the documented rule
    # A snapshot written before snapshots were sealed (no sha256, insertion order) is used: with the
    # log below it cleaned up, nothing else could give this state.
    await edit_snapshot(file_url, v, lambda d: d.pop("sha256"), reseal=False)
    await clean_log(file_url, v)
    async with lakestream.open_store(file_url) as store:
        m = Manifest(store)
        assert (await m.load()).to_json() == before.to_json() and m.problems == []


def test_the_snapshot_bytes_are_the_state_and_its_checksum() -> None:
    state = rich_state()
    d = orjson.loads(state.to_json())
    assert d.pop("sha256") == hashlib.sha256(orjson.dumps(d, option=orjson.OPT_SORT_KEYS)).hexdigest()
    assert d == state.to_dict()


# -- steps removed: read, gc and producers see the log's truth ------------------------------------


@pytest.mark.parametrize("reseal", [False, True], ids=["stale-checksum", "recomputed-checksum"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
async def test_steps_removed_from_a_snapshot(file_url: str, where: str, reseal: bool, caplog) -> None:
    await new_stream(file_url, 10)
    v = await write_snapshot(file_url)
    before, keys = await lakestream.load_state(file_url), await read_keys(file_url)
    segments = await listing(file_url, "segments/")
    cut = {"first": slice(0, 3), "middle": slice(4, 7), "last": slice(-3, None)}[where]
    await edit_snapshot(file_url, v, lambda d: d["steps"].__delitem__(cut), reseal=reseal)

    assert (await lakestream.load_state(file_url)).to_json() == before.to_json()
    assert warned_about(caplog, snapshot_key(v))
    assert await read_keys(file_url) == keys  # no renumbered steps
    for dry_run in (True, False):
        with pytest.raises(CorruptData, match=snapshot_key(v)):
            await lakestream.gc(file_url, dry_run=dry_run, lease=0.0)
    assert await listing(file_url, "segments/") == segments
    assert await resumed_cursor(file_url) == before.producers["p"].cursor == 10 * B


@pytest.mark.parametrize("reseal", [False, True], ids=["stale-checksum", "recomputed-checksum"])
@pytest.mark.parametrize("value", ["abc", 1.5, -1, None, True, [0]])
async def test_a_snapshot_with_a_bad_first_step(file_url: str, value: Any, reseal: bool, caplog) -> None:
    await new_stream(file_url, 6)
    v = await write_snapshot(file_url)
    before, keys = await lakestream.load_state(file_url), await read_keys(file_url)
    await edit_snapshot(file_url, v, lambda d: d.__setitem__("first_step", value), reseal=reseal)
    async with lakestream.open_store(file_url) as store:
        with pytest.raises(ValueError, match=r"first_step|checksum"):
            State.from_json(await store.get(snapshot_key(v)))
    assert (await lakestream.load_state(file_url)).to_json() == before.to_json()
    assert warned_about(caplog, snapshot_key(v))
    assert await read_keys(file_url) == keys
    report = await lakestream.verify(file_url)  # it reads the stream, and says the snapshot is bad
    assert report.steps == 6 and not report.ok and snapshot_key(v) in report.problems[0]


async def test_a_bad_newest_snapshot_falls_back_to_the_older_one(file_url: str, caplog) -> None:
    await new_stream(file_url, 4)
    old = await write_snapshot(file_url)
    await produce(file_url, 8 * B)
    new = await write_snapshot(file_url)
    before = await lakestream.load_state(file_url)
    await clean_log(file_url, old)  # replay from 0 is impossible: only the older snapshot helps
    await edit_snapshot(file_url, new, lambda d: d["steps"].pop(), reseal=True)
    async with lakestream.open_store(file_url) as store:
        m = Manifest(store)
        assert (await m.load()).to_json() == before.to_json()
        assert len(m.problems) == 1 and snapshot_key(new) in m.problems[0]
    assert warned_about(caplog, snapshot_key(new))
    assert await resumed_cursor(file_url) == 8 * B


async def test_a_snapshot_under_another_version_is_not_used(file_url: str, caplog) -> None:
    await new_stream(file_url, 4)
    v = await write_snapshot(file_url)
    await produce(file_url, 6 * B)
    before = await lakestream.load_state(file_url)
    async with lakestream.open_store(file_url) as store:
        # the state at v stored as the snapshot of the tail, and the hint pointing at it
        await store.put(snapshot_key(before.version), await store.get(snapshot_key(v)))
        await store.put(HINT_KEY, orjson.dumps({"version": before.version}))
        m = Manifest(store)
        assert (await m.load()).to_json() == before.to_json()
        assert "not " + str(before.version) in m.problems[0]
    # the version inside changed to match the name, checksum recomputed: the log record disagrees
    await edit_snapshot(file_url, before.version, lambda d: d.__setitem__("version", before.version), reseal=True)
    async with lakestream.open_store(file_url) as store:
        m = Manifest(store)
        assert (await m.load()).to_json() == before.to_json()
        assert f"disagrees with {log_key(before.version)}" in m.problems[0]


async def test_an_unreadable_hint_or_a_missing_snapshot_is_no_problem(file_url: str, caplog) -> None:
    await new_stream(file_url, 4)
    v = await write_snapshot(file_url)
    before = await lakestream.load_state(file_url)
    async with lakestream.open_store(file_url) as store:
        for hint in (b"garbage", b'{"version": "abc"}', b'{"version": 999}'):
            await store.put(HINT_KEY, hint)
            m = Manifest(store)
            assert (await m.load()).to_json() == before.to_json() and m.problems == []
        await store.delete([snapshot_key(v)])
        m = Manifest(store)
        assert (await m.load()).to_json() == before.to_json() and m.problems == []


# -- a hole in the log is an error, never an empty stream -----------------------------------------


@pytest.mark.parametrize("how", ["deleted", "corrupted"])
async def test_a_lost_snapshot_after_log_clean_up_is_a_hole(url: str, how: str) -> None:
    await new_stream(url, 4)
    v = await write_snapshot(url)
    await clean_log(url, v)
    await produce(url, 6 * B)  # resumes from the snapshot, commits after it
    assert (await lakestream.load_state(url)).head == 5
    if how == "deleted":
        async with lakestream.open_store(url) as store:
            await store.delete([snapshot_key(v)])
    else:
        await edit_snapshot(url, v, lambda d: d.__setitem__("first_step", "abc"), reseal=True)
    logs, segments = await listing(url, LOG_PREFIX), await listing(url, "segments/")
    hole = rf"{url}: the log has a hole: version 1 \({log_key(1)}\) is missing"
    with pytest.raises(CorruptData, match=hole):
        await lakestream.load_state(url)
    with pytest.raises(CorruptData, match=hole):
        async with lakestream.open_reader(url, 0):
            pass
    with pytest.raises(CorruptData, match=hole):  # never "no cursor": that would re-produce the source
        await resumed_cursor(url)
    with pytest.raises(CorruptData, match=hole):
        await lakestream.verify(url)
    with pytest.raises(CorruptData, match=hole):
        await lakestream.gc(url, dry_run=True)
    assert await listing(url, LOG_PREFIX) == logs and await listing(url, "segments/") == segments


async def test_a_hole_in_a_stream_without_snapshots_is_reported(file_url: str) -> None:
    await new_stream(file_url, 3)
    assert (await lakestream.load_state(file_url)).head == 2
    async with lakestream.open_store(file_url) as store:
        await store.delete([log_key(2)])
    with pytest.raises(CorruptData, match=f"version 2 \\({log_key(2)}\\) is missing"):
        await lakestream.load_state(file_url)


# -- GC acts only on what it could check -----------------------------------------------------------


async def test_gc_never_cleans_the_log_below_a_bad_snapshot(file_url: str) -> None:
    await new_stream(file_url, 4)
    good = await write_snapshot(file_url)
    await produce(file_url, 6 * B)
    bad = await write_snapshot(file_url)
    # the hint names the good snapshot; the newest one, which log clean-up would keep, is forged
    await edit_snapshot(file_url, bad, lambda d: d["steps"].pop(), reseal=True)
    async with lakestream.open_store(file_url) as store:
        await store.put(HINT_KEY, orjson.dumps({"version": good}))
        m = Manifest(store)
        await m.load()
        assert m.problems == []  # the load itself used the good one
    logs = await listing(file_url, LOG_PREFIX)
    with pytest.raises(CorruptData, match=snapshot_key(bad)):
        await lakestream.gc(file_url, lease=0.0)
    assert await listing(file_url, LOG_PREFIX) == logs
    assert (await lakestream.load_state(file_url)).head == 5


@pytest.mark.parametrize("log", ["whole", "cleaned"])
async def test_a_forged_snapshot_consistent_with_its_record_is_caught_by_a_replay(file_url: str, log: str) -> None:
    """Steps 0..2 dropped and first_step moved past them, checksum recomputed: the cheap checks on
    load pass (a reclaim looks like this), but `verify` and `gc` replay the retained log."""
    await new_stream(file_url, 4)
    older = await write_snapshot(file_url)
    await produce(file_url, 10 * B)
    v = await write_snapshot(file_url)
    if log == "cleaned":
        await clean_log(file_url, older)  # the replay starts at the older snapshot

    def forge(d: dict[str, Any]) -> None:
        del d["steps"][:3]
        d["first_step"] = 3

    await edit_snapshot(file_url, v, forge, reseal=True)
    assert (await lakestream.load_state(file_url)).first_step == 3  # the documented limit of load
    report = await lakestream.verify(file_url)
    differs = f"snapshot {snapshot_key(v)} differs from the replay of the log to version {v}"
    assert not report.ok and any(differs in p and "steps 3..9, the log 0..9" in p for p in report.problems)
    segments, logs = await listing(file_url, "segments/"), await listing(file_url, LOG_PREFIX)
    for dry_run in (True, False):
        with pytest.raises(CorruptData, match=differs):
            await lakestream.gc(file_url, dry_run=dry_run, lease=0.0)
    assert await listing(file_url, "segments/") == segments and await listing(file_url, LOG_PREFIX) == logs


async def test_the_cli_reads_past_a_bad_snapshot_and_names_it_and_a_hole_in_one_line(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/stream"
    await new_stream(url, 6)
    v = await write_snapshot(url)
    await edit_snapshot(url, v, lambda d: d["steps"].__delitem__(slice(2, 5)), reseal=True)
    r = run_cli("read", url, "--rank", 0, "--out", tmp_path / "out", check=True)
    assert sorted(read_out_dir(tmp_path / "out")) == list(range(6)) and snapshot_key(v) in r.stderr
    for args in (("gc", url, "--dry-run"), ("verify", url)):
        r = run_cli(*args, check=False)
        assert snapshot_key(v) in r.stdout + r.stderr and "Traceback" not in r.stderr, args
    # the only snapshot gone after log clean-up: a hole, reported in one line by every command
    await clean_log(url, v)
    async with lakestream.open_store(url) as store:
        await store.delete([snapshot_key(v)])
    for args in (("status", url), ("verify", url), ("read", url, "--rank", 0), ("gc", url, "--dry-run")):
        r = run_cli(*args, check=False)
        assert "the log has a hole: version 1" in r.stderr and "Traceback" not in r.stderr, args
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def mounted_tree(url: str, tmp_path: Path, name: str, nsteps: int) -> dict[tuple[int, int], dict[str, bytes]]:
    m = MountProc(url, tmp_path / name, tmp_path / f"{name}.log").start().wait_ready()
    try:
        return read_tree(str(m.mountpoint), list(range(W)), nsteps)
    finally:
        assert m.stop() == 0, m.log()


@pytest.mark.skipif(not os.access("/dev/fuse", os.R_OK | os.W_OK), reason="needs /dev/fuse")
async def test_the_mount_starts_and_serves_past_a_snapshot_with_a_bad_first_step(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/stream"
    await new_stream(url, 6)
    v = await write_snapshot(url)
    before = await anyio.to_thread.run_sync(mounted_tree, url, tmp_path, "before", 6)
    await edit_snapshot(url, v, lambda d: d.__setitem__("first_step", "abc"), reseal=True)
    after = await anyio.to_thread.run_sync(mounted_tree, url, tmp_path, "after", 6)
    assert after == before and len(after) == 6 * W and all(after.values())


# -- the format, property-tested ---------------------------------------------------------------


RANKS = [[0, 10, 7, 2], [10, 12, 9, 2]]  # two rank slices tiling a 22-byte segment


def _commit(pid: str, epoch: int, seq: int, n: int, first: int) -> bytes:
    ranks = tuple(tuple(r) for r in RANKS)
    tgbs = tuple(TgbRef(f"segments/{pid}/{epoch}-{seq + i}-x.tgb", ranks, first + i) for i in range(n))  # type: ignore[arg-type]
    return encode_record(CommitRecord(pid, epoch, seq, tgbs, ts=1.5 + seq))


def rich_state() -> State:
    """A state touched by every record kind, including a rejected one."""
    log = [
        encode_record(CreateRecord(Config(world_size=W, global_batch=B, keep_checkpoints=2))),
        encode_record(RegisterRecord("a", 1, "t1", 1.0)),
        encode_record(RegisterRecord("b", 1, "t2", 1.25)),
        _commit("a", 1, 0, 2, 0),
        _commit("b", 1, 0, 1, 100),
        encode_record(CheckpointRecord("c1", 1, 2.0)),
        _commit("a", 1, 2, 3, 2),
        encode_record(CheckpointRecord("c2", 4, 2.5)),
        encode_record(ReclaimRecord(1, 3.0)),
        b'{"kind": "nope"}',
        encode_record(RewindRecord(4, 4.0)),
        encode_record(RegisterRecord("a", 3, "t3", 5.0)),
        _commit("a", 3, 5, 1, 5),
    ]
    s = State()
    for v, data in enumerate(log):
        s.apply(v, data)
    assert s.first_step == 1 and s.head == 5 and s.rewinds == 1 and len(s.rejected) == 1
    return s


RICH = rich_state().to_json()

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=4,
)


def _paths(node: Any, path: tuple = ()) -> list[tuple]:
    out = [path]
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, child in items:
        out.extend(_paths(child, (*path, k)))
    return out


def _mutate(doc: Any, data: st.DataObject) -> Any:
    """`doc` with one node replaced, deleted, duplicated or given a new member."""
    path = data.draw(st.sampled_from(_paths(doc)))
    if not path:
        return data.draw(_json)
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    op = data.draw(st.sampled_from(["replace", "delete", "duplicate", "add"]))
    if op == "replace":
        parent[key] = data.draw(_json)
    elif op == "delete":
        del parent[key]
    elif op == "duplicate" and isinstance(parent, list):
        parent.insert(key, parent[key])
    elif isinstance(parent, dict):
        parent[data.draw(st.text(max_size=8))] = data.draw(_json)
    else:
        parent.insert(key, data.draw(_json))
    return doc


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_any_mutation_of_a_snapshot_is_rejected_or_changes_nothing(data: st.DataObject) -> None:
    mutated = _mutate(orjson.loads(RICH), data)
    try:
        state = State.from_json(orjson.dumps(mutated))
    except ValueError:
        return
    assert state.to_json() == RICH


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_a_flipped_byte_is_rejected_or_changes_nothing(data: st.DataObject) -> None:
    at = data.draw(st.integers(0, len(RICH) - 1))
    flipped = RICH[:at] + bytes([RICH[at] ^ data.draw(st.integers(1, 255))]) + RICH[at + 1 :]
    try:
        state = State.from_json(flipped)
    except ValueError:
        return
    assert state.to_json() == RICH


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_an_unsealed_snapshot_is_validated_field_by_field(data: st.DataObject) -> None:
    """Without a checksum a mutation may yield another state, but only a well-formed one, and
    anything malformed is a ValueError, never a TypeError or KeyError."""
    doc = orjson.loads(RICH)
    del doc["sha256"]
    try:
        state = State.from_json(orjson.dumps(_mutate(doc, data)))
    except ValueError:
        return
    assert State.from_json(state.to_json()).to_json() == state.to_json()
    assert [s.step for s in state.steps] == list(range(state.first_step, state.head + 1))


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d.pop("version"),
        lambda d: d.__setitem__("version", "3"),
        lambda d: d.__setitem__("version", 2),  # older than its steps and checkpoints
        lambda d: d.__setitem__("config", None),
        lambda d: d["config"].__setitem__("world_size", 0),
        lambda d: d["config"].pop("world_size"),
        lambda d: d["config"].__setitem__("bogus", 1),
        lambda d: d.__setitem__("steps", {}),
        lambda d: d["steps"].__setitem__(0, "x"),
        lambda d: d["steps"][0].__setitem__(0, 7),
        lambda d: d["steps"][0].__setitem__(1, -1),
        lambda d: d["steps"][0].__setitem__(2, 5),
        lambda d: d["steps"][0].__setitem__(3, "nobody"),
        lambda d: d["steps"][0].__setitem__(4, 99),
        lambda d: d["steps"][2].__setitem__(5, 1),  # a sequence number that does not rise
        lambda d: d["steps"][0].__setitem__(6, []),  # a TGB has 1 or more slices (any world size it was sealed for)
        lambda d: d["steps"][0][6].__setitem__(1, [11, 12, 9, 2]),  # slices do not tile
        lambda d: d["steps"][0][6].__setitem__(0, [0, 10, 2**32, 2]),
        lambda d: d["steps"][0][6].__setitem__(0, [0, 10, 7, "2"]),
        lambda d: d["steps"][0].__setitem__(8, "noon"),
        lambda d: d["steps"][0].pop(),
        lambda d: d.__setitem__("producers", []),
        lambda d: d["producers"]["a"].__setitem__("epoch", "1"),
        lambda d: d["producers"]["a"].__setitem__("seq", -2),
        lambda d: d["producers"]["a"].__setitem__("tgbs", 1),
        lambda d: d["producers"]["a"].__setitem__("extra", 1),
        lambda d: d["producers"].__setitem__("../x", d["producers"]["a"]),
        lambda d: d.__setitem__("checkpoints", [["c2", 4, 7], ["c2", 4, 7]]),
        lambda d: d.__setitem__("checkpoints", [["c2", 0, 7]]),  # below first_step
        lambda d: d.__setitem__("checkpoints", [["c2", 9, 7]]),  # above the head
        lambda d: d.__setitem__("checkpoints", [[1, 4, 7]]),
        lambda d: d.__setitem__("rejected", [[9, 1]]),
        lambda d: d.__setitem__("rejected", [[99, "x"]]),
        lambda d: d.__setitem__("rewinds", -1),
        lambda d: d.__setitem__("shapes", [[5, 2, 12], [3, 1, 12]]),  # reshapes out of order
        lambda d: d.__setitem__("shapes", [[5, 0, 12]]),
        lambda d: d.__setitem__("shapes", [[5, 2]]),
        lambda d: d.__setitem__("shapes", [[0, 2, 1]]),  # fewer samples than ranks
        lambda d: d.__setitem__("shapes", {"5": 2}),
        lambda d: d.__setitem__("extra", 0),
    ],
)
def test_malformed_fields_are_value_errors(edit: Callable[[dict[str, Any]], None]) -> None:
    d = orjson.loads(RICH)
    del d["sha256"]
    State.from_json(orjson.dumps(d))  # the unedited, unsealed snapshot is fine
    edit(d)
    with pytest.raises(ValueError, match="invalid snapshot"):
        State.from_json(orjson.dumps(d))
    with pytest.raises(ValueError, match="checksum mismatch"):
        State.from_json(orjson.dumps({**d, "sha256": orjson.loads(RICH)["sha256"]}))
