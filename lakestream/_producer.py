"""Producers: samples in, transactional global batches committed exactly once.

    put(sample, cursor) -> builder -> (full) seal: assign ranks, encode, upload  -> committer
                                      bounded bytes in flight, pipelined            groups ready TGBs

A producer registers with a new epoch (fencing every older incarnation of its id), reads the cursor
of its last committed TGB and resumes its source there. Each TGB gets the next sequence number of
the producer; the committer commits the ready prefix of its TGBs in order, and learns from the
manifest itself which of them landed (see `_state`), so an ambiguous put is never repeated.
Errors of background work surface at the next `put`, `flush` or `close`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import time
import uuid
import zlib
from collections import deque
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.to_thread
import orjson

from . import _decisions as decisions
from . import _hooks
from ._batching import assign_ranks, mix_counts, pack_plan, packed_cursor
from ._combine import Combiner
from ._errors import CorruptData, InvalidSample, ObjectNotFound, ProducerFenced
from ._layout import COST_FIELD, INTENTS_PREFIX, intent_key, register_intent_key, segment_key
from ._lifecycle import JOB_LIVE
from ._manifest import AppendResult, Manifest, Tail
from ._pacing import AttemptOutcome, CommitPolicy, Observation, make_policy
from ._records import (
    CheckpointRecord,
    CloseRecord,
    CommitRecord,
    FinishRecord,
    GroupRecord,
    MixRecord,
    ReclaimRecord,
    Record,
    RecordError,
    RegisterRecord,
    ReleaseRecord,
    ReshapeRecord,
    Resume,
    RewindRecord,
    TgbRef,
    decode_record,
    encode_record,
    record_kind,
)
from ._retry import retry
from ._segment import (
    CHECKSUMS,
    DEFAULT_CHECKSUM,
    EncodedSample,
    check_slice,
    dump_json,
    encode_sample,
    encode_segment,
    index_slice,
)
from ._state import Leftover, State
from ._store import Data, ObjectStore
from ._tasks import cancel_task_group, enter_task_group, run_sync

__all__ = ["Producer", "ProducerStats"]

log = logging.getLogger("lakestream.producer")

# seconds after its upload that a TGB still waiting is uploaded again (a commit never names one
# older than `_decisions.MAX_UPLOAD_AGE`: GC may be deleting it as an orphan)
REUPLOAD_AFTER = decisions.MAX_UPLOAD_AGE / 2
MAX_SCAN = 32  # log versions a producer reads at once for its own commits
FIND_UPWARDS = 2  # versions after its declaring that a registered producer reads first for its register
HOLD_POLL = (0.01, 0.5)  # a producer held by back-pressure looks again after this, doubling to at most that
# Combining (see `_combine`): how often a combiner commits what was declared; how often a producer
# with declared TGBs looks at the tail hint; how long the log may stand still while it waits before
# it commits them itself (and everything else declared), staying a combiner for a while after.
COMBINE_EVERY = (0.25, 0.5)  # a round after one that committed at least COMBINE_FULL TGBs; after any other
COMBINE_FULL = 4
# A combiner at the cap (the head `max_steps_ahead` past the consumption mark) reads the mark about
# once a step the trainer takes (its pace, smoothed with MARK_PACE_WEIGHT, within MARK_POLL), and
# commits as soon as it frees COMBINE_FULL steps, CAP_BATCH_TIME of them at a slow pace (or all it
# holds), rather than at its next round:
# the loop trainer -> mark -> combiner -> readers is what paces a fast trainer at the cap. Before a
# round that may be short of room, the mark it commits on is at most that old.
MARK_PACE_WEIGHT = 0.2
MARK_POLL = (0.05, 0.15)  # seconds between reads of the mark at the cap: at least, at most
CAP_BATCH_TIME = 0.2  # seconds of the trainer's steps a combiner at the cap commits at once, at most
# A producer first looks for its declared TGBs after LOOK_FIRST, then every LOOK_EVERY, less often
# (doubling up to LOOK_MAX) while looks find nothing of its own landed (back-pressure holds them).
LOOK_FIRST, LOOK_EVERY, LOOK_MAX = 0.75, 0.25, 2.0
COMBINE_SNAPSHOT_EVERY = 64  # versions between a combiner's snapshots (at most the stream's snapshot_every)
BEAT_EVERY = 1.0  # a combiner that commits nothing while TGBs are declared says so this often
# A producer takes over when the tail hint stood still for TAKEOVER_AFTER (LEADER_PATIENCE times
# that while it names another combiner), doubled for each takeover of its own in a row that found
# another combiner at work (at most 2**MAX_BACKOFF times), plus a random part spread over
# TAKEOVER_SPREAD per producer in its view (at least TAKEOVER_AFTER, at most SPREAD_MAX): of
# thousands of producers that see the same silence, one goes first, and names itself in the tail
# hint at once, before the others' turns come.
TAKEOVER_AFTER = 2.0
LEADER_PATIENCE = 4.0
MAX_BACKOFF = 2
TAKEOVER_SPREAD, SPREAD_MAX = 0.01, 60.0
STICKY = 30.0
# Back-pressure holds declared TGBs for seconds at scale (the head at `max_steps_ahead`, with a
# combiner's beat in the tail hint): only TGBs held this long make their producer read the log.
CATCH_UP_AFTER = 30.0


# Records that leave the rules as they are (`State.rules_digest`).
_KEEP_RULES = {
    r.kind
    for r in (GroupRecord, CommitRecord, RegisterRecord, FinishRecord, CheckpointRecord, ReleaseRecord, ReclaimRecord)
}


@dataclass(slots=True)
class _Tgb:
    seq: int
    samples: list[EncodedSample]
    costs: list[float] | None
    cursor: Any
    nbytes: int
    sealed_at: float
    mix: int | None = None  # the version of the mix record it was sealed for
    sources: tuple[tuple[str, int], ...] | None = None  # its samples per named source, under a mixture
    ref: TgbRef | None = None  # where it was uploaded, once it was
    data: Data = b""  # its segment, until committed (to upload it again)
    declared_at: float | None = None  # when its intent was put (combining)

    @property
    def uploaded(self) -> bool:
        return self.ref is not None

    @property
    def segment(self) -> str:
        return self.ref.segment if self.ref is not None else ""


class _UploadAgain(Exception):
    """A record was about to name an upload too old to commit (see `Producer._append_fresh`)."""


@dataclass(slots=True)
class ProducerStats:
    samples: int = 0
    tgbs_committed: int = 0
    bytes_uploaded: int = 0
    commits: int = 0
    commit_attempts: int = 0
    conflicts: int = 0
    backpressure_waits: int = 0
    ready_to_visible: list[float] = field(default_factory=list)


class Producer:
    """Turns samples into committed TGBs. Create with `lakestream.open_producer`."""

    def __init__(
        self,
        store: ObjectStore,
        producer_id: str,
        *,
        cost: Callable[[Mapping[str, Any]], float] | None = None,
        max_inflight_bytes: int = 256 << 20,
        policy: str | CommitPolicy | None = None,
        gc_interval: float | None = None,
        checksum: str = DEFAULT_CHECKSUM,
        manifest: Manifest | None = None,
        combine: bool = False,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.id = producer_id
        # A store outage never stops a producer: every store call retries for as long as it takes.
        self.manifest = manifest or Manifest(store, clock=clock, retries=None)
        self._cost = cost
        self._max_inflight = max_inflight_bytes
        if policy == "combine":  # declare TGBs for a combiner rather than commit them (see `_combine`)
            policy, combine = None, True
        self._policy = make_policy(policy)
        self._gc_interval = gc_interval
        if checksum not in CHECKSUMS:
            raise ValueError(f"checksum must be one of {', '.join(CHECKSUMS)}, not {checksum!r}")
        self._checksum = checksum
        self._clock = clock
        self._wall = wall  # timestamps in records and segment keys
        self._token = uuid.uuid4().hex
        self._mention = orjson.dumps({"producer": producer_id})[1:-1]  # how a record names this producer
        self._key_prefix = producer_id.replace(".", "_")
        self.epoch = 0
        self.global_batch = 0  # the most samples a TGB of this incarnation holds (set on registering)
        self.cursor: Any = None  # the source position to resume from (after the last committed sample)
        self.stats = ProducerStats()
        self._next_seq = 0
        self._committed_seq = -1
        self._samples: list[EncodedSample] = []
        self._sources: dict[str, int] = {}  # samples of the open batch per named source
        self._mix: int | None = None  # the mix version the open batch is sealed for
        self._costs: list[float] = []
        self._cursors: list[Any] = []  # each sample's cursor, for a leftover
        self._names: list[str | None] = []  # each sample's source, for a leftover
        self._keys: set[str] = set()
        self._last_cursor: Any = None
        self._pending: deque[_Tgb] = deque()
        self._mark: int | None = None  # the trainer's consumption mark, as last read
        self._mark_at = -math.inf
        # Combining: declare TGBs as intents; learn what landed from the versions after `_seen`.
        self.combine = combine
        self._combiner = Combiner(self.manifest, self._spawn, self._wall)
        self._tail_lock = anyio.Lock()
        self._tail_due: tuple[int, bool] | None = None
        self._tail_writing = False
        self._rng = self.manifest.rng  # jitter: seeded where the manifest's is
        self._seen = -1  # the log version up to which this producer looked for its own commits
        self._tail_head = -1  # the head the tail hint last said
        self._tail_at = -math.inf  # when it was read last
        self._last_tail: Tail | None = None  # and what it said
        self._tail: Tail | None = None  # the tail hint as last read
        self._beat = 0  # rounds of this combiner that committed nothing (see `Manifest.read_tail`)
        self._beat_at = -math.inf
        self._last_round = 0  # TGBs (and registers) the last combine round committed
        self._log_end = -1  # the last log version known to exist when it started (combining)
        self._mark_pace = 0.0  # steps a second the mark moved, smoothed over its reads
        self._capped = False  # the last combine round was short of room (the head at back-pressure's cap)
        self._held = 0  # declared TGBs it left for lack of room
        self._short = False  # the last round, on room the mark freed, had less declared than that room
        self._looks = 0  # looks in a row that found none of this producer's TGBs landed
        self._caught_up_at = -math.inf
        self._moved_at = 0.0  # when a combiner was last seen at work (or this producer started waiting)
        self._draw = (math.nan, 0.0)  # (`_moved_at`, the random part of the wait for a takeover after it)
        self._backoff = 0  # takeovers in a row that found another combiner at work
        self._wrote = -1  # the log version of the tail hint this producer last wrote as the combiner
        self._finished = False  # (combining) its finish landed
        self._combining_until = -math.inf  # a combiner that took over stays one until then
        self._leader: tuple[int, bool] = (-1, False)  # (version, whether this producer leads there)
        self._inflight = 0
        self._changed = anyio.Event()
        self._closing = False
        self._flushing = 0
        self._error: BaseException | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._metrics = _hooks.producer(self)

    # -- lifecycle -----------------------------------------------------------------------------

    async def __aenter__(self) -> Producer:
        state = await (self._load_from_snapshot() if self.combine else self.manifest.load())
        assert state.config is not None
        self.config = state.config
        version = await (self._register_combined() if self.combine else self._register())
        self._tg = await enter_task_group()
        if self.combine:
            self._tg.start_soon(self._declarer)
            self._tg.start_soon(self._combining)
        else:
            self._tg.start_soon(self._committer)
        if gc := self._gc_interval:
            self._tg.start_soon(self._collect_garbage, gc)
        if version is not None:
            self._appended(version)
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if exc_type is None:
                await self.close()
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Stop at once: uploads and commits in progress are abandoned (never half-visible)."""
        tg, self._tg = self._tg, None
        await cancel_task_group(tg)

    async def _load_from_snapshot(self) -> State:
        """A combining producer starts from the newest snapshot, not the log after it (thousands
        start together): the tail hint says whether the versions up to it changed the rules (see
        `Tail`), and the few after it (a combiner writes the hint after its version) are read to
        see that they did not. Else, or with no hint, it follows the log."""
        state = await self.manifest.load(follow=False)
        tail = await self.manifest.read_tail()
        if tail is not None and tail.version >= state.version and tail.rules == state.rules_digest():
            for v in range(tail.version + 1, tail.version + 1 + MAX_SCAN):
                if (data := await self.manifest.read_version(v)) is None:
                    self._tail, self._tail_head = tail, tail.head
                    self._log_end = v - 1
                    return state
                if record_kind(data) not in _KEEP_RULES:  # (a malformed one is a no-op: following costs time only)
                    break
        await self.manifest.refresh()
        return state

    async def _register(self) -> int | None:
        result = await self.manifest.append(lambda st, _: decisions.register(st, self.id, self._token, self._wall()))
        self._metrics.appended(result)
        self._registered()
        return result.version

    async def _register_combined(self) -> None:
        """Declare this incarnation and wait until a combiner registered it (or do it: no combiner
        moved the tail hint for TAKEOVER_AFTER). A registering producer does not follow the log:
        it looks at its register intent, which a combiner deletes once it landed, then reads the
        few versions that may hold it, whose register says where this incarnation resumes."""
        key = register_intent_key(self.id, self._token)
        # A register declared by an earlier incarnation of this id that died before it landed
        # would land later and fence this one: those go first (one process per producer id).
        mine = await retry(lambda: self.store.list(f"{INTENTS_PREFIX}{self.id}/r-"), attempts=None)
        if mine:
            await retry(lambda: self.store.delete(mine), attempts=None)
        data = encode_record(RegisterRecord(self.id, 1, self._token, self._wall()))
        await retry(lambda: self.store.put(key, data), attempts=None)
        since = max(self.manifest.state.version, self._log_end)  # it lands after this version
        # With no producer at work in the stream there is no combiner to wait for: one of those
        # registering takes over soon (a random wait spreads those that start together).
        alone = not any(p.token and not p.finished for p in self.manifest.state.producers.values())
        alone &= self._tail is None or not self._tail.leader  # (a hint naming a combiner: one was at work)
        self._moved_at = self._clock() - (TAKEOVER_AFTER * (1 + self._rng.random()) if alone else 0.0)
        interval = LOOK_FIRST
        while not self._registered_in(self.manifest.state):  # (a takeover follows the log)
            await anyio.sleep(interval * (0.5 + self._rng.random()))
            interval = min(interval * 1.5, LOOK_MAX)  # many register at once: look less often
            try:
                await retry(lambda: self.store.get(key), attempts=None)
            except ObjectNotFound:  # landed (or an incarnation started since deleted it: fenced)
                if (found := await self._find_register(since)) is not None:
                    self._resumed(*found)
                    return
                await self._follow_to_tail()
                if not self._registered_in(self.manifest.state):
                    raise ProducerFenced(
                        f"{self.manifest.url}: producer {self.id!r}: another process took the id before this one "
                        "registered; run one process per producer id"
                    ) from None
                break
            if (
                self._clock() - self._moved_at > TAKEOVER_AFTER
                and not self._moved(await self._read_tail())  # only combining producers write it: one at work?
                and self._clock() - self._moved_at > self._patience()
            ):
                await self._claim()
                await self._follow_to_tail()
                if await self._claimed():
                    await self._combine_round(took_over=True)
                self._moved_at = self._clock()
        self._registered()

    def _registered_in(self, state: State) -> bool:
        p = state.producers.get(self.id)
        return p is not None and p.token == self._token

    async def _find_register(self, since: int) -> tuple[int, int, Resume] | None:
        """(version, epoch, resume) of this incarnation's register, read from the versions after
        `since` (the log's end when it was declared): the first FIND_UPWARDS of them (where it
        usually is: it lands in the first round after it was declared), then from the log's end
        (the tail hint's version and any after it) down, at most MAX_SCAN in all; None if none of
        them holds it."""
        datas: dict[int, bytes] = {}
        for v in range(since + 1, since + 1 + FIND_UPWARDS):
            if (data := await self.manifest.read_version(v)) is None:
                break  # past the log's end
            if (found := self._register_in(v, data)) is not None:
                return found
            datas[v] = data
        else:
            tail = await self._read_tail()
            top = max(since + FIND_UPWARDS, -1 if tail is None else tail.version)
            while (data := await self.manifest.read_version(top + 1)) is not None:  # the hint is behind
                top += 1
                datas[top] = data
            for v in range(top, max(since + FIND_UPWARDS, top - MAX_SCAN), -1):
                if v not in datas and (data := await self.manifest.read_version(v)) is not None:
                    datas[v] = data
                if v in datas and (found := self._register_in(v, datas[v])) is not None:
                    return found
        return None

    def _register_in(self, version: int, data: bytes) -> tuple[int, int, Resume] | None:
        """(version, epoch, resume) of this incarnation's register if the log version `data` holds it."""
        if self._token.encode() not in data:
            return None  # (the bytes say so without decoding a group of thousands of slices)
        # The group is decoded whole, as every reader decodes it (a malformed one is a no-op for
        # all, and registers nobody); the producers of one process registered by it share the
        # decoded record (`decode_record`).
        try:
            record = decode_record(data)
        except RecordError:
            return None
        for r in record.records if isinstance(record, GroupRecord) else ():
            if isinstance(r, RegisterRecord) and r.token == self._token and r.producer == self.id and r.resume:
                return version, r.epoch, r.resume
        return None

    def _registered(self) -> None:
        p = self.manifest.state.producers[self.id]
        if p.token != self._token:  # pragma: no cover - append guarantees it
            raise ProducerFenced(f"{self.manifest.url}: producer {self.id!r} could not register")
        self._resumed(self.manifest.state.version, p.epoch, self.manifest.state.resume_of(self.id))

    def _resumed(self, version: int, epoch: int, resume: Resume) -> None:
        """Registered as `epoch` at `version`: continue from `resume` (a later change of the global
        batch fences this incarnation, so `resume.batch` holds for its life)."""
        self.epoch, self.cursor, self.global_batch = epoch, resume.cursor, resume.batch
        self._committed_seq = resume.seq
        self._next_seq = resume.seq + 1
        self._seen = max(self._seen, version)
        log.info(
            "%s: producer %s registered epoch %d, resuming at %s",
            self.manifest.url, self.id, self.epoch, orjson.dumps(self.cursor).decode(),
        )  # fmt: skip

    # -- the public API ------------------------------------------------------------------------

    def mix_now(self) -> tuple[int | None, tuple[tuple[str, float], ...] | None]:
        """(version, weights) of the mixture in force at the step the next TGB would take (after the
        head as this producer last saw the log, and its own TGBs sealed before), or (None, None)."""
        m = self.manifest.state.mix_at(self._head() + 1 + len(self._pending))  # if no other producer commits first
        return (m.version, m.weights) if m else (None, None)

    async def drop_source(self, source: str) -> None:
        """`source` ended and the others go on without it: seal the open batch (a short TGB, which
        holds at most each share), wait until every TGB is committed, then record the mixture in
        force without `source` from the step after the head (`_decisions.drop_source`; nothing when
        it gives `source` no share already). Raises ConfigMismatch when a mix is recorded from a
        later step, and what `flush` raises."""
        self._check()
        if self._samples:
            await self._seal()
        await self.flush()
        if self.combine:
            await self._follow_to_tail()
        result = await self.manifest.append(
            lambda st, _: decisions.drop_source(
                st, source, from_step=st.head + 1, now=self._wall(), url=self.manifest.url
            )
        )
        self._metrics.appended(result)
        if result.version is not None:
            log.info("%s: source %s ended; the mixture goes on without it", self.manifest.url, source)
            self._appended(result.version)

    async def put(
        self, sample: Mapping[str, Any], *, cursor: Any = None, source: str | None = None, mix: int | None = None
    ) -> None:
        """Add one sample; `cursor` is the source position just after it (JSON-able).

        Under a mixture (see `mix_now`), `source` names the sample's source and `mix` the version
        of the mix the open batch is composed for (the same for every sample of a global batch);
        a TGB whose mix is no longer in force at the step it would take is never committed
        (MixChanged).

        Awaits while too many bytes are in flight. Raises InvalidSample for a sample or cursor that
        cannot be stored (nothing is added), ProducerFenced if a newer incarnation registered, and
        any error of background uploads or commits.
        """
        self._check()
        dump_json(cursor, lambda: f"producer {self.id!r}: cursor {cursor!r:.100}")
        # A default key names the producer too: keys are unique in the whole stream (verify checks).
        default = f"{self._key_prefix}-{self._next_seq:06d}-{len(self._samples):05d}"
        given = sample.get(COST_FIELD)
        if given is not None:  # the sample's own cost: used for balancing, not stored
            sample = {k: v for k, v in sample.items() if k != COST_FIELD}
        enc = encode_sample(sample, default, max_bytes=self.config.max_sample_bytes)
        if enc.key in self._keys:
            raise InvalidSample(f"producer {self.id!r}: sample key {enc.key!r} appears twice in one global batch")
        cost: Any = given if given is not None else self._cost(sample) if self._cost is not None else None
        if cost is not None:
            try:
                cost = float(cost) if not isinstance(cost, bool | str | bytes) else math.nan
            except (TypeError, ValueError):
                cost = math.nan
            if not math.isfinite(cost) or cost < 0:
                raise InvalidSample(f"producer {self.id!r}: cost of sample {enc.key!r} is not a finite number >= 0")
            # Samples put before without a cost cost nothing: counts stay balanced to within one anyway.
            self._costs += [0.0] * (len(self._samples) - len(self._costs)) + [cost]
        elif self._costs:
            self._costs.append(0.0)
        if self._samples and mix != self._mix:
            raise InvalidSample(f"producer {self.id!r}: sample {enc.key!r} is for mix {mix}, its batch for {self._mix}")
        self._mix = mix
        if source is not None:
            self._sources[source] = self._sources.get(source, 0) + 1
        self._samples.append(enc)
        self._cursors.append(cursor)
        self._names.append(source)
        self._keys.add(enc.key)
        self._last_cursor = cursor
        self.stats.samples += 1
        if len(self._samples) >= self.global_batch:
            await self._seal()

    @property
    def open_samples(self) -> int:
        """Samples put into the global batch not sealed yet."""
        return len(self._samples)

    async def flush(self) -> None:
        """Wait until every full TGB put so far is committed (a partial one stays open).

        The commit policy does not delay TGBs while someone flushes.
        """
        target = self._next_seq - 1
        self._flushing += 1
        self._notify()
        try:
            while self._committed_seq < target:
                self._check()
                await self._wait_changed()
        finally:
            self._flushing -= 1
        self._check()

    async def close(self) -> None:
        """The source ended: commit every whole TGB, then record that this producer finished
        (`finish`), handing in a final partial TGB as its leftover. At most one step of a stream,
        its last, is short: leftovers are held until every producer of the stream has finished,
        and the last one to finish packs them (`pack`), a lone producer its own short last step."""
        self._check()
        await self.flush()
        leftover = await self._upload_leftover() if self._samples else None
        await self._finish(leftover)
        state = self.manifest.state
        if state.leftovers and not state.unfinished():
            await self.pack()
        self._closing = True
        self._notify()

    async def pack(self, *, force: bool = False) -> int:
        """Pack every held leftover into TGBs of this producer, committed in one record; the steps
        committed (0 if another producer packed them first, or one produces again: the last to
        finish packs). Every TGB but the last is a whole global batch (under a mixture, see
        `_batching.pack_plan`). `force` packs even while producers of the stream have not finished
        (`lakestream pack`). Raises CorruptData for a leftover segment that fails its checks."""
        self._check()
        state = self.manifest.state
        held = sorted(state.leftovers.items())
        if not held or (not force and state.unfinished()):
            return 0
        parts = {pid: await self._read_leftover(pid, h) for pid, h in held}
        head = state.head

        def shape(k: int) -> tuple[int, dict[str, int] | None]:
            batch, m = state.batch_at(head + 1 + k), state.mix_at(head + 1 + k)
            return batch, mix_counts(m.weights, batch) if m else None

        try:
            plan = pack_plan([(pid, len(parts[pid][0]), parts[pid][2]) for pid, _ in held], shape)
        except ValueError as e:
            raise InvalidSample(
                f"{self.manifest.url}: producer {self.id!r} cannot pack the held leftovers: {e}"
            ) from None
        done: dict[str, set[int]] = {pid: set() for pid, _ in held}
        pending: list[decisions.PendingTgb] = []
        blobs: list[Data] = []
        for k, tgb in enumerate(plan):
            step = head + 1 + k
            samples = [parts[pid][0][i] for pid, i in tgb]
            if len({s.key for s in samples}) != len(samples):
                raise InvalidSample(
                    f"{self.manifest.url}: producer {self.id!r}: a sample key repeats in the held leftovers"
                )
            costs = (
                [(parts[pid][3] or [0.0] * (i + 1))[i] for pid, i in tgb] if any(p[3] for p in parts.values()) else None
            )
            ranks = assign_ranks(costs, len(samples), state.world_at(step))
            data, slices = await anyio.to_thread.run_sync(
                encode_segment, [[samples[i] for i in r] for r in ranks], self._checksum
            )
            seq, self._next_seq = self._next_seq, self._next_seq + 1
            key = segment_key(self.id, self.epoch, seq, self._wall())
            await self._put_segment(key, data)
            blobs.append(data)
            counts: dict[str, int] = {}
            for pid, i in tgb:
                counts[pid] = counts.get(pid, 0) + 1
                done[pid].add(i)
            try:
                packed = tuple(
                    (pid, n, packed_cursor(parts[pid][1], parts[pid][2], done[pid], state.leftovers[pid].before))
                    for pid, n in sorted(counts.items())
                )
            except ValueError as e:
                raise InvalidSample(f"{self.manifest.url}: producer {self.id!r} cannot pack: {e}") from None
            m = state.mix_at(step)
            names: dict[str, int] = {}
            for pid, i in tgb:
                if (src := parts[pid][2]) is not None:
                    names[src[i]] = names.get(src[i], 0) + 1
            ref = TgbRef(
                key, tuple((r[0], r[1], r[2], r[3]) for r in slices), None, m.version if m else None,
                tuple(sorted(names.items())) if m else None, self._checksum, packed,
            )  # fmt: skip
            pending.append(decisions.PendingTgb(seq, ref))
        packs = [(pid, h.ref.segment) for pid, h in held]

        def decide(state: State, lost: int) -> Record | None:
            return decisions.pack(
                state, self.id, self.epoch, pending, packs, lost, self._wall(), force=force, url=self.manifest.url
            )

        result = await self._append_fresh(decide, pending, blobs)
        self._metrics.appended(result)
        self._drop_committed(self.manifest.state)
        if result.version is not None:
            self._appended(result.version)
        if self._committed_seq < pending[-1].seq:
            log.info("%s: producer %s left the held leftovers to another producer", self.manifest.url, self.id)
            return 0
        self.stats.tgbs_committed += len(pending)
        log.info(
            "%s: producer %s packed the leftovers of %s into %d step(s)",
            self.manifest.url, self.id, ", ".join(pid for pid, _ in held), len(pending),
        )  # fmt: skip
        return len(pending)

    @property
    def policy_name(self) -> str:
        return "combine" if self.combine else self._policy.name

    @property
    def committed_seq(self) -> int:
        return self._committed_seq

    # -- internals -----------------------------------------------------------------------------

    async def _put_segment(self, key: str, data: Data) -> None:
        """Upload a segment (a TGB, a leftover, a packed TGB), retried for as long as it takes, and count it."""
        await retry(lambda: self.store.put(key, data), attempts=None, on_error=self._metrics.upload_failed)
        self._metrics.uploaded(len(data))
        self.stats.bytes_uploaded += len(data)

    async def _upload_leftover(self) -> tuple[decisions.PendingTgb, tuple[int, int, int], bytes]:
        """Upload the open partial batch as this producer's leftover: one slice of its samples, then
        each sample's cursor, source and cost as JSON (what a packer needs to cut it anywhere)."""
        samples, self._samples = self._samples, []
        costs = self._costs + [0.0] * (len(samples) - len(self._costs)) if self._costs else None
        cursors, names = self._cursors, self._names
        sources = tuple(sorted(self._sources.items())) if self._sources else None
        self._costs, self._cursors, self._names, self._keys, self._sources = [], [], [], set(), {}
        side = orjson.dumps({
            "cursors": cursors, "sources": names if any(n is not None for n in names) else None, "costs": costs,
        })  # fmt: skip
        # Format 1 (arrays as .npy fields): a packer copies the samples' fields as they are stored.
        data, slices = await anyio.to_thread.run_sync(lambda: encode_segment([samples], self._checksum, version=1))
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        key = segment_key(self.id, self.epoch, seq, self._wall())
        blob = b"".join((data, side))
        await self._put_segment(key, blob)
        ref = TgbRef(key, (tuple(slices[0]),), self._last_cursor, self._mix, sources, self._checksum)  # type: ignore[arg-type]
        return decisions.PendingTgb(seq, ref), (len(data), len(side), zlib.crc32(side)), blob

    async def _finish(self, leftover: tuple[decisions.PendingTgb, tuple[int, int, int], bytes] | None) -> None:
        tgbs, cursors, blobs = ([leftover[0]], leftover[1], [leftover[2]]) if leftover is not None else ([], None, [])
        if self.combine:
            await self._follow_to_tail()  # a combining producer does not follow the log

        def decide(state: State, _: int) -> Record | None:
            tgb = tgbs[0] if tgbs else None
            return decisions.finish(state, self.id, self.epoch, tgb, cursors, self._wall(), self.manifest.url)

        result = await self._append_fresh(decide, tgbs, blobs)
        self._metrics.appended(result)
        self._drop_committed(self.manifest.state)
        if self.combine:  # it combines no more: its tail hint names none, so another takes over soon
            self._finished, self._combining_until = True, -math.inf
        if result.version is not None:
            self._appended(result.version, tail=not self.combine)
            if self.combine:
                await self._write_tail()

    async def _append_fresh(
        self,
        decide: Callable[[State, int], Record | None],
        tgbs: list[decisions.PendingTgb],
        blobs: Sequence[Data],
    ) -> AppendResult:
        """Append `decide`'s record, which names the uploads `tgbs` (whose bytes are `blobs`): if
        one is too old to name when it decides (`_decisions.stale`: an append retried through a
        long outage), each is uploaded again under a new key, in place in `tgbs`, and it decides
        again."""

        def fresh(state: State, lost: int) -> Record | None:
            record = decide(state, lost)
            if record is not None and any(decisions.stale(t.ref, self._wall()) for t in tgbs):
                raise _UploadAgain
            return record

        while True:
            try:
                return await self.manifest.append(fresh)
            except _UploadAgain:
                for i, (t, blob) in enumerate(zip(tgbs, blobs, strict=True)):
                    tgbs[i] = decisions.PendingTgb(t.seq, await self._put_again(t.seq, t.ref, blob))

    async def _read_leftover(
        self, pid: str, held: Leftover
    ) -> tuple[list[EncodedSample], list[Any], list[str] | None, list[float] | None]:
        """A held leftover's samples (as stored), and each one's cursor, source and cost; its segment
        is untrusted: checked against the finish record (CRC-32s, sizes, counts). Raises CorruptData."""
        segment = held.ref.segment
        where = f"{self.manifest.url}: the leftover of producer {pid!r} object {segment}"
        offset, length, crc, n = held.ref.ranks[0]
        at, size, crc2 = held.cursors
        try:
            data = await retry(lambda: self.store.get(segment))
        except ObjectNotFound:
            raise CorruptData(f"{where}: segment object is missing") from None
        if len(data) != at + size:
            raise CorruptData(f"{where}: {len(data)} bytes, the finish record says {at + size}")
        view = memoryview(data)
        check_slice(view[offset : offset + length], crc, where, held.ref.checksum)
        check_slice(view[at:], crc2, f"{where} (cursors)")
        refs = index_slice(view[offset : offset + length], where)
        samples: list[EncodedSample] = []
        for r in refs:
            if not samples or samples[-1].key != r.key:
                samples.append(EncodedSample(r.key, ()))
            field = (r.field, r.tag, bytes(view[offset + r.offset : offset + r.offset + r.length]))
            samples[-1] = EncodedSample(r.key, (*samples[-1].fields, field))
        try:
            side = orjson.loads(view[at:])
        except orjson.JSONDecodeError as e:
            raise CorruptData(f"{where}: cursors are not JSON ({e})") from None
        cursors, names, costs = (
            (side.get(k) for k in ("cursors", "sources", "costs")) if isinstance(side, dict) else (None,) * 3
        )
        if not (
            len(samples) == n and isinstance(cursors, list) and len(cursors) == n
            and (names is None or (isinstance(names, list) and len(names) == n and all(isinstance(x, str) for x in names)))
            and (costs is None or (isinstance(costs, list) and len(costs) == n
                                   and all(type(x) is float and math.isfinite(x) and x >= 0 for x in costs)))
            and (n == 0 or cursors[-1] == held.ref.cursor)
        ):  # fmt: skip
            raise CorruptData(f"{where}: its samples, cursors, sources or costs do not match the finish record's {n}")
        return samples, cursors, names, costs

    def _check(self) -> None:
        if self._error is not None:
            raise self._error
        if self._tg is None and self.epoch:
            raise RuntimeError(f"producer {self.id!r} is closed")

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def _wait_changed(self) -> None:
        await self._changed.wait()

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        self._notify()

    async def _seal(self) -> None:
        # Back-pressure holds the source before the upload, not after it: storage stays bounded,
        # and an upload is not left waiting uncommitted (and ageing towards GC's orphan grace).
        await self._room(for_upload=True)
        samples, self._samples = self._samples, []
        costs, self._costs = (self._costs or None), []
        self._keys = set()
        self._cursors, self._names = [], []
        sources, self._sources = (tuple(sorted(self._sources.items())) if self._sources else None), {}
        tgb = _Tgb(
            self._next_seq, samples, costs, self._last_cursor, sum(s.nbytes for s in samples), self._clock(),
            self._mix, sources,
        )  # fmt: skip
        self._next_seq += 1
        while self._inflight and self._inflight + tgb.nbytes > self._max_inflight:
            self._check()
            await self._wait_changed()
        self._inflight += tgb.nbytes
        self._pending.append(tgb)
        assert self._tg is not None
        self._tg.start_soon(self._upload, tgb)

    async def _upload(self, tgb: _Tgb) -> None:
        try:
            # Sealed for the world size in force after the head; readers re-slice otherwise.
            ranks = assign_ranks(tgb.costs, len(tgb.samples), self.manifest.state.world_at(self._head() + 1))
            parts = [[tgb.samples[i] for i in r] for r in ranks]
            data, slices = await run_sync(
                encode_segment, parts, self._checksum, nbytes=tgb.nbytes, items=len(tgb.samples)
            )
            key = segment_key(self.id, self.epoch, tgb.seq, self._wall())
            await self._put_segment(key, data)
            ranks_ref = tuple((r[0], r[1], r[2], r[3]) for r in slices)
            tgb.ref, tgb.samples = TgbRef(key, ranks_ref, tgb.cursor, tgb.mix, tgb.sources, self._checksum), []
            tgb.data = data
            self._notify()
        except Exception as e:
            self._fail(e)

    async def _committer(self) -> None:
        try:
            while True:
                ready = self._ready()
                if not ready:
                    if self._closing and not self._pending:
                        return
                    await self._wait_changed()
                    continue
                active, lost, commits = self._activity()
                obs = Observation(
                    len(ready), self._clock() - ready[0].sealed_at, active, self._flushing > 0, lost, commits
                )
                decision = self._policy.decide(obs)
                deadline = self._clock() + decision.delay
                while not self._flushing and (left := deadline - self._clock()) > 0:
                    with anyio.move_on_after(left):
                        await self._wait_changed()
                await self._read_mark_if_stale()  # the room is checked at commit on a fresh mark and log
                room = await self._room()
                ready = self._ready()[: min(room, self._policy.group_cap)]  # and what became ready meanwhile
                await self._commit(ready, fresh=decision.fresh)
        except Exception as e:
            self._fail(e)

    # -- combining (see `_combine`) -------------------------------------------------------------

    async def _declarer(self) -> None:
        """Declare each run of uploaded TGBs as one intent as soon as it is uploaded, then learn when
        they land. Back-pressure held the upload (`_room(for_upload=True)`); the combiner holds
        what it cannot commit yet and commits it the moment the mark frees room, so a producer
        waits for the room by looking for its TGBs, not by reading the mark and the tail hint."""
        try:
            while True:
                fresh = [t for t in self._ready() if t.declared_at is None]
                if fresh:
                    self._check()
                    await self._declare(fresh)
                    continue
                if not self._pending:
                    if self._closing:
                        return
                    await self._wait_changed()
                    continue
                if all(t.declared_at is None for t in self._pending):
                    await self._wait_changed()  # uploads in progress
                    continue
                oldest = min(t.declared_at for t in self._pending if t.declared_at is not None)
                first = oldest + LOOK_FIRST - self._clock()  # about when a combiner will have committed it
                every = min(LOOK_EVERY * 2 ** max(0, self._looks - 2), LOOK_MAX)  # held back: look less often
                with anyio.move_on_after(max(first, every * (0.75 + 0.5 * self._rng.random()))):
                    await self._wait_changed()
                committed = self._committed_seq
                await self._look()
                self._looks = 0 if self._committed_seq != committed else self._looks + 1
                await self._declare_again()
        except Exception as e:
            self._fail(e)

    async def _declare(self, tgbs: list[_Tgb]) -> None:
        await self._upload_again(tgbs)
        if not any(t.declared_at is not None for t in self._pending):
            # Nothing declared is outstanding: what is declared now can only land after the tail.
            fresh = self._clock() - self._tail_at < HOLD_POLL[1]  # read before the upload (`_room`)
            if (tail := self._last_tail if fresh else await self._read_tail()) is not None:
                self._seen = max(self._seen, tail.version)
            self._moved_at = self._clock()
        await self._put_intent(tgbs)
        self.stats.commit_attempts += 1
        now = self._clock()
        for t in tgbs:
            t.declared_at = now

    async def _declare_again(self) -> None:
        """Declared TGBs still waiting REUPLOAD_AFTER after their upload (a trainer that paused, a
        long outage) are uploaded again and declared again, all of those waiting in one intent
        under the first one's key (a combiner holding an intent too old to commit fetches it again;
        one it holds that is not needs no new one)."""
        held = [t for t in self._pending if t.declared_at is not None]
        if await self._upload_again(held):
            await self._put_intent(held)

    async def _put_intent(self, tgbs: list[_Tgb]) -> None:
        """Declare the uploaded run `tgbs` in one intent, under the key of its first TGB."""
        refs = tuple(t.ref for t in tgbs if t.ref is not None)
        data = encode_record(CommitRecord(self.id, self.epoch, tgbs[0].seq, refs, 0, self._wall()))
        await retry(lambda: self.store.put(intent_key(self.id, self.epoch, tgbs[0].seq), data), attempts=None)

    async def _look(self) -> None:
        """Did declared TGBs land? The tail hint says where the log ends (and its beat that a
        combiner holds declared TGBs back); the versions since `_seen` say what landed. No
        combiner at work for a while (`_patience`: no group record, beat or combiner newly named
        in the hint, while other records, such as producers finishing, may move the log) makes
        this producer commit itself, and what the others declared; TGBs declared CATCH_UP_AFTER
        ago while a combiner works make it catch up with the whole log once, to learn why
        (fenced, or sealed for a mix no longer in force)."""
        tail = await self._read_tail()
        self._moved(tail)
        if tail is not None and tail.version > self._seen:
            view = self.manifest.state
            if tail.version > view.version and tail.rules not in (-1, view.rules_digest()):
                await self._catch_up()  # a rewind, shape, mix or close since the view: what does it mean here?
            elif self._seen >= tail.since:  # the hint names the one version to read, if any
                v = tail.landed.get(self.id)
                if v is not None and v > self._seen:
                    await self._read_landing(v)
                self._seen = max(self._seen, tail.version)
            else:
                await self._scan(tail.version)
        declared = [t.declared_at for t in self._pending if t.declared_at is not None]
        if not declared:
            return
        oldest = min(declared)
        now = self._clock()
        if now - max(oldest, self._moved_at) > self._patience():
            await self._take_over()
        elif now - max(oldest, self._caught_up_at) > CATCH_UP_AFTER:
            await self._catch_up()
            for t in self._pending:  # declared again: an intent may have been deleted
                t.declared_at = None
            self._notify()

    async def _read_landing(self, version: int) -> None:
        """Take in this producer's commits at `version`, which the tail hint says holds its newest
        TGBs; if they do not follow what it knows landed, read the versions before it too."""
        data = await self.manifest.read_version(version)
        try:
            record = decode_record(data) if data is not None else None
        except RecordError:
            record = None
        mine = [
            r for r in (record.records if isinstance(record, GroupRecord) else (record,))
            if isinstance(r, CommitRecord) and r.producer == self.id and r.epoch == self.epoch
        ]  # fmt: skip
        if not mine or mine[0].seq > self._committed_seq + 1:
            await self._scan(version)  # earlier ones landed in versions before it (or the hint is wrong)
            return
        for r in mine:
            self._landed(r)
        self._moved_at = self._clock()

    async def _scan(self, top: int) -> None:
        """Read versions `_seen + 1`..`top` and take in this producer's commits in them."""
        if top - self._seen > 4 * MAX_SCAN:  # far behind: the whole log is cheaper (snapshots)
            await self._catch_up()
            return
        first = self._seen + 1
        datas: list[bytes | None] = [None] * min(top - self._seen, MAX_SCAN)

        async def fetch(i: int) -> None:
            datas[i] = await self.manifest.read_version(first + i)

        async with anyio.create_task_group() as tg:
            for i in range(len(datas)):
                tg.start_soon(fetch, i)
        behind = False
        for i, data in enumerate(datas):
            if data is None:
                break  # not there (a hint ahead of the log, or a version not visible yet)
            self._seen = first + i
            if data.startswith(b'{"kind":"group"') and self._mention not in data:
                self._moved_at = self._clock()  # a combiner at work, on others' TGBs: no need to decode them
                continue
            try:
                record = decode_record(data)
            except RecordError:
                continue  # a no-op for everyone
            if isinstance(record, GroupRecord):
                self._moved_at = self._clock()  # a combiner is at work
            for r in record.records if isinstance(record, GroupRecord) else (record,):
                if isinstance(r, CommitRecord) and r.producer == self.id and r.epoch == self.epoch:
                    behind |= not self._landed(r)
                elif isinstance(r, RegisterRecord) and r.producer == self.id and r.token != self._token:
                    behind = True  # fenced: the catch-up says so
                elif isinstance(r, RewindRecord | ReshapeRecord | MixRecord | CloseRecord):
                    behind = True  # may fence this producer or refuse what it declared
        if behind:
            await self._catch_up()

    def _landed(self, r: CommitRecord) -> bool:
        """Take in a commit of this incarnation's TGBs; False if it does not follow what this
        producer knows landed (then only the whole log can say what did)."""
        last = r.seq + len(r.tgbs) - 1
        if last <= self._committed_seq:
            return True
        if r.seq != self._committed_seq + 1:
            return False
        self._committed_through(last, r.tgbs[-1].cursor)
        return True

    async def _follow_to_tail(self) -> None:
        """Bring the view of the log to its tail: from the newest snapshot when the tail hint says
        the view is far behind (combiners snapshot every COMBINE_SNAPSHOT_EVERY versions), else by
        reading the versions since."""
        tail = await self.manifest.read_tail()
        if tail is not None and tail[0] - self.manifest.state.version > 2 * COMBINE_SNAPSHOT_EVERY:
            await self.manifest.load()
        else:
            await self.manifest.refresh()

    async def _catch_up(self) -> None:
        """Follow the whole log to its tail; what landed, whether this incarnation is fenced, and
        whether a declared TGB can no longer land (MixChanged) all come from the state."""
        await self._follow_to_tail()
        self._seen, self._caught_up_at = max(self._seen, self.manifest.state.version), self._clock()
        self._drop_committed(self.manifest.state)
        waiting = [decisions.PendingTgb(t.seq, t.ref) for t in self._ready() if t.ref is not None]
        if waiting:  # raises what committing them would (ProducerFenced, MixChanged, StreamClosed)
            decisions.commit(self.manifest.state, self.id, self.epoch, waiting, 0, self._wall(), self.manifest.url)

    def _moved(self, tail: Tail | None) -> bool:
        """Take in the tail hint just read: whether it moved (a combiner wrote a version, its beat
        while it holds TGBs back, or a producer named itself the combiner) since the last one."""
        moved = tail is not None and (
            self._tail is None or (*tail[:3], tail.leader) != (*self._tail[:3], self._tail.leader)
        )
        if moved:
            self._moved_at = self._clock()
        if tail is not None or self._tail is None:
            self._tail = tail
        return moved

    def _patience(self) -> float:
        """How long the tail hint may stand still (since `_moved_at`) before this producer takes
        over (see TAKEOVER_AFTER). Its random part is drawn once for each time the hint moved."""
        if self._draw[0] != self._moved_at:
            self._draw = (self._moved_at, self._rng.random())
        leader = self._tail.leader if self._tail is not None else ""
        wait = TAKEOVER_AFTER * (LEADER_PATIENCE if leader not in ("", self.id) else 1.0)
        spread = min(max(TAKEOVER_AFTER, TAKEOVER_SPREAD * len(self.manifest.state.producers)), SPREAD_MAX)
        return wait * (1 << min(self._backoff, MAX_BACKOFF)) + spread * self._draw[1]

    async def _claim(self) -> None:
        """Name this producer the combiner in the tail hint (as it stands, or at this producer's
        view), before catching up with the log: producers that read it give it time rather than
        take over too. Best effort: one that does not see it may take over as well."""
        view = self.manifest.state
        tail = self._tail
        if tail is None:
            tail = Tail(view.version, view.head, 0, view.rules_digest(), view.version, {})
        try:
            await self.manifest.put_tail(tail._replace(leader=self.id))
            self._wrote = tail.version
        except Exception as e:
            log.debug("%s: tail hint failed: %s", self.manifest.url, e)

    async def _claimed(self) -> bool:
        """After `_claim` and a catch-up: whether the tail hint still names no other combiner
        newer than what this producer wrote (else another took over meanwhile: leave it to it,
        and wait longer before the next takeover)."""
        if await self._other_at_work():
            self._backoff += 1
            self._combining_until = -math.inf
            return False
        return True

    async def _other_at_work(self) -> bool:
        """Whether the tail hint names another combiner, at a version at least the one this
        producer last wrote (a tail hint is written after the version, or by a producer taking over)."""
        tail = await self._read_tail()
        return tail is not None and tail.leader not in ("", self.id) and tail.version >= self._wrote

    async def _take_over(self) -> None:
        """Claim the combiner's role, catch up, declare again what did not land, and combine
        unless another producer took over meanwhile."""
        await self._claim()
        await self._catch_up()
        ready = self._ready()
        if any(t.declared_at is not None for t in ready):  # (else it landed, unseen in the tail hint)
            for t in self._pending:  # declared again at the first one not committed (intents may be gone)
                t.declared_at = None
            await self._declare(ready)
        if await self._claimed():  # named in the hint, it combines (the combiner it replaces stops)
            await self._combine_round(took_over=True)
        else:
            self._moved_at = self._clock()

    async def _combining(self) -> None:
        """Combine in the background while this producer leads (or took over lately)."""
        try:
            while True:
                every = COMBINE_EVERY[0] if self._last_round >= COMBINE_FULL else COMBINE_EVERY[1]
                if self._short:  # the mark freed more room than was declared: more is coming (held at sources)
                    every = 2 * self._mark_poll()
                freed = await self._wait_for_round(every * (0.75 + 0.5 * self._rng.random()))
                if self._finished:
                    return
                if self._leads():
                    await self._combine_round(held=freed)
                elif self._clock() < self._combining_until and await self._claimed():
                    await self._combine_round(held=freed)  # (one that took over stops once another is at work)
                else:
                    self._capped = False  # not combining: nothing to watch the mark for
        except Exception as e:
            self._fail(e)

    async def _wait_for_round(self, wait: float) -> bool:
        """Wait `wait` seconds for the next round; while the last one held declared TGBs for lack
        of room, only until the consumption mark (read every `_mark_poll()`) frees enough of it: then
        True (the round may commit what it holds without listing the intents again)."""
        deadline = self._clock() + wait
        while self._capped and (left := deadline - self._clock()) > 0:
            await anyio.sleep(min(self._mark_poll(), left))
            await self._read_mark()
            room = decisions.room(self.manifest.state, self._mark)
            if room >= self._cap_batch() or 0 < self._held <= room:
                return True
        if (left := deadline - self._clock()) > 0:
            await anyio.sleep(left)
        return False

    def _leads(self) -> bool:
        """Whether this producer is the combiner the stream's producers agree on: of those not
        finished (as of its view of the log), the one whose id hashes lowest."""
        state = self.manifest.state
        if self._leader[0] != state.version:
            live = [pid for pid, p in state.producers.items() if not p.finished and p.token]
            first = min(live, key=lambda pid: hashlib.sha256(pid.encode()).digest(), default=None)
            self._leader = (state.version, first == self.id)
        return self._leader[1]

    async def _combine_round(self, *, took_over: bool = False, held: bool = False) -> None:
        """One round of combining. `held`: the consumption mark just freed room while the head
        was at the cap."""
        if decisions.room(self.manifest.state, self._mark) < 4 * COMBINE_FULL:  # else the mark can wait
            await self._read_mark_if_stale(self._mark_poll())
        # Room freed for what it holds: commit that at once, without listing the intents again (and
        # list them then if what it held was not all valid).
        quick = held and self._held >= decisions.room(self.manifest.state, self._mark)
        await self._one_round(relist=not quick)
        if quick and decisions.room(self.manifest.state, self._mark) > 0:
            await self._one_round(relist=True)
        self._short = held and not self._capped
        if took_over or self._clock() < self._combining_until:
            self._combining_until = self._clock() + STICKY
        self._notify()

    async def _one_round(self, *, relist: bool) -> None:
        result = await self._combiner.round(self._mark, relist=relist)
        state = self.manifest.state
        self._capped = decisions.room(state, self._mark) <= 0
        self._held = self._combiner.waiting(state) if self._capped else 0
        self._seen, self._moved_at = max(self._seen, state.version), self._clock()
        if self.epoch:
            self._drop_committed(state)
        if result is None:
            return  # nothing declared: nobody waits
        self._metrics.appended(result)
        record = result.record
        self._last_round = (  # (registers count: thousands starting together are a busy stream too)
            sum(len(r.tgbs) if isinstance(r, CommitRecord) else 1 for r in record.records)
            if isinstance(record, GroupRecord)
            else 0
        )
        if result.version is not None:
            self.stats.commits += 1
            self._appended(result.version, tail=False)
            self._write_tail_soon(self._beat, leader=not self._finished)  # the next round need not wait for it
            self._backoff = 0  # it leads
        elif self._clock() - self._beat_at >= BEAT_EVERY:
            # Declared TGBs wait (back-pressure, or not valid): say that a combiner is at work.
            self._beat, self._beat_at = self._beat + 1, self._clock()
            self._write_tail_soon(self._beat, leader=not self._finished)

    async def _room(self, *, for_upload: bool = False) -> int:
        """How many steps may be committed now (`_decisions.room`: the head at most
        `max_steps_ahead` past the trainer's consumption mark or the oldest checkpoint), waiting
        while there is none. `for_upload`: room for one more TGB, counting this producer's
        uncommitted ones as taken; a combining producer's, as far again past the cap (declared
        TGBs wait for the combiner, which commits them the moment the mark frees room, while what
        the sources would only start uploading then is a round trip or more away; the head itself
        never passes the cap). A held producer looks at the mark and the log's next version
        twice a second at most."""
        if not self.config.max_steps_ahead:
            return decisions.UNLIMITED
        ahead = self.config.max_steps_ahead if for_upload and self.combine else 0
        if for_upload and self.combine and self._clock() - min(self._mark_at, self._tail_at) > HOLD_POLL[1]:
            # It seals on a view at most HOLD_POLL[1] old (it may not have looked for long): held
            # here, at the source, rather than after the upload, with its TGB waiting to land. The
            # tail hint carries the mark its combiner commits on: one GET where it leaves room
            # (held, it reads the mark itself below).
            tail = await self._read_tail()
            if tail is None or tail.mark is None:
                await self._read_mark()
            elif self._mark is None or tail.mark > self._mark:
                self._mark = tail.mark
        interval = HOLD_POLL[0]
        held = None
        while True:
            self._check()
            taken = len(self._pending) if for_upload else 0
            room = decisions.room(self.manifest.state, self._mark, self._tail_head) + ahead - taken
            if held is not None:  # the time held is counted as it passes (a metric, scraped meanwhile)
                now = self._clock()
                self._metrics.held(now - held)
                held = now
            if room > 0:
                return room
            if held is None:
                held = self._clock()
                self.stats.backpressure_waits += 1
            elif self._clock() - self._mark_at >= HOLD_POLL[1]:
                decisions.check_open(self.manifest.state, self.id, self.manifest.url)  # never room past a close
                await self._read_mark()
                if self.combine:  # not following the log: the tail hint says where the head is
                    await self._read_tail()
                else:
                    await self.manifest.refresh(window=1)  # one GET unless the log moved
                    self._drop_committed(self.manifest.state)
                continue
            await anyio.sleep(interval)
            interval = min(interval * 2, HOLD_POLL[1])

    async def _read_tail(self) -> Tail | None:
        """The tail hint, its head taken in (`_head`, back-pressure)."""
        tail = self._last_tail = await self.manifest.read_tail()
        self._tail_at = self._clock()
        if tail is not None:
            self._tail_head = max(self._tail_head, tail.head)
        return tail

    async def _read_mark_if_stale(self, age: float = HOLD_POLL[1]) -> None:
        """Read the consumption mark again if back-pressure is on and it is older than `age`."""
        if self.config.max_steps_ahead and self._clock() - self._mark_at > age:
            await self._read_mark()

    async def _read_mark(self) -> None:
        """The consumption mark back-pressure follows: the slowest of the `main` job's mark and
        the marks of the other jobs the stream knows that are live (published within JOB_LIVE)."""
        mark = await self.manifest.read_consumed()
        now = self._wall()
        for job in self.manifest.state.jobs:
            other = await self.manifest.read_mark(job)
            if other is not None and now - other[1] < JOB_LIVE:
                mark = other[0] if mark is None else min(mark, other[0])
        at, was = self._clock(), self._mark
        if mark is not None and was is not None and mark >= was and at > self._mark_at:  # its pace, smoothed
            self._mark_pace += MARK_PACE_WEIGHT * ((mark - was) / (at - self._mark_at) - self._mark_pace)
        self._mark_at = at
        if mark is not None or self._mark is None:
            self._mark = mark  # a mark that went away (deleted, unreadable) keeps the last one seen

    def _cap_batch(self) -> int:
        """How many steps the mark must free before a combiner at the cap commits what it holds:
        COMBINE_FULL, or fewer at a slow trainer's pace (what it takes in CAP_BATCH_TIME, at least
        one), so that TGBs wait for room at most about that long more than they must."""
        return min(COMBINE_FULL, max(1, round(CAP_BATCH_TIME * self._mark_pace)))

    def _mark_poll(self) -> float:
        """How often a combiner at the cap reads the mark: about once a step the trainer takes,
        within MARK_POLL (so at 10 steps a second ten GETs a second, at 30 twenty)."""
        pace = self._mark_pace
        return MARK_POLL[1] if pace <= 0 else min(max(1 / pace, MARK_POLL[0]), MARK_POLL[1])

    def _active(self) -> int:
        """Producers with a commit record in the policy's activity window, this one included."""
        return self._activity()[0]

    def _activity(self) -> tuple[int, int, int]:
        """From the commit records in the policy's activity window: the producers active (this one
        included), and the races their latest commits lost and how many such commits there are."""
        since = self._wall() - self._policy.activity_window
        active, lost, commits = 1, 0, 0
        for pid, p in self.manifest.state.producers.items():
            if p.last_ts >= since:
                active += pid != self.id
                if p.commits:
                    lost += p.lost
                    commits += 1
        return active, lost, commits

    def _head(self) -> int:
        """The head: as the log view has it, or the tail hint if newer (a combining producer's view
        lags the log, except for the rules, which the hint says are the same)."""
        return max(self.manifest.state.head, self._tail_head)

    def _ready(self) -> list[_Tgb]:
        ready = []
        for t in self._pending:
            if not t.uploaded:
                break
            ready.append(t)
        return ready

    async def _upload_again(self, tgbs: list[_Tgb]) -> bool:
        """Upload again, under a new key, each of `tgbs` uploaded REUPLOAD_AFTER ago (held by
        back-pressure, a long outage): a commit never names an upload GC may take for an orphan
        (`_decisions.stale`). Whether any was."""
        old = [t for t in tgbs if t.ref is not None and decisions.upload_age(t.ref, self._wall()) > REUPLOAD_AFTER]
        for t in old:
            assert t.ref is not None
            t.ref = await self._put_again(t.seq, t.ref, t.data)
        return bool(old)

    async def _put_again(self, seq: int, ref: TgbRef, data: Data) -> TgbRef:
        """Upload TGB `seq`'s segment `data` again under a new key (a new upload time): `ref` there."""
        key = segment_key(self.id, self.epoch, seq, self._wall())
        await self._put_segment(key, data)
        return dataclasses.replace(ref, segment=key)

    def _drop_committed(self, state: State) -> None:
        p = decisions.current_incarnation(state, self.id, self.epoch, self.manifest.url)
        self._committed_through(p.seq, p.cursor)

    def _committed_through(self, seq: int, cursor: Any) -> None:
        now = self._clock()
        while self._pending and self._pending[0].seq <= seq:
            t = self._pending.popleft()
            self._inflight -= t.nbytes
            self.stats.tgbs_committed += 1
            self.stats.ready_to_visible.append(now - t.sealed_at)
            self._metrics.committed(t, now - t.sealed_at)
        if seq != self._committed_seq:
            self._committed_seq = seq
            self._notify()  # flush waits for it
        self.cursor = cursor

    async def _commit(self, ready: list[_Tgb], *, fresh: bool = False) -> None:
        await self._upload_again(ready)
        pending = [decisions.PendingTgb(t.seq, t.ref) for t in ready if t.ref is not None]  # all uploaded
        before = self._committed_seq

        def decide(state: State, lost: int) -> Record | None:
            self.stats.commit_attempts += 1
            return decisions.commit(
                state, self.id, self.epoch, pending, lost, self._wall(), self.manifest.url, consumed=self._mark
            )

        result = await self.manifest.append(decide, fresh=fresh, conflict_delay=self._policy.conflict_delay)
        self.stats.conflicts += result.conflicts
        self._metrics.appended(result)
        self._drop_committed(self.manifest.state)
        # The slot's latency: the read that found the tail and the put that took it; not the
        # catch-up reads of what others wrote meanwhile, nor waits after lost races.
        slot = result.probe_latency + result.put_latency
        self._policy.observe(AttemptOutcome(slot, result.conflicts, self._committed_seq - before))
        if result.version is not None:
            self.stats.commits += 1
            self._appended(result.version)
        self._notify()

    def _appended(self, version: int, *, tail: bool = True) -> None:
        """Off the commit path: a combining writer of a version points the tail hint at it, and whoever
        writes a version that is a multiple of `snapshot_every` snapshots it (the state is copied
        now; serialising and writing happen in the background)."""
        if self._tg is None:
            return
        if tail and self.combine:  # (a stream's producers that commit themselves follow the log)
            self._write_tail_soon(0, leader=False)
        every = min(self.config.snapshot_every, COMBINE_SNAPSHOT_EVERY) if self.combine else self.config.snapshot_every
        if version % every == 0:
            self._tg.start_soon(self._snapshot, self.manifest.state.copy())

    def _spawn(self, work: Callable[[], Coroutine[Any, Any, None]]) -> bool:
        """Run `work` in the background (False: closed, the caller does it itself)."""
        if self._tg is None:
            return False
        self._tg.start_soon(work)
        return True

    async def _write_tail(self, beat: int = 0, *, leader: bool = False) -> None:
        """Point the tail hint at this producer's view; `leader`: as the combiner, naming itself
        (a producer that wrote a version of its own names none). One write at a time, each of the
        view as it is then, so that a hint never goes back."""
        try:
            async with self._tail_lock:
                version = self.manifest.state.version
                mark = self._mark if leader else None  # what it commits on, for producers about to upload
                await self.manifest.write_tail(self.manifest.state, beat, self.id if leader else "", mark)
            if leader:
                self._wrote = max(self._wrote, version)
        except Exception as e:  # best effort: a stale tail costs a held producer a log read
            log.debug("%s: tail hint failed: %s", self.manifest.url, e)

    def _write_tail_soon(self, beat: int, *, leader: bool) -> None:
        """`_write_tail` in the background, off the combiner's path from one version to the next;
        hints due while one is written are written once, after it, with the newest view."""
        if self._tg is None:
            return
        self._tail_due = (beat, leader)
        if not self._tail_writing:
            self._tail_writing = True
            self._tg.start_soon(self._tail_writer)

    async def _tail_writer(self) -> None:
        try:
            while (due := self._tail_due) is not None:
                self._tail_due = None
                await self._write_tail(due[0], leader=due[1])
        finally:
            self._tail_writing = False

    async def _collect_garbage(self, interval: float) -> None:
        """GC in the background, every `interval` seconds; failures are logged, not fatal."""
        from ._gc import gc

        while True:
            await anyio.sleep(interval)
            try:
                report = await gc(self.store)
                log.info("%s", report.summary())
            except Exception as e:
                log.warning("%s: background gc failed: %s", self.manifest.url, e)

    async def _snapshot(self, state: State) -> None:
        try:
            data = await anyio.to_thread.run_sync(state.to_json)
            await self.manifest.write_snapshot(data, state.version)
        except Exception as e:  # best effort: a missing snapshot costs readers time, not data
            log.warning("%s: snapshot at version %d failed: %s", self.manifest.url, state.version, e)
