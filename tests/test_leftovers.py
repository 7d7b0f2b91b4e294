"""Partial last global batches of producers running together: held as leftovers (`finish`), packed
once by the last producer to finish, so that at most one step of a stream, its last, is short."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import orjson
import pytest
from cliutil import cli_env, make_source_dir, run_cli, spawn_cli, wait_until
from hypothesis import given, settings
from hypothesis import strategies as st

import lakestream
from lakestream import Config, State
from lakestream import _decisions as decisions
from lakestream._batching import pack_plan, packed_cursor
from lakestream._manifest import Manifest
from lakestream._records import (
    CommitRecord,
    CreateRecord,
    FinishRecord,
    RegisterRecord,
    RewindRecord,
    TgbRef,
    encode_record,
)

W, B = 2, 4


class Log:
    """A stream's log built record by record, each checked to take effect (or not) as expected."""

    def __init__(self) -> None:
        self.state = State()
        self.records: list[bytes] = []
        self.put(encode_record(CreateRecord(Config(world_size=W, global_batch=B))))

    def put(self, data: bytes, *, ok: bool = True) -> str | None:
        why = self.state.apply(len(self.records), data)
        self.records.append(data)
        assert (why is None) == ok, why
        return why

    def register(self, pid: str) -> None:
        p = self.state.producers.get(pid)
        self.put(encode_record(RegisterRecord(pid, (p.epoch if p else 0) + 1, f"t{len(self.records)}")))

    def commit(self, pid: str, n: int = 1, samples: int = B) -> None:
        """`n` TGBs of `samples` each; cursors count the producer's samples (as a source position)."""
        p = self.state.producers[pid]
        at = p.cursor or 0
        tgbs = tuple(
            TgbRef(f"segments/{pid}/{p.epoch}-{p.seq + 1 + i}-x.tgb", ((0, 1, 0, samples),), at + samples * (i + 1))
            for i in range(n)
        )
        self.put(encode_record(CommitRecord(pid, p.epoch, p.seq + 1, tgbs)))

    def finish(self, pid: str, n: int = 0, *, ok: bool = True) -> None:
        """Finish with a leftover of `n` samples (none for 0), each sample's cursor one past the last."""
        p = self.state.producers[pid]
        at = p.cursor or 0
        left = (
            decisions.PendingTgb(
                p.seq + 1, TgbRef(f"segments/{pid}/{p.epoch}-{p.seq + 1}-left.tgb", ((0, 10, 0, n),), at + n)
            )
            if n
            else None
        )
        record = decisions.finish(self.state, pid, p.epoch, left, (10, 5, 0) if n else None, 0.0)
        assert record is not None
        self.put(encode_record(record), ok=ok)

    def pack(self, packer: str, *, force: bool = False) -> CommitRecord | None:
        """The pack the producer `packer` makes of the held leftovers (per-sample cursors as in `finish`)."""
        s = self.state
        held = sorted(s.leftovers.items())
        plan = pack_plan([(pid, h.samples, None) for pid, h in held], lambda k: (s.batch_at(s.head + 1 + k), None))
        done: dict[str, set[int]] = {pid: set() for pid, _ in held}
        p = s.producers[packer]
        pending = []
        for k, tgb in enumerate(plan):
            counts: dict[str, int] = {}
            for pid, i in tgb:
                counts[pid] = counts.get(pid, 0) + 1
                done[pid].add(i)
            packed = tuple(
                (pid, n, packed_cursor(cursors(s, pid), None, done[pid], s.leftovers[pid].before))
                for pid, n in sorted(counts.items())
            )
            ref = TgbRef(
                f"segments/{packer}/{p.epoch}-{p.seq + 1 + k}-pack.tgb", ((0, 1, 0, len(tgb)),), None, packed=packed
            )
            pending.append(decisions.PendingTgb(p.seq + 1 + k, ref))
        packs = [(pid, h.ref.segment) for pid, h in held]
        return decisions.pack(s, packer, p.epoch, pending, packs, 0, 0.0, force=force)


def cursors(s: State, pid: str) -> list[int]:
    h = s.leftovers[pid]
    return [(h.before or 0) + i + 1 for i in range(h.samples)]


def samples_of(s: State, pid: str, upto: int | None = None) -> int:
    """How many of `pid`'s samples the retained steps up to `upto` hold."""
    n = 0
    for step in s.steps:
        if upto is not None and step.step > upto:
            break
        if step.packed is not None:
            n += sum(k for owner, k, _ in step.packed if owner == pid)
        elif step.producer == pid:
            n += step.samples
    return n


def test_a_producer_that_finishes_first_holds_its_leftover_and_the_last_packs() -> None:
    log = Log()
    log.register("a")
    log.register("b")
    log.commit("a", 2)
    log.finish("a", 3)
    s = log.state
    assert s.producers["a"].finished and s.producers["a"].cursor == 11 and s.producers["a"].seq == 2
    assert s.head == 1 and s.leftovers["a"].samples == 3 and s.leftovers["a"].before == 8
    assert log.pack("a") is None  # b is still producing: the last one to finish packs
    log.commit("b", 1)
    log.finish("b", 2)
    assert s.unfinished() == []
    record = log.pack("b")
    assert record is not None and record.packs == (
        ("a", s.leftovers["a"].ref.segment),
        ("b", s.leftovers["b"].ref.segment),
    )
    log.put(encode_record(record))
    assert [x.samples for x in s.steps] == [4, 4, 4, 4, 1]  # one short step, the last
    assert s.steps[3].packed == (("a", 3, 11), ("b", 1, 5)) and s.steps[4].packed == (("b", 1, 6),)
    assert s.leftovers == {} and s.producers["a"].cursor == 11 and s.producers["b"].cursor == 6
    assert s.producers["b"].seq == 3  # the packer's own sequence numbers
    log.put(encode_record(record), ok=False)  # exactly once: its leftovers are no longer held


def test_finish_and_pack_noop_rules() -> None:
    log = Log()
    for pid in ("a", "b", "c"):
        log.register(pid)
    p = log.state.producers["a"]
    left = TgbRef(f"segments/a/{p.epoch}-{p.seq + 1}-l.tgb", ((0, 10, 0, 3),), 3)
    bad = [
        FinishRecord("a", p.epoch, p.seq + 2, -1, left, (10, 5, 0)),  # not the next seq
        FinishRecord("a", p.epoch + 1, p.seq + 1, -1, left, (10, 5, 0)),  # not its epoch
        FinishRecord("a", p.epoch, p.seq + 1, 0, left, (10, 5, 0)),  # not the head
        FinishRecord("a", p.epoch, p.seq + 1, -1, TgbRef(left.segment, ((0, 10, 0, B),), 3), (10, 5, 0)),  # whole
        FinishRecord("a", p.epoch, p.seq + 1, -1, TgbRef("segments/a/l", ((0, 10, 0, 3),), 3), (10, 5, 0)),  # key
        FinishRecord("a", p.epoch, p.seq + 1, -1, left, (9, 5, 0)),  # cursors not after the slice
        FinishRecord("a", p.epoch, p.seq + 1, -1, None, None),  # without a leftover, seq is the committed one
        FinishRecord("z", 1, 0, -1, None, None),  # not registered
    ]
    for r in bad:
        assert log.state.check(r) is not None, r
        log.put(encode_record(r), ok=False)
    log.finish("a", 3)
    again = FinishRecord("a", p.epoch, p.seq, -1, None, None)
    log.put(encode_record(again), ok=False)  # finished already
    log.finish("b", 2)
    log.finish("c")
    good = log.pack("c")
    assert good is not None
    seg_a = log.state.leftovers["a"].ref.segment
    variants = [
        CommitRecord("c", good.epoch, good.seq, good.tgbs, packs=(("a", "segments/a/other"), good.packs[1])),
        CommitRecord("c", good.epoch, good.seq, good.tgbs, packs=(("a", seg_a),)),  # b's samples, not packed
        CommitRecord(  # a's whole leftover, another cursor
            "c",
            good.epoch,
            good.seq,
            (TgbRef(good.tgbs[0].segment, good.tgbs[0].ranks, None, packed=(("a", 3, 99), ("b", 1, 1))),),
            packs=good.packs,
        ),  # fmt: skip
        CommitRecord(  # counts that do not add up to the TGB's samples
            "c",
            good.epoch,
            good.seq,
            (TgbRef(good.tgbs[0].segment, good.tgbs[0].ranks, None, packed=(("a", 2, 2), ("b", 1, 1))),),
            packs=good.packs,
        ),  # fmt: skip
    ]
    for r in variants:
        log.put(encode_record(r), ok=False)
    log.put(encode_record(good))
    assert log.state.leftovers == {} and [x.samples for x in log.state.steps] == [4, 1]


def test_registering_again_gives_the_leftover_back() -> None:
    log = Log()
    log.register("a")
    log.register("b")
    log.commit("a")
    log.finish("a", 3)
    log.finish("b", 2)
    assert log.state.unfinished() == []
    # a packer that crashed before packing runs again: its own leftover goes back to its source
    log.register("b")
    s = log.state
    assert "b" not in s.leftovers and s.producers["b"].cursor is None and not s.producers["b"].finished
    assert s.producers["b"].seq == 0  # sequence numbers keep rising: the given-back segment is dead
    assert log.pack("a") is None  # b produces again: nobody packs until it finishes
    log.finish("b", 2)
    record = log.pack("b")
    assert record is not None
    log.put(encode_record(record))
    assert [x.samples for x in s.steps] == [4, 4, 1]
    assert s.producers["a"].cursor == 7 and s.producers["b"].cursor == 2


def test_rewind_restores_cursors_of_held_and_packed_leftovers() -> None:
    log = Log()
    for pid in ("a", "b", "c"):
        log.register(pid)
    log.commit("a")
    log.commit("b")
    log.finish("a", 3)  # held: a's cursor 7
    log.commit("c")
    log.finish("b", 3)
    # a rewind while leftovers are held: they are dropped, each producer back to its last step
    snapshot = log.state.copy(), list(log.records)
    log.put(encode_record(RewindRecord(2)))
    s = log.state
    assert s.leftovers == {} and [s.producers[x].cursor for x in "abc"] == [4, 4, 4]
    assert not any(p.finished for p in s.producers.values())
    # the same, packed: steps 3 (a's 3 + b's 1) and 4 (b's 2) after steps 0..2
    log.state, log.records = snapshot
    log.finish("c")
    record = log.pack("c")
    assert record is not None
    log.put(encode_record(record))
    s = log.state
    assert [x.samples for x in s.steps] == [4, 4, 4, 4, 2]
    after = s.copy(), list(log.records)
    log.put(encode_record(RewindRecord(3)))  # b's leftover split across steps 3 and 4
    assert [s.producers[x].cursor for x in "abc"] == [7, 5, 4]
    assert s.producers["c"].finished and not s.producers["b"].finished  # c lost nothing
    log.state, log.records = after
    log.put(encode_record(RewindRecord(2)))
    assert [log.state.producers[x].cursor for x in "abc"] == [4, 4, 4]


def test_snapshots_carry_leftovers_finished_producers_and_packed_steps() -> None:
    log = Log()
    for pid in ("a", "b"):
        log.register(pid)
    log.commit("a")
    log.finish("a", 3)
    snap = log.state.to_json()
    back = State.from_json(snap)
    assert back.to_json() == snap and back.leftovers == log.state.leftovers and back.producers["a"].finished
    log.finish("b", 2)
    record = log.pack("b")
    assert record is not None
    log.put(encode_record(record))
    snap = log.state.to_json()
    assert State.from_json(snap).steps == log.state.steps
    assert log.state.check_last_record(log.records[-1]) is None
    # a snapshot whose leftover belongs to a producer that has not finished is refused
    d = orjson.loads(snap)
    d.pop("sha256")
    d["leftovers"] = {"a": [{"segment": "segments/a/l", "ranks": [[0, 10, 0, 3]], "cursor": 7}, [10, 5, 0], 4]}
    d["producers"]["a"].pop("finished")
    with pytest.raises(ValueError, match="not a finished producer"):
        State.from_json(orjson.dumps(d))
    d = orjson.loads(snap)
    d.pop("sha256")
    d["steps"][-1][10][0][1] = 5  # packed counts that do not add up to the step's samples
    with pytest.raises(ValueError, match="packed"):
        State.from_json(orjson.dumps(d))


@settings(max_examples=60, deadline=None)
@given(
    tgbs=st.lists(st.integers(0, 3), min_size=1, max_size=4),
    lefts=st.data(),
    order=st.randoms(use_true_random=False),
)
def test_every_leftover_sample_once_only_the_last_step_short_and_rewinds_exact(tgbs, lefts, order) -> None:
    pids = [f"p{i}" for i in range(len(tgbs))]
    left = {pid: lefts.draw(st.integers(0, B - 1)) for pid in pids}
    log = Log()
    for pid in pids:
        log.register(pid)
    for pid, n in zip(pids, tgbs, strict=True):
        if n:
            log.commit(pid, n)
    finishing = list(pids)
    order.shuffle(finishing)
    for i, pid in enumerate(finishing):
        log.finish(pid, left[pid])
        s = log.state
        assert s.unfinished() == sorted(finishing[i + 1 :])
        if s.leftovers and not s.unfinished():
            record = log.pack(pid)
            assert record is not None
            log.put(encode_record(record))
    s = log.state
    assert s.leftovers == {}
    assert all(x.samples == B for x in s.steps[:-1])  # at most one short step, the last
    for pid, n in zip(pids, tgbs, strict=True):
        assert samples_of(s, pid) == n * B + left[pid] == (s.producers[pid].cursor or 0)
    # replay from a snapshot anywhere gives the same state
    for v in range(1, len(log.records)):
        replay = State()
        for i, r in enumerate(log.records[: v + 1]):
            replay.apply(i, r)
        tail = State.from_json(replay.to_json())
        for i in range(v + 1, len(log.records)):
            tail.apply(i, log.records[i])
        assert tail.to_json() == s.to_json()
    # a rewind to any step resumes each producer right after its samples in the retained steps
    for to in range(-1, s.head + 1):
        r = State.from_json(s.to_json())
        r.apply(len(log.records), encode_record(RewindRecord(to)))
        for pid in pids:
            assert (r.producers[pid].cursor or 0) == samples_of(s, pid, to), (to, pid)


def test_pack_plan_under_a_mixture_meets_the_shares() -> None:
    shares = {"a": 3, "b": 1}
    lefts = [("p", 3, ["a", "a", "b"]), ("q", 2, ["a", "a"])]
    plan = pack_plan(lefts, lambda k: (4, shares))
    assert plan == [[("p", 0), ("p", 1), ("q", 0), ("p", 2)], [("q", 1)]]
    with pytest.raises(ValueError, match="no share"):
        pack_plan([("p", 1, ["c"])], lambda k: (4, shares))
    # a producer's packed samples are the first of each source: the pipeline's cursors compose
    docs = [{"sources": {"a": 1}}, {"sources": {"a": 2}}, {"sources": {"a": 2, "b": 1}}]
    assert packed_cursor(docs, ["a", "a", "b"], {0, 2}, {"sources": {"a": 0}}) == {"sources": {"a": 1, "b": 1}}
    assert packed_cursor(docs, ["a", "a", "b"], {0, 1}, None) == docs[1]
    with pytest.raises(ValueError):
        packed_cursor([1, 2, 3], ["a", "a", "b"], {0, 2}, 0)


# -- real processes ---------------------------------------------------------------------------------

KILL_ON_PACK = """
import os, signal, sys
import lakestream.testing as t

async def hook(op, key):
    if op == "get" and key.startswith("segments/"):  # reading the held leftovers: about to pack
        os.kill(os.getpid(), signal.SIGKILL)

t.inject_faults("seed=1", lambda store: setattr(store, "hook", hook))
sys.exit(t.run_command(sys.argv[1:]))
"""


def status(url: str) -> dict:
    return orjson.loads(run_cli("status", url, "--json", check=True).stdout)


def check_stream(url: str, total: int, batch: int) -> State:
    """Every sample once (verify), `total` of them, and only the last step short."""
    r = run_cli("verify", url, "--json", check=True)
    report = orjson.loads(r.stdout)
    assert report["ok"] and report["samples"] == total and report["held"] == 0, report
    state = anyio.run(lakestream.load_state, url)
    assert [s.samples for s in state.steps[:-1]] == [batch] * state.head
    assert state.steps[-1].samples == total % batch or batch
    return state


def test_producers_of_different_lengths_make_one_short_last_step(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/s"
    run_cli("init", url, "--world-size", 2, "--global-batch", 8, check=True)
    rng = random.Random(0)
    sizes = {"a": 21, "b": 30, "c": 14}
    for pid, n in sizes.items():
        make_source_dir(tmp_path / pid, pid, n, rng)
    # slow enough that every producer registers before the first one's source ends
    procs = [
        spawn_cli("produce", url, "--producer-id", pid, "--from-dir", tmp_path / pid, "--rate", 10) for pid in sizes
    ]
    for p in procs:
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    state = check_stream(url, sum(sizes.values()), 8)
    assert state.steps[-1].packed is not None and len(state.steps) == 9  # 65 = 8 x 8 + 1
    d = status(url)
    assert d["leftovers"] == {} and d["waiting_for"] == [] and d["finished"] == sorted(sizes)


def test_a_packer_killed_after_its_finish_packs_on_its_next_run(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/s"
    run_cli("init", url, "--world-size", 2, "--global-batch", 8, check=True)
    rng = random.Random(1)
    make_source_dir(tmp_path / "a", "a", 21, rng)
    make_source_dir(tmp_path / "b", "b", 30, rng)
    b = subprocess.Popen(
        [sys.executable, "-c", KILL_ON_PACK, "produce", url, "--producer-id", "b", "--from-dir", str(tmp_path / "b"),
         "--rate", "2"],  # slow (15 s): a, a CLI start and 21 files, runs to its end meanwhile
        env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    wait_until(lambda: "b" in status(url)["producers"], what="b registered")
    run_cli("produce", url, "--producer-id", "a", "--from-dir", tmp_path / "a", check=True)
    d = status(url)
    assert d["leftovers"]["a"]["samples"] == 5 and d["waiting_for"] == ["b"]  # a finished first: it holds 5
    b.communicate(timeout=60)
    assert b.returncode == -signal.SIGKILL
    d = status(url)
    assert {k: v["samples"] for k, v in d["leftovers"].items()} == {"a": 5, "b": 6} and d["waiting_for"] == []
    r = run_cli("verify", url, "--json", check=True)
    assert orjson.loads(r.stdout)["held"] == 11  # committed (their cursors moved on), not in a step yet
    state = anyio.run(lakestream.load_state, url)
    assert all(s.samples == 8 for s in state.steps)
    # b runs again: its leftover goes back to its source, it produces it again and packs both
    run_cli("produce", url, "--producer-id", "b", "--from-dir", tmp_path / "b", check=True)
    state = check_stream(url, 51, 8)
    assert [s.samples for s in state.steps[-2:]] == [8, 3]
    assert status(url)["leftovers"] == {}


def test_a_lone_producer_still_commits_its_short_last_step(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/s"
    run_cli("init", url, "--world-size", 2, "--global-batch", 8, check=True)
    make_source_dir(tmp_path / "a", "a", 21, random.Random(2))
    run_cli("produce", url, "--producer-id", "a", "--from-dir", tmp_path / "a", check=True)
    state = check_stream(url, 21, 8)
    assert [s.samples for s in state.steps] == [8, 8, 5]
    d = status(url)
    assert d["finished"] == ["a"] and d["leftovers"] == {}
    # more files later: the same producer continues after its short step, as before
    make_source_dir(tmp_path / "a2", "z", 3, random.Random(3))
    for f in (tmp_path / "a2").iterdir():
        f.rename(tmp_path / "a" / f.name)
    run_cli("produce", url, "--producer-id", "a", "--from-dir", tmp_path / "a", check=True)
    assert [s.samples for s in anyio.run(lakestream.load_state, url).steps] == [8, 8, 5, 3]


def test_pack_command_packs_for_a_producer_that_never_finishes(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/s"
    run_cli("init", url, "--world-size", 2, "--global-batch", 8, check=True)
    make_source_dir(tmp_path / "a", "a", 21, random.Random(4))
    anyio.run(_register, url, "gone")  # a producer of the job that died for good
    run_cli("produce", url, "--producer-id", "a", "--from-dir", tmp_path / "a", check=True)
    r = run_cli("status", url, check=True)
    assert "held leftover of a: 5 samples" in r.stdout and "wait for gone" in r.stdout
    r = run_cli("pack", url, check=True)
    assert "packed the leftovers of a into 1 step(s)" in r.stdout
    check_stream(url, 21, 8)


async def _register(url: str, pid: str) -> None:
    async with lakestream.open_store(url) as store:
        m = Manifest(store)
        await m.load()
        await m.append(lambda st, _: decisions.register(st, pid, "dead", 0.0))
