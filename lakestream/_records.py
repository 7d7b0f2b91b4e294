"""Manifest log records: one frozen class per kind, and their one codec. No I/O.

A log version holds one record, a JSON object with a string `kind` (docs/format.md gives every
member). `decode_record` checks a record's *schema* — every member's type and range, the
segment key's shape — and returns the typed record, or raises RecordError saying what is wrong.
Whether a well-formed record is valid *at its position* (a current epoch, the next sequence
number, a retained step …) is the state machine's question (`_state.State.apply`); what to write
is the decisions' (`_decisions`).
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, ClassVar, NamedTuple

import orjson

from ._config import LIMITS, Config

__all__ = [
    "CHECKSUM_BITS",
    "MAIN_JOB",
    "MAX_STEP",
    "CheckpointRecord",
    "CloseRecord",
    "CommitRecord",
    "CreateRecord",
    "DetachRecord",
    "FinishRecord",
    "ForkBase",
    "ForkRecord",
    "GroupRecord",
    "JobRecord",
    "MixRecord",
    "ReclaimRecord",
    "Record",
    "RecordError",
    "RegisterRecord",
    "ReleaseRecord",
    "ReopenRecord",
    "ReshapeRecord",
    "Resume",
    "RewindRecord",
    "TgbRef",
    "UnforkRecord",
    "check_job",
    "check_source_name",
    "check_stream_url",
    "decode_record",
    "encode_record",
    "record_kind",
]

PRODUCER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_CHECKPOINT_ID = 256
JOB_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")  # a training job's name (`--job`)
MAIN_JOB = "main"  # the job of every record that names none
MAX_JOBS = 256  # jobs a stream knows at once


def check_job(name: Any) -> str:
    """`name` if it is a job name (1 to 64 letters, digits, '_', '.', '-', not starting with '.' or
    '-'), else ValueError."""
    if not isinstance(name, str) or not JOB_NAME.fullmatch(name):
        raise ValueError(f"job name {name!r:.80}: a job name is 1 to 64 letters, digits, '_', '.' and '-'")
    return name


MAX_SEGMENT_KEY = 1024
CHECKSUM_BITS = {"crc32": 32, "xxh3-64": 64}  # the checksums a TGB's slices may have, and their widths
MAX_PACKED = 65536  # producers whose leftovers one packed TGB holds
MAX_GROUP = 16384  # records one group holds


class RecordError(ValueError):
    """Bytes at a log version that are not a well-formed record (a no-op for every reader)."""


MAX_URL = 1024  # characters of a stream URL a record names (a fork's source, a source's fork)
MAX_FORKS = 256  # forks a stream holds steps for at once


def check_stream_url(url: Any) -> str:
    """`url` if it can name a stream in a record (1 to MAX_URL printable characters, no space),
    else ValueError."""
    if not (isinstance(url, str) and 0 < len(url) <= MAX_URL and url.isprintable() and " " not in url):
        raise ValueError(f"stream URL {url!r:.120}: 1 to {MAX_URL} printable characters without spaces")
    return url


@dataclass(frozen=True, slots=True)
class ForkBase:
    """What a fork starts from: the stream at `source` as it was below step `at_step`. `state` is
    that state as a snapshot's members (`State.to_dict`) at version 0: the source's steps below
    `at_step`, their producers fenced; the state machine checks it as it checks a snapshot."""

    source: str
    at_step: int
    state: Mapping[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "at_step": self.at_step, "state": self.state}


@dataclass(frozen=True, slots=True)
class CreateRecord:
    """Version 0: the stream's shape, fixed for its life. A fork's (`fork`) also holds the steps it
    shares with its source."""

    config: Config
    ts: float = 0.0
    fork: ForkBase | None = None
    kind: ClassVar[str] = "create"

    def members(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "ts": self.ts} | (
            {"fork": self.fork.to_dict()} if self.fork is not None else {}
        )


@dataclass(frozen=True, slots=True)
class RegisterRecord:
    """A producer incarnation: `epoch` is the id's previous epoch + 1, fencing older ones. A
    register that a combiner commits also says where the incarnation resumes (`resume`: its `seq`,
    `cursor` and the global batch in force after the head, as applying it leaves them; checked by
    `State`), so that the producer learns it from this one record instead of following the log."""

    producer: str
    epoch: int
    token: str
    ts: float = 0.0
    resume: Resume | None = None
    kind: ClassVar[str] = "register"

    def members(self) -> dict[str, Any]:
        m = {"producer": self.producer, "epoch": self.epoch, "token": self.token, "ts": self.ts}
        if self.resume is not None:
            m["resume"] = {"seq": self.resume.seq, "cursor": self.resume.cursor, "batch": self.resume.batch}
        return m


@dataclass(frozen=True, slots=True)
class Resume:
    """Where a new incarnation resumes: its last committed `seq`, its `cursor`, the global `batch`."""

    seq: int
    cursor: Any
    batch: int


class RankSlice(NamedTuple):
    """Where one rank's part of a TGB lives in its segment (a tuple: every reader builds hundreds
    of these a step)."""

    offset: int
    length: int
    digest: int  # the slice's checksum (of the kind its Step names)
    samples: int


@dataclass(frozen=True, slots=True)
class TgbRef:
    """One TGB of a commit: its segment, each rank's (offset, length, checksum, samples), the cursor;
    under a mixture, the version of the `mix` record it was sealed for and its samples per source;
    the checksum its slices have (`CHECKSUM_BITS`; absent from the record: `crc32`). A TGB of a
    commit that packs leftovers has `packed`: (producer, samples, cursor) of each producer whose
    leftover samples it holds, the cursor being that producer's after them."""

    segment: str
    ranks: tuple[tuple[int, int, int, int], ...]
    cursor: Any = None
    mix: int | None = None
    sources: tuple[tuple[str, int], ...] | None = None
    checksum: str = "crc32"
    packed: tuple[tuple[str, int, Any], ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {"segment": self.segment, "ranks": [list(r) for r in self.ranks], "cursor": self.cursor}
        if self.checksum != "crc32":  # absent for CRC-32: records written before the member stay valid
            d["checksum"] = self.checksum
        if self.mix is not None:  # absent outside mixtures: the format of a TGB is unchanged there
            d["mix"] = self.mix
        if self.sources is not None:
            d["sources"] = [list(x) for x in self.sources]
        if self.packed is not None:
            d["packed"] = [list(x) for x in self.packed]
        return d


@dataclass(frozen=True, slots=True)
class CommitRecord:
    """TGBs `seq`, `seq + 1` … of a producer, appended as the next steps in this order.

    With `packs` ((producer, leftover segment), …) the TGBs hold those held leftovers' samples
    (each TGB says whose in `packed`), and the commit consumes the leftovers."""

    producer: str
    epoch: int
    seq: int
    tgbs: tuple[TgbRef, ...]
    lost: int = 0  # races this commit lost before it landed (what commit pacing listens to)
    ts: float = 0.0
    packs: tuple[tuple[str, str], ...] = ()
    kind: ClassVar[str] = "commit"

    def members(self) -> dict[str, Any]:
        return {
            "producer": self.producer, "epoch": self.epoch, "seq": self.seq, "ts": self.ts, "lost": self.lost,
            "tgbs": [t.to_dict() for t in self.tgbs],
        } | ({"packs": [list(x) for x in self.packs]} if self.packs else {})  # fmt: skip


@dataclass(frozen=True, slots=True)
class FinishRecord:
    """The producer's source ended. `leftover` (sequence number `seq`, the committed one + 1) is its
    partial last global batch, held until every producer has finished and one of them packs the
    held leftovers; its segment holds one slice of the samples, then at `cursors` (offset, length,
    crc32) the JSON object {"cursors": [...], "sources": [...] | null, "costs": [...] | null} of
    each sample's cursor, source and cost. Without a leftover, `seq` is the committed one. `head`
    is the stream's head where it lands (what a snapshot at its version is checked against)."""

    producer: str
    epoch: int
    seq: int
    head: int
    leftover: TgbRef | None = None
    cursors: tuple[int, int, int] | None = None
    ts: float = 0.0
    kind: ClassVar[str] = "finish"

    def members(self) -> dict[str, Any]:
        return {
            "producer": self.producer, "epoch": self.epoch, "seq": self.seq, "head": self.head,
            "leftover": self.leftover.to_dict() if self.leftover is not None else None,
            "cursors": list(self.cursors) if self.cursors is not None else None, "ts": self.ts,
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class CheckpointRecord:
    """The trainer's checkpoint `id` at `step` is durable: retain the step. `job`: the training
    job whose checkpoint it is (absent: `main`); a job not known yet becomes known."""

    id: str
    step: int
    ts: float = 0.0
    job: str = MAIN_JOB
    kind: ClassVar[str] = "checkpoint"

    def members(self) -> dict[str, Any]:
        return {"id": self.id, "step": self.step, "ts": self.ts} | ({"job": self.job} if self.job != MAIN_JOB else {})


@dataclass(frozen=True, slots=True)
class ReleaseRecord:
    id: str
    ts: float = 0.0
    job: str = MAIN_JOB
    kind: ClassVar[str] = "release"

    def members(self) -> dict[str, Any]:
        return {"id": self.id, "ts": self.ts} | ({"job": self.job} if self.job != MAIN_JOB else {})


@dataclass(frozen=True, slots=True)
class JobRecord:
    """A training job `job` reads the stream (back-pressure counts its consumption mark while it
    is live); with `retire`, it no longer does: its checkpoints are dropped and its mark ignored."""

    job: str
    retire: bool = False
    ts: float = 0.0
    kind: ClassVar[str] = "job"

    def members(self) -> dict[str, Any]:
        return {"job": self.job, "retire": self.retire, "ts": self.ts}


@dataclass(frozen=True, slots=True)
class ReclaimRecord:
    """Steps below `below` (at most the watermark) leave the manifest."""

    below: int
    ts: float = 0.0
    kind: ClassVar[str] = "reclaim"

    def members(self) -> dict[str, Any]:
        return {"below": self.below, "ts": self.ts}


@dataclass(frozen=True, slots=True)
class RewindRecord:
    """Discard the steps after `to_step` and fence every producer. With `skip` (ranges of steps
    after `to_step`, first and last inclusive, rising, disjoint): replay instead, that is append the
    TGBs of the steps after `to_step` again as new steps, in order, except those of the skipped
    steps, which are recorded as skipped; no producer is fenced or moved back."""

    to_step: int
    ts: float = 0.0
    skip: tuple[tuple[int, int], ...] = ()
    kind: ClassVar[str] = "rewind"

    def members(self) -> dict[str, Any]:
        return {"to_step": self.to_step, "ts": self.ts} | ({"skip": [list(x) for x in self.skip]} if self.skip else {})


@dataclass(frozen=True, slots=True)
class CloseRecord:
    """The stream ends after step `after_step` (the head, or a later step the head has yet to reach):
    no step past it is ever committed, and readers end once they have read it."""

    after_step: int
    ts: float = 0.0
    kind: ClassVar[str] = "close"

    def members(self) -> dict[str, Any]:
        return {"after_step": self.after_step, "ts": self.ts}


@dataclass(frozen=True, slots=True)
class ReopenRecord:
    """Undo the close: steps may be committed past it again."""

    ts: float = 0.0
    kind: ClassVar[str] = "reopen"

    def members(self) -> dict[str, Any]:
        return {"ts": self.ts}


@dataclass(frozen=True, slots=True)
class ForkRecord:
    """The stream at `url` is a fork of this one at `at_step`: its steps below `at_step` are this
    stream's, by reference. Until an `unfork`, this stream keeps them (from its first step then on)
    and refuses what would discard them."""

    url: str
    at_step: int
    ts: float = 0.0
    kind: ClassVar[str] = "fork"

    def members(self) -> dict[str, Any]:
        return {"url": self.url, "at_step": self.at_step, "ts": self.ts}


@dataclass(frozen=True, slots=True)
class UnforkRecord:
    """The fork at `url` no longer reads this stream's steps: what only it kept may be reclaimed."""

    url: str
    ts: float = 0.0
    kind: ClassVar[str] = "unfork"

    def members(self) -> dict[str, Any]:
        return {"url": self.url, "ts": self.ts}


@dataclass(frozen=True, slots=True)
class DetachRecord:
    """A fork stops reading its source: the steps it shares with it leave its manifest (as a
    reclaim), and what follows is its own alone."""

    ts: float = 0.0
    kind: ClassVar[str] = "detach"

    def members(self) -> dict[str, Any]:
        return {"ts": self.ts}


MAX_STEP = 1 << 63  # steps are 64-bit signed integers in records and snapshots
MAX_SKIP_RANGES = 1024


def check_skip(raw: Any, after: int) -> tuple[tuple[int, int], ...]:
    """`[[first, last], ...]` as a tuple, or RecordError: 1 to MAX_SKIP_RANGES ranges of steps after
    `after`, each first <= last, rising and disjoint."""
    ok = isinstance(raw, list | tuple) and 0 < len(raw) <= MAX_SKIP_RANGES
    low = after + 1
    for x in raw if ok else ():
        if not (isinstance(x, list | tuple) and len(x) == 2 and all(type(v) is int for v in x)
                and low <= x[0] <= x[1] < MAX_STEP):  # fmt: skip
            ok = False
            break
        low = x[1] + 1
    if not ok:
        raise RecordError(
            f"rewind: skip {raw!r:.100} is not 1 to {MAX_SKIP_RANGES} rising, disjoint [first, last] step ranges "
            f"after step {after}"
        )
    return tuple((x[0], x[1]) for x in raw)


SOURCE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")  # what a mix record may hold (older names too)
NEW_SOURCE_NAME = re.compile(r"[A-Za-z0-9_]{1,64}")  # what `mix` and `produce` accept
MAX_SOURCES = 256


def check_source_name(name: Any) -> str:
    """`name` if it is a source name a user may give (`mix`, `produce`): 1 to 64 ASCII letters,
    digits and '_', else ValueError. No '-', so that a sample key `<name>-<key>` under a mixture
    has one source and one key; no '.', which no key has."""
    if not isinstance(name, str) or not NEW_SOURCE_NAME.fullmatch(name):
        raise ValueError(f"source name {name!r:.80}: a source name is 1 to 64 letters, digits and '_' (no '-' or '.')")
    return name


@dataclass(frozen=True, slots=True)
class MixRecord:
    """From step `from_step` on, every TGB holds each named source's share of the global batch
    (`_batching.mix_counts` of `weights`); it replaces every mix from `from_step` on. Empty
    `weights` clear: from `from_step` on no mixture is in force, as before the first mix."""

    from_step: int
    weights: tuple[tuple[str, float], ...]
    ts: float = 0.0
    kind: ClassVar[str] = "mix"

    def members(self) -> dict[str, Any]:
        return {"from_step": self.from_step, "weights": [list(w) for w in self.weights], "ts": self.ts}


def check_weights(weights: Any) -> tuple[tuple[str, float], ...]:
    """`[[name, weight], ...]` as a tuple, or ValueError: 1 to 256 distinct source names, weights
    finite and >= 0, adding up to a finite number more than 0 (so that each share, weight / total,
    is a number from 0 to 1)."""
    if not isinstance(weights, list | tuple) or not 0 < len(weights) <= MAX_SOURCES:
        raise ValueError(f"weights must be 1 to {MAX_SOURCES} [name, weight] pairs")
    out = []
    for w in weights:
        if not (isinstance(w, list | tuple) and len(w) == 2 and isinstance(w[0], str) and SOURCE_NAME.match(w[0])):
            raise ValueError(f"bad source weight {w!r:.100}: a name is [A-Za-z0-9_][A-Za-z0-9_.-]{{0,63}}")
        v = w[1]
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            raise ValueError(f"source {w[0]!r}: weight {v!r:.40} is not a finite number >= 0")
        out.append((w[0], float(v)))
    if len({n for n, _ in out}) != len(out):
        raise ValueError("source names must be distinct")
    total = sum(v for _, v in out)
    if not 0 < total < math.inf:
        raise ValueError(f"the weights add up to {total}, not a finite number more than 0 (any scale: a=1,b=3)")
    return tuple(out)


@dataclass(frozen=True, slots=True)
class ReshapeRecord:
    """From step `from_step` on, steps are read as `world_size` ranks and hold at most
    `global_batch` samples (until a later reshape); it replaces every reshape from `from_step` on.

    Steps committed with another number of rank slices are re-sliced on read (`_batching.reslice`).
    A new global batch also discards the steps from `from_step` on and fences every producer, as a
    rewind to `from_step - 1` does: TGBs sealed for the old batch are never committed.
    """

    from_step: int
    world_size: int
    global_batch: int
    ts: float = 0.0
    kind: ClassVar[str] = "reshape"

    def members(self) -> dict[str, Any]:
        return {
            "from_step": self.from_step, "world_size": self.world_size, "global_batch": self.global_batch,
            "ts": self.ts,
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class GroupRecord:
    """Several producers' `register` and `commit` records in one version (what combining commits),
    applied in order, each as if it stood alone at that version: one that is not valid where it
    stands is a no-op by itself, and the others still apply."""

    records: tuple[RegisterRecord | CommitRecord, ...]
    ts: float = 0.0
    kind: ClassVar[str] = "group"

    def members(self) -> dict[str, Any]:
        return {"ts": self.ts, "records": [{"kind": r.kind, **r.members()} for r in self.records]}


Record = (
    CreateRecord | RegisterRecord | CommitRecord | CheckpointRecord | ReleaseRecord | ReclaimRecord | RewindRecord
    | ReshapeRecord | MixRecord | FinishRecord | GroupRecord | CloseRecord | ReopenRecord | JobRecord | ForkRecord
    | UnforkRecord | DetachRecord
)  # fmt: skip


def encode_record(record: Record) -> bytes:
    """The record's bytes: one JSON object, `kind` first."""
    return orjson.dumps({"kind": record.kind, **record.members()})


# -- decoding: untrusted bytes in, a typed record or RecordError out -------------------------------


@dataclass(slots=True)
class _Fields:
    """A record's members, read one by one with the check each needs."""

    r: Mapping[str, Any]
    what: str = field(default="")

    def need(self, ok: bool, why: str) -> None:
        if not ok:
            raise RecordError(why)

    def int(self, name: str, lo: int = 0, *, why: str = "") -> int:
        v = self.r.get(name)
        self.need(type(v) is int and v >= lo, why or f"{self.what}: bad {name} {v!r:.60}")
        return int(v)  # type: ignore[arg-type]

    def str(self, name: str, *, why: str = "") -> str:
        v = self.r.get(name)
        self.need(isinstance(v, str), why or f"{self.what}: {name} must be a string")
        return str(v)

    def ts(self) -> float:
        ts = self.r.get("ts", 0.0)
        return float(ts) if isinstance(ts, (int, float)) and not isinstance(ts, bool) else 0.0


def segment_key_ok(key: Any) -> bool:
    """`segments/…`: relative, '/'-separated, no empty, hidden, '.' or '..' part, at most 1 KiB."""
    if not isinstance(key, str) or not key.startswith("segments/") or len(key) > MAX_SEGMENT_KEY or "\\" in key:
        return False
    return all(part and not part.startswith(".") and part.isprintable() for part in key.split("/"))


def _tgb(f: _Fields, t: Any) -> TgbRef:
    f.need(isinstance(t, dict), f"{f.what}: a TGB must be an object")
    f.need(segment_key_ok(t.get("segment")), f"{f.what}: bad segment key {t.get('segment')!r:.300}")
    ranks = t.get("ranks")
    f.need(isinstance(ranks, list) and len(ranks) > 0, f"{f.what}: a TGB needs its rank slices")
    # Every reader decodes every step's slices (hundreds of ranks): checked in C-level passes,
    # each a list of four ints >= 0 (a bool is not one here).
    ok = set(map(type, ranks)) == {list} and set(map(len, ranks)) == {4}
    flat = list(chain.from_iterable(ranks)) if ok else []
    if not ok or set(map(type, flat)) != {int} or min(flat) < 0:
        rs = next(rs for rs in ranks if not (isinstance(rs, list) and len(rs) == 4
                                             and all(type(x) is int and x >= 0 for x in rs)))  # fmt: skip
        raise RecordError(f"{f.what}: bad rank slice {rs!r:.100}")
    out = list(map(RankSlice._make, ranks))  # what `State` keeps: made once per process (`decode_record`)
    checksum = t.get("checksum", "crc32")
    f.need(isinstance(checksum, str) and checksum in CHECKSUM_BITS, f"{f.what}: unknown checksum {checksum!r:.40}")
    mix, sources = t.get("mix"), t.get("sources")
    # A fork's mixture in force when it forked has version 0 (its create record's).
    f.need(mix is None or (type(mix) is int and mix >= 0), f"{f.what}: bad mix version {mix!r:.40}")
    if sources is not None:
        f.need(
            isinstance(sources, list) and 0 < len(sources) <= MAX_SOURCES
            and all(isinstance(x, list) and len(x) == 2 and isinstance(x[0], str) and SOURCE_NAME.match(x[0])
                    and type(x[1]) is int and x[1] >= 0 for x in sources)
            and len({x[0] for x in sources}) == len(sources),
            f"{f.what}: bad sources {sources!r:.100}",
        )  # fmt: skip
        sources = tuple((x[0], x[1]) for x in sources)
    packed = t.get("packed")
    if packed is not None:
        f.need(
            isinstance(packed, list) and 0 < len(packed) <= MAX_PACKED
            and all(isinstance(x, list) and len(x) == 3 and isinstance(x[0], str) and PRODUCER_ID.match(x[0])
                    and type(x[1]) is int and x[1] > 0 for x in packed)
            and len({x[0] for x in packed}) == len(packed),
            f"{f.what}: bad packed {packed!r:.100}",
        )  # fmt: skip
        packed = tuple((x[0], x[1], x[2]) for x in packed)
    return TgbRef(t["segment"], tuple(out), t.get("cursor"), mix, sources, checksum, packed)


def record_kind(data: bytes) -> str | None:
    """The kind a record in `encode_record`'s form names first, without decoding it (None: not in
    that form). Only a hint: what the record is, and whether it is valid, takes `decode_record`."""
    if data.startswith(b'{"kind":"') and (end := data.find(b'"', 9, 64)) > 9:
        return data[9:end].decode("ascii", "replace")
    return None


# The records of the last few large versions decoded in this process, by their bytes: the log
# followers of one process (a node's ranks, a mount, a simulation's thousands of clients) each
# read every version, and a group or a step of hundreds of ranks costs far more to decode than
# to look up. Records are immutable, so one decoded record serves every follower.
_DECODED: dict[bytes, Record] = {}
DECODED_MAX, DECODED_MIN_BYTES = 64, 4096


def decode_record(data: bytes) -> Record:
    """The typed record stored in `data`. Raises RecordError for anything else."""
    cache = type(data) is bytes and len(data) >= DECODED_MIN_BYTES
    if cache and (record := _DECODED.get(data)) is not None:
        return record
    try:
        r = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise RecordError(f"JSONDecodeError: {e}") from None
    record = _decode(r)
    if cache:
        if len(_DECODED) >= DECODED_MAX:
            with contextlib.suppress(RuntimeError, StopIteration):  # another thread changed it meanwhile
                _DECODED.pop(next(iter(_DECODED)), None)  # the oldest
        _DECODED[data] = record
    return record


def _job(f: _Fields, r: dict[str, Any], what: str, *, required: bool = False) -> str:
    """The record's `job`: a job name; absent (unless `required`): `main`."""
    job = r.get("job", None if required else MAIN_JOB)
    f.need(isinstance(job, str) and bool(JOB_NAME.fullmatch(job)), f"{what}: bad job name {job!r:.80}")
    return str(job)


def _url(f: _Fields, url: Any, what: str) -> str:
    try:
        return check_stream_url(url)
    except ValueError as e:
        raise RecordError(f"{what}: {e}") from None


def _decode(r: Any, *, inner: bool = False) -> Record:
    if not isinstance(r, dict) or not isinstance(r.get("kind"), str):
        raise RecordError("not a record: a JSON object with a string 'kind' is required")
    kind = r["kind"]
    if inner and kind not in ("register", "commit"):
        raise RecordError(f"group: a group holds register and commit records, not {kind!r:.40}")
    f = _Fields(r, kind)
    if kind == "create":
        f.need(isinstance(r.get("config"), dict), "create: config must be an object")
        base = None
        if "fork" in r:
            g = r["fork"]
            f.need(
                isinstance(g, dict) and isinstance(g.get("state"), dict), "create: fork must be an object with a state"
            )
            base = ForkBase(_url(f, g.get("source"), "create: fork"), _Fields(g, "create: fork").int("at_step"),
                            g["state"])  # fmt: skip
        try:
            return CreateRecord(Config.from_dict(r["config"]), f.ts(), base)
        except (ValueError, TypeError) as e:
            raise RecordError(f"{type(e).__name__}: {e}") from None
    if kind == "register":
        pid = r.get("producer")
        f.need(isinstance(pid, str) and bool(PRODUCER_ID.match(pid)), f"register: bad producer id {pid!r}")
        f.what = f"register {pid}"
        epoch = f.int("epoch", 1, why=f"register {pid}: epoch {r.get('epoch')!r} is not a positive integer")
        resume = None
        if "resume" in r:
            f.need(isinstance(r["resume"], dict), f"register {pid}: resume must be an object")
            g = _Fields(r["resume"], f"register {pid}: resume")
            resume = Resume(g.int("seq", -1), r["resume"].get("cursor"), g.int("batch", 1))
        return RegisterRecord(str(pid), epoch, f.str("token"), f.ts(), resume)
    if kind == "commit":
        pid = r.get("producer")
        f.need(isinstance(pid, str), f"commit: producer {pid!r} is not registered")
        f.what = f"commit {pid}"
        epoch, seq = f.int("epoch"), f.int("seq")
        lost = f.int("lost", why=f"commit {pid}: lost must be a count, not {r.get('lost')!r}") if "lost" in r else 0
        tgbs: Any = r.get("tgbs")
        f.need(isinstance(tgbs, list) and len(tgbs) > 0, f"commit {pid}: tgbs must be a non-empty list")
        packs: Any = r.get("packs", [])
        f.need(
            isinstance(packs, list) and len(packs) <= MAX_PACKED
            and all(isinstance(x, list) and len(x) == 2 and isinstance(x[0], str) and segment_key_ok(x[1])
                    for x in packs) and len({x[0] for x in packs}) == len(packs),
            f"commit {pid}: bad packs {packs!r:.100}",
        )  # fmt: skip
        refs = tuple(_tgb(f, t) for t in tgbs)
        f.need(all((t.packed is not None) == bool(packs) for t in refs),
               f"commit {pid}: a TGB names packed samples, or not, unlike its commit's packs")  # fmt: skip
        return CommitRecord(str(pid), epoch, seq, refs, lost, f.ts(), tuple((x[0], x[1]) for x in packs))
    if kind == "finish":
        pid = r.get("producer")
        f.need(isinstance(pid, str), f"finish: producer {pid!r} is not registered")
        f.what = f"finish {pid}"
        epoch, seq, head = f.int("epoch"), f.int("seq", -1), f.int("head", -1)
        raw, cur = r.get("leftover"), r.get("cursors")
        if raw is None:
            f.need(cur is None, f"finish {pid}: cursors without a leftover")
            return FinishRecord(str(pid), epoch, seq, head, None, None, f.ts())
        left = _tgb(f, raw)
        f.need(len(left.ranks) == 1 and left.packed is None, f"finish {pid}: a leftover is one slice of samples")
        f.need(
            isinstance(cur, list) and len(cur) == 3 and all(type(x) is int and x >= 0 for x in cur),
            f"finish {pid}: bad cursors {cur!r:.100}",
        )
        assert isinstance(cur, list)
        return FinishRecord(str(pid), epoch, seq, head, left, (cur[0], cur[1], cur[2]), f.ts())
    if kind == "checkpoint":
        cid = r.get("id")
        f.need(isinstance(cid, str) and 0 < len(cid) <= MAX_CHECKPOINT_ID, f"checkpoint: bad id {cid!r}")
        step = f.int("step", why=f"checkpoint {cid}: bad step {r.get('step')!r}")
        return CheckpointRecord(str(cid), step, f.ts(), _job(f, r, f"checkpoint {cid}"))
    if kind == "release":
        cid = r.get("id")
        f.need(isinstance(cid, str), f"release: no checkpoint {cid!r}")
        return ReleaseRecord(str(cid), f.ts(), _job(f, r, "release"))
    if kind == "job":
        f.need(type(r.get("retire", False)) is bool, f"job: retire must be true or false, not {r.get('retire')!r:.40}")
        return JobRecord(_job(f, r, "job", required=True), r.get("retire", False), f.ts())
    if kind == "reclaim":
        return ReclaimRecord(f.int("below", why=f"reclaim: bad step {r.get('below')!r}"), f.ts())
    if kind == "rewind":
        to = f.int("to_step", -1, why=f"rewind: bad step {r.get('to_step')!r}")
        return RewindRecord(to, f.ts(), check_skip(r.get("skip", []), to) if "skip" in r else ())
    if kind == "close":
        return CloseRecord(f.int("after_step", -1, why=f"close: bad step {r.get('after_step')!r:.40}"), f.ts())
    if kind == "reopen":
        return ReopenRecord(f.ts())
    if kind == "fork":
        return ForkRecord(_url(f, r.get("url"), "fork"), f.int("at_step", why=f"fork: bad step {r.get('at_step')!r:.40}"),
                          f.ts())  # fmt: skip
    if kind == "unfork":
        return UnforkRecord(_url(f, r.get("url"), "unfork"), f.ts())
    if kind == "detach":
        return DetachRecord(f.ts())
    if kind == "mix":
        try:
            weights = () if r.get("weights") == [] else check_weights(r.get("weights"))  # [] clears
        except ValueError as e:
            raise RecordError(f"mix: {e}") from None
        return MixRecord(f.int("from_step", why=f"mix: bad step {r.get('from_step')!r:.40}"), weights, f.ts())
    if kind == "reshape":
        lo, hi = LIMITS["world_size"]
        world = f.int("world_size", lo, why=f"reshape: bad world size {r.get('world_size')!r:.40}")
        batch = f.int("global_batch", lo, why=f"reshape: bad global batch {r.get('global_batch')!r:.40}")
        f.need(world <= batch <= LIMITS["global_batch"][1], f"reshape: global batch {batch} for world size {world}")
        f.need(world <= hi, f"reshape: world size {world} is above the limit {hi}")
        step = f.int("from_step", why=f"reshape: bad step {r.get('from_step')!r:.40}")
        return ReshapeRecord(step, world, batch, f.ts())
    if kind == "group" and not inner:
        records: Any = r.get("records")
        f.need(isinstance(records, list) and 0 < len(records) <= MAX_GROUP,
               f"group: records must be a list of 1 to {MAX_GROUP}")  # fmt: skip
        subs = tuple(_decode(x, inner=True) for x in records)
        f.need(all(not getattr(x, "packs", ()) for x in subs), "group: a commit in a group packs no leftovers")
        return GroupRecord(subs, f.ts())  # type: ignore[arg-type]
    raise RecordError(f"unknown record kind {kind!r}")
