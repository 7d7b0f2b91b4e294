"""GC's plan is pure: property tests against the invariants of docs/guarantees.md, on states built
by the protocol's own decisions and listings holding committed segments, orphans and strangers."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lakestream import Config, State
from lakestream import _decisions as decide
from lakestream._gc import plan_gc, plan_log
from lakestream._layout import parse_segment_key, segment_key
from lakestream._records import Record, TgbRef, encode_record

PRODUCERS = ["a", "b"]
NOW = 1_000_000.0


class World:
    """A stream driven through the decisions, remembering every segment ever uploaded."""

    def __init__(self) -> None:
        self.state = State()
        self.apply(decide.create(Config(world_size=1, global_batch=1, keep_checkpoints=2), 0.0))
        self.segments: dict[str, int] = {}
        self.n = 0

    def apply(self, record: Record | None) -> None:
        if record is not None:
            assert self.state.check(record) is None
            assert self.state.apply(self.state.version + 1, encode_record(record)) is None

    def upload(self, producer: str, epoch: int, seq: int, at: float) -> TgbRef:
        key = segment_key(producer, epoch, seq, at)
        self.segments[key] = 100 + seq
        return TgbRef(key, ((0, 100 + seq, 0, 1),), seq)


@st.composite
def worlds(draw: st.DrawFn) -> World:
    w = World()
    for _ in range(draw(st.integers(0, 25))):
        op = draw(st.sampled_from(["register", "commit", "commit", "orphan", "checkpoint", "rewind", "reclaim"]))
        p = draw(st.sampled_from(PRODUCERS))
        ts = NOW - draw(st.floats(0, 10_000))
        ps = w.state.producers.get(p)
        if op == "register":
            w.n += 1
            w.apply(decide.register(w.state, p, f"t{w.n}", ts))
        elif op in ("commit", "orphan") and ps is not None and ps.token:
            seq = ps.seq + 1
            ref = w.upload(p, ps.epoch, seq + draw(st.integers(0, 2)) * (op == "orphan"), ts)
            if op == "commit":
                w.apply(decide.commit(w.state, p, ps.epoch, [decide.PendingTgb(seq, ref)], 0, ts))
        elif op == "checkpoint" and w.state.head >= w.state.first_step:
            lo = max(w.state.first_step, w.state.checkpoints[-1].step if w.state.checkpoints else 0)
            if lo <= w.state.head:
                w.n += 1
                w.apply(decide.checkpoint(w.state, f"c{w.n}", draw(st.integers(lo, w.state.head)), ts))
        elif op == "rewind":
            to = draw(st.integers(w.state.first_step - 1, w.state.head))
            w.apply(decide.rewind(w.state, to_step=to, rewinds_before=w.state.rewinds, now=ts))
        elif op == "reclaim":
            w.apply(decide.reclaim(w.state, ts))
    for key in draw(st.lists(st.sampled_from(["segments/x", "segments/a/junk.tgb", "other/k"]), max_size=2)):
        w.segments[key] = 1  # not segment keys: never touched
    return w


@settings(max_examples=300, deadline=None)
@given(worlds(), st.floats(0, 20_000), st.booleans())
def test_nothing_readable_or_still_committable_is_ever_in_a_plan(w: World, grace: float, reclaim_first: bool) -> None:
    s = w.state
    plan = plan_gc(s, w.segments, [], [], {}, now=NOW, grace=grace, lease=600)
    below = plan.reclaim_below if plan.reclaim_below is not None else s.first_step
    assert plan.reclaim_below is None or plan.reclaim_below == s.watermark > s.first_step
    readable = {x.segment for x in s.steps if x.step >= below}
    doomed = set(plan.segments.delete)
    assert not doomed & readable, "a readable step's segment is in the plan"
    assert all(k.startswith("segments/") and k.count("/") == 2 and k.endswith(".tgb") for k in doomed)
    for key in doomed:
        parsed = parse_segment_key(key)
        assert parsed is not None
        producer, epoch, seq, uploaded = parsed
        p = s.producers.get(producer)
        if p is not None and epoch == p.epoch and seq > p.seq:  # still committable: only when old
            assert NOW - max(uploaded, p.last_ts) >= grace, (key, p)
    # Everything retained but unreferenced is either kept young or deleted, never lost track of.
    kept = plan.segments.kept_uploads
    assert kept + len(doomed) <= len(w.segments)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(1, 400), unique=True, max_size=6),
    st.lists(st.integers(0, 500), unique=True, max_size=40),
    st.dictionaries(st.integers(1, 400), st.floats(NOW - 5000, NOW), max_size=6),
    st.integers(400, 600),
    st.floats(0, 3000),
)
def test_log_clean_up_keeps_the_create_record_the_horizon_and_everything_above(
    snapshots: list[int], logs: list[int], times: dict[int, float], version: int, lease: float
) -> None:
    state = State()
    state.apply(0, encode_record(decide.create(Config(world_size=1, global_batch=1, snapshot_every=100), 0.0)))
    state.version = version
    plan = plan_log(state, snapshots, logs, times, now=NOW, lease=lease)
    if plan.horizon is None:
        assert not plan.snapshots and not plan.log_versions and plan.hint is None
        return
    h = plan.horizon
    assert h in snapshots and NOW - times[h] > lease  # the horizon's record is older than the lease
    assert all(NOW - times.get(v, NOW) <= lease for v in snapshots if v > h)  # it is the newest such
    assert 0 not in plan.log_versions and all(v < h for v in plan.log_versions)
    assert plan.log_versions == sorted(plan.log_versions)  # ascending: rule 1
    assert set(plan.snapshots) == {v for v in snapshots if v < h}
    assert plan.hint is not None and plan.hint >= h and plan.hint not in plan.snapshots
