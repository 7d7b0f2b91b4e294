"""The manifest state machine: pure, deterministic, and every invalid record a no-op."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lakestream import Config, State
from lakestream._records import (
    CheckpointRecord,
    CloseRecord,
    CommitRecord,
    CreateRecord,
    GroupRecord,
    ReclaimRecord,
    Record,
    RegisterRecord,
    ReleaseRecord,
    ReopenRecord,
    RewindRecord,
    TgbRef,
    encode_record,
)

W = 2


def create(**kw: int) -> bytes:
    return encode_record(CreateRecord(Config(world_size=W, global_batch=4, **kw)))


def register(pid: str, epoch: int, token: str = "t") -> bytes:
    return encode_record(RegisterRecord(pid, epoch, token))


def tgb(pid: str, epoch: int, seq: int, cursor: object = None) -> TgbRef:
    return TgbRef(f"segments/{pid}/{epoch}-{seq}-x.tgb", ((0, 10, 1, 2), (10, 10, 2, 2)), cursor)


def commit(pid: str, epoch: int, seq: int, n: int = 1, cursor: object = None, lost: int = 0) -> bytes:
    return encode_record(CommitRecord(pid, epoch, seq, tuple(tgb(pid, epoch, seq + i, cursor) for i in range(n)), lost))


def replay(records: list[bytes]) -> State:
    s = State()
    for v, r in enumerate(records):
        s.apply(v, r)
    return s


def test_commit_assigns_gap_free_steps_and_advances_cursor() -> None:
    s = replay([create(), register("a", 1), commit("a", 1, 0, 2, cursor=7), register("b", 1), commit("b", 1, 0)])
    assert [x.step for x in s.steps] == [0, 1, 2]
    assert [x.producer for x in s.steps] == ["a", "a", "b"]
    assert s.producers["a"].seq == 1 and s.producers["a"].cursor == 7
    assert s.head == 2 and not s.rejected


def test_commit_records_the_races_it_lost() -> None:
    lost = commit("a", 1, 1, lost=3)
    s = replay([create(), register("a", 1), commit("a", 1, 0)])
    assert s.producers["a"].lost == 0
    assert s.apply(3, lost) is None and s.producers["a"].lost == 3
    assert State.from_json(s.to_json()).producers["a"].lost == 3


def test_stale_epoch_and_wrong_seq_are_noops() -> None:
    s = replay([create(), register("a", 1), commit("a", 1, 0), register("a", 2)])
    assert s.apply(4, commit("a", 1, 1)) is not None  # fenced epoch
    assert s.apply(5, commit("a", 2, 0)) is not None  # seq 0 already committed: a duplicate
    assert s.apply(6, commit("a", 2, 2)) is not None  # a gap in seq
    assert s.apply(7, commit("a", 2, 1)) is None
    assert [x.seq for x in s.steps] == [0, 1]
    assert [v for v, _ in s.rejected] == [4, 5, 6]


def test_a_commit_of_a_segment_committed_before_or_named_for_another_tgb_is_a_noop() -> None:
    """A segment key names its producer, epoch and seq; a commit must name its own TGBs' keys, so
    a segment already committed (retained, reclaimed or discarded) is never a step again."""
    s = replay([create(), register("a", 1), commit("a", 1, 0, 3), register("b", 1)])
    step0 = s.steps[0].segment
    ranks = ((0, 10, 1, 2), (10, 10, 2, 2))

    def one(pid: str, epoch: int, seq: int, segment: str) -> CommitRecord:
        return CommitRecord(pid, epoch, seq, (TgbRef(segment, ranks, None),))

    for bad in (
        one("a", 1, 3, step0),  # step 0's segment again, as the next seq
        one("b", 1, 0, step0),  # another producer's committed segment
        one("a", 1, 3, "segments/a/1-4-x.tgb"),  # another seq's key
        one("a", 1, 3, "segments/a/2-3-x.tgb"),  # another epoch's key
        one("a", 1, 3, "segments/b/1-3-x.tgb"),  # another producer's key
        one("a", 1, 3, "segments/a/1-3-x/y.tgb"),  # deeper than a producer's directory
        one("a", 1, 3, "segments/a/1-3-x.bin"),
        one("a", 1, 3, "segments/a/1-33-x.tgb"),
        CommitRecord("a", 1, 3, (TgbRef("segments/a/1-3-x.tgb", ranks), TgbRef("segments/a/1-3-y.tgb", ranks))),
    ):
        why = s.check(bad)
        assert why is not None and "is not a key of its TGB" in why, bad
        assert s.apply(s.version + 1, encode_record(bad)) == why and s.head == 2
    assert s.apply(s.version + 1, encode_record(one("a", 1, 3, "segments/a/1-3-0a1b.tgb"))) is None
    assert [x.segment for x in s.steps][-1] == "segments/a/1-3-0a1b.tgb"

    # Reclaimed or discarded, a segment stays spent: its seq is committed for good.
    assert s.apply(s.version + 1, encode_record(CheckpointRecord("c", 2))) is None
    assert s.apply(s.version + 1, encode_record(ReclaimRecord(2))) is None
    assert s.apply(s.version + 1, encode_record(RewindRecord(2))) is None  # discards step 3, fences a
    assert s.apply(s.version + 1, encode_record(RegisterRecord("a", 3, "u"))) is None
    for gone in (step0, "segments/a/1-3-0a1b.tgb"):
        assert s.check(one("a", 3, 4, gone)) is not None
    assert s.check(one("a", 3, 4, "segments/a/3-4-x.tgb")) is None

    d = orjson.loads(s.to_json())
    del d["sha256"]
    d["steps"][0][2] = "segments/a/1-9-x.tgb"  # a snapshot's step with another TGB's key
    with pytest.raises(ValueError, match="is not a key of producer a epoch 1 seq 2"):
        State.from_json(orjson.dumps(d))


@pytest.mark.parametrize(
    "data",
    [
        b"not json",
        b"[]",
        b'{"kind": 3}',
        b'{"kind": "nope"}',
        b'{"kind": "commit", "producer": "a", "epoch": 1, "seq": 1, "tgbs": []}',
        b'{"kind": "commit", "producer": "a", "epoch": 1, "seq": 1, "tgbs": [{"segment": "segments/x", "ranks": []}]}',
        b'{"kind": "reshape", "from_step": 0, "world_size": 0}',
        b'{"kind": "reshape", "from_step": -1, "world_size": 1}',
        b'{"kind": "commit", "producer": "a", "epoch": 1, "seq": 1, "tgbs": [{"segment": "../x", "ranks": [[0,1,2,3],[1,1,1,1]]}]}',
        b'{"kind": "commit", "producer": "a", "epoch": 1, "seq": 1, "lost": -1, "tgbs": [{"segment": "segments/x", "ranks": [[0,1,2,3],[1,1,1,1]]}]}',
        b'{"kind": "register", "producer": "a/b", "epoch": 1, "token": "t"}',
        b'{"kind": "create", "config": {"world_size": 2, "global_batch": 4}}',
    ],
)
def test_malformed_records_are_noops_everywhere(data: bytes) -> None:
    base = [create(), register("a", 1), commit("a", 1, 0)]
    s1, s2 = replay(base), replay(base)
    before = s1.to_json()
    assert s1.apply(3, data) is not None
    s2.apply(3, data)
    assert s1.to_json() == s2.to_json()
    after = orjson.loads(s1.to_json())
    assert after["version"] == 3 and after["rejected"][0][0] == 3
    assert after["steps"] == orjson.loads(before)["steps"]


def test_version_zero_must_be_create() -> None:
    s = State()
    assert s.apply(0, register("a", 1)) is not None
    assert s.config is None
    assert s.apply(1, create()) is not None  # too late: the stream is invalid for good


def test_apply_requires_the_next_version() -> None:
    with pytest.raises(ValueError):
        State().apply(1, create())


# -- properties --------------------------------------------------------------------------------

producers = st.sampled_from(["a", "b", "c"])
ops = st.lists(
    st.one_of(
        st.tuples(st.just("register"), producers),
        st.tuples(st.just("commit"), producers, st.integers(1, 3)),
        st.tuples(st.just("stale"), producers),
        st.tuples(st.just("garbage"), st.binary(max_size=20)),
        st.tuples(st.just("close"), st.integers(-1, 3)),
        st.tuples(st.just("reopen")),
    ),
    max_size=40,
)


def build_log(ops_: list[tuple]) -> list[bytes]:
    """A log as concurrent writers would produce it: each record valid at its position, plus noise."""
    s = replay([create()])
    log = [create()]
    for op in ops_:
        kind = op[0]
        if kind == "register":
            p = s.producers.get(op[1])
            rec = register(op[1], (p.epoch if p else 0) + 1)
        elif kind == "commit":
            p = s.producers.get(op[1])
            if p is None:
                continue
            rec = commit(op[1], p.epoch, p.seq + 1, op[2], cursor=p.seq + op[2])
        elif kind == "stale":
            p = s.producers.get(op[1])
            rec = commit(op[1], (p.epoch - 1) if p else 1, (p.seq + 1) if p else 0)
        elif kind == "close":  # after the head, or a later step; one before the head is a no-op
            rec = encode_record(CloseRecord(s.head + op[1]))
        elif kind == "reopen":
            rec = encode_record(ReopenRecord())
        else:
            rec = op[1]
        s.apply(len(log), rec)
        log.append(rec)
    return log


@given(ops)
def test_apply_is_deterministic(ops_: list[tuple]) -> None:
    log = build_log(ops_)
    assert replay(log).to_json() == replay(log).to_json()


@given(ops, st.data())
def test_snapshot_plus_replay_equals_full_replay(ops_: list[tuple], data: st.DataObject) -> None:
    log = build_log(ops_)
    cut = data.draw(st.integers(0, len(log) - 1))
    snap = State.from_json(replay(log[: cut + 1]).to_json())
    for v in range(cut + 1, len(log)):
        snap.apply(v, log[v])
    assert snap.to_json() == replay(log).to_json()


@given(ops)
def test_steps_gap_free_and_seqs_increase(ops_: list[tuple]) -> None:
    s = replay(build_log(ops_))
    assert [x.step for x in s.steps] == list(range(len(s.steps)))
    for pid, p in s.producers.items():
        seqs = [x.seq for x in s.steps if x.producer == pid]
        assert seqs == list(range(len(seqs)))
        assert p.seq == len(seqs) - 1


@given(ops)
def test_the_head_never_passes_a_close(ops_: list[tuple]) -> None:
    """Replaying the log step by step, a closed stream's head is at most its close; only a reopen clears it."""
    s = State()
    for v, rec in enumerate(build_log(ops_)):
        before = s.closed_after
        s.apply(v, rec)
        assert s.closed_after is None or s.head <= s.closed_after
        if before is not None and s.closed_after != before:
            assert s.closed_after is None and orjson.loads(rec)["kind"] == "reopen"


def test_commits_past_a_close_are_noops_until_a_reopen() -> None:
    s = replay([create(), register("a", 1), commit("a", 1, 0, 2)])
    assert s.apply(3, encode_record(CloseRecord(0))) is not None  # before the head: a no-op
    assert s.closed_after is None
    assert s.apply(4, encode_record(CloseRecord(2))) is None
    assert s.closed_after == 2 and not s.ended
    assert s.apply(5, commit("a", 1, 2, 2)) is not None  # steps 2 and 3: past the close
    assert s.apply(6, commit("a", 1, 2)) is None and s.head == 2 and s.ended
    assert s.apply(7, commit("a", 1, 3)) is not None and s.head == 2
    assert s.apply(8, encode_record(CloseRecord(5))) is not None  # closed already
    group = encode_record(GroupRecord((RegisterRecord("b", 1, "t"), CommitRecord("b", 1, 0, (tgb("b", 1, 0),)))))
    assert s.apply(9, group) is not None  # the register takes effect, the commit is a no-op
    assert s.producers["b"].epoch == 1 and s.head == 2
    assert s.apply(10, encode_record(ReopenRecord())) is None and s.closed_after is None
    assert s.apply(11, encode_record(ReopenRecord())) is not None  # not closed
    assert s.apply(12, commit("a", 1, 3)) is None and s.head == 3
    assert [v for v, _ in s.rejected] == [3, 5, 7, 8, 9, 11]


def test_a_closed_state_round_trips_and_one_never_closed_keeps_its_snapshot() -> None:
    s = replay([create(), register("a", 1), commit("a", 1, 0)])
    never = s.to_json()
    assert b"closed_after" not in never
    s.apply(3, encode_record(CloseRecord(4)))
    assert State.from_json(s.to_json()).closed_after == 4
    assert s.check_last_record(encode_record(CloseRecord(4))) is None
    assert s.check_last_record(encode_record(CloseRecord(5))) is not None
    s.apply(4, encode_record(ReopenRecord()))
    assert State.from_json(s.to_json()).closed_after is None and b"closed_after" not in s.to_json()
    bad = s.to_dict() | {"closed_after": -1}  # before the head 0
    with pytest.raises(ValueError, match="closed_after"):
        State.from_json(orjson.dumps(bad))


@given(st.permutations(["a", "b", "c"]), st.integers(1, 3))
def test_rebase_only_renumbers_steps(order: list[str], n: int) -> None:
    """The same commit records in any order (as races decide) give the same TGBs, renumbered."""
    head = [create(), register("a", 1), register("b", 1), register("c", 1)]
    recs = {p: commit(p, 1, 0, n, cursor=p) for p in "abc"}
    s = replay(head + [recs[p] for p in order])
    assert not s.rejected
    assert [x.producer for x in s.steps] == [p for p in order for _ in range(n)]
    assert {p: s.producers[p].cursor for p in "abc"} == {p: p for p in "abc"}


class ManifestMachine(RuleBasedStateMachine):
    """Commit, fence, checkpoint, release, reclaim and rewind against a simple model."""

    def __init__(self) -> None:
        super().__init__()
        self.state = replay([create(keep_checkpoints=2)])
        self.model_steps: list[tuple[str, int]] = []  # (producer, seq) per step, from first_step
        self.first = 0
        self.epochs: dict[str, int] = {}
        self.seqs: dict[str, int] = {}
        self.ckpts: list[tuple[str, int]] = []
        self.n = 0
        self.spent: list[str] = []  # every segment ever committed
        self.closed: int | None = None  # the step the stream is closed after

    def put(self, rec: Record) -> str | None:
        return self.state.apply(self.state.version + 1, encode_record(rec))

    @rule(p=producers)
    def register(self, p: str) -> None:
        e = self.epochs.get(p, 0) + 1
        assert self.put(RegisterRecord(p, e, "x")) is None
        self.epochs[p] = e

    @rule(p=producers, n=st.integers(1, 3), stale=st.booleans())
    def commit(self, p: str, n: int, stale: bool) -> None:
        if p not in self.epochs:
            return
        seq = self.seqs.get(p, -1) + 1
        epoch = self.epochs[p] - (1 if stale else 0)
        why = self.state.apply(self.state.version + 1, commit(p, epoch, seq, n))
        if stale or (self.closed is not None and self.first + len(self.model_steps) + n - 1 > self.closed):
            assert why is not None
            return
        assert why is None
        self.model_steps += [(p, seq + i) for i in range(n)]
        self.seqs[p] = seq + n - 1
        self.spent += [x.segment for x in self.state.steps[-n:]]

    @precondition(lambda self: self.spent)
    @rule(p=producers, data=st.data())
    def commit_a_spent_segment(self, p: str, data: st.DataObject) -> None:
        """Whether its step is retained, reclaimed or discarded, a segment is never committed again."""
        if p not in self.epochs:
            return
        segment = data.draw(st.sampled_from(self.spent))
        ref = TgbRef(segment, ((0, 10, 1, 2), (10, 10, 2, 2)))
        before = self.state.to_dict()["steps"]
        assert self.put(CommitRecord(p, self.epochs[p], self.seqs.get(p, -1) + 1, (ref,))) is not None
        assert self.state.to_dict()["steps"] == before

    @precondition(lambda self: self.model_steps)
    @rule(data=st.data())
    def checkpoint(self, data: st.DataObject) -> None:
        head = self.first + len(self.model_steps) - 1
        lo = max(self.first, self.ckpts[-1][1] if self.ckpts else 0)
        if lo > head:
            return
        step = data.draw(st.integers(lo, head))
        self.n += 1
        assert self.put(CheckpointRecord(f"c{self.n}", step)) is None
        self.ckpts = [*self.ckpts, (f"c{self.n}", step)][-2:]

    @precondition(lambda self: self.ckpts)
    @rule()
    def release_oldest(self) -> None:
        assert self.put(ReleaseRecord(self.ckpts[0][0])) is None
        self.ckpts.pop(0)

    @precondition(lambda self: self.ckpts and self.ckpts[0][1] > self.first)
    @rule()
    def reclaim(self) -> None:
        below = self.ckpts[0][1]
        assert self.put(ReclaimRecord(below)) is None
        del self.model_steps[: below - self.first]
        self.first = below

    @rule(data=st.data())
    def rewind(self, data: st.DataObject) -> None:
        head = self.first + len(self.model_steps) - 1
        to = data.draw(st.integers(self.first - 1, head))
        assert self.put(RewindRecord(to)) is None
        del self.model_steps[to + 1 - self.first :]
        self.ckpts = [c for c in self.ckpts if c[1] <= to]
        for p in self.epochs:
            self.epochs[p] += 1

    @rule(ahead=st.integers(-1, 3))
    def close(self, ahead: int) -> None:
        head = self.first + len(self.model_steps) - 1
        why = self.put(CloseRecord(head + ahead))
        assert (why is None) == (self.closed is None and ahead >= 0)
        if why is None:
            self.closed = head + ahead

    @rule()
    def reopen(self) -> None:
        assert (self.put(ReopenRecord()) is None) == (self.closed is not None)
        self.closed = None

    @invariant()
    def matches_model(self) -> None:
        s = self.state
        assert s.first_step == self.first
        assert [(x.producer, x.seq) for x in s.steps] == self.model_steps
        assert [x.step for x in s.steps] == list(range(self.first, self.first + len(self.model_steps)))
        assert [(c.id, c.step) for c in s.checkpoints] == self.ckpts
        assert s.watermark == (self.ckpts[0][1] if self.ckpts else -1)
        assert s.closed_after == self.closed
        assert {p: x.epoch for p, x in s.producers.items()} == self.epochs
        assert all(x.segment.startswith(f"segments/{x.producer}/{x.epoch}-{x.seq}-") for x in s.steps)
        assert State.from_json(s.to_json()).to_json() == s.to_json()


TestManifestMachine = ManifestMachine.TestCase
TestManifestMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_a_tgb_names_its_checksum_and_records_without_one_are_crc32() -> None:
    old = orjson.loads(commit("a", 1, 0))
    assert "checksum" not in old["tgbs"][0]  # a CRC-32 TGB is written as before the member existed
    wide = TgbRef(tgb("a", 1, 1).segment, ((0, 10, 2**64 - 1, 2), (10, 10, 2**40, 2)), None, checksum="xxh3-64")
    s = replay([create(), register("a", 1), commit("a", 1, 0), encode_record(CommitRecord("a", 1, 1, (wide,)))])
    assert [st.checksum for st in s.steps] == ["crc32", "xxh3-64"]
    assert s.steps[1].ranks[0].digest == 2**64 - 1
    back = State.from_json(s.to_json())
    assert back.steps == s.steps and back.to_json() == s.to_json()
    assert len(orjson.loads(s.to_json())["steps"][0]) == 9  # a CRC-32 step keeps the 9-item entry


@pytest.mark.parametrize(
    "tgb_",
    [
        {"segment": "segments/a/1-0-x.tgb", "ranks": [[0, 10, 2**32, 4]], "cursor": None},  # CRC-32 is 32 bits
        {"segment": "segments/a/1-0-x.tgb", "ranks": [[0, 10, 1, 4]], "cursor": None, "checksum": "md5"},
        {"segment": "segments/a/1-0-x.tgb", "ranks": [[0, 10, 1, 4]], "cursor": None, "checksum": 64},
    ],
)
def test_a_tgb_with_an_unknown_checksum_or_a_digest_too_wide_is_a_noop(tgb_: dict) -> None:
    record = orjson.dumps({"kind": "commit", "producer": "a", "epoch": 1, "seq": 0, "tgbs": [tgb_]})
    s = replay([create(), register("a", 1), record])
    assert s.head == -1


# -- replays: a rewind that skips steps ----------------------------------------------------------

commits = st.tuples(st.just("commit"), producers, st.integers(1, 3))
history_ops = st.lists(
    st.one_of(
        st.tuples(st.just("register"), producers),
        commits,
        commits,
        commits,
        st.tuples(
            st.just("replay"),
            st.integers(0, 6),
            st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2)), min_size=1, max_size=3),
        ),  # fmt: skip
        st.tuples(st.just("rewind"), st.integers(0, 6)),
        st.tuples(st.just("reclaim"), st.integers(0, 4)),
        st.tuples(st.just("close"), st.integers(0, 3)),
    ),
    min_size=8,
    max_size=40,
)


def build_history(ops_: list[tuple]) -> list[bytes]:
    """A log of commits, replays (a rewind `back` steps from the head skipping ranges given as
    (gap, length) after it), plain rewinds, reclaims behind a checkpoint and closes; each record
    valid where it stands (cursors count each producer's TGBs)."""
    s = replay([create()])
    log = [create()]

    def add(rec: bytes) -> None:
        assert s.apply(len(log), rec) is None, (rec, s.rejected)
        log.append(rec)

    for pid in ("a", "b", "c"):
        add(register(pid, 1))

    for op in ops_:
        kind = op[0]
        if kind == "register":
            p = s.producers.get(op[1])
            add(register(op[1], (p.epoch if p else 0) + 1))
        elif kind == "commit":
            p = s.producers[op[1]]
            if not p.token:  # fenced by a rewind: a new incarnation
                add(register(op[1], p.epoch + 1))
            room = op[2] if s.closed_after is None else min(op[2], s.closed_after - s.head)
            if room > 0:
                add(commit(op[1], p.epoch, p.seq + 1, room, cursor=p.tgbs + room))
        elif kind in ("replay", "rewind"):
            to = max(s.first_step - 1, s.head - op[1])
            skip, low = [], to + 1
            for gap, length in op[2] if kind == "replay" else ():
                if low + gap + length <= s.head:
                    skip.append((low + gap, low + gap + length))
                    low += gap + length + 1
            if kind == "rewind" or skip:
                add(encode_record(RewindRecord(to, 0.0, tuple(skip))))
        elif kind == "reclaim" and s.steps:
            at = min(s.first_step + op[1], s.head)
            if not s.checkpoints or s.checkpoints[-1].step <= at:
                add(encode_record(CheckpointRecord(f"c{len(log)}", at)))
            if s.checkpoints and s.watermark > s.first_step:
                add(encode_record(ReclaimRecord(s.watermark)))
        elif kind == "close":
            add(encode_record(CloseRecord(s.head + op[1]) if s.closed_after is None else ReopenRecord()))
    return log


def history(s: State) -> list[tuple[str, int]]:
    """(producer, seq) of each TGB of the retained steps and the skipped ones, in the history's order."""
    from lakestream._state import _in_order

    return [(x.producer, x.seq) for x in _in_order(s.steps, s.skipped)]


@settings(max_examples=300)
@given(history_ops, st.data())
def test_replays_keep_each_tgb_once_in_order_and_every_cursor_after_its_last(
    ops_: list[tuple], data: st.DataObject
) -> None:
    log = build_history(ops_)
    s, replays = State(), []
    for v, rec in enumerate(log):
        before = s.copy()
        s.apply(v, rec)
        assert s.check_last_record(rec) is None, orjson.loads(rec)
        r = orjson.loads(rec)
        if r["kind"] == "rewind" and r.get("skip"):
            # The steps after the rewind are the old ones but the skipped, in order, at the record's version.
            skipped = {n for a, b in r["skip"] for n in range(a, b + 1)}
            old = [x for x in before.steps if x.step > r["to_step"]]
            new = [x for x in s.steps if x.step > r["to_step"]]
            assert [(x.segment, x.cursor) for x in new] == [(x.segment, x.cursor) for x in old if x.step not in skipped]
            assert all(x.version == v for x in new) and [x.step for x in s.steps] == list(
                range(s.first_step, s.head + 1)
            )
            assert sorted((k.step.producer, k.step.seq) for k in s.skipped) == sorted(
                [(k.step.producer, k.step.seq) for k in before.skipped]
                + [(x.producer, x.seq) for x in old if x.step in skipped]
            )
            replays.append(len(skipped))
            assert {p: (q.epoch, q.cursor, q.seq) for p, q in s.producers.items()} == {
                p: (q.epoch, q.cursor, q.seq) for p, q in before.producers.items()
            }  # nobody fenced or moved back
            if before.closed_after is not None:
                assert s.closed_after == before.closed_after - len(skipped)
    # Each TGB once, each producer's in rising seq, and its cursor after its newest one (or its base).
    seen = history(s)
    assert len(seen) == len(set(seen))
    for pid, p in s.producers.items():
        seqs = [q for x, q in seen if x == pid]
        assert seqs == sorted(seqs)
        mine = [x for x in _steps_in_order(s) if x.producer == pid and x.packed is None]
        assert p.cursor == (mine[-1].cursor if mine else p.base_cursor)
    cut = data.draw(st.integers(0, len(log) - 1))
    snap = State.from_json(replay(log[: cut + 1]).to_json())
    for v in range(cut + 1, len(log)):
        snap.apply(v, log[v])
    assert snap.to_json() == s.to_json()
    event("replays with skipped steps: " + ("none" if not replays else "some" if len(replays) < 3 else "3 or more"))


def _steps_in_order(s: State) -> list:
    from lakestream._state import _in_order

    return _in_order(s.steps, s.skipped)


def test_a_replay_moves_shapes_mixes_and_the_close_with_the_steps_they_name() -> None:
    from lakestream._records import MixRecord, ReshapeRecord

    log = [create(), register("a", 1), commit("a", 1, 0, 6, cursor=6)]  # steps 0..5
    log += [encode_record(MixRecord(8, (("x", 1.0),))), encode_record(ReshapeRecord(4, 1, 4))]
    log += [encode_record(CloseRecord(9)), encode_record(RewindRecord(1, 0.0, ((2, 3),)))]
    s = replay(log)
    assert [x.seq for x in s.steps] == [0, 1, 4, 5] and s.head == 3
    assert [(k.at, k.step.step, k.step.seq) for k in s.skipped] == [(1, 2, 2), (1, 3, 3)]
    assert s.shapes == [(2, 1, 4)] and [m.from_step for m in s.mixes] == [6] and s.closed_after == 7
    assert s.producers["a"].cursor == 6 and s.producers["a"].epoch == 1 and not s.rejected
    assert State.from_json(s.to_json()).to_json() == s.to_json()
    # A plain rewind behind the skipped TGBs drops them (their samples are produced again); one after keeps them.
    later = s.copy()
    later.apply(len(log), encode_record(RewindRecord(2)))
    assert [k.step.seq for k in later.skipped] == [2, 3] and later.producers["a"].cursor == 6
    back = s.copy()
    back.apply(len(log), encode_record(RewindRecord(1)))
    assert back.skipped == [] and back.producers["a"].cursor == 6  # cursor of step 1's TGB: the one commit's


@pytest.mark.parametrize(
    "skip",
    [[], [[3, 2]], [[2, 3], [3, 4]], [[1, 1]], [[2, 3], [1, 1]], [["2", 3]], "2-3", [[2, 3, 4]], [[2, 1 << 63]]],
)
def test_a_rewind_with_bad_skip_ranges_is_malformed(skip: object) -> None:
    s = replay([create(), register("a", 1), commit("a", 1, 0, 6, cursor=6)])
    rec = orjson.dumps({"kind": "rewind", "to_step": 1, "ts": 0.0, "skip": skip})
    assert s.apply(3, rec) is not None and s.head == 5


def test_a_replay_skipping_past_the_head_is_a_noop() -> None:
    s = replay([create(), register("a", 1), commit("a", 1, 0, 3, cursor=3)])
    assert s.apply(3, encode_record(RewindRecord(0, 0.0, ((2, 3),)))) is not None and s.head == 2


def test_a_rewind_after_a_replay_resumes_each_producer_after_its_skipped_tgbs() -> None:
    """A producer whose newest TGBs were skipped resumes after them when a later rewind keeps their
    place: its skipped samples are never produced again."""
    log = [create(), register("a", 1), register("b", 1)]
    log += [commit("a", 1, i, cursor=i + 1) for i in range(6)] + [commit("b", 1, 0, cursor=1)]  # a: 0..5, b: 6
    log += [encode_record(RewindRecord(1, 0.0, ((4, 5),)))]  # a's seq 4 and 5 skipped, after step 3
    s = replay(log)
    assert [(x.producer, x.seq) for x in s.steps] == [("a", 0), ("a", 1), ("a", 2), ("a", 3), ("b", 0)]
    s.apply(len(log), encode_record(RewindRecord(4)))
    assert s.producers["a"].cursor == 6 and s.producers["b"].cursor == 1
    assert [k.step.seq for k in s.skipped] == [4, 5]
    s.apply(len(log) + 1, encode_record(RewindRecord(3)))  # to the step before them: a produces them again
    assert s.producers["a"].cursor == 4 and s.producers["b"].cursor is None and s.skipped == []


# -- jobs: each its own checkpoints on one stream ------------------------------------------------


def test_each_job_keeps_its_own_checkpoints_and_the_watermark_is_the_oldest_of_any() -> None:
    from lakestream._records import JobRecord

    s = replay([create(keep_checkpoints=2), register("a", 1), commit("a", 1, 0, 10, cursor=10)])
    log_at = 3

    def put(r: object) -> str | None:
        nonlocal log_at
        why = s.apply(log_at, encode_record(r))  # type: ignore[arg-type]
        log_at += 1
        return why

    assert put(CheckpointRecord("c", 6)) is None and put(CheckpointRecord("c", 2, job="eval")) is None  # same id
    assert s.jobs == ["eval"] and s.watermark == 2
    assert put(CheckpointRecord("d", 1, job="eval")) is not None  # older than eval's newest
    assert put(CheckpointRecord("d", 4, job="eval")) is None and put(CheckpointRecord("e", 5, job="eval")) is None
    assert [(c.job, c.id) for c in s.checkpoints] == [("main", "c"), ("eval", "d"), ("eval", "e")]  # eval keeps 2
    assert s.watermark == 4 and put(ReleaseRecord("c", job="eval")) is not None  # no such checkpoint of eval
    assert State.from_json(s.to_json()).to_json() == s.to_json()
    assert put(JobRecord("eval", retire=True)) is None
    assert s.jobs == [] and [c.id for c in s.checkpoints] == ["c"] and s.watermark == 6
    assert put(JobRecord("eval", retire=True)) is not None and put(JobRecord("main")) is not None
    assert put(JobRecord("ablation")) is None and s.jobs == ["ablation"] and put(JobRecord("ablation")) is not None
    for bad in ({"job": "-x"}, {"job": ""}, {"job": 3}, {"job": "x" * 65}):
        assert s.apply(log_at, orjson.dumps({"kind": "checkpoint", "id": "z", "step": 7, "ts": 0.0, **bad})) is not None
        log_at += 1
    snap = s.to_dict()
    assert snap["jobs"] == ["ablation"] and State.from_json(s.to_json()).jobs == ["ablation"]


@given(st.lists(st.tuples(st.sampled_from(["main", "eval", "abl"]), st.integers(0, 9), st.booleans()), max_size=30))
def test_jobs_checkpoints_round_trip_and_each_job_keeps_its_newest(ops_: list[tuple]) -> None:
    from lakestream._records import JobRecord

    log = [create(keep_checkpoints=2), register("a", 1), commit("a", 1, 0, 10, cursor=10)]
    for i, (job, step, retire) in enumerate(ops_):
        rec = JobRecord(job, retire=True) if retire and job != "main" else CheckpointRecord(f"c{i}", step, job=job)
        log.append(encode_record(rec))
    s = State()
    for v, rec in enumerate(log):
        s.apply(v, rec)
        assert s.check_last_record(rec) is None
    assert State.from_json(s.to_json()).to_json() == s.to_json()
    for job in ["main", *s.jobs]:
        steps = [c.step for c in s.checkpoints_of(job)]
        assert steps == sorted(steps) and len(steps) <= 2
    assert s.watermark == min((c.step for c in s.checkpoints), default=-1)
    assert {c.job for c in s.checkpoints} <= {"main", *s.jobs}


def _tiles(ranks: list[tuple[int, int, int, int]], bits: int) -> int | None:
    """The rank-slice rule by its definition: slices tile the segment from offset 0 in rank order
    and have checksums of their width; the samples they hold, or None."""
    end = samples = 0
    for offset, length, crc, n in ranks:
        if offset != end or length >= 1 << 62 or crc >= 1 << bits:
            return None
        end, samples = end + length, samples + n
    return samples


slice_values = st.one_of(st.integers(0, 40), st.sampled_from([(1 << 32) - 1, 1 << 32, (1 << 62) - 1, 1 << 62]))


@settings(max_examples=300)
@given(
    st.lists(st.tuples(slice_values, slice_values, slice_values, st.integers(1, 3)), min_size=1, max_size=3),
    st.booleans(),
    st.booleans(),
)
def test_a_commit_takes_effect_exactly_when_its_rank_slices_tile_the_segment(
    raw: list[tuple[int, int, int, int]], tile: bool, wide: bool
) -> None:
    ranks = list(raw)  # (at most 3 slices: their offsets stay below 2**64, as JSON integers must)
    if tile:  # (drawn at random, slices almost never tile: make them, keeping the lengths drawn)
        end = 0
        for i, (_, length, crc, n) in enumerate(ranks):
            ranks[i], end = (end, length, crc, n), end + length
    checksum = "xxh3-64" if wide else "crc32"
    s = State()
    s.apply(0, encode_record(CreateRecord(Config(world_size=len(ranks), global_batch=64))))
    s.apply(1, register("a", 1))
    t = TgbRef("segments/a/1-0-x.tgb", tuple(ranks), None, checksum=checksum)
    s.apply(2, encode_record(CommitRecord("a", 1, 0, (t,))))
    samples = _tiles(ranks, 64 if wide else 32)
    assert s.head == (0 if samples is not None else -1)
    if samples is not None:
        assert s.steps[0].ranks == tuple(ranks) and sum(r.samples for r in s.steps[0].ranks) == samples


def test_followers_of_one_process_share_a_decoded_steps_rank_slices() -> None:
    """A group's TGBs are decoded once per process (`decode_record`) and every follower's step
    keeps their rank slices as decoded, rather than building hundreds of its own a step."""
    ranks = tuple((10 * i, 10, i, 1) for i in range(64))
    records = [RegisterRecord(f"p{i}", 1, "t") for i in range(8)]
    records += [CommitRecord(f"p{i}", 1, 0, (TgbRef(f"segments/p{i}/1-0-x.tgb", ranks, None),)) for i in range(8)]
    group = encode_record(GroupRecord(tuple(records), 1.0))
    a, b = State(), State()
    for s in (a, b):
        s.apply(0, encode_record(CreateRecord(Config(world_size=64, global_batch=64))))
        s.apply(1, bytes(bytearray(group)))  # each follower reads its own copy of the bytes
    assert a.head == b.head == 7
    assert all(x.ranks is y.ranks and x.ranks == ranks for x, y in zip(a.steps, b.steps, strict=True))
    assert a.steps[0].ranks[1].offset == 10
