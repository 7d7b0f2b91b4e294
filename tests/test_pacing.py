"""The commit controller (pure) and 32 producers committing through it on an emulated store."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

import lakestream
from lakestream._pacing import (
    PACE_LATE,
    PACE_SPED_UP,
    PACE_WAKE,
    AttemptOutcome,
    BackoffPolicy,
    DacPolicy,
    EagerPolicy,
    IntervalPolicy,
    Observation,
    StepPace,
    make_policy,
)
from lakestream._store import MemoryStore
from lakestream.testing import FaultyStore

observations = st.builds(
    Observation,
    ready=st.integers(1, 5000),
    oldest_age=st.floats(0, 100),
    active_producers=st.integers(1, 1000),
    flushing=st.booleans(),
    lost=st.integers(0, 5000),
    commits=st.integers(0, 1000),
)
outcomes = st.builds(
    AttemptOutcome, latency=st.floats(0, 10), conflicts=st.integers(0, 20), committed=st.integers(0, 100)
)


@given(st.lists(st.one_of(outcomes, observations), max_size=30), observations, st.integers(0, 2**32))
def test_dac_decisions_are_bounded(history: list[AttemptOutcome | Observation], obs: Observation, seed: int) -> None:
    p = DacPolicy(rng=random.Random(seed))
    for x in history:
        p.observe(x) if isinstance(x, AttemptOutcome) else p.decide(x)
    d = p.decide(obs)
    assert 1 <= p.group_cap <= p.max_group
    assert p.min_multiplier <= p.multiplier <= p.max_multiplier and p.latency >= 0
    # the ceiling: max_commit_delay, stretched to the paced interval when the slot cannot carry
    # it; N is the larger of what is seen and its slowly decaying recent peak
    n = max(obs.active_producers, round(p._peak))
    ceiling = max(p.max_commit_delay, p.multiplier * n * p.latency)
    assert 0 <= d.delay <= ceiling
    if obs.flushing:
        assert d.delay == 0
    if obs.oldest_age >= ceiling:
        assert d.delay == 0  # an old TGB is committed now
    assert 0 <= p.conflict_delay(3) <= p.latency * 4


@given(observations, st.integers(0, 2**32))
def test_every_policy_waits_a_bounded_time_and_commits_at_least_one_tgb(obs: Observation, seed: int) -> None:
    for name in ("dac", "eager", "backoff", "interval"):
        policy = make_policy(name, random.Random(seed))
        d = policy.decide(obs)
        assert policy.group_cap >= 1 and d.delay >= 0


def test_dac_alone_commits_at_once_and_in_company_paces() -> None:
    p = DacPolicy(rng=random.Random(1))
    assert p.decide(Observation(3, 0.0, 1)).delay == 0.0
    assert not p.decide(Observation(3, 0.0, 1)).fresh  # nobody to listen for
    crowded = p.decide(Observation(3, 0.0, 16))
    assert crowded.delay > 0 and crowded.fresh


def test_dac_backs_off_under_conflict_and_speeds_up_without() -> None:
    p = DacPolicy(rng=random.Random(1))
    calm = p.interval(8)
    p.decide(Observation(1, 0.0, 8, lost=8, commits=8))  # half the puts lost: above the target
    assert p.multiplier > 1 and p.interval(8) > calm
    for _ in range(3):
        p.decide(Observation(1, 0.0, 8, lost=40, commits=8))  # heavy contention: 2x at most each time
    first = math.sqrt(math.log(0.5) / math.log(0.7))
    assert p.multiplier == pytest.approx(first * 2**1.5)
    high = p.multiplier
    p.decide(Observation(1, 0.0, 8, lost=3, commits=7))  # exactly the target (0.3): no change
    assert p.multiplier == pytest.approx(high)
    for _ in range(30):
        p.decide(Observation(1, 0.0, 8, lost=0, commits=8))  # no lost races: faster, to the floor
    assert p.multiplier == p.min_multiplier
    # a lost race even alone means someone else appeared: wait
    q = DacPolicy(rng=random.Random(1))
    assert q.decide(Observation(1, 0.0, 1, lost=2, commits=1)).delay > 0


@pytest.mark.parametrize("n", [4, 64, 256])
@pytest.mark.parametrize("window", [0.02, 0.1])
def test_dac_settles_at_the_target_loss_rate(n: int, window: float) -> None:
    """Closed loop with the collision model (a put loses with p = 1 - exp(-N W / T)), expected
    counts fed back as the manifest would show them: m settles where p is the target."""
    p = DacPolicy(rng=random.Random(1), max_commit_delay=1000)
    for _ in range(100):
        p.observe(AttemptOutcome(0.045, 0, 1))
    lost = 0.0
    for _ in range(40):
        loss = 1 - math.exp(-n * window / p.interval(n))
        commits = 1000
        lost = commits * loss / (1 - loss)  # expected lost puts per landed commit: p / (1 - p)
        p.decide(Observation(1, 0.0, n, lost=round(lost), commits=commits))
    loss = 1 - math.exp(-n * window / p.interval(n))
    assert loss == pytest.approx(p.target_conflicts, abs=0.01)


def test_dac_paces_to_the_slot() -> None:
    p = DacPolicy(rng=random.Random(1), max_commit_delay=100)
    for _ in range(30):
        p.observe(AttemptOutcome(0.04, 0, 1))
    assert p.interval(10) == pytest.approx(10 * 0.04, rel=0.01)
    delays = [p.decide(Observation(1, 0.0, 10)).delay for _ in range(200)]
    assert min(delays) >= 0.75 * 0.4 and max(delays) <= 1.25 * 0.4 + 1e-9
    assert 0.37 < sum(delays) / len(delays) < 0.43


def test_dac_ceiling_stretches_only_when_the_slot_cannot_carry_it() -> None:
    p = DacPolicy(rng=random.Random(1), max_commit_delay=0.5)
    for _ in range(30):
        p.observe(AttemptOutcome(0.04, 0, 1))
    # 4 producers: paced interval 0.16 s < 0.5 s: the ceiling holds
    assert all(p.decide(Observation(1, 0.3, 4)).delay <= 0.2 for _ in range(100))
    # 64 producers: 2.6 s: waiting to 0.5 s would only collide
    assert max(p.decide(Observation(1, 0.3, 64)).delay for _ in range(100)) > 1.0


def test_baselines() -> None:
    assert EagerPolicy().decide(Observation(9, 5.0, 50)).delay == 0 and EagerPolicy().group_cap == 1
    b = BackoffPolicy(rng=random.Random(1))
    waits = [b.conflict_delay(n) for n in range(1, 12)]
    assert 0.09 <= waits[0] <= 0.11 and 0.18 <= waits[1] <= 0.22
    assert all(w <= 66 for w in waits) and waits[-1] >= 54
    i = IntervalPolicy(interval=0.5)
    assert i.decide(Observation(4, 0.2, 3)).delay == pytest.approx(0.3)
    assert i.decide(Observation(4, 0.2, 3, flushing=True)).delay == 0
    with pytest.raises(ValueError, match="unknown commit policy 'fast'"):
        make_policy("fast")
    with pytest.raises(ValueError, match="target_conflicts"):
        DacPolicy(target_conflicts=1.0)


class RecordingDac(DacPolicy):
    """DAC that records, for every decision, the age of its oldest TGB, the wait it adds, and the paced interval."""

    def __init__(self, waits: list[tuple[float, float, float]], **kw) -> None:
        super().__init__(**kw)
        self.waits = waits

    def decide(self, obs: Observation):  # type: ignore[no-untyped-def]
        d = super().decide(obs)
        fair = self.multiplier * max(obs.active_producers, round(self._peak)) * self.latency
        self.waits.append((obs.oldest_age, d.delay, fair))
        return d


async def test_32_producers_no_livelock_exactly_once_ceiling_respected() -> None:
    inner = MemoryStore()
    await lakestream.create(inner, world_size=2, global_batch=2)
    fast = {op: (0.004, 0.3) for op in ("get", "get_range", "put", "put_if_absent", "list", "delete")}
    store = FaultyStore(inner, latency=fast, rng=random.Random(7))
    waits: list[tuple[float, float, float]] = []
    ceiling = 1.5
    n_producers, per_producer = 32, 24
    stats = []

    async def produce(k: int) -> None:
        policy = RecordingDac(waits, max_commit_delay=ceiling, rng=random.Random(k))
        async with lakestream.open_producer(store, f"p{k}", policy=policy) as p:
            stats.append(p.stats)
            await anyio.sleep(k / n_producers / 10)
            for i in range(per_producer):
                await p.put({"__key__": f"p{k}-{i}", "txt": "x"}, cursor=i + 1)
                await anyio.sleep(0.05)

    with anyio.fail_after(120):  # livelock would run into this
        async with anyio.create_task_group() as tg:
            for k in range(n_producers):
                tg.start_soon(produce, k)
    state = await lakestream.load_state(inner)
    keys: Counter[str] = Counter()
    async with lakestream.open_reader(inner, None) as r:
        for step in state.steps:
            for rank in (0, 1):
                keys.update(f.key for f in (await r.fetch_raw(step, rank)).files)
    assert keys == Counter(f"p{k}-{i}" for k in range(n_producers) for i in range(per_producer))
    assert sum(s.tgbs_committed for s in stats) == len(state.steps) == n_producers * per_producer // 2
    # While the slot can carry the ceiling (the paced interval is below it), no wait the policy adds
    # takes the oldest TGB past it. A TGB may reach the decision older than the ceiling already (it
    # became ready during a commit that lost races, or the loop ran late on a loaded machine): that
    # one is put at once. The wall clock of the run is not the policy's to bound.
    held = [(age, delay) for age, delay, fair in waits if fair <= ceiling]
    assert any(delay > 0 for _, delay in held)
    late = [(age, delay) for age, delay in held if delay > 0 and age + delay > ceiling + 1e-6]
    assert not late, late
    assert sum(s.commits for s in stats) < len(state.steps)  # grouping happened


def test_step_pace_forgets_its_pace_when_the_stream_speeds_up() -> None:
    """Six steps 0.1 s apart, then steps 2 ms apart: from the first short gap the pace is not
    known and the follower looks at once (the median of the last gaps is still 0.1 s, and a step
    landing just after a look would wait 0.09 s to be seen); once the median follows, the new
    pace is known. A gap of the old length after a short one brings the old pace back."""
    pace = StepPace()
    for step in range(6):
        pace.arrived(step, 10.0 + 0.1 * step)
    assert pace.due(6) == pytest.approx(10.5 + PACE_WAKE * 0.1)
    pace.arrived(6, 10.502)
    assert pace.due(7) == 0.0 and pace.gap(7) == 0.0 and pace.longest(7, 0.5) == math.inf
    pace.arrived(7, 10.602)
    assert pace.due(8) == pytest.approx(10.602 + PACE_WAKE * 0.1)
    for step in range(8, 16):
        pace.arrived(step, 10.602 + 0.002 * (step - 7))
    assert pace.gap(16) == pytest.approx(0.002)
    pace.arrived(16, -math.inf)  # when it was found is not known: not counted
    assert pace.gap(16) == pytest.approx(0.002) and pace.gap(17) == 0.0


@given(
    st.lists(st.floats(0.001, 10.0), min_size=0, max_size=20),
    st.lists(st.integers(1, 3), min_size=20, max_size=20),
)
def test_step_pace_expects_the_next_step_a_fraction_into_the_median_gap_of_consecutive_arrivals(
    gaps: list[float], strides: list[int]
) -> None:
    """`StepPace.due` is PACE_WAKE into the median of the last gaps between consecutive steps'
    arrivals, after the previous step's; at once (0.0) for any other step, while fewer than
    two such gaps are known among the last arrivals, or while the last gap is shorter than
    PACE_SPED_UP of that median: a catch-up (steps not waited for one by one), a skip or a stream
    that just sped up leaves no pace, and a reader then looks at once, never later than it would."""
    pace = StepPace()
    arrivals: list[tuple[int, float]] = []
    step, when = 0, 100.0
    for gap, stride in zip(gaps, strides):
        pace.arrived(step, when)
        arrivals.append((step, when))
        step, when = step + stride, when + gap
    last = arrivals[-9:]
    known = sorted(t1 - t0 for (s0, t0), (s1, t1) in itertools.pairwise(last) if s1 == s0 + 1)
    for asked in (arrivals[-1][0] + 1 if arrivals else 1, arrivals[-1][0] + 2 if arrivals else 2, 0):
        due = pace.due(asked)
        longest = pace.longest(asked, 0.5)
        sped_up = (  # the last gap shorter than PACE_SPED_UP of the median
            len(last) >= 2
            and last[-2][0] == last[-1][0] - 1
            and len(known) >= 2
            and last[-1][1] - last[-2][1] < PACE_SPED_UP * known[(len(known) - 1) // 2]
        )
        if arrivals and asked == arrivals[-1][0] + 1 and len(known) >= 2 and not sped_up:
            gap = known[(len(known) - 1) // 2]
            assert due == pytest.approx(arrivals[-1][1] + PACE_WAKE * gap)
            assert arrivals[-1][1] < due <= arrivals[-1][1] + max(known)
            # Past due, looks come at least every PACE_LATE of the gap in the first second of a
            # wait, and less and less often after it (a stream that stopped).
            assert longest == pytest.approx(PACE_LATE * gap)
            assert pace.longest(asked, 3600.0) == pytest.approx(max(PACE_LATE * gap, 3599.0 / 8))
        else:
            assert due == 0.0 and longest == math.inf
