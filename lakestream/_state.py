"""The manifest state machine: records in, state out. No I/O, no clock, no randomness.

Theory of operation
-------------------
A stream's manifest is a log of records at versions 0, 1, 2 … Version 0 is the `create` record;
every later version holds exactly one record. The state at version v is `apply` folded over the
records 0..v, and nothing else: every reader and writer that applies the same log gets the same
state, byte for byte (`State.to_json`). A snapshot is that state serialised, so
`snapshot(v) + records v+1..w` equals replaying 0..w.

Invariants, kept by `apply` alone:

* Steps are `first_step .. head` with no gaps. A `commit` appends its TGBs at `head + 1 …` in
  record order; step numbers are assigned here, never by the writer. A commit record therefore
  does not change when its writer loses a race and retries at a later version ("rebase" is free).
* A record that is invalid at its position — bad JSON, unknown kind, wrong schema, a stale epoch,
  a sequence number that is not the producer's next — is a no-op, recorded in `rejected`.
  Writers check their own record against the state they built before putting it, so in a healthy
  stream nothing is ever rejected; `verify` and `status` report it when something is.
* `register` raises a producer's epoch by exactly one; a producer may commit only with its current
  epoch. An older incarnation ("zombie") that catches up with the log sees the newer epoch before
  it can write the next version, so it can never commit again.
* Each TGB carries a per-producer sequence number; a commit is valid only if its first TGB's `seq`
  is the producer's committed `seq + 1`. A writer that is unsure whether its put landed re-reads
  the log: every TGB with `seq <= producers[id].seq` is committed, every other one is not.
* Each TGB carries the producer's source cursor after its last sample, so a restarted producer
  resumes exactly after its last committed sample.
* A TGB's segment key names its producer, epoch and sequence number (`_layout.segment_prefix`),
  and a commit is valid only if each of its keys names the record's. Since a producer's `seq` only
  rises (a rewind or reclaim never lowers it), no segment is ever committed twice: not one a
  retained step references, nor one a rewind discarded or a reclaim dropped. No set of keys is
  kept for this; the check is O(1) a TGB.
* `checkpoint`, `release`, `reclaim` and `rewind` (the lifecycle) only move `first_step`, `head`,
  the checkpoint list and epochs; they never reorder steps.
* A rewind with `skip` replays: the TGBs of the steps after `to_step` become new steps at that
  record's version, in order, except those of the skipped steps, which are kept as `skipped`
  (each after the new step `at`) until a reclaim passes them, or a rewind to a step before them
  (to `at` or lower) gives them back to their producers. A replayed TGB is referenced anew, never committed anew; steps named by shapes, mixes and
  the close after `to_step` move down with the steps they name. No producer is fenced or moved
  back: their cursors already follow every replayed and skipped TGB. Cursors are taken in the
  history's order, skipped TGBs in their place, so that nothing skipped is produced again.
* A `mix` record applies from a step after the head and replaces every mix from that step on; one
  with no weights clears. `mix_at(step)` is the newest mix from `step` or before, None before the
  first one or from a clear on. A TGB committed at a step names exactly that mix's version (no
  mix under None) and holds its shares, so a TGB sealed for other weights is never committed.
* A `close` record ends the stream after a step at or past the head (`closed_after`): a commit
  that would put a step past it is a no-op, so the head never passes it. A `reopen` record
  clears it. A rewind leaves it as it is (the steps up to it may be committed again).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import hashlib
import zlib
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import orjson

from ._batching import mix_counts
from ._config import FORMAT_VERSION, LIMITS, Config
from ._layout import segment_prefix
from ._records import (
    CHECKSUM_BITS,
    JOB_NAME,
    MAIN_JOB,
    MAX_FORKS,
    MAX_JOBS,
    PRODUCER_ID,
    CheckpointRecord,
    CloseRecord,
    CommitRecord,
    CreateRecord,
    DetachRecord,
    FinishRecord,
    ForkRecord,
    GroupRecord,
    JobRecord,
    MixRecord,
    RankSlice,
    ReclaimRecord,
    Record,
    RecordError,
    RegisterRecord,
    ReleaseRecord,
    ReopenRecord,
    ReshapeRecord,
    Resume,
    RewindRecord,
    TgbRef,
    UnforkRecord,
    _Fields,
    _tgb,
    check_stream_url,
    check_weights,
    decode_record,
)

__all__ = [
    "FORMAT_VERSION",
    "LIMITS",
    "Config",
    "Leftover",
    "ProducerState",
    "RankSlice",
    "State",
    "Step",
]


@dataclass(frozen=True, slots=True)
class Step:
    """One committed TGB at its step."""

    step: int
    version: int
    segment: str
    producer: str
    epoch: int
    seq: int
    ranks: tuple[RankSlice, ...]
    cursor: Any
    ts: float
    checksum: str = "crc32"  # what `RankSlice.digest` is: `crc32` or `xxh3-64`
    # A step that packs leftovers: (producer, samples, cursor) of each producer whose leftover
    # samples it holds, the cursor being that producer's after them; `cursor` is then not used.
    packed: tuple[tuple[str, int, Any], ...] | None = None

    @property
    def samples(self) -> int:
        return sum(r.samples for r in self.ranks)

    @property
    def nbytes(self) -> int:
        return sum(r.length for r in self.ranks)

    def to_list(self) -> list[Any]:
        """The snapshot's entry: 9 items, then the checksum unless it is `crc32` and nothing follows, then `packed`."""
        return [
            self.step, self.version, self.segment, self.producer, self.epoch, self.seq,
            [[r.offset, r.length, r.digest, r.samples] for r in self.ranks], self.cursor, self.ts, *self._extra(),
        ]  # fmt: skip

    def _extra(self) -> list[Any]:
        """The entry's optional items after `ts`: the checksum (when not CRC-32, or before `packed`),
        then `packed` (a step that packs leftovers)."""
        if self.packed is not None:
            return [self.checksum, [list(x) for x in self.packed]]
        return [self.checksum] if self.checksum != "crc32" else []

    @classmethod
    def from_list(cls, v: list[Any]) -> Step:
        step, version, segment, producer, epoch, seq, ranks, cursor, ts, *extra = v
        checksum = extra[0] if extra else "crc32"
        pk = tuple((x[0], x[1], x[2]) for x in extra[1]) if len(extra) > 1 else None
        return cls(step, version, segment, producer, epoch, seq, tuple(map(RankSlice._make, ranks)), cursor, ts,
                   checksum, pk)  # fmt: skip

    def cursors(self) -> list[tuple[str, Any]]:
        """(producer, cursor after this step) of each producer whose samples it holds."""
        if self.packed is not None:
            return [(pid, cursor) for pid, _, cursor in self.packed]
        return [(self.producer, self.cursor)]


@dataclass(frozen=True, slots=True)
class Leftover:
    """A finished producer's partial last global batch, held until it is packed (see `FinishRecord`)."""

    ref: TgbRef  # its segment, its one slice of samples, the producer's cursor after it; mix and sources
    cursors: tuple[int, int, int]  # (offset, length, crc32) of each sample's cursor, source and cost
    before: Any  # the producer's cursor before it: what a new incarnation resumes from

    @property
    def samples(self) -> int:
        return self.ref.ranks[0][3]

    def to_list(self) -> list[Any]:
        return [self.ref.to_dict(), list(self.cursors), self.before]


@dataclass(slots=True)
class ProducerState:
    epoch: int = 0
    seq: int = -1  # last committed TGB sequence number
    cursor: Any = None  # source position after the last committed sample
    token: str = ""  # the registering incarnation's random id
    last_ts: float = 0.0  # timestamp of its last record
    commits: int = 0
    tgbs: int = 0
    base_cursor: Any = None  # its cursor after its last reclaimed TGB (what a rewind falls back to)
    lost: int = 0  # races its last commit lost before it landed (what commit pacing listens to)
    finished: bool = False  # its source ended (a `finish` record), and it has not registered since

    def to_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch, "seq": self.seq, "cursor": self.cursor, "token": self.token,
            "last_ts": self.last_ts, "commits": self.commits, "tgbs": self.tgbs, "base_cursor": self.base_cursor,
            "lost": self.lost,
        } | ({"finished": True} if self.finished else {})  # fmt: skip


class _Reject(Exception):
    pass


def _need(cond: bool, why: str) -> None:
    if not cond:
        raise _Reject(why)


def _tiled_samples(t: TgbRef, what: str) -> int:
    """The samples of `t`'s rank slices, which must tile its segment from offset 0 in rank order
    and have checksums of their width (`_Reject` otherwise). Every follower checks every step's
    hundreds of slices: the checks are C-level passes, the loop only says which slice failed."""
    offsets, lengths, digests, counts = zip(*t.ranks, strict=True) if t.ranks else ((), (), (), ())
    if (
        offsets[:1] in ((), (0,))
        and list(offsets[1:]) == list(accumulate(lengths[:-1]))
        and max(lengths, default=0) < 1 << 62
        and max(digests, default=0) < 1 << CHECKSUM_BITS[t.checksum]
    ):
        return sum(counts)
    end = 0
    for rs in t.ranks:
        offset, length, crc, _ = rs
        _need(offset == end and length < 1 << 62 and crc < 1 << CHECKSUM_BITS[t.checksum],
              f"{what}: rank slice {list(rs)!r} does not follow the previous one at {end}")  # fmt: skip
        end += length
    raise AssertionError("unreachable: a slice failed the checks above")  # pragma: no cover


def rank_slices(ranks: tuple[tuple[int, int, int, int], ...]) -> tuple[RankSlice, ...]:
    """`ranks` as RankSlices: as they are when decoded (`_records`, once per process for every
    follower), else converted."""
    if type(ranks) is tuple and set(map(type, ranks)) <= {RankSlice}:
        return ranks  # type: ignore[return-value]
    return tuple(map(RankSlice._make, ranks))


def _int(v: Any, lo: int = 0) -> bool:
    return type(v) is int and v >= lo


def _segment_of(key: str, producer: str, epoch: int, seq: int) -> bool:
    """Is `key` a segment key of TGB `seq` of `producer` at `epoch` (`_layout.segment_key`)?"""
    prefix = segment_prefix(producer, epoch, seq)
    rest = key[len(prefix) :]
    return key.startswith(prefix) and rest.endswith(".tgb") and "/" not in rest


@dataclass(frozen=True, slots=True)
class Mix:
    """A mixture in force from `from_step`: the weights of the `mix` record at log `version`; none
    (a cleared mixture) when they are empty."""

    from_step: int
    version: int
    weights: tuple[tuple[str, float], ...]


@dataclass(frozen=True, slots=True)
class Skipped:
    """The TGB of a step a replay skipped (`step`, as it was), after the new step `at`."""

    at: int
    step: Step

    def to_list(self) -> list[Any]:
        return [self.at, self.step.to_list()]


@dataclass(frozen=True, slots=True)
class Fork:
    """A fork of this stream (at `url`) whose steps below `at_step` are this stream's: they are
    kept from step `hold` (the first step when it forked) on until an `unfork`."""

    url: str
    at_step: int
    hold: int
    version: int


@dataclass(frozen=True, slots=True)
class Base:
    """Where a fork's shared steps live: the stream at `source`, which it forked at `at_step`. A
    TGB is the source's when its epoch is below `epochs[producer]` (each producer's epoch as the
    fork fenced it; the fork's own incarnations come after)."""

    source: str
    at_step: int
    epochs: dict[str, int]

    def holds(self, s: Step) -> bool:
        """Whether step entry `s` is a TGB of the source (its segment is in the source's store)."""
        return s.epoch < self.epochs.get(s.producer, 0)

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "at_step": self.at_step, "epochs": dict(sorted(self.epochs.items()))}


@dataclass(slots=True)
class Checkpoint:
    id: str
    step: int
    version: int
    job: str = MAIN_JOB


@dataclass(slots=True)
class State:
    """A stream's manifest state at `version`. Mutated only by `apply`."""

    version: int = -1
    config: Config | None = None
    first_step: int = 0  # lowest step not reclaimed
    steps: list[Step] = field(default_factory=list)  # steps[i] is step first_step + i
    producers: dict[str, ProducerState] = field(default_factory=dict)
    checkpoints: list[Checkpoint] = field(default_factory=list)  # oldest first
    rewinds: int = 0
    rejected: list[tuple[int, str]] = field(default_factory=list)
    shapes: list[tuple[int, int, int]] = field(default_factory=list)  # (from step, world, batch), rising step
    mixes: list[Mix] = field(default_factory=list)  # rising from step
    leftovers: dict[str, Leftover] = field(default_factory=dict)  # held, by producer
    closed_after: int | None = None  # the stream ends after this step (a `close` record), if closed
    skipped: list[Skipped] = field(default_factory=list)  # TGBs a replay skipped, rising `at`
    jobs: list[str] = field(default_factory=list)  # the training jobs other than `main` known, sorted
    forks: list[Fork] = field(default_factory=list)  # the forks holding this stream's steps, by version
    base: Base | None = None  # a fork's source, until it detaches

    # -- queries -------------------------------------------------------------------------------

    @property
    def head(self) -> int:
        """The newest committed step, or first_step - 1 (-1 for a new stream) when there is none."""
        return self.first_step + len(self.steps) - 1

    @property
    def watermark(self) -> int:
        """The oldest retained checkpoint's step, of any job; -1 with no checkpoint (nothing reclaimable)."""
        return min(c.step for c in self.checkpoints) if self.checkpoints else -1

    @property
    def reclaimable(self) -> int:
        """The step below which steps may be reclaimed: the watermark, or lower where a fork holds
        steps from a lower one; -1 with no checkpoint."""
        return min([self.watermark] + [f.hold for f in self.forks]) if self.checkpoints else -1

    @property
    def fork_floor(self) -> int:
        """The lowest step no rewind or new global batch may change: every fork's steps lie below it."""
        return max((f.at_step for f in self.forks), default=0)

    def shape_at(self, step: int) -> tuple[int, int]:
        """(world size, global batch) of `step`: the newest reshape from `step` or before, else the config's."""
        assert self.config is not None
        i = bisect.bisect_right(self.shapes, (step, 1 << 62, 0))
        if not i:
            return self.config.world_size, self.config.global_batch
        _, world, batch = self.shapes[i - 1]
        return world, batch

    def mix_at(self, step: int) -> Mix | None:
        """The mixture in force at `step`: the newest mix from `step` or before, if any and not a
        cleared one (empty weights). None: TGBs at `step` name no mix, as before the first one."""
        i = bisect.bisect_right([m.from_step for m in self.mixes], step)
        return self.mixes[i - 1] if i and self.mixes[i - 1].weights else None

    def first_batch_change(self, from_step: int, batch: int) -> int | None:
        """The first step from `from_step` on whose global batch a reshape from `from_step` to
        `batch` would change (it replaces every shape from `from_step` on), or None."""
        if self.batch_at(from_step) != batch:
            return from_step
        return next((step for step, _, b in self.shapes if step > from_step and b != batch), None)

    def world_at(self, step: int) -> int:
        """The number of ranks `step` is read as."""
        return self.shape_at(step)[0]

    def batch_at(self, step: int) -> int:
        """The most samples `step` may hold."""
        return self.shape_at(step)[1]

    def checkpoints_of(self, job: str) -> list[Checkpoint]:
        """The retained checkpoints of training job `job`, oldest first."""
        return [c for c in self.checkpoints if c.job == job]

    def knows_job(self, job: str) -> bool:
        """Whether `job` is a training job of this stream: `main`, or one a record named since."""
        return job == MAIN_JOB or job in self.jobs

    def step(self, n: int) -> Step | None:
        i = n - self.first_step
        return self.steps[i] if 0 <= i < len(self.steps) else None

    @property
    def ended(self) -> bool:
        """The stream is closed and its head reached the close: no step will follow the head."""
        return self.closed_after is not None and self.head >= self.closed_after

    def unfinished(self, but: str | None = None) -> list[str]:
        """The producers still producing (no `finish` since they registered), `but` aside: who the
        held leftovers wait for."""
        return sorted(pid for pid, p in self.producers.items() if not p.finished and pid != but)

    # -- the transition function ---------------------------------------------------------------

    def apply(self, version: int, data: bytes) -> str | None:
        """Apply the record stored at `version`; None if it took effect, else why it was a no-op.

        `version` must be `self.version + 1`. Deterministic; never raises for bad record bytes.
        """
        if version != self.version + 1:
            raise ValueError(f"apply: version {version} does not follow {self.version}")
        try:
            record = decode_record(data)
            if isinstance(record, GroupRecord):
                why = self._apply_group(version, record)
            else:
                self._validate(version, record)
                self._apply(version, record)
                why = None
        except (_Reject, RecordError) as e:
            why = str(e)
            self.rejected.append((version, why))
        self.version = version
        return why

    def _apply_group(self, version: int, group: GroupRecord) -> str | None:
        """Each record of the group in order, each a no-op by itself where it is not valid."""
        whys = []
        for i, r in enumerate(group.records):
            try:
                self._validate(version, r)
                self._apply(version, r)
            except _Reject as e:
                whys.append(why := f"group record {i}: {e}")
                self.rejected.append((version, why))
        return "; ".join(whys) or None

    def rules_digest(self) -> int:
        """A digest of what decides where a producer's TGB may go, besides the producers and the
        head: the rewinds, shapes, mixtures and the close (the tail hint carries it, so that a
        producer starting from a snapshot knows whether the versions after it changed them)."""
        mixes = [(m.from_step, m.version) for m in self.mixes]
        return zlib.crc32(orjson.dumps([self.rewinds, self.shapes, mixes, self.closed_after]))

    def landings(self, versions: int, most: int = 1024) -> tuple[int, dict[str, int]]:
        """(since, landed): for each producer with a TGB in a version after `since`, the newest
        such version; `since` is `versions` before this version, or later where more than `most`
        producers landed (for the tail hint: a combining producer reads that version alone)."""
        since, landed = max(-1, self.version - versions), dict[str, int]()
        for s in reversed(self.steps):
            if s.version <= since:
                break
            if s.producer not in landed:
                if len(landed) == most:
                    since = s.version
                    break
                landed[s.producer] = s.version
        return since, {pid: v for pid, v in landed.items() if v > since}

    def resume_of(self, producer: str) -> Resume:
        """Where a new incarnation of `producer` registered now resumes (`RegisterRecord.resume`):
        its last committed seq, its cursor (before its held leftover, which goes back to its source)
        and the global batch after the head."""
        p, held = self.producers.get(producer), self.leftovers.get(producer)
        cursor = held.before if held is not None else p.cursor if p is not None else None
        return Resume(p.seq if p is not None else -1, cursor, self.batch_at(self.head + 1))

    def take(self, record: RegisterRecord | CommitRecord) -> str | None:
        """Apply `record` as part of the group being built for the next version (the version does
        not move); None if it took effect, else why it would be a no-op there (nothing changes)."""
        try:
            self._validate(self.version + 1, record)
        except _Reject as e:
            return str(e)
        self._apply(self.version + 1, record)
        return None

    def check(self, record: Record) -> str | None:
        """Why `record` would be a no-op at the next version (for a group: any of its records), or
        None if it would take effect."""
        if isinstance(record, GroupRecord):
            scratch = self.copy()
            for i, r in enumerate(record.records):
                if (why := scratch.take(r)) is not None:
                    return f"group record {i}: {why}"
            return None
        try:
            self._validate(self.version + 1, record)
        except _Reject as e:
            return str(e)
        return None

    def _validate(self, version: int, r: Record) -> None:
        """Is the (well-formed) record valid at `version`? Raises _Reject saying why not."""
        if version == 0 or isinstance(r, CreateRecord):
            _need(version == 0 and isinstance(r, CreateRecord), "version 0 must be a create record")
            assert isinstance(r, CreateRecord)
            if r.fork is not None:
                _forked(r)
            return
        _need(self.config is not None, "stream has no valid create record")
        assert self.config is not None
        if isinstance(r, RegisterRecord):
            prev = self.producers.get(r.producer)
            want = (prev.epoch if prev else 0) + 1
            _need(r.epoch == want, f"register {r.producer}: epoch {r.epoch!r} is not {want}")
            if r.resume is not None:
                _need(r.resume == self.resume_of(r.producer), f"register {r.producer}: not where it resumes")
        elif isinstance(r, CommitRecord):
            self._validate_commit(r, self.config)
            if r.packs:
                self._validate_packs(r)
        elif isinstance(r, FinishRecord):
            self._validate_finish(r)
        elif isinstance(r, CheckpointRecord):
            cid, step = r.id, r.step
            _need(self.first_step <= step <= self.head, f"checkpoint {cid}: step {step} is not retained")
            mine = self.checkpoints_of(r.job)
            for c in mine:
                _need(c.id != cid, f"checkpoint {cid}: id already recorded at step {c.step}")
            _need(not mine or step >= mine[-1].step,
                  f"checkpoint {cid}: step {step} is older than the newest checkpoint")  # fmt: skip
            _need(self.knows_job(r.job) or len(self.jobs) < MAX_JOBS, f"checkpoint {cid}: {MAX_JOBS} jobs already")
        elif isinstance(r, ReleaseRecord):
            _need(any((c.job, c.id) == (r.job, r.id) for c in self.checkpoints), f"release: no checkpoint {r.id!r}")
        elif isinstance(r, JobRecord):
            _need(r.job != MAIN_JOB, "job: the main job is always known (release its checkpoints instead)")
            if r.retire:
                _need(r.job in self.jobs, f"job: no job {r.job!r} to retire")
            else:
                _need(r.job not in self.jobs, f"job: {r.job!r} is known already")
                _need(len(self.jobs) < MAX_JOBS, f"job {r.job}: {MAX_JOBS} jobs already")
        elif isinstance(r, ReclaimRecord):
            _need(r.below > self.first_step, f"reclaim: steps below {r.below} are already gone")
            _need(r.below <= self.watermark, f"reclaim: step {r.below} is above the watermark {self.watermark}")
            _need(r.below <= self.reclaimable, f"reclaim: a fork holds the steps from {self.reclaimable}")
        elif isinstance(r, RewindRecord):
            _need(self.first_step - 1 <= r.to_step <= self.head, f"rewind: step {r.to_step} is not retained")
            _need(r.to_step >= self.fork_floor - 1, f"rewind: a fork holds the steps up to {self.fork_floor - 1}")
            _need(not r.skip or r.skip[-1][1] <= self.head, f"rewind: skips steps after the head {self.head}")
        elif isinstance(r, CloseRecord):
            _need(self.closed_after is None, f"close: the stream is closed already after step {self.closed_after}")
            _need(r.after_step >= self.head, f"close: step {r.after_step} is before the head {self.head}")
        elif isinstance(r, ReopenRecord):
            _need(self.closed_after is not None, "reopen: the stream is not closed")
        elif isinstance(r, MixRecord):
            _need(r.from_step > self.head, f"mix: step {r.from_step} is committed (the head is {self.head})")
        elif isinstance(r, ReshapeRecord):
            _need(r.from_step >= self.first_step, f"reshape: step {r.from_step} was reclaimed")
            change = self.first_batch_change(r.from_step, r.global_batch)
            _need(change is None or change <= self.head + 1,
                  f"reshape: it changes the global batch of step {change}; a new global batch applies from at "
                  f"most the step after the head ({self.head + 1})")  # fmt: skip
            _need(change is None or change >= self.fork_floor,
                  f"reshape: it changes the global batch of step {change}; a fork holds the steps up to "
                  f"{self.fork_floor - 1}")  # fmt: skip
        elif isinstance(r, ForkRecord):
            _need(self.base is None or not self.base.epochs, "fork: this stream is a fork that reads its source")
            _need(self.first_step <= r.at_step <= self.head + 1,
                  f"fork: step {r.at_step} is not from the first step {self.first_step} to the head + 1")  # fmt: skip
            _need(all(f.url != r.url for f in self.forks), f"fork: {r.url} is a fork already")
            _need(len(self.forks) < MAX_FORKS, f"fork: {MAX_FORKS} forks already")
        elif isinstance(r, UnforkRecord):
            _need(any(f.url == r.url for f in self.forks), f"unfork: {r.url} is not a fork of this stream")
        elif isinstance(r, DetachRecord):
            _need(
                self.base is not None and bool(self.base.epochs),
                "detach: this stream is not a fork that reads a source",
            )

    def _incarnation(self, kind: str, pid: str, epoch: int) -> ProducerState:
        """The producer a `kind` record of `pid` at `epoch` writes for: registered, that epoch current."""
        p = self.producers.get(pid)
        _need(p is not None, f"{kind}: producer {pid!r} is not registered")
        assert p is not None
        _need(epoch == p.epoch, f"{kind} {pid}: epoch {epoch!r} is fenced by {p.epoch}")
        return p

    def _validate_commit(self, r: CommitRecord, config: Config) -> None:
        pid = r.producer
        p = self._incarnation("commit", pid, r.epoch)
        _need(r.seq == p.seq + 1, f"commit {pid}: seq {r.seq!r} is not the next ({p.seq + 1})")
        _need(self.closed_after is None or self.head + len(r.tgbs) <= self.closed_after,
              f"commit {pid}: the stream is closed after step {self.closed_after}")  # fmt: skip
        for i, t in enumerate(r.tgbs):
            # Each TGB's own key: never one committed before (its seq would be committed already).
            _need(_segment_of(t.segment, pid, r.epoch, r.seq + i),
                  f"commit {pid}: segment {t.segment!r:.200} is not a key of its TGB "
                  f"({segment_prefix(pid, r.epoch, r.seq + i)}….tgb)")  # fmt: skip
            # A TGB holds the rank slices of the world size it was sealed for; a step read as
            # another world size is re-sliced on read (`_batching.reslice`).
            _need(len(t.ranks) <= LIMITS["world_size"][1], f"commit {pid}: {len(t.ranks)} rank slices")
            # Slices tile the segment from offset 0 in rank order (as the codec writes them), hold at
            # most a global batch, and have checksums of their width: whatever reads them may rely on it.
            batch = self.batch_at(self.head + 1 + i)
            samples = _tiled_samples(t, f"commit {pid}")
            _need(0 < samples <= batch, f"commit {pid}: a TGB of {samples} samples (global batch {batch})")
            self._validate_mix(pid, self.head + 1 + i, t, samples, batch)

    def _validate_finish(self, r: FinishRecord) -> None:
        pid = r.producer
        p = self._incarnation("finish", pid, r.epoch)
        _need(not p.finished, f"finish {pid}: epoch {p.epoch} already finished")
        _need(r.head == self.head, f"finish {pid}: head {r.head} is not the head {self.head}")
        t = r.leftover
        if t is None:
            _need(r.seq == p.seq, f"finish {pid}: seq {r.seq!r} is not the committed one ({p.seq})")
            return
        _need(r.seq == p.seq + 1, f"finish {pid}: seq {r.seq!r} is not the next ({p.seq + 1})")
        assert r.cursors is not None
        offset, length, crc, n = t.ranks[0]
        step, batch = self.head + 1, self.batch_at(self.head + 1)
        _need(
            offset == 0 and length < 1 << 62 and crc < 1 << CHECKSUM_BITS[t.checksum],
            f"finish {pid}: bad leftover slice {list(t.ranks[0])}",
        )
        _need(_segment_of(t.segment, pid, r.epoch, r.seq),
              f"finish {pid}: segment {t.segment!r:.200} is not a key of its leftover (segments/{pid}/{r.epoch}-{r.seq}-….tgb)")  # fmt: skip
        _need(0 < n < batch, f"finish {pid}: a leftover of {n} samples (global batch {batch})")
        at, size, crc = r.cursors
        _need(at == length and size < 1 << 62 and crc < 1 << 32, f"finish {pid}: bad cursors {list(r.cursors)}")
        self._validate_mix(pid, step, t, n, batch)

    def _validate_packs(self, r: CommitRecord) -> None:
        """A commit that packs held leftovers: each named one is held, and the TGBs hold a prefix of
        each one's samples (all of them, unless the packer dropped the rest) and nothing else."""
        pid = r.producer
        packs = dict(r.packs)
        for owner, segment in r.packs:
            held = self.leftovers.get(owner)
            _need(held is not None and held.ref.segment == segment,
                  f"commit {pid}: the leftover {segment} of {owner!r} is not held (packed already, or given back)")  # fmt: skip
        taken: dict[str, int] = {}
        last: dict[str, Any] = {}
        for t in r.tgbs:
            assert t.packed is not None
            samples = sum(x[3] for x in t.ranks)
            _need(sum(n for _, n, _ in t.packed) == samples,
                  f"commit {pid}: a packed TGB of {samples} samples names {t.packed!r:.200}")  # fmt: skip
            for owner, n, cursor in t.packed:
                _need(
                    owner in packs, f"commit {pid}: a TGB holds samples of {owner!r}, whose leftover it does not pack"
                )
                taken[owner] = taken.get(owner, 0) + n
                last[owner] = cursor
        for owner in packs:
            held = self.leftovers[owner]
            got = taken.get(owner, 0)
            _need(got <= held.samples, f"commit {pid}: {got} samples of {owner!r}'s leftover of {held.samples}")
            _need(got < held.samples or last[owner] == held.ref.cursor,
                  f"commit {pid}: {owner!r}'s cursor after its whole leftover is not the leftover's")  # fmt: skip

    def _validate_mix(self, pid: str, step: int, t: TgbRef, samples: int, batch: int) -> None:
        """Under a mixture a TGB names the mix it was sealed for and holds each source's share; under
        none (before the first mix, or from a cleared one on) it names no mix."""
        m = self.mix_at(step)
        if m is None:
            _need(t.mix is None, f"commit {pid}: a TGB sealed for mix version {t.mix} at step {step}, under no mix")
            return
        _need(
            t.mix == m.version, f"commit {pid}: a TGB sealed for mix version {t.mix} at step {step} (mix {m.version})"
        )
        shares = mix_counts(m.weights, batch)
        got = dict(t.sources or ())
        _need(sum(got.values()) == samples and all(got.get(n, 0) <= c for n, c in shares.items())
              and got.keys() <= shares.keys() and (samples < batch or got == {n: c for n, c in shares.items() if c}),
              f"commit {pid}: a TGB with sources {t.sources!r:.200} at step {step} is not the mix's shares")  # fmt: skip

    def _apply(self, version: int, r: Record) -> None:
        """Apply a record already validated at `version`."""
        if isinstance(r, CreateRecord):
            if r.fork is not None:  # validated: a snapshot's members at version 0
                base = _state_from_dict(dict(r.fork.state))
                for name in State.__dataclass_fields__:
                    setattr(self, name, getattr(base, name))
                self.base = Base(r.fork.source, r.fork.at_step, {pid: p.epoch for pid, p in self.producers.items()})
            self.config = r.config
        elif isinstance(r, RegisterRecord):
            p = self.producers.setdefault(r.producer, ProducerState())
            p.epoch, p.token, p.last_ts = r.epoch, r.token, r.ts
            p.finished = False
            # A held leftover goes back to its source: the new incarnation produces it again, so a
            # producer's held samples are always its newest (what a rewind's cursors rely on).
            if (held := self.leftovers.pop(r.producer, None)) is not None:
                p.cursor = held.before
        elif isinstance(r, FinishRecord):
            p = self.producers[r.producer]
            p.finished, p.last_ts = True, r.ts
            if r.leftover is not None:
                assert r.cursors is not None
                self.leftovers[r.producer] = Leftover(r.leftover, r.cursors, p.cursor)
                p.seq, p.cursor = r.seq, r.leftover.cursor
                p.tgbs += 1
        elif isinstance(r, CommitRecord):
            p = self.producers[r.producer]
            for owner, _ in r.packs:
                held = self.leftovers.pop(owner)
                self.producers[owner].cursor = held.before  # unless some of its samples are packed (below)
            for i, t in enumerate(r.tgbs):
                self.steps.append(
                    Step(
                        step=self.head + 1,
                        version=version,
                        segment=t.segment,
                        producer=r.producer,
                        epoch=r.epoch,
                        seq=r.seq + i,
                        ranks=rank_slices(t.ranks),
                        cursor=t.cursor,
                        ts=r.ts,
                        checksum=t.checksum,
                        packed=t.packed,
                    )  # fmt: skip
                )
                if t.packed is None:
                    p.cursor = t.cursor
                for owner, _, after in t.packed or ():  # a packing commit leaves the packer's own cursor alone
                    self.producers[owner].cursor = after
            p.seq = r.seq + len(r.tgbs) - 1
            p.last_ts = r.ts
            p.lost = r.lost
            p.commits += 1
            p.tgbs += len(r.tgbs)
        elif isinstance(r, CheckpointRecord):
            self.checkpoints.append(Checkpoint(r.id, r.step, version, r.job))
            if not self.knows_job(r.job):
                bisect.insort(self.jobs, r.job)
            assert self.config is not None
            keep = self.config.keep_checkpoints
            if keep and len(mine := self.checkpoints_of(r.job)) > keep:  # the job's oldest ones go
                old = {id(c) for c in mine[:-keep]}
                self.checkpoints = [c for c in self.checkpoints if id(c) not in old]
        elif isinstance(r, ReleaseRecord):
            self.checkpoints = [c for c in self.checkpoints if (c.job, c.id) != (r.job, r.id)]
        elif isinstance(r, JobRecord):
            if r.retire:
                self.jobs.remove(r.job)
                self.checkpoints = [c for c in self.checkpoints if c.job != r.job]
            else:
                bisect.insort(self.jobs, r.job)
        elif isinstance(r, ReclaimRecord):
            self._reclaim(r.below)
        elif isinstance(r, ForkRecord):
            self.forks.append(Fork(r.url, r.at_step, self.first_step, version))
        elif isinstance(r, UnforkRecord):
            self.forks = [f for f in self.forks if f.url != r.url]
        elif isinstance(r, DetachRecord):
            assert self.base is not None
            below = next((s.step for s in self.steps if not self.base.holds(s)), self.head + 1)
            self.skipped = [k for k in self.skipped if not self.base.holds(k.step)]
            self.checkpoints = [c for c in self.checkpoints if c.step >= below]
            self._reclaim(below)
            self.base = Base(self.base.source, self.base.at_step, {})  # the source is named still: it may hold steps
        elif isinstance(r, RewindRecord):
            if r.skip:
                self._replay_after(version, r.to_step, r.skip)
            else:
                self._discard_after(r.to_step)
        elif isinstance(r, CloseRecord):
            self.closed_after = r.after_step
        elif isinstance(r, ReopenRecord):
            self.closed_after = None
        elif isinstance(r, MixRecord):
            self.mixes = [m for m in self.mixes if m.from_step < r.from_step] + [Mix(r.from_step, version, r.weights)]
        elif isinstance(r, ReshapeRecord):
            change = self.first_batch_change(r.from_step, r.global_batch)
            self.shapes = [x for x in self.shapes if x[0] < r.from_step] + [(r.from_step, r.world_size, r.global_batch)]
            if change is not None:  # no step keeps a batch other than the one it was sealed for
                self._discard_after(change - 1)

    def _reclaim(self, below: int) -> None:
        """Drop the steps below `below` (and the skipped TGBs before them)."""
        gone = [k for k in self.skipped if k.at < below]
        for s in _in_order(self.steps[: below - self.first_step], gone):
            for pid, cursor in s.cursors():
                self.producers[pid].base_cursor = cursor
        del self.steps[: below - self.first_step]
        del self.skipped[: len(gone)]
        self.first_step = below
        # Shapes of reclaimed steps only: keep the one in force at first_step and what follows.
        while len(self.shapes) > 1 and self.shapes[1][0] <= self.first_step:
            del self.shapes[0]
        while len(self.mixes) > 1 and self.mixes[1].from_step <= self.first_step:
            del self.mixes[0]

    def fork_at(self, at_step: int) -> State:
        """The state a fork of this stream at `at_step` starts from (at version 0): the steps below
        `at_step`, every producer fenced and resuming from its cursor there, nothing else of this
        stream's (checkpoints, jobs, forks, held leftovers, the close). Every version it names is 0."""
        assert (self.base is None or not self.base.epochs) and self.first_step <= at_step <= self.head + 1
        st = self.copy()
        st._discard_after(at_step - 1)
        zero = functools.partial(dataclasses.replace, version=0)
        st.steps = [zero(s) for s in st.steps]
        st.skipped = [Skipped(k.at, zero(k.step)) for k in st.skipped]
        st.mixes = [zero(m) for m in st.mixes]
        st.version, st.checkpoints, st.rejected, st.jobs, st.forks = 0, [], [], [], []
        st.closed_after, st.base = None, None
        return st

    def _discard_after(self, to_step: int) -> None:
        """Discard the steps after `to_step` and fence every producer (a rewind)."""
        del self.steps[to_step + 1 - self.first_step :]
        self.checkpoints = [c for c in self.checkpoints if c.step <= to_step]
        self.skipped = [k for k in self.skipped if k.at < to_step]  # what follows step to_step is produced again
        self.rewinds += 1
        # Every producer is fenced and resumes from its cursor as of step `to_step`: that of its
        # newest retained (or skipped) TGB, or of the newest one holding its packed leftover samples.
        # Held leftovers are dropped (their producers produce them again).
        self.leftovers = {}
        last: dict[str, Any] = {}
        for s in _in_order(self.steps, self.skipped):
            last.update(s.cursors())
        for pid, p in self.producers.items():
            cursor = last.get(pid, p.base_cursor)
            p.epoch += 1
            p.token = ""
            p.finished = p.finished and cursor == p.cursor  # still done only if nothing of it was discarded
            p.cursor = cursor
            # Sequence numbers keep rising so that discarded TGBs are never mistaken for new ones.

    def _replay_after(self, version: int, to_step: int, skip: tuple[tuple[int, int], ...]) -> None:
        """Append the TGBs of the steps after `to_step` again as new steps, but those of `skip` (a replay)."""
        skipped = [n for a, b in skip for n in range(a, b + 1)]  # steps of a validated record: at most the head's
        cut = to_step + 1 - self.first_step
        rest, self.steps = self.steps[cut:], self.steps[:cut]
        self.checkpoints = [c for c in self.checkpoints if c.step <= to_step]
        self.rewinds += 1
        gone, after = set(skipped), [k for k in self.skipped if k.at >= to_step]
        del self.skipped[len(self.skipped) - len(after) :]
        k = 0
        for s in rest:  # skipped before, in their place, then each step replayed or skipped
            while k < len(after) and after[k].at < s.step:
                self.skipped.append(Skipped(self.head, after[k].step))
                k += 1
            if s.step in gone:
                self.skipped.append(Skipped(self.head, s))
            else:
                self.steps.append(dataclasses.replace(s, step=self.head + 1, version=version))
        self.skipped += [Skipped(self.head, x.step) for x in after[k:]]

        def moved(step: int) -> int:  # where the step now at `step` (or the first one after it) goes
            return step - bisect.bisect_left(skipped, step) if step > to_step else step

        shapes: dict[int, tuple[int, int, int]] = {}
        for f, world, batch in self.shapes:  # of two that now start at the same step, the later holds
            shapes[moved(f)] = (moved(f), world, batch)
        self.shapes = list(shapes.values())
        mixes: dict[int, Mix] = {}
        for m in self.mixes:
            mixes[moved(m.from_step)] = Mix(moved(m.from_step), m.version, m.weights)
        self.mixes = list(mixes.values())
        if self.closed_after is not None:
            self.closed_after = moved(self.closed_after + 1) - 1

    def copy(self) -> State:
        """An independent copy; O(steps) pointer copies, steps themselves are immutable."""
        return State(
            version=self.version, config=self.config, first_step=self.first_step, steps=list(self.steps),
            producers={k: ProducerState(**v.to_dict()) for k, v in self.producers.items()},
            checkpoints=[Checkpoint(c.id, c.step, c.version, c.job) for c in self.checkpoints],
            rewinds=self.rewinds, rejected=list(self.rejected), shapes=list(self.shapes),
            mixes=list(self.mixes), leftovers=dict(self.leftovers), closed_after=self.closed_after,
            skipped=list(self.skipped), jobs=list(self.jobs), forks=list(self.forks), base=self.base,
        )  # fmt: skip

    # -- snapshots -----------------------------------------------------------------------------

    def to_json(self) -> bytes:
        """The whole state as a snapshot: deterministic bytes, sealed with a checksum.

        The bytes are `to_dict()` as compact JSON with sorted keys, plus a last member `sha256`:
        the hex SHA-256 of those bytes (`from_json` recomputes it over what it parsed).
        """
        body = orjson.dumps(self.to_dict(), option=orjson.OPT_SORT_KEYS)
        return body[:-1] + b',"sha256":"' + hashlib.sha256(body).hexdigest().encode() + b'"}'

    def to_dict(self) -> dict[str, Any]:
        return (
            {
                "version": self.version,
                "config": self.config.to_dict() if self.config else None,
                "first_step": self.first_step,
                "steps": [s.to_list() for s in self.steps],
                "producers": {k: self.producers[k].to_dict() for k in sorted(self.producers)},
                "checkpoints": [
                    [c.id, c.step, c.version] + ([c.job] if c.job != MAIN_JOB else []) for c in self.checkpoints
                ],
                "rewinds": self.rewinds,
                "rejected": [list(x) for x in self.rejected],
            }
            | ({"shapes": [list(x) for x in self.shapes]} if self.shapes else {})
            | (  # absent when never reshaped
                {"mixes": [[m.from_step, m.version, [list(w) for w in m.weights]] for m in self.mixes]}
                if self.mixes
                else {}
            )
            | (  # absent when nothing is held
                {"leftovers": {k: self.leftovers[k].to_list() for k in sorted(self.leftovers)}}
                if self.leftovers
                else {}
            )
            | ({"closed_after": self.closed_after} if self.closed_after is not None else {})  # absent unless closed
            | ({"skipped": [k.to_list() for k in self.skipped]} if self.skipped else {})  # absent unless skipped
            | ({"jobs": list(self.jobs)} if self.jobs else {})  # absent while `main` is the only job
            | ({"forks": [[f.url, f.at_step, f.hold, f.version] for f in self.forks]} if self.forks else {})
            | (
                {"base": self.base.to_dict()} if self.base is not None else {}
            )  # absent unless a fork reading its source
        )

    @classmethod
    def from_json(cls, data: bytes) -> State:
        """The state a snapshot holds. Raises ValueError (only) for anything that is not one.

        A snapshot with a `sha256` member must match it: the SHA-256 of the object without that
        member, as compact JSON with sorted keys. One without it (written before snapshots were
        sealed) is accepted on its structure alone. Either way every field is checked for type and
        range, and the invariants `apply` keeps are checked in O(steps): steps contiguous from
        `first_step`, each naming a known producer with rising sequence numbers and the stream's
        rank slices, checkpoints on retained steps, nothing newer than `version`.
        """
        try:
            d = orjson.loads(data)
        except orjson.JSONDecodeError as e:
            raise ValueError(f"not a snapshot: not JSON ({e})") from None
        if not isinstance(d, dict):
            raise ValueError("not a snapshot: not a JSON object")
        if "sha256" in d:
            seal = d.pop("sha256")
            try:
                body = orjson.dumps(d, option=orjson.OPT_SORT_KEYS)
            except orjson.JSONEncodeError as e:  # pragma: no cover - what orjson parsed, it writes
                raise ValueError(f"not a snapshot: {e}") from None
            if seal != hashlib.sha256(body).hexdigest():
                raise ValueError("snapshot checksum mismatch: its sha256 does not match its content")
        return _state_from_dict(d)

    def check_last_record(self, data: bytes) -> str | None:
        """Why this state cannot be the result of applying `data` (the log record at its version)
        last, or None if it agrees with it.

        This is how a snapshot is cross-checked against the log (`_manifest`): O(record) and one GET,
        not a replay. It checks what the record at `version` did: a commit's TGBs are the last
        steps (so a snapshot that drops or alters the newest steps is caught whenever its version
        is a commit, which is where producers snapshot), a register's epoch and token, a
        checkpoint, a release, a reclaim's first step, a rewind's head; a record this state
        rejected must be its newest rejection.
        """
        v = self.version
        if self.rejected and self.rejected[-1][0] == v:
            return None  # a no-op at v: nothing more to compare without the state before it
        try:
            r = decode_record(data)
        except RecordError as e:
            return f"the record at version {v} is malformed ({e}), which this state did not reject"
        if isinstance(r, GroupRecord):
            return self._check_group(r)
        if isinstance(r, CreateRecord):
            ok = v == 0 and self.config == r.config
            ok = ok and (
                not self.steps if r.fork is None else self.base is not None and self.head == r.fork.at_step - 1
            )
        elif isinstance(r, ForkRecord):
            ok = any((f.url, f.at_step, f.version) == (r.url, r.at_step, v) for f in self.forks)
        elif isinstance(r, UnforkRecord):
            ok = all(f.url != r.url for f in self.forks)
        elif isinstance(r, DetachRecord):
            ok = self.base is not None and not self.base.epochs
        elif isinstance(r, RegisterRecord):
            p = self.producers.get(r.producer)
            ok = p is not None and (p.epoch, p.token, p.last_ts) == (r.epoch, r.token, r.ts)
        elif isinstance(r, FinishRecord):
            p, held = self.producers.get(r.producer), self.leftovers.get(r.producer)
            ok = (
                p is not None and p.finished and p.epoch == r.epoch and p.last_ts == r.ts and p.seq == r.seq
                and self.head == r.head
                and (r.leftover is None or (held is not None and held.ref == r.leftover and p.cursor == r.leftover.cursor))
            )  # fmt: skip
        elif isinstance(r, CommitRecord):
            p, n = self.producers.get(r.producer), len(r.tgbs)
            tail = self.steps[-n:] if n <= len(self.steps) else []
            ok = (
                p is not None and len(tail) == n and p.seq == r.seq + n - 1
                and (bool(r.packs) or p.cursor == r.tgbs[-1].cursor) and p.lost == r.lost
                and all(owner not in self.leftovers for owner, _ in r.packs)
                and (n == len(self.steps) or self.steps[-n - 1].version < v)
                and all(
                    (s.version, s.producer, s.epoch, s.seq, s.segment, s.ts, s.cursor, s.checksum, s.packed)
                    == (v, r.producer, r.epoch, r.seq + i, t.segment, r.ts, t.cursor, t.checksum, t.packed)
                    and tuple((x.offset, x.length, x.digest, x.samples) for x in s.ranks) == t.ranks
                    for i, (s, t) in enumerate(zip(tail, r.tgbs, strict=True))
                )
            )  # fmt: skip
        elif isinstance(r, CheckpointRecord):
            last = self.checkpoints[-1] if self.checkpoints else None
            ok = last is not None and (last.id, last.step, last.version, last.job) == (r.id, r.step, v, r.job)
        elif isinstance(r, ReleaseRecord):
            ok = all((c.job, c.id) != (r.job, r.id) for c in self.checkpoints)
        elif isinstance(r, JobRecord):
            ok = (r.job in self.jobs) != r.retire and (not r.retire or not self.checkpoints_of(r.job))
        elif isinstance(r, ReclaimRecord):
            ok = self.first_step == r.below
        elif isinstance(r, MixRecord):
            ok = bool(self.mixes) and self.mixes[-1] == Mix(r.from_step, v, r.weights)
        elif isinstance(r, ReshapeRecord):
            ok = bool(self.shapes) and self.shapes[-1] == (r.from_step, r.world_size, r.global_batch)
        elif isinstance(r, CloseRecord):
            ok = self.closed_after == r.after_step
        elif isinstance(r, ReopenRecord):
            ok = self.closed_after is None
        elif r.skip:
            tail = self.steps[r.to_step + 1 - self.first_step :]
            ok = all(s.version == v for s in tail) and any(k.at >= r.to_step for k in self.skipped)
        else:
            ok = self.head == r.to_step and all(p.token == "" for p in self.producers.values())
        return None if ok else f"the state does not reflect the {r.kind} record at version {v}"

    def _check_group(self, g: GroupRecord) -> str | None:
        """A group every record of which took effect: its commits' TGBs are the last steps, in its
        order, and each producer whose last record in it is a register has that incarnation."""
        v = self.version
        want = [(r, i) for r in g.records if isinstance(r, CommitRecord) for i in range(len(r.tgbs))]
        tail = self.steps[-len(want) :] if 0 < len(want) <= len(self.steps) else []
        ok = len(tail) == len(want) and (
            len(want) == len(self.steps) or not want or self.steps[-len(want) - 1].version < v
        )
        ok = ok and all(
            (s.version, s.producer, s.epoch, s.seq, s.segment, s.ts, s.cursor, s.checksum)
            == (v, r.producer, r.epoch, r.seq + i, r.tgbs[i].segment, r.ts, r.tgbs[i].cursor, r.tgbs[i].checksum)
            and tuple((x.offset, x.length, x.digest, x.samples) for x in s.ranks) == r.tgbs[i].ranks
            for s, (r, i) in zip(tail, want, strict=False)
        )
        last = {r.producer: r for r in g.records}
        for pid, r in last.items():
            p = self.producers.get(pid)
            if isinstance(r, RegisterRecord):
                ok = ok and p is not None and (p.epoch, p.token) == (r.epoch, r.token)
            else:
                ok = ok and p is not None and p.seq == r.seq + len(r.tgbs) - 1 and p.cursor == r.tgbs[-1].cursor
        return None if ok else f"the state does not reflect the group record at version {v}"


# -- snapshot validation ---------------------------------------------------------------------------

_STATE_KEYS = frozenset({"version", "config", "first_step", "steps", "producers", "checkpoints", "rewinds", "rejected"})
_PRODUCER_KEYS = frozenset(ProducerState.__dataclass_fields__)
_CONFIG_KEYS = frozenset(Config.__dataclass_fields__)


def _bad(why: str) -> ValueError:
    return ValueError(f"invalid snapshot: {why}")


def _state_from_dict(d: dict[str, Any]) -> State:
    """A State from a snapshot's parsed JSON, checking every field; raises ValueError.

    O(steps x world size); messages are only formatted for the field that fails.
    """
    if d.keys() - {"shapes", "mixes", "leftovers", "closed_after", "skipped", "jobs", "forks", "base"} != _STATE_KEYS:
        raise _bad(f"members {sorted(d)!r:.200} are not {sorted(_STATE_KEYS)}")
    version, first, rewinds = d["version"], d["first_step"], d["rewinds"]
    for name, v in (("version", version), ("first_step", first), ("rewinds", rewinds)):
        if not _int(v):
            raise _bad(f"{name} {v!r:.40} is not a non-negative integer")
    raw = d["config"]
    if not (isinstance(raw, dict) and raw.keys() <= _CONFIG_KEYS):
        raise _bad(f"config {raw!r:.200} is not a stream config")
    try:
        config = Config.from_dict(raw)
    except (ValueError, TypeError) as e:
        raise _bad(f"config: {e}") from None

    producers: dict[str, ProducerState] = {}
    if not isinstance(d["producers"], dict):
        raise _bad("producers is not an object")
    for pid, raw in d["producers"].items():
        if not PRODUCER_ID.match(pid):
            raise _bad(f"bad producer id {pid!r:.140}")
        if not (isinstance(raw, dict) and raw.keys() <= _PRODUCER_KEYS):
            raise _bad(f"producer {pid}: {raw!r:.200} is not a producer")
        p = ProducerState(**raw)
        if not (
            _int(p.epoch, 1) and _int(p.seq, -1) and isinstance(p.token, str) and type(p.last_ts) is float
            and _int(p.commits) and _int(p.tgbs) and _int(p.lost) and p.tgbs == p.seq + 1 and p.commits <= p.tgbs
            and type(p.finished) is bool
        ):  # fmt: skip
            raise _bad(f"producer {pid}: bad epoch, seq, token, last_ts, commits, tgbs or lost in {raw!r:.300}")
        producers[pid] = p

    steps: list[Step] = []
    if not isinstance(d["steps"], list):
        raise _bad("steps is not a list")
    last_seq: dict[str, int] = {}
    shapes = _shapes_from(d.get("shapes", []))
    batch_at = State(config=config, shapes=shapes).batch_at
    last_version, world = 0, LIMITS["world_size"][1]  # 0: a fork's steps of its source
    for i, raw in enumerate(d["steps"]):
        n = first + i
        if not (isinstance(raw, list) and len(raw) in (9, 10, 11)):
            raise _bad(f"step {n}: {raw!r:.200} is not a list of 9 to 11 items")
        step, sv, segment, pid, epoch, seq, ranks, cursor, ts, *extra = raw
        checksum = extra[0] if extra else "crc32"
        if len(extra) > 2 or (extra and not (isinstance(checksum, str) and checksum in CHECKSUM_BITS)):
            raise _bad(f"step {n}: unknown checksum {checksum!r:.40}")
        bits = CHECKSUM_BITS[checksum]
        if not (type(step) is int and step == n):
            raise _bad(f"entry {i} is step {step!r:.40}, not {n}: steps are contiguous from first_step {first}")
        if not (_int(sv) and last_version <= sv <= version):
            raise _bad(f"step {n}: version {sv!r:.40} is not in {last_version}..{version}")
        if not (isinstance(segment, str) and segment.startswith("segments/")):
            raise _bad(f"step {n}: bad segment key {segment!r:.200}")
        owner = producers.get(pid) if isinstance(pid, str) else None
        if owner is None:
            raise _bad(f"step {n}: producer {pid!r:.140} is not among the producers")
        if not (_int(epoch, 1) and epoch <= owner.epoch):
            raise _bad(f"step {n}: epoch {epoch!r:.40} is not in 1..{owner.epoch}")
        low = last_seq.get(pid, -1)
        if not (_int(seq) and low < seq <= owner.seq):
            raise _bad(f"step {n}: seq {seq!r:.40} is not in {low + 1}..{owner.seq} of producer {pid}")
        if not _segment_of(segment, pid, epoch, seq):
            raise _bad(f"step {n}: segment {segment!r:.200} is not a key of producer {pid} epoch {epoch} seq {seq}")
        if type(ts) is not float:
            raise _bad(f"step {n}: ts {ts!r:.40} is not a number")
        if not (isinstance(ranks, list) and 0 < len(ranks) <= world):
            raise _bad(f"step {n}: not 1 to {world} rank slices")
        end = samples = 0
        slices = []
        for rs in ranks:
            if type(rs) is not list or len(rs) != 4:
                raise _bad(f"step {n}: bad rank slice {rs!r:.100}")
            off, length, crc, k = rs
            if not (
                type(off) is int and type(length) is int and type(crc) is int and type(k) is int
                and off == end and length >= 0 and 0 <= crc < 1 << bits and k >= 0
            ):  # fmt: skip
                raise _bad(f"step {n}: bad rank slice {rs!r:.100} (slices tile the segment from offset 0)")
            end += length
            samples += k
            slices.append(RankSlice(off, length, crc, k))
        if not 0 < samples <= batch_at(n):
            raise _bad(f"step {n}: {samples} samples (global batch {batch_at(n)})")
        packed = _packed_from(extra[1], producers, samples, n) if len(extra) > 1 else None
        last_seq[pid], last_version = seq, sv
        steps.append(Step(n, sv, segment, pid, epoch, seq, tuple(slices), cursor, ts, checksum, packed))
    head = first + len(steps) - 1

    checkpoints: list[Checkpoint] = []
    if not isinstance(d["checkpoints"], list):
        raise _bad("checkpoints is not a list")
    jobs = d.get("jobs", [])
    if not (isinstance(jobs, list) and len(jobs) <= MAX_JOBS and jobs == sorted(set(jobs))
            and all(isinstance(j, str) and JOB_NAME.fullmatch(j) and j != MAIN_JOB for j in jobs)):  # fmt: skip
        raise _bad(f"jobs {jobs!r:.200} is not a sorted list of distinct job names other than {MAIN_JOB!r}")
    ids: set[tuple[str, str]] = set()
    newest: dict[str, int] = {}  # each job's newest checkpoint's step
    last_version = 0
    for raw in d["checkpoints"]:
        if not (isinstance(raw, list) and len(raw) in (3, 4)):
            raise _bad(f"checkpoint {raw!r:.200} is not [id, step, version] or [id, step, version, job]")
        cid, step, cv, *rest = raw
        job = rest[0] if rest else MAIN_JOB
        if not ((job == MAIN_JOB and not rest) or job in jobs):
            raise _bad(f"checkpoint {cid!r:.300}: job {job!r:.80} is not among the jobs")
        if not (isinstance(cid, str) and 0 < len(cid) <= 256 and (job, cid) not in ids):
            raise _bad(f"bad or repeated checkpoint id {cid!r:.300}")
        low = newest.get(job, first)
        if not (_int(step) and low <= step <= head and _int(cv) and last_version < cv <= version):
            raise _bad(f"checkpoint {cid}: step {step!r:.40} or version {cv!r:.40} out of order or not retained")
        ids.add((job, cid))
        newest[job], last_version = step, cv
        checkpoints.append(Checkpoint(cid, step, cv, job))
    keep = config.keep_checkpoints
    if keep and any(sum(c.job == j for c in checkpoints) > keep for j in newest):
        raise _bad(f"more checkpoints of a job than the {keep} the stream keeps")

    rejected: list[tuple[int, str]] = []
    if not isinstance(d["rejected"], list):
        raise _bad("rejected is not a list")
    for raw in d["rejected"]:
        low = rejected[-1][0] + 1 if rejected else 0
        if not (isinstance(raw, list) and len(raw) == 2 and _int(raw[0]) and low <= raw[0] <= version):
            raise _bad(f"rejection {raw!r:.200} is not [version, why] in version order")
        if not isinstance(raw[1], str):
            raise _bad(f"rejection {raw!r:.200} is not [version, why]")
        rejected.append((raw[0], raw[1]))

    mixes = _mixes_from(d.get("mixes", []), version)
    leftovers = _leftovers_from(d.get("leftovers", {}), producers)
    closed = d.get("closed_after")
    if closed is not None and not (_int(closed, -1) and head <= closed < 1 << 63):
        raise _bad(f"closed_after {closed!r:.40} is not a step from the head {head} on")
    skipped = _skipped_from(d.get("skipped", []), producers, first, head, version)
    forks = _forks_from(d.get("forks", []), first, head, version)
    base = _base_from(d["base"], producers) if "base" in d else None
    return State(
        version, config, first, steps, producers, checkpoints, rewinds, rejected, shapes, mixes, leftovers, closed,
        skipped, jobs, forks, base,
    )  # fmt: skip


def _forks_from(raw: Any, first: int, head: int, version: int) -> list[Fork]:
    """A snapshot's `forks`: [[url, at step, hold, version], …] by rising version, the hold from the
    first step to the fork's step, which is at most the head + 1."""
    if not (isinstance(raw, list) and len(raw) <= MAX_FORKS):
        raise _bad(f"forks is not a list of at most {MAX_FORKS}")
    out: list[Fork] = []
    for x in raw:
        low = out[-1].version if out else 0
        ok = isinstance(x, list) and len(x) == 4 and all(_int(v) for v in x[1:])
        ok = ok and first <= x[2] <= x[1] <= head + 1 and low < x[3] <= version and all(f.url != x[0] for f in out)
        try:
            check_stream_url(x[0] if ok else None)
        except ValueError:
            raise _bad(f"fork {x!r:.200} is not [url, at step, hold, version] after the last") from None
        out.append(Fork(*x))
    return out


def _base_from(raw: Any, producers: dict[str, ProducerState]) -> Base:
    """A fork's `base`: {"source": url, "at_step": step, "epochs": {producer: epoch}}, each epoch at
    most its producer's."""
    ok = isinstance(raw, dict) and raw.keys() == {"source", "at_step", "epochs"} and _int(raw["at_step"])
    epochs = raw.get("epochs") if ok else None
    ok = (
        ok
        and isinstance(epochs, dict)
        and all(pid in producers and _int(e, 1) and e <= producers[pid].epoch for pid, e in epochs.items())
    )
    try:
        check_stream_url(raw["source"] if ok else None)
    except ValueError:
        raise _bad(f"base {raw!r:.200} is not a fork's source, step and epochs") from None
    assert isinstance(epochs, dict)
    return Base(raw["source"], raw["at_step"], dict(epochs))


def _forked(r: CreateRecord) -> None:
    """A fork's create record: its state is a valid snapshot at version 0 of the steps below its
    fork step, with the record's config, every producer fenced, and nothing else of its source's."""
    assert r.fork is not None
    try:
        st = _state_from_dict(dict(r.fork.state))
    except ValueError as e:
        raise _Reject(f"create: fork: {e}") from None
    _need(st.version == 0 and st.config == r.config, "create: fork: its state is not at version 0 with its config")
    _need(st.head == r.fork.at_step - 1, f"create: fork: its state's head {st.head} is not step {r.fork.at_step - 1}")
    _need(
        not (st.checkpoints or st.rejected or st.jobs or st.forks or st.leftovers)
        and st.base is None and st.closed_after is None and all(not p.token for p in st.producers.values()),
        "create: fork: its state holds more than fenced producers, steps, shapes and mixes",
    )  # fmt: skip


def _skipped_from(raw: Any, producers: dict[str, ProducerState], first: int, head: int, version: int) -> list[Skipped]:
    """A snapshot's `skipped`: [[at, step entry], …], `at` rising from first_step - 1 to the head,
    each entry a TGB of a known producer and incarnation at a version before `version`."""
    if not isinstance(raw, list):
        raise _bad("skipped is not a list")
    out: list[Skipped] = []
    for x in raw:
        low = out[-1].at if out else first - 1
        ok = isinstance(x, list) and len(x) == 2 and _int(x[0], -1) and low <= x[0] <= head
        e: Any = x[1] if ok else None
        ok = ok and isinstance(e, list) and len(e) in (9, 10, 11) and all(_int(v) for v in (e[0], e[1], e[4], e[5]))
        ok = ok and (e[1] < version or e[1] == 0) and e[3] in producers and e[5] <= producers[e[3]].seq
        ok = ok and isinstance(e[2], str) and _segment_of(e[2], e[3], e[4], e[5]) and type(e[8]) is float
        ok = ok and isinstance(e[6], list) and 0 < len(e[6]) <= LIMITS["world_size"][1]
        ok = ok and all(type(r) is list and len(r) == 4 and all(_int(v) for v in r) for r in e[6])
        ok = ok and (len(e) < 10 or e[9] in CHECKSUM_BITS)
        if not ok:
            raise _bad(f"skipped {x!r:.200} is not [at, step entry] after the last")
        try:
            step = Step.from_list(e)
        except (TypeError, ValueError, IndexError) as err:
            raise _bad(f"skipped {x!r:.200}: {err}") from None
        out.append(Skipped(x[0], step))
    return out


def _in_order(steps: list[Step], skipped: list[Skipped]) -> list[Step]:
    """`steps` (rising) and the TGBs of `skipped` (each after its step `at`) in the history's order."""
    out, k = [], 0
    for s in steps:
        while k < len(skipped) and skipped[k].at < s.step:
            out.append(skipped[k].step)
            k += 1
        out.append(s)
    return out + [x.step for x in skipped[k:]]


def _packed_from(
    raw: Any, producers: dict[str, ProducerState], samples: int, n: int
) -> tuple[tuple[str, int, Any], ...]:
    """A packed step's [[producer, samples, cursor], …]: known producers, once each, adding up to its samples."""
    if not (
        isinstance(raw, list) and raw
        and all(isinstance(x, list) and len(x) == 3 and x[0] in producers and _int(x[1], 1) for x in raw)
        and len({x[0] for x in raw}) == len(raw) and sum(x[1] for x in raw) == samples
    ):  # fmt: skip
        raise _bad(f"step {n}: packed {raw!r:.200} is not [[producer, samples, cursor], …] of its {samples} samples")
    return tuple((x[0], x[1], x[2]) for x in raw)


def _leftovers_from(raw: Any, producers: dict[str, ProducerState]) -> dict[str, Leftover]:
    """A snapshot's `leftovers`: {producer: [leftover TGB, [offset, length, crc32], cursor before]}, each of a
    finished producer, whose cursor is the leftover's."""
    if not isinstance(raw, dict):
        raise _bad("leftovers is not an object")
    out: dict[str, Leftover] = {}
    for pid, v in sorted(raw.items()):
        p = producers.get(pid)
        if p is None or not p.finished:
            raise _bad(f"leftover of {pid!r:.140}, which is not a finished producer")
        if not (isinstance(v, list) and len(v) == 3 and isinstance(v[1], list) and len(v[1]) == 3):
            raise _bad(f"leftover of {pid}: {v!r:.200} is not [TGB, cursors, cursor before]")
        try:
            ref = _tgb(_Fields({}, f"leftover of {pid}"), v[0])
        except RecordError as e:
            raise _bad(str(e)) from None
        (off, length, crc, k), (at, size, crc2) = ref.ranks[0], v[1]
        if not (
            len(ref.ranks) == 1 and ref.packed is None and off == 0 and 0 <= crc < 1 << CHECKSUM_BITS[ref.checksum] and k > 0
            and at == length and _int(size) and type(crc2) is int and 0 <= crc2 < 1 << 32
            and ref.cursor == p.cursor
        ):  # fmt: skip
            raise _bad(
                f"leftover of {pid}: {v!r:.200} is not one slice of samples, its cursors, and the producer's cursor"
            )
        out[pid] = Leftover(ref, (at, size, crc2), v[2])
    return out


def _mixes_from(raw_mixes: Any, version: int) -> list[Mix]:
    """A snapshot's `mixes`: [[from step, record version, [[name, weight], …]], …], rising from step
    (weights [] where a mix was cleared)."""
    if not isinstance(raw_mixes, list):
        raise _bad("mixes is not a list")
    mixes: list[Mix] = []
    for raw in raw_mixes:
        if not (isinstance(raw, list) and len(raw) == 3 and _int(raw[0]) and _int(raw[1]) and raw[1] <= version):
            raise _bad(f"mix {raw!r:.100} is not [from step, version, weights]")
        try:
            weights = () if raw[2] == [] else check_weights(raw[2])
        except ValueError as e:
            raise _bad(f"mix {raw!r:.100}: {e}") from None
        if mixes and raw[0] <= mixes[-1].from_step:
            raise _bad(f"mix {raw!r:.100} out of order")
        mixes.append(Mix(raw[0], raw[1], weights))
    return mixes


def _shapes_from(raw_shapes: Any) -> list[tuple[int, int, int]]:
    """A snapshot's `shapes`: [[from step, world size, global batch], …], rising from step."""
    if not isinstance(raw_shapes, list):
        raise _bad("shapes is not a list")
    shapes: list[tuple[int, int, int]] = []
    for raw in raw_shapes:
        if not (isinstance(raw, list) and len(raw) == 3 and all(_int(x) for x in raw)):
            raise _bad(f"shape {raw!r:.100} is not [from step, world size, global batch]")
        step, world, batch = raw
        if not (1 <= world <= LIMITS["world_size"][1] and world <= batch <= LIMITS["global_batch"][1]):
            raise _bad(f"shape {raw!r:.100}: world size or global batch out of range")
        if shapes and step <= shapes[-1][0]:
            raise _bad(f"shape {raw!r:.100} out of order")
        shapes.append((step, world, batch))
    return shapes
