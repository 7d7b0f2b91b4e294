"""Commit policies, and DAC: decentralised adaptive commit. Pure: no I/O, no clock, no hidden randomness.

A policy answers two questions for one producer's committer, from what that producer observed:
how long to wait before the next commit attempt, and how many ready TGBs to put in it. It is told
the outcome of every attempt. The engine does the waiting and the I/O (`_producer`).

Theory of operation (DAC)
-------------------------
The manifest has one commit slot: version v + 1 can only be written after v exists, so the slot
carries at most one commit per commit latency L (a conditional PUT plus the GETs that find the
tail). N producers that commit independently share it. If each commits once every T seconds, the
slot is busy a fraction ρ = N·L/T of the time, and a commit attempt collides with another with a
probability that grows like 1 - exp(-ρ); each collision costs a wasted PUT and, on some stores
(SeaweedFS), seconds. So:

* **Pace to a fair share.** T = m · N · L / ρ, with ρ = `utilisation` (0.5): the slot is used,
  not fought over, and each producer gets 1/N of it. N is read from the manifest itself: the
  number of producers whose commit records (they carry timestamps) fall in the last
  `activity_window` seconds. L is an EWMA of this producer's own attempt latencies.
* **Group.** Every TGB that became ready while waiting goes into the one commit, so throughput is
  carried by group size, not by commit rate: g ≈ rate · T TGBs per commit.
* **Back off on conflict.** A lost race multiplies m by `backoff` (up to `max_multiplier`); each
  clean commit multiplies it by 1 - `recovery` (down to 1), so m settles where about one commit in
  five meets a lost race. This corrects for a wrong N (producers that appear or vanish) and for
  latency the EWMA has not caught yet. L is the latency of the slot itself: the read that found
  the tail plus the put, not the catch-up reads of others' versions nor waits after lost races.
  N only decays slowly (by `n_decay` per decision) from its recent peak, because producers that
  keep losing races leave no records for the window to count.
* **Jitter.** The wait is drawn uniformly in [½T, 1½T] from an injected random number, so
  producers that started together drift apart instead of colliding forever.
* **Listen before talk.** When others are active, the committer reads the log up to its tail right
  before it puts (the GETs it would need after a lost race anyway), so most collisions cost a
  cheap 404 instead of a failed conditional PUT.
* **Latency ceiling.** No TGB waits longer than `max_commit_delay` in the committer: the wait is
  cut so that the oldest ready TGB is put by then — as long as the slot can carry that, i.e. the
  fair-share interval N·L/ρ is below the ceiling. Past that point a ceiling can only be held by
  colliding, which costs latency and throughput alike, so the ceiling stretches to the fair share
  and latency grows with N while throughput holds. The ceiling is jittered too (¾ to 1 of it), so
  producers held at it do not keep colliding in lockstep.
* **Alone, no wait.** With N ≤ 1 nothing competes: commit as soon as anything is ready, grouping
  whatever became ready during the previous commit.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

__all__ = [
    "AttemptOutcome",
    "BackoffPolicy",
    "CommitPolicy",
    "DacPolicy",
    "Decision",
    "EagerPolicy",
    "IntervalPolicy",
    "Observation",
    "make_policy",
]


@dataclass(frozen=True, slots=True)
class Observation:
    """What a producer knows when it has TGBs ready to commit."""

    ready: int  # TGBs ready, in order
    oldest_age: float  # seconds since the oldest ready TGB became ready
    active_producers: int  # producers with a commit in the activity window, this one included
    closing: bool = False  # the producer is flushing: commit now


@dataclass(frozen=True, slots=True)
class AttemptOutcome:
    """The result of one commit (possibly after lost races)."""

    latency: float  # seconds from the first put to the commit landing (or giving up)
    conflicts: int  # lost races (412s) on the way
    committed: int  # TGBs committed


@dataclass(frozen=True, slots=True)
class Decision:
    delay: float  # seconds to wait before putting
    group: int  # how many of the TGBs ready now to commit (>= 1, <= ready); more may join during the wait
    fresh: bool  # read the log to its tail right before putting


class CommitPolicy:
    """Base: commit everything ready at once. `group_cap` bounds TGBs per commit."""

    name = "base"
    group_cap = 1 << 30
    activity_window = 2.0

    def decide(self, obs: Observation) -> Decision:
        return Decision(0.0, max(1, min(obs.ready, self.group_cap)), False)

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
        d = min(self.cap, self.base * 2 ** (conflicts - 1))
        return d * (1 + self.rng.uniform(-self.jitter, self.jitter))


@dataclass
class IntervalPolicy(CommitPolicy):
    """Group commit on a fixed interval: everything ready, every `interval` seconds."""

    interval: float = 0.5
    name = "interval"

    def decide(self, obs: Observation) -> Decision:
        delay = 0.0 if obs.closing else max(0.0, self.interval - obs.oldest_age)
        return Decision(delay, max(1, obs.ready), False)


@dataclass
class DacPolicy(CommitPolicy):
    """Decentralised adaptive commit; see the module docstring for the law."""

    utilisation: float = 0.5
    max_commit_delay: float = 3.0
    backoff: float = 1.5
    recovery: float = 0.1
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
        if not 0 < self.utilisation <= 1:
            raise ValueError(f"utilisation must be in (0, 1], got {self.utilisation}")
        if self.max_commit_delay < 0:
            raise ValueError(f"max_commit_delay must be >= 0, got {self.max_commit_delay}")
        self.latency = self.initial_latency
        self._active = 1
        self._peak = 1.0
        self.activity_window = max(2.0, 2 * self.max_commit_delay)

    def interval(self, active: int) -> float:
        """The paced interval T for `active` producers, before jitter and the ceiling."""
        return self.multiplier * max(1, active) * self.latency / self.utilisation

    def decide(self, obs: Observation) -> Decision:
        self._active = obs.active_producers
        group = max(1, min(obs.ready, self.max_group))
        alone = obs.active_producers <= 1
        if obs.closing or (alone and self.multiplier <= 1.0):
            return Decision(0.0, group, not alone)
        # Jitter both the paced interval and the ceiling: producers held at the ceiling would
        # otherwise keep the phase they have, and two that collided once would collide forever.
        u = self.rng.random()
        # N only falls slowly: producers that keep losing races write nothing the window sees.
        self._peak = max(float(obs.active_producers), self._peak * self.n_decay)
        n = max(obs.active_producers, round(self._peak))
        fair = self.interval(n) / self.multiplier
        t = self.multiplier * fair * (0.5 + u)
        # The ceiling holds while the slot can carry it (fair <= max_commit_delay). Beyond that,
        # holding it would only trade latency for collisions that cost both, so it stretches to
        # the fair share: throughput stays up and latency grows with N.
        ceiling = max(self.max_commit_delay, self.multiplier * fair) * (0.75 + 0.25 * u) - obs.oldest_age - self.latency
        self.activity_window = max(2.0, 2 * self.max_commit_delay, 3 * fair)
        return Decision(max(0.0, min(t, ceiling)), group, not alone)

    def conflict_delay(self, conflicts: int) -> float:
        """After a lost race the losers all learn the tail at once: spread their retries over a
        window that doubles with each loss, in units of the commit latency (capped at N)."""
        return self.rng.uniform(0, 1) * self.latency * min(self._active, 2**conflicts)

    def observe(self, outcome: AttemptOutcome) -> None:
        if outcome.latency > 0:
            self.latency += self.latency_alpha * (outcome.latency - self.latency)
        if outcome.conflicts:
            self.multiplier = min(self.max_multiplier, self.multiplier * self.backoff**outcome.conflicts)
        else:
            self.multiplier = max(1.0, self.multiplier * (1 - self.recovery))


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
    return cls(rng=rng) if rng is not None and takes_rng else cls()  # type: ignore[call-arg]
