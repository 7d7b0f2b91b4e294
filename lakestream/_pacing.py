"""Commit policies, and DAC: decentralised adaptive commit; and the pace at which a follower of
the log expects the next step (`StepPace`). Pure: no I/O, no clock, no hidden randomness.

A policy answers two questions for one producer's committer, from what that producer observed:
how long to wait before the next commit attempt, and how many ready TGBs to put in it. It is told
the outcome of every attempt. The engine does the waiting and the I/O (`_producer`).

Theory of operation (DAC)
-------------------------
The manifest has one commit slot: version v + 1 can only be written after v exists. A put of
v + 1 loses the race (412) when another put of v + 1 lands between the read that found v to be
the tail and the put itself: a race window W of about one GET and one PUT. N producers that each
commit once every T seconds put commits on the slot at rate λ = N/T, and a put then loses with
probability p = 1 - exp(-λW). Every put that loses costs one more PUT and GET, and a little latency;
a slot driven past λW ≈ 1 carries fewer commits the harder it is pushed (livelock). Each TGB waits
about T in its producer. So the pace sets a trade: short T is low latency, long T is few lost races.
DAC picks a point on it, the same for every producer, from what the manifest shows:

* **Pace to the slot.** T = m · N · L. N is read from the manifest itself: the producers whose
  records (they carry timestamps) fall in the last `activity_window` seconds. L is an EWMA of this
  producer's own slot latency (the read that found the tail plus the put). m = 1 would fill the
  slot if W were L; m corrects for everything that model gets wrong.
* **Listen to the slot.** Every commit record carries the races its writer lost before it landed
  (`lost`). From the latest commit of each active producer, each producer estimates the loss
  probability p of a put, on N samples rather than its own few, and all of them see the same
  ones. As -ln(1 - p) is proportional to λ, the interval that would meet the target loss
  probability q (`target_conflicts`, 0.3) is T · ln(1 - p) / ln(1 - q); m moves by the square root
  of that ratio at each decision (damped, at most 2x). q = 0.3 keeps λW ≈ 0.36, far from the
  livelock at 1, at about 1.4 puts per commit.
* **Group.** Every TGB that became ready while waiting goes into the one commit, so throughput is
  carried by group size, not by commit rate: g ≈ rate · T TGBs per commit.
* **Jitter.** The wait is drawn uniformly in [(1 - j)T, (1 + j)T] (j = `jitter`, 0.25) from an
  injected random number, so producers that started together drift apart.
* **Listen before talk.** When others are active the committer reads the log to its tail right
  before it puts, then confirms the tail with one more GET, so the race window is one round trip,
  not the slowest GET of the catch-up; most collisions then cost a 404 rather than a failed PUT.
* **Losers spread out.** The losers of one race learn the new tail together: each waits a random
  0-2 L, then 0-4 L, before its next put. No more than that: the pace answers lasting contention,
  and a per-commit backoff that kept doubling only makes one commit's TGBs the latency tail.
* **Latency ceiling.** No TGB waits longer than `max_commit_delay` in the committer: the wait is
  cut so that the oldest ready TGB is put by then — as long as the slot can carry that, i.e. T is
  below the ceiling. Past that point a ceiling can only be held by colliding, which costs latency
  and throughput alike, so the ceiling stretches to T and latency grows with N while throughput
  holds. The ceiling is jittered too (¾ to 1 of it).
* **N falls slowly.** N decays by `n_decay` per decision from its recent peak: producers that keep
  losing races leave no records for the window to count.
* **Alone, no wait.** With N ≤ 1 and no lost races nothing competes: commit as soon as anything
  is ready, grouping whatever became ready during the previous commit.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import cast

__all__ = [
    "AttemptOutcome",
    "BackoffPolicy",
    "CommitPolicy",
    "DacPolicy",
    "Decision",
    "EagerPolicy",
    "IntervalPolicy",
    "Observation",
    "StepPace",
    "make_policy",
]

PACE_WAKE = 0.9  # a follower at the tail looks again for the next step this far into the gap it expects
PACE_GAPS = 8  # the arrivals of steps waited for that the expected gap is the median gap of
PACE_LATE = 1 / 8  # once a step is past due, the longest wait between looks for it, as a fraction of its gap
PACE_SPED_UP = 1 / 2  # a last gap shorter than this fraction of the median: the stream may have sped up


@dataclass(frozen=True, slots=True)
class Observation:
    """What a producer knows when it has TGBs ready to commit."""

    ready: int  # TGBs ready, in order
    oldest_age: float  # seconds since the oldest ready TGB became ready
    active_producers: int  # producers with a commit in the activity window, this one included
    flushing: bool = False  # someone waits in `Producer.flush`/`close` for these TGBs: commit now
    lost: int = 0  # races lost by the latest commits of the active producers (from their records)
    commits: int = 0  # how many such commits were seen


@dataclass(frozen=True, slots=True)
class AttemptOutcome:
    """The result of one commit (possibly after lost races)."""

    latency: float  # seconds from the first put to the commit landing (or giving up)
    conflicts: int  # lost races (412s) on the way
    committed: int  # TGBs committed


@dataclass(frozen=True, slots=True)
class Decision:
    delay: float  # seconds to wait before putting (TGBs that become ready meanwhile join the commit)
    fresh: bool  # read the log to its tail right before putting


class CommitPolicy:
    """Base: commit everything ready at once. `group_cap` bounds TGBs per commit."""

    name = "base"
    group_cap = 1 << 30
    activity_window = 2.0

    def decide(self, obs: Observation) -> Decision:
        return Decision(0.0, False)

    def observe(self, outcome: AttemptOutcome) -> None:
        pass

    def conflict_delay(self, conflicts: int) -> float:
        """Wait before retrying after the `conflicts`-th lost race of one commit."""
        return 0.0


class EagerPolicy(CommitPolicy):
    """Commit each TGB on its own as soon as it is ready; retry a lost race at once."""

    name = "eager"
    group_cap = 1


@dataclass
class BackoffPolicy(CommitPolicy):
    """Commit each TGB at once; after a lost race wait exponentially longer, with jitter.

    Iceberg's defaults: 100 ms doubling up to 60 s, ±10 % jitter.
    """

    base: float = 0.1
    cap: float = 60.0
    jitter: float = 0.1
    rng: random.Random = field(default_factory=random.Random)
    name = "backoff"
    group_cap = 1

    def conflict_delay(self, conflicts: int) -> float:
        d = min(self.cap, self.base * 2.0 ** min(conflicts - 1, 64))
        return d * (1 + self.rng.uniform(-self.jitter, self.jitter))


@dataclass
class IntervalPolicy(CommitPolicy):
    """Group commit on a fixed interval: everything ready, every `interval` seconds."""

    interval: float = 0.5
    name = "interval"

    def decide(self, obs: Observation) -> Decision:
        delay = 0.0 if obs.flushing else max(0.0, self.interval - obs.oldest_age)
        return Decision(delay, False)


@dataclass
class DacPolicy(CommitPolicy):
    """Decentralised adaptive commit; see the module docstring for the law."""

    target_conflicts: float = 0.3
    jitter: float = 0.25
    max_commit_delay: float = 3.0
    gain: float = 0.5
    min_multiplier: float = 0.25
    max_multiplier: float = 8.0
    latency_alpha: float = 0.2
    initial_latency: float = 0.05
    max_group: int = 1024
    n_decay: float = 0.98
    rng: random.Random = field(default_factory=random.Random)
    name = "dac"
    multiplier: float = 1.0
    latency: float = 0.0

    @property
    def group_cap(self) -> int:  # type: ignore[override]
        return self.max_group

    def __post_init__(self) -> None:
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), got {self.jitter}")
        if not 0 < self.target_conflicts < 1:
            raise ValueError(f"target_conflicts must be in (0, 1), got {self.target_conflicts}")
        if not 0 < self.min_multiplier <= 1 <= self.max_multiplier:
            raise ValueError(
                f"need 0 < min_multiplier <= 1 <= max_multiplier, got {self.min_multiplier}, {self.max_multiplier}"
            )
        if not 0 < self.gain <= 1:
            raise ValueError(f"gain must be in (0, 1], got {self.gain}")
        if self.max_commit_delay < 0:
            raise ValueError(f"max_commit_delay must be >= 0, got {self.max_commit_delay}")
        self.latency = self.initial_latency
        self._active = 1
        self._peak = 1.0
        self.activity_window = max(2.0, 2 * self.max_commit_delay)

    def interval(self, active: int) -> float:
        """The paced interval T for `active` producers, before jitter and the ceiling."""
        return self.multiplier * max(1, active) * self.latency

    def listen(self, lost: int, commits: int) -> None:
        """Move m towards the pace at which a put loses with probability `target_conflicts`,
        from the lost races the latest commit records report. A put loses when another lands in
        its race window W; with commits arriving at rate λ = N/T that happens with probability
        p = 1 - exp(-λW). So -ln(1 - p) is proportional to 1/T, and the interval that meets the
        target is T · ln(1 - p) / ln(1 - q): m moves by the square root of that ratio (damped
        against the noise of few samples), at most by 2x either way per decision."""
        if commits <= 0:
            return
        p = min(lost / (lost + commits), 0.9)
        ratio = math.log1p(-p) / math.log1p(-self.target_conflicts)
        step = min(2.0, max(0.5, ratio)) ** self.gain
        self.multiplier = min(self.max_multiplier, max(self.min_multiplier, self.multiplier * step))

    def decide(self, obs: Observation) -> Decision:
        self._active = obs.active_producers
        alone = obs.active_producers <= 1
        self.listen(obs.lost, obs.commits)
        if obs.flushing or (alone and self.multiplier <= 1.0):
            return Decision(0.0, not alone)
        # Jitter both the paced interval and the ceiling: producers held at the ceiling would
        # otherwise keep the phase they have, and two that collided once would collide forever.
        u = self.rng.random()
        # N only falls slowly: producers that keep losing races write nothing the window sees.
        self._peak = max(float(obs.active_producers), self._peak * self.n_decay)
        n = max(obs.active_producers, round(self._peak))
        fair = self.interval(n) / self.multiplier
        t = self.multiplier * fair * (1 - self.jitter + 2 * self.jitter * u)
        # The ceiling holds while the slot can carry it (fair <= max_commit_delay). Beyond that,
        # holding it would only trade latency for collisions that cost both, so it stretches to
        # the fair share: throughput stays up and latency grows with N.
        ceiling = max(self.max_commit_delay, self.multiplier * fair) * (0.75 + 0.25 * u) - obs.oldest_age - self.latency
        self.activity_window = max(2.0, 2 * self.max_commit_delay, 3 * self.multiplier * fair)
        return Decision(max(0.0, min(t, ceiling)), not alone)

    def conflict_delay(self, conflicts: int) -> float:
        """After a lost race the losers all learn the tail at once: spread their retries over a
        window of 2, then 4 commit latencies. No further: the pace (m) is what answers lasting
        contention; a per-commit backoff that kept doubling would only make this commit's TGBs
        the tail of the latency distribution."""
        return self.rng.uniform(0, 1) * self.latency * min(self._active, 4, 1 << min(conflicts, 8))

    def observe(self, outcome: AttemptOutcome) -> None:
        if outcome.latency > 0:
            self.latency += self.latency_alpha * (outcome.latency - self.latency)


POLICIES = {"dac": DacPolicy, "eager": EagerPolicy, "backoff": BackoffPolicy, "interval": IntervalPolicy}


def make_policy(policy: str | CommitPolicy | None, rng: random.Random | None = None) -> CommitPolicy:
    """A policy from its name (`dac`, `eager`, `backoff`, `interval`) or as given."""
    if policy is None:
        policy = "dac"
    if isinstance(policy, CommitPolicy):
        return policy
    try:
        cls = POLICIES[policy]
    except KeyError:
        raise ValueError(f"unknown commit policy {policy!r}: choose one of {', '.join(POLICIES)}") from None
    takes_rng = cls in (DacPolicy, BackoffPolicy)
    return cast(CommitPolicy, cls(rng=rng) if rng is not None and takes_rng else cls())


class StepPace:
    """When a follower of the log at its tail expects the next step: from when the last steps it
    waited for arrived (`arrived`: each step, and when the read of the log that found it was
    sent, on the follower's clock; not when its answer came back, which would make each arrival
    look a read's latency later than the step landed, so that at S3's 25-60 ms a read the looks
    fell a whole step behind).

    Once a read of the log finds the step waited for is not there, the follower looks again when
    it is due (`due`) rather than at every doubling of a poll interval from its least; past that,
    at an interval that doubles up to `PACE_LATE` of the gap (`longest`). A steady stream is then
    read two to four times a step, and a step is seen within an eighth of a gap of landing, not
    up to half a gap late. Used by readers (`Reader.wait_for_step`) and the mount's follower."""

    def __init__(self, gaps: int = PACE_GAPS, wake: float = PACE_WAKE) -> None:
        self.wake = wake
        self._arrivals: deque[tuple[int, float]] = deque(maxlen=gaps + 1)

    def arrived(self, step: int, when: float) -> None:
        """`step` was waited for, and the read that found it was sent at `when` (not a finite
        time: not known, and the arrival is not counted)."""
        if math.isfinite(when):
            self._arrivals.append((step, when))

    def gap(self, step: int) -> float:
        """The gap at which `step` is expected after the previous one: the median gap between
        consecutive steps' last arrivals (the lower one of an even count: of two, the shorter,
        so a pause before the first steps does not stand for the pace); 0.0 (not known) unless
        the previous step's arrival and at least two such gaps are known (after a catch-up or a
        pause, when the previous step landed is not known), and while the last gap is shorter
        than PACE_SPED_UP of the median (the stream may have sped up: until the median follows, a
        step that lands just after a look would otherwise wait most of the old gap to be seen; a
        follower that only caught up pays a few more reads, from `poll_min` doubling)."""
        a = self._arrivals
        if len(a) < 3 or step != a[-1][0] + 1:
            return 0.0
        gaps = [t1 - t0 for (s0, t0), (s1, t1) in itertools.pairwise(a) if s1 == s0 + 1]
        if len(gaps) < 2:
            return 0.0
        median = sorted(gaps)[(len(gaps) - 1) // 2]
        if a[-2][0] == a[-1][0] - 1 and a[-1][1] - a[-2][1] < PACE_SPED_UP * median:
            return 0.0  # the stream may have sped up: a step waited for at the old pace could come late
        return median

    def due(self, step: int) -> float:
        """When to look again for `step` after a read found the log ends before it: `wake` into
        its expected gap after the previous step's arrival; 0.0 (at once) if that is not known."""
        gap = self.gap(step)
        return self._arrivals[-1][1] + self.wake * gap if gap else 0.0

    def delay(self, step: int, empty: int, now: float, waited: float, least: float, most: float) -> float:
        """Seconds until the next look for `step`, after `empty` looks in a row found the log
        ends before it (1: the first; `waited` seconds into the wait): after the first, until it
        is due; after each later one, `least` doubling up to `longest`; within [least, most]
        either way. With no pace known the first is `least` and the doubling unbounded."""
        if empty <= 1:
            return min(max(least, self.due(step) - now), most)
        return min(least * 2.0 ** min(empty - 2, 30), max(least, self.longest(step, waited)), most)

    def longest(self, step: int, waited: float) -> float:
        """The longest wait between looks for `step` once it is past due, `waited` seconds into
        its wait: PACE_LATE of its expected gap, or an eighth of the wait beyond a second,
        whichever is longer (a stream that stopped is read less and less often); unbounded
        (inf) if the gap is not known."""
        gap = self.gap(step)
        return max(PACE_LATE * gap, (waited - 1.0) / 8) if gap else math.inf
