"""What to write: the send half of the protocol, as pure functions. No I/O, no clock.

Each operation is a function of the state the record will follow and of what the caller wants
(its intent); it returns the record to append, None when nothing is left to do (an earlier
attempt whose answer was lost already landed), or raises the domain error. `Manifest.append`
calls it again on the newer state after every lost race, so a decision is always made on the
state its record will follow:

    refresh → decide(state) → put-if-absent(version + 1) → lost? refresh, decide again

A record a decision returns is always valid at the next version (`State.check` agrees); the
lifecycle rules therefore exist once, here, and `State.apply` enforces them for every reader.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ._config import LIMITS, Config
from ._errors import ConfigMismatch, MixChanged, ProducerFenced, StepUnavailable, StreamClosed
from ._layout import parse_segment_key
from ._records import (
    MAIN_JOB,
    MAX_FORKS,
    MAX_JOBS,
    MAX_STEP,
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
    ReclaimRecord,
    RecordError,
    RegisterRecord,
    ReleaseRecord,
    ReopenRecord,
    ReshapeRecord,
    RewindRecord,
    TgbRef,
    UnforkRecord,
    check_job,
    check_skip,
    check_source_name,
    check_stream_url,
    check_weights,
)
from ._state import ProducerState, State

__all__ = [
    "MAX_UPLOAD_AGE",
    "PendingTgb",
    "check_open",
    "checkpoint",
    "close",
    "combine",
    "commit",
    "create",
    "current_incarnation",
    "detach",
    "drop_source",
    "finish",
    "fork",
    "job",
    "mix",
    "pack",
    "reclaim",
    "register",
    "release",
    "reopen",
    "reshape",
    "rewind",
    "room",
    "stale",
    "unfork",
    "upload_age",
]

UNLIMITED = 1 << 30

# No commit names a segment uploaded longer ago than this (by the segment key's upload time and the
# committer's clock); producers upload again what waits half as long. GC deletes an unreferenced
# upload only once it is older than its orphan grace (at least 300 s), judged on a state read after
# its listing: so a segment it deletes could only still be committed by a put in flight for 180 s.
MAX_UPLOAD_AGE = 120.0


def upload_age(ref: TgbRef, now: float) -> float:
    """How long before `now` `ref`'s segment was uploaded, by its key (0 for a key without an upload
    time, which is not a producer's upload)."""
    parsed = parse_segment_key(ref.segment)
    return 0.0 if parsed is None else now - parsed[3]


def stale(ref: TgbRef, now: float) -> bool:
    """Whether `ref`'s segment is too old to commit: GC may be deleting it."""
    return upload_age(ref, now) > MAX_UPLOAD_AGE


def _young(refs: Sequence[TgbRef], now: float) -> int:
    """How many of `refs` come before the first `stale` one."""
    return next((i for i, r in enumerate(refs) if stale(r, now)), len(refs))


def create(config: Config, now: float) -> CreateRecord:
    return CreateRecord(config, now)


def register(state: State, producer: str, token: str, now: float) -> RegisterRecord | None:
    """A new incarnation of `producer` (`token` is its random id), fencing every older one."""
    p = state.producers.get(producer)
    if p is not None and p.token == token:
        return None  # an earlier attempt, whose answer was lost, landed
    return RegisterRecord(producer, (p.epoch if p else 0) + 1, token, now)


def current_incarnation(state: State, producer: str, epoch: int, url: str = "") -> ProducerState:
    """The producer's state, if `epoch` is still its current incarnation; else ProducerFenced."""
    p = state.producers.get(producer)
    if p is None or p.epoch != epoch:
        if p is not None and p.token:  # a register record: another process took the id
            why = (f"another process registered as producer {producer!r} (epoch {p.epoch}) and fenced this one "
                   f"(epoch {epoch}); run one process per producer id")  # fmt: skip
        elif p is not None:  # a rewind or a new global batch fenced every producer
            why = (f"producer {producer!r} epoch {epoch} was fenced by a rewind or a new global batch; run it again "
                   "to resume from its cursor there")  # fmt: skip
        else:
            why = f"producer {producer!r} is not registered"
        raise ProducerFenced(f"{url}: {why}")
    return p


def room(state: State, consumed: int | None = None, head: int | None = None) -> int:
    """How many steps may be committed after the head: back-pressure holds the head to
    `max_steps_ahead` steps past its base, the newest of the step the trainer consumed last
    (`consumed`, from its mark; a mark past the head counts as the head) and the oldest retained
    checkpoint's step (with neither, the step before the first readable one). `head`: a head
    known to be newer than the state's (a producer that does not follow the log)."""
    assert state.config is not None
    limit = state.config.max_steps_ahead
    if not limit:
        return UNLIMITED
    top = state.head if head is None else max(head, state.head)
    base = state.watermark if state.checkpoints else state.first_step - 1
    if consumed is not None:
        base = max(base, min(consumed, top))
    return limit - (top - base)


@dataclass(frozen=True, slots=True)
class PendingTgb:
    """An uploaded TGB waiting for its commit: its sequence number and where it is."""

    seq: int
    ref: TgbRef


def commit(
    state: State,
    producer: str,
    epoch: int,
    pending: Sequence[PendingTgb],
    lost: int,
    now: float,
    url: str = "",
    *,
    consumed: int | None = None,
) -> CommitRecord | None:
    """Commit the `pending` TGBs (in sequence order) that are not committed yet, as many as
    back-pressure leaves room for (`room`, with the trainer's `consumed` mark); `lost` is the
    number of races this commit has lost so far. None when all landed (an ambiguous put whose
    answer was lost) or there is no room. Only those before the first `stale` one (the producer
    uploads it again). On a closed stream only those up to the close; raises StreamClosed when none
    fits. Raises ProducerFenced."""
    p = current_incarnation(state, producer, epoch, url)
    todo = [t for t in pending if t.seq > p.seq]
    todo = todo[: _young([t.ref for t in todo], now)]
    if todo and state.closed_after is not None:
        check_open(state, producer, url)
        todo = todo[: state.closed_after - state.head]
    todo = todo[: max(0, room(state, consumed))]
    if not todo:
        return None
    for i, t in enumerate(todo):
        _check_mix(state, producer, t.seq, t.ref, state.head + 1 + i, url)
    return CommitRecord(producer, epoch, todo[0].seq, tuple(t.ref for t in todo), lost, now)


def combine(
    state: State,
    intents: Sequence[RegisterRecord | CommitRecord],
    *,
    consumed: int | None = None,
    now: float,
    limit: int = 4096,
) -> GroupRecord | None:
    """One group record committing every declared intent that is valid on `state`, in one version:
    registers first (each a new incarnation, fencing older ones, saying where it resumes), then
    commits, oldest declared first, each producer's in sequence order from its next one (what
    landed already is left out, so an intent whose commit landed is simply done), as many TGBs as
    back-pressure leaves room for (`room`), at most `limit` records. An intent that is not valid here (fenced, a gap in its
    producer's sequence, sealed for another mix or shape) is left out, and so are its TGBs from the
    first `stale` one on (its producer declares them again, uploaded again: a later intent may hold
    them). None when nothing is left."""
    scratch = state.copy()
    left = room(state, consumed)
    if state.closed_after is not None:  # nothing past the close (a producer finds out: StreamClosed)
        left = min(left, state.closed_after - state.head)
    taken: list[RegisterRecord | CommitRecord] = []
    for r in sorted((r for r in intents if isinstance(r, RegisterRecord)), key=lambda r: (r.ts, r.producer)):
        p = scratch.producers.get(r.producer)
        if p is not None and p.token == r.token:
            continue  # landed
        reg = RegisterRecord(r.producer, (p.epoch if p else 0) + 1, r.token, r.ts, scratch.resume_of(r.producer))
        if len(taken) < limit and scratch.take(reg) is None:
            taken.append(reg)
    runs: dict[tuple[str, int], list[CommitRecord]] = {}
    for c in intents:
        if isinstance(c, CommitRecord):
            runs.setdefault((c.producer, c.epoch), []).append(c)
    # Producers by their oldest intent, first: fair under back-pressure; each one's run in order.
    for (pid, epoch), run in sorted(runs.items(), key=lambda kv: (min(c.ts for c in kv[1]), kv[0])):
        for c in sorted(run, key=lambda c: c.seq):
            p = scratch.producers.get(pid)
            if left <= 0 or len(taken) >= limit or p is None or p.epoch != epoch:
                break
            skip = p.seq + 1 - c.seq  # its TGBs that landed already
            if skip < 0:
                break  # a gap: the intent before it is not declared (or not seen) yet
            if skip < len(c.tgbs):
                tgbs = c.tgbs[skip : skip + left]
                tgbs = tgbs[: _young(tgbs, now)]
                if not tgbs:
                    continue  # too old: declared again, uploaded again, in a later intent
                sub = CommitRecord(pid, epoch, c.seq + skip, tgbs, 0, c.ts)
                if scratch.take(sub) is not None:
                    break  # not valid here (sealed for another mix or shape): the producer finds out
                taken.append(sub)
                left -= len(tgbs)
    return GroupRecord(tuple(taken), now) if taken else None


def check_open(state: State, producer: str, url: str = "") -> None:
    """Raises StreamClosed when no step follows the head (the stream is closed and its head reached
    the close): what the producer has not committed never will be."""
    if state.ended:
        raise StreamClosed(
            f"{url}: the stream is closed after step {state.closed_after}: producer {producer!r} stops; what it "
            "did not commit is not committed ('lakestream reopen' and run it again to continue)"
        )


def _check_mix(state: State, producer: str, seq: int, ref: TgbRef, step: int, url: str) -> None:
    m = state.mix_at(step)
    if ref.mix != (m.version if m else None):
        raise MixChanged(
            f"{url}: producer {producer!r}: TGB {seq} was sealed for mix version {ref.mix}, step "
            f"{step} is under {m.version if m else 'no mix'}: start again from the committed cursor"
        )


def finish(
    state: State,
    producer: str,
    epoch: int,
    leftover: PendingTgb | None,
    cursors: tuple[int, int, int] | None,
    now: float,
    url: str = "",
) -> FinishRecord | None:
    """The producer's source ended; `leftover` is its uploaded partial last global batch (and
    `cursors` where its per-sample cursors are in that segment), held until every producer has
    finished and the last one packs the held leftovers. None once this incarnation finished.
    Raises ProducerFenced, MixChanged."""
    p = current_incarnation(state, producer, epoch, url)
    if p.finished:
        return None  # an earlier attempt, whose answer was lost, landed
    if leftover is None:
        return FinishRecord(producer, epoch, p.seq, state.head, None, None, now)
    _check_mix(state, producer, leftover.seq, leftover.ref, state.head + 1, url)
    return FinishRecord(producer, epoch, leftover.seq, state.head, leftover.ref, cursors, now)


def pack(
    state: State,
    producer: str,
    epoch: int,
    pending: Sequence[PendingTgb],
    packs: Sequence[tuple[str, str]],
    lost: int,
    now: float,
    *,
    force: bool = False,
    url: str = "",
) -> CommitRecord | None:
    """Commit the `pending` TGBs that pack the held leftovers `packs` ((producer, segment), all of
    them, in producer order). None when they landed, or when they may no longer land: the held
    leftovers are no longer exactly `packs` (packed by another, or given back by a producer that
    registered again) or, unless `force`, a producer is producing again (the last to finish packs).
    Raises ProducerFenced, MixChanged."""
    p = current_incarnation(state, producer, epoch, url)
    if pending[0].seq <= p.seq:
        return None
    held = sorted((pid, h.ref.segment) for pid, h in state.leftovers.items())
    if held != list(packs) or (not force and state.unfinished()):
        return None
    check_open(state, producer, url)
    if state.closed_after is not None and state.head + len(pending) > state.closed_after:
        raise StreamClosed(f"{url}: the stream is closed after step {state.closed_after}: the held leftovers of "
                           f"{len(pending)} steps do not fit before it and are not committed")  # fmt: skip
    for i, t in enumerate(pending):
        _check_mix(state, producer, t.seq, t.ref, state.head + 1 + i, url)
    return CommitRecord(producer, epoch, pending[0].seq, tuple(t.ref for t in pending), lost, now, tuple(packs))


def checkpoint(
    state: State, checkpoint_id: str, step: int, now: float, url: str = "", job: str = MAIN_JOB
) -> CheckpointRecord | None:
    """Retain `step` for training job `job`'s checkpoint `checkpoint_id`; None if already recorded.

    Raises ConfigMismatch (the id at another step), StepUnavailable (the step is not committed or
    not retained) and ValueError (older than the job's newest checkpoint, a bad job name, too many jobs).
    """
    check_job(job)
    mine = state.checkpoints_of(job)
    if not state.knows_job(job) and len(state.jobs) >= MAX_JOBS:
        raise ValueError(f"{url}: the stream has {MAX_JOBS} jobs already: retire one (`lakestream job --retire`)")
    for c in mine:
        if c.id == checkpoint_id:
            if c.step != step:
                raise ConfigMismatch(f"{url}: checkpoint {checkpoint_id!r} is at step {c.step}, not {step}")
            return None
    if not state.first_step <= step <= state.head:
        raise StepUnavailable(
            f"{url}: cannot checkpoint step {step}: readable steps are {state.first_step}..{state.head}"
        )
    if mine and step < mine[-1].step:
        newest = mine[-1]
        raise ValueError(
            f"{url}: checkpoint step {step} is older than the newest checkpoint {newest.id!r} at step {newest.step}"
        )
    if not 0 < len(checkpoint_id) <= 256:
        raise ValueError(f"{url}: a checkpoint id is 1 to 256 characters, not {len(checkpoint_id)}")
    return CheckpointRecord(checkpoint_id, step, now, job)


def release(state: State, checkpoint_id: str, now: float, job: str = MAIN_JOB) -> ReleaseRecord | None:
    """Drop a retained checkpoint of job `job`; None if it is not retained."""
    if not any(c.id == checkpoint_id for c in state.checkpoints_of(job)):
        return None
    return ReleaseRecord(checkpoint_id, now, job)


def job(state: State, name: str, now: float, *, retire: bool = False, url: str = "") -> JobRecord | None:
    """Make training job `name` known (back-pressure then counts its live consumption mark), or with
    `retire` forget it and drop its checkpoints; None if that is so already. ValueError for `main`
    (always known), a bad name, or a stream with MAX_JOBS jobs."""
    check_job(name)
    if name == MAIN_JOB:
        raise ValueError(f"{url}: the main job is always known; release its checkpoints instead")
    if (name in state.jobs) != retire:
        return None
    if not retire and len(state.jobs) >= MAX_JOBS:
        raise ValueError(f"{url}: the stream has {MAX_JOBS} jobs already: retire one (`lakestream job --retire`)")
    return JobRecord(name, retire, now)


def rewind(
    state: State,
    *,
    to_checkpoint: str | None = None,
    to_step: int | None = None,
    rewinds_before: int,
    now: float,
    url: str = "",
    skip: tuple[tuple[int, int], ...] = (),
    job: str = MAIN_JOB,
) -> RewindRecord | None:
    """Discard the steps after a retained checkpoint (or `to_step`); with `skip` (step ranges
    after it, first and last inclusive), replay them but the skipped ones instead. None once a
    rewind landed after the caller's view (`rewinds_before`): its own earlier attempt, or another one.

    Raises StepUnavailable for a checkpoint that is not retained or a step not readable, ValueError
    for skip ranges that are not rising, disjoint ranges of steps after it up to the head.
    """
    if (to_checkpoint is None) == (to_step is None):
        raise ValueError("rewind needs exactly one of to_checkpoint and to_step")
    if state.rewinds > rewinds_before:
        return None
    target = to_step
    if to_checkpoint is not None:
        found = [c for c in state.checkpoints_of(job) if c.id == to_checkpoint]
        if not found:
            have = ", ".join(f"{c.id}@{c.step}" for c in state.checkpoints_of(job)) or "none"
            of = f" of job {job!r}" if job != MAIN_JOB else ""
            raise StepUnavailable(f"{url}: no retained checkpoint {to_checkpoint!r}{of} (retained: {have})")
        target = found[0].step
    assert target is not None
    if not state.first_step - 1 <= target <= state.head:
        raise StepUnavailable(
            f"{url}: cannot rewind to step {target}: readable steps are {state.first_step}..{state.head}"
        )
    if skip:
        try:
            skip = check_skip(list(skip), target)
        except RecordError as e:
            raise ValueError(f"{url}: {e}") from None
        if skip[-1][1] > state.head:
            raise ValueError(f"{url}: cannot skip step {skip[-1][1]}: the head is step {state.head}")
    _fork_holds(state, target + 1, f"rewind to step {target}", url)
    return RewindRecord(target, now, skip)


def _fork_holds(state: State, step: int, what: str, url: str) -> None:
    """ConfigMismatch if a fork holds `step` (its steps below its fork step are this stream's)."""
    holding = [f for f in state.forks if f.at_step > step]
    if holding:
        names = ", ".join(f"{f.url} (at step {f.at_step})" for f in holding[:3])
        raise ConfigMismatch(
            f"{url}: cannot {what}: fork{'s' if len(holding) > 1 else ''} {names} read{'' if len(holding) > 1 else 's'} "
            f"the steps up to {state.fork_floor - 1}; unfork or delete {'them' if len(holding) > 1 else 'it'} first, "
            "or fork from the checkpoint instead"
        )


def fork(state: State, url: str, at_step: int, now: float, source: str = "") -> ForkRecord | None:
    """Record that the stream at `url` forks this one at `at_step`: this stream keeps the steps
    below it. None if that fork is recorded already. Raises ConfigMismatch for a fork of another
    step at `url` or a stream that reads a source itself, StepUnavailable for a step outside
    first step .. head + 1, ValueError for a bad URL or too many forks."""
    check_stream_url(url)
    if state.base is not None and state.base.epochs:
        raise ConfigMismatch(
            f"{source}: this stream is a fork of {state.base.source} that still reads it: fork that one, or unfork "
            "this one first"
        )
    for f in state.forks:
        if f.url == url:
            if f.at_step == at_step:
                return None
            raise ConfigMismatch(f"{source}: {url} is a fork of this stream at step {f.at_step}, not {at_step}")
    if type(at_step) is not int or not state.first_step <= at_step <= state.head + 1:
        raise StepUnavailable(
            f"{source}: cannot fork at step {at_step!r}: the steps are {state.first_step}..{state.head} (a fork starts "
            f"at one of them or after the head)"
        )
    if len(state.forks) >= MAX_FORKS:
        raise ValueError(f"{source}: {MAX_FORKS} forks hold this stream already: unfork one")
    return ForkRecord(url, at_step, now)


def unfork(state: State, url: str, now: float) -> UnforkRecord | None:
    """The fork at `url` no longer reads this stream; None if it is not (or no longer) a fork."""
    return UnforkRecord(url, now) if any(f.url == url for f in state.forks) else None


def detach(state: State, now: float) -> DetachRecord | None:
    """A fork stops reading its source; None if it does not."""
    return DetachRecord(now) if state.base is not None and state.base.epochs else None


def close(state: State, after_step: int | None, now: float, url: str = "") -> CloseRecord | None:
    """End the stream after `after_step` (None: the head): no step past it is ever committed.
    None when it is closed there already. Raises ValueError for a step before the head, or when it
    is closed after another step (reopen it first)."""
    target = state.head if after_step is None else after_step
    if type(target) is not int or not -1 <= target < MAX_STEP:
        raise ValueError(f"{url}: step {target!r} is out of range (-1 to 2^63 - 1)")
    if state.closed_after is not None:
        if state.closed_after == target:
            return None
        raise ValueError(
            f"{url}: the stream is closed already after step {state.closed_after}; reopen it to close it after "
            f"step {target}"
        )
    if target < state.head:
        raise ValueError(f"{url}: cannot close after step {target}: steps up to {state.head} are committed")
    return CloseRecord(target, now)


def reopen(state: State, now: float) -> ReopenRecord | None:
    """Undo the close: steps may be committed past it again. None when the stream is not closed."""
    return ReopenRecord(now) if state.closed_after is not None else None


def reclaim(state: State, now: float) -> ReclaimRecord | None:
    """Steps below the watermark (or a fork's hold, if lower) leave the manifest; None if there are none."""
    return ReclaimRecord(state.reclaimable, now) if state.reclaimable > state.first_step else None


def reshape(
    state: State,
    world_size: int,
    *,
    global_batch: int | None = None,
    from_step: int | None = None,
    now: float,
    url: str = "",
) -> ReshapeRecord | None:
    """From `from_step` (None: the step after the head) read steps as `world_size` ranks of at most
    `global_batch` samples (None: the global batch in force there).

    The record replaces every shape from `from_step` on, so it changes the global batch of each
    later step whose batch differs from `global_batch`. The first step whose batch it changes must
    be at most the step after the head; the steps from it on are discarded and every producer is
    fenced, as by a rewind (`State.first_batch_change`). A world size alone (`global_batch` None)
    keeps every step's batch: it is refused where a later reshape set another one.

    None when that shape is already the newest one recorded from that step. Raises
    StepUnavailable for a reclaimed step, ValueError for a shape the stream cannot have, a global
    batch set for a future step or a world size alone that would change a later step's batch.
    """
    start = state.head + 1 if from_step is None else from_step
    if type(start) is not int or start >= MAX_STEP:
        raise ValueError(f"{url}: step {start!r} is out of range (below 2^63)")
    batch = state.batch_at(start) if global_batch is None else global_batch
    (lo, hi), (_, top) = LIMITS["world_size"], LIMITS["global_batch"]
    if type(world_size) is not int or not lo <= world_size <= hi:
        raise ValueError(f"{url}: world size {world_size!r} must be from {lo} to {hi}")
    if type(batch) is not int or not world_size <= batch <= top:
        raise ValueError(f"{url}: global batch {batch!r} must be from the world size ({world_size}) to {top}")
    if start < state.first_step:
        raise StepUnavailable(f"{url}: cannot reshape from step {start}: steps below {state.first_step} were reclaimed")
    change = state.first_batch_change(start, batch)
    if change is not None and global_batch is None:
        raise ValueError(
            f"{url}: the global batch is {state.batch_at(change)} from step {change}: a new world size from step "
            f"{start} with the global batch {batch} would change it; reshape from step {change} or later, or give "
            f"the global batch (which discards the steps from step {change} on)"
        )
    if change is not None and change > state.head + 1:
        raise ValueError(
            f"{url}: a new global batch applies from the step after the head ({state.head + 1}) at the latest, "
            f"not from step {change}"
        )
    if change is not None:
        _fork_holds(state, change, f"change the global batch from step {change}", url)
    if state.shapes and state.shapes[-1] == (start, world_size, batch):
        return None
    return ReshapeRecord(start, world_size, batch, now)


def mix(
    state: State,
    weights: Sequence[tuple[str, float]] | None,
    *,
    from_step: int | None = None,
    now: float,
    url: str = "",
) -> MixRecord | None:
    """From `from_step` (None: the step after the head; never a committed step) every TGB holds
    each source's share of the global batch by `weights`. None when that mix is already the newest
    one recorded from that step. Raises ValueError for bad weights or source names
    (`check_source_name`) or a committed step.

    `weights` None clears: from `from_step` on no mixture is in force (an empty `mix` record), as
    before the first one. None when none is already: no mix in force there and none after it."""
    start = state.head + 1 if from_step is None else from_step
    checked: tuple[tuple[str, float], ...] = ()
    if weights is not None:
        for w in weights:  # a name given now follows the rule for new names (older records may hold others)
            check_source_name(w[0] if isinstance(w, list | tuple) and w else None)
        checked = check_weights([list(w) for w in weights])
    if type(start) is not int or start <= state.head or start >= MAX_STEP:
        raise ValueError(f"{url}: a mix applies from a step not committed yet (after {state.head}), not {start!r}")
    if weights is None and state.mix_at(start) is None and all(m.from_step <= start for m in state.mixes):
        return None
    if state.mixes and (state.mixes[-1].from_step, state.mixes[-1].weights) == (start, checked):
        return None
    return MixRecord(start, checked, now)


def drop_source(state: State, source: str, *, from_step: int, now: float, url: str = "") -> MixRecord | None:
    """`source` ended: from `from_step` (or the step after the head, if that is later) the mixture
    in force there without it, the other weights as they are (so their shares are renormalised
    among themselves). What a producer run with `--on-source-end renormalize` appends.

    None when the mixture in force there gives `source` no share already (an earlier attempt of
    this producer, or another producer whose copy of the source ended, recorded it; or no mix is in
    force). Raises ConfigMismatch when another mix is recorded from a later step (a mix record
    would replace it), unless each such mix is the one this records (as after a rewind to before
    the step another producer dropped the source from), and ValueError when no other source has a
    weight."""
    start = max(from_step, state.head + 1)
    m = state.mix_at(start)
    if m is None or not dict(m.weights).get(source):
        return None
    rest = tuple((n, w) for n, w in m.weights if n != source)
    if not sum(w for _, w in rest):
        raise ValueError(f"{url}: source {source!r} ended and no other source of the mix has a weight")
    if later := [x.from_step for x in state.mixes if x.from_step > start and x.weights != rest]:
        raise ConfigMismatch(
            f"{url}: source {source!r} ended at step {start}; renormalising the mix there would replace the one "
            f"recorded from step {later[0]}: record the weights without {source!r} with 'lakestream mix' instead"
        )
    return MixRecord(start, rest, now)
