"""The manifest log on an object store: load, follow, append (optimistic concurrency), snapshot.

Layout under the stream root:

    _lakestream/log/<version:020d>.json        one record per version; version 0 is `create`
    _lakestream/snapshots/<version:020d>.json  the whole state at that version, sealed (`State.to_json`)
    _lakestream/last_snapshot                  best-effort hint: {"version": v}

Appending is a put-if-absent of `version + 1`. The loser of a race reads the versions it missed,
applies them, asks its `build` callback for a record valid on the new state, and tries again;
because `apply` assigns step numbers, a commit record never has to be rewritten (see
`_state`). The tail is found by reading forward until a GET answers "not found": no LIST on
the hot path.

Ambiguity and ABA. A put may land while its answer is lost; the retry meets its own record. The
writer never trusts a put's answer alone for the meaning of what it wrote: `build` derives what is
still to do from the state, so a record that landed is seen as landed. Deleting old log versions
(GC) opens one more hazard: a writer stalled since before a deletion could re-create a deleted
version and believe it committed. Three rules rule it out:

1. GC deletes log version v (and snapshots older than v) only once the hint has pointed at a
   snapshot above v for at least `lease` seconds, and deletes log versions in ascending order.
2. A writer or reader whose view of the tail was last confirmed more than `lease / 2` ago first
   moves to the newest snapshot (found by LIST) before it reads or puts the next version.
3. A writer whose put succeeded more than `lease / 2` after its view was confirmed does not take
   the success at its word: it reloads from the newest snapshot and re-derives what landed, as for
   an ambiguous put. A resurrected version lies below that snapshot and is never read.

Within `lease / 2` of a confirmation no version above the confirmed tail can have been deleted
(it would need a snapshot above it that is `lease` old), so a put in that window meets a
"precondition failed" rather than a gap.

Snapshots are a cache of the log, and are not trusted blindly (`read_snapshot`). One is used only
if its checksum matches (`State.from_json`; old unsealed snapshots on their structure alone), every
field and invariant checks out, the version inside equals the version in its name, the log record
at that version still exists, and the state reflects that record (`State.check_last_record`: one
GET, not a replay; it catches a snapshot that drops or alters the newest steps whenever its
version is a commit, as the producers' snapshots are). A snapshot that fails is skipped with a
warning naming it, and the next older one is tried, and finally the log from version 0; what was
skipped is kept in `Manifest.problems`, and GC refuses to act on such a load. A snapshot forged
with a recomputed checksum and consistent with its own log record is not caught here, only by a
replay of the log below it (`audit_snapshots`, which `verify` and GC run).

Without a usable snapshot the log is read from version 0, and one LIST of the log checks that
the version where reading stopped is really the tail: if later versions exist (the versions below
were cleaned up, and the snapshot that covered them is gone or bad), the stream has a hole, and
`load` raises CorruptData naming it rather than showing a stream that looks empty or old.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import anyio
import orjson

from . import _decisions as decisions
from ._errors import ConfigMismatch, CorruptData, ObjectNotFound, StoreUnavailable, StreamNotFound
from ._layout import HINT_KEY, LOG_PREFIX, SNAPSHOT_PREFIX, TAIL_KEY, consumed_key, log_key, snapshot_key, version_of
from ._records import MAIN_JOB, PRODUCER_ID, Record, encode_record
from ._retry import STORE_BACKOFF, retry
from ._state import Config, State
from ._store import ObjectStore
from ._tasks import task_group

__all__ = [
    "LOG_PREFIX", "SNAPSHOT_PREFIX", "AppendResult", "Manifest", "Tail", "create_stream", "log_key", "snapshot_key",
]  # fmt: skip

MAX_WINDOW = 32
RATE_HORIZON = 5.0  # seconds over which the log's growth rate is averaged

log = logging.getLogger("lakestream.log")


async def _get_or_none(store: ObjectStore, key: str) -> bytes | None:
    try:
        return await store.get(key)
    except ObjectNotFound:
        return None


async def create_stream(store: ObjectStore, config: Config, *, wall: Callable[[], float] = time.time) -> bool:
    """Create the stream; True if created, False if it existed with the same config.

    Raises ConfigMismatch naming every option that differs.
    """
    if await store.put_if_absent(log_key(0), encode_record(decisions.create(config, wall()))):
        return True
    state = State()
    state.apply(0, await store.get(log_key(0)))
    if state.config is None:
        raise ConfigMismatch(f"{store.url}: version 0 is not a valid create record: {state.rejected}")
    have, want = state.config.to_dict(), config.to_dict()
    diff = [f"{k}: stream has {have.get(k)!r}, asked for {want[k]!r}" for k in want if have.get(k) != want[k]]
    if diff:
        raise ConfigMismatch(f"{store.url}: a stream exists with another config: " + "; ".join(diff))
    return False


@dataclass(frozen=True, slots=True)
class AppendResult:
    """What `Manifest.append` did."""

    version: int | None  # the version written; None: the decision said nothing was left to do
    record: Record | None  # what was written
    conflicts: int  # races lost to other writers before it landed
    probe_latency: float  # the read round that last found the tail
    put_latency: float  # the last conditional put


class Tail(NamedTuple):
    """The tail hint: the log's `version` and `head` when a combiner wrote it; `beat` counts its
    rounds that committed nothing, so that producers waiting for it can tell a combiner at work
    (held by back-pressure) from none; `rules` is `State.rules_digest()` there (-1: not given), so
    that a producer starting from a snapshot knows whether the versions since changed the rules;
    `landed` names, for each producer whose TGBs landed in a version after `since`, the newest
    such version (`State.landings`), so that it reads that one version to learn what landed;
    `leader` names the combiner at work ("": none named), so that producers whose views started
    from a snapshot know that one exists and give it time before taking over; `mark` is the
    consumption mark that combiner committed on (None: not given), so that a producer about to
    upload learns the room left from one GET, not two."""

    version: int
    head: int
    beat: int
    rules: int = -1
    since: int = -1
    landed: Mapping[str, int] = {}
    leader: str = ""
    mark: int | None = None


TAIL_LANDINGS = 64  # versions the tail hint's `landed` covers
MAX_TAIL = 1 << 16  # bytes of a tail hint read (1,024 producers' landings)


def _tail(data: bytes) -> Tail | None:
    """The tail hint in `data`, validated (None: unusable; a `landed` part that is not what it
    should be is left out, so the producers reading it read the versions themselves)."""
    try:
        d = orjson.loads(data) if len(data) <= MAX_TAIL else None
    except ValueError:
        return None
    if not isinstance(d, dict):
        return None
    ints = [d.get("version"), d.get("head"), d.get("beat"), d.get("rules", -1), d.get("since", -1)]
    if not all(type(v) is int and -1 <= v < 1 << 63 for v in ints):
        return None
    version, head, beat, rules, since = ints
    landed = d.get("landed", {})
    if not (
        isinstance(landed, dict) and since <= version
        and all(type(v) is int and since < v <= version and PRODUCER_ID.match(k) for k, v in landed.items())
    ):  # fmt: skip
        since, landed = version, {}
    leader = d.get("leader", "")
    if not (isinstance(leader, str) and (leader == "" or PRODUCER_ID.match(leader))):
        leader = ""  # not a producer id: none named (producers wait as if none were at work)
    mark = d.get("mark")
    if not (type(mark) is int and -1 <= mark < 1 << 63):
        mark = None  # not given, or not a step: producers read the mark itself
    return Tail(version, head, beat, rules, since, landed, leader, mark)


class Manifest:
    """A live view of one stream's manifest. One task appends at a time; others may refresh."""

    def __init__(
        self,
        store: ObjectStore,
        *,
        lease: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        retries: int | None = 8,
        rng: random.Random | None = None,
    ) -> None:
        self.store = store
        self.retries = retries  # None: retry transient failures for as long as it takes
        self._attempts = None if retries is None else 6  # of each read
        self.rng = rng or random.Random()
        self.state = State()
        self.lease = lease
        self.clock = clock
        self.confirmed_at = -math.inf  # clock() when the tail was last confirmed
        # clock() when the read that brought the newest versions applied was sent: the version
        # landed before the store answered it, so a follower pacing itself takes this, not the
        # moment the answer came back, for when it arrived (a GET's latency would otherwise make
        # each step look later than the last by that much, and the next look for it come late).
        self.found_at = -math.inf
        self.requests = 0  # store requests made for the log (for cost accounting)
        self._probe_latency = 0.0  # the read round that found the tail, last time
        self.problems: list[str] = []  # snapshots the last load skipped as bad (see `read_snapshot`)
        self._missing = ""  # the snapshot the hint named, if the last load did not find it
        self._refreshing = anyio.Lock()
        # Called with the state after each version it applies (tools that must see every step,
        # even one that a rewind discards within the same refresh).
        self.on_apply: Callable[[State], None] | None = None
        # The log's growth rate (versions per second, decayed over RATE_HORIZON), from which a
        # refresh guesses how many versions to read in its first parallel round.
        self._seen = (-1, -math.inf)  # (version, clock) at the last confirmed tail
        self._versions = 0.0
        self._seconds = 0.0

    @property
    def url(self) -> str:
        return self.store.url

    # -- reading -------------------------------------------------------------------------------

    async def _get(self, key: str) -> bytes | None:
        return await retry(lambda: _get_or_none(self.store, key), attempts=self._attempts)

    async def load(self, *, follow: bool = True) -> State:
        """(Re)build the state from the newest usable snapshot and the log after it; without
        `follow`, from the newest snapshot alone (or, with no snapshot hint, version 0): a view that
        may be behind the log, for a combining producer (see `Producer`).

        Raises StreamNotFound if the stream was never created, CorruptData if no usable snapshot
        covers a hole in the log (versions missing below others that exist).
        """
        started = self.clock()
        self.problems = []
        self._missing = ""
        state, hinted = await self._newest_snapshot(listing=follow)
        self.state = state or State()
        self.confirmed_at = started  # the hint is as fresh as the moment it was read (rule 1)
        if not follow and state is None and (data := await self.read_version(0)) is not None:
            self.state.apply(0, data)
        if not follow and self.state.config is not None:
            return self.state
        await self.refresh()
        if not hinted:
            await self._check_log_is_whole()
        if self.state.version < 0:
            raise StreamNotFound(f"{self.url}: no stream here (no {log_key(0)})")
        return self.state

    async def read_snapshot(self, version: int) -> State:
        """The snapshot at `version`, checked (see the module docstring).

        Raises ObjectNotFound if there is none, CorruptData naming it if it fails a check.
        """
        key = snapshot_key(version)
        data = await self._get(key)
        self.requests += 1
        if data is None:
            raise ObjectNotFound(f"{self.url}: no snapshot {key}")
        record = await self._get(log_key(version))
        self.requests += 1
        try:
            state = await anyio.to_thread.run_sync(State.from_json, data)
        except ValueError as e:
            raise CorruptData(f"{self.url}: snapshot {key} is unusable: {e}") from None
        if state.version != version:
            raise CorruptData(f"{self.url}: snapshot {key} holds the state at version {state.version}, not {version}")
        if record is None:
            raise CorruptData(f"{self.url}: snapshot {key}: the log version it covers ({log_key(version)}) is missing")
        why = state.check_last_record(record)
        if why is not None:
            raise CorruptData(f"{self.url}: snapshot {key} disagrees with {log_key(version)}: {why}")
        return state

    def _skip(self, e: CorruptData) -> None:
        log.warning("%s; falling back to an older snapshot or the log", e)
        self.problems.append(str(e))

    async def _newest_snapshot(self, *, listing: bool = True) -> tuple[State | None, bool]:
        """The newest usable snapshot, and whether it is the one the hint names. Without `listing`,
        none when there is no hint (a view that need not be the newest: every snapshot writer
        points the hint at its snapshot, and GC deletes no log version before it did, so the log
        is whole from version 0; thousands of producers starting save a LIST each)."""
        hint = await self._get(HINT_KEY)
        self.requests += 1
        if hint is None and not listing:
            return None, False
        tried = None
        if hint is not None:
            try:
                tried = orjson.loads(hint)["version"]
            except (ValueError, KeyError, TypeError):
                pass
            if type(tried) is not int or tried < 0:
                log.warning("%s: ignoring the unreadable snapshot hint %s: %r", self.url, HINT_KEY, hint[:100])
                tried = None
        if tried is not None:
            try:
                return await self.read_snapshot(tried), True
            except ObjectNotFound:
                self._missing = f"the hint names {snapshot_key(tried)}, which does not exist"
                log.info("%s: %s", self.url, self._missing)
            except CorruptData as e:
                self._skip(e)
        return await self._newest_listed_snapshot(skip=tried), False

    async def _newest_listed_snapshot(self, skip: int | None = None) -> State | None:
        keys = await retry(lambda: self.store.list(SNAPSHOT_PREFIX), attempts=self._attempts)
        self.requests += 1
        versions = sorted((v for k in keys if (v := version_of(k)) is not None and v != skip), reverse=True)
        for v in versions:
            try:
                return await self.read_snapshot(v)
            except ObjectNotFound:
                continue  # deleted since the listing (log clean-up): an older one may still be there
            except CorruptData as e:
                self._skip(e)
        return None

    async def audit_snapshots(self) -> list[str]:
        """Replay the retained log through every stored snapshot and compare; the problems found.

        What `read_snapshot`'s cheap checks cannot see (a snapshot forged with a recomputed checksum
        yet consistent with its own log record) a replay does. The replay starts at version 0 if
        the log below the oldest snapshot is whole, else at the oldest snapshot that passes its
        checks. O(retained log) GETs, like `verify`, which runs it.
        """
        listed = await retry(lambda: self.store.list(SNAPSHOT_PREFIX))
        snaps = sorted(v for k in listed if (v := version_of(k)) is not None)
        logs = {v for k in await retry(lambda: self.store.list(LOG_PREFIX)) if (v := version_of(k)) is not None}
        problems: list[str] = []
        replay = Manifest(self.store, lease=math.inf, clock=self.clock)  # never jumps to a snapshot
        if snaps and not all(v in logs for v in range(snaps[0])):
            for v in snaps:
                try:
                    replay.state = await self.read_snapshot(v)
                    break
                except (ObjectNotFound, CorruptData) as e:
                    problems.append(str(e))
        seen: dict[int, tuple[bytes, int, int]] = {}  # version: (digest, first step, head) of the replay
        wanted = set(snaps)

        def look(st: State) -> None:
            if st.version in wanted:
                seen[st.version] = (hashlib.sha256(st.to_json()).digest(), st.first_step, st.head)

        replay.on_apply = look
        await replay.refresh()
        for v, (digest, first, head) in sorted(seen.items()):
            key = snapshot_key(v)
            data = await self._get(key)
            try:
                stored = None if data is None else await anyio.to_thread.run_sync(State.from_json, data)
            except ValueError as e:
                problems.append(f"{self.url}: snapshot {key} is unusable: {e}")
                continue
            if stored is not None and hashlib.sha256(stored.to_json()).digest() != digest:
                problems.append(
                    f"{self.url}: snapshot {key} differs from the replay of the log to version {v} (it holds "
                    f"steps {stored.first_step}..{stored.head}, the log {first}..{head})"
                )
        for v in snaps:
            if v > replay.state.version:
                problems.append(f"{self.url}: snapshot {snapshot_key(v)} is past the log's tail {replay.state.version}")
        return problems

    async def _check_log_is_whole(self) -> None:
        """Raise CorruptData if log versions exist above the one where reading stopped."""
        keys = await retry(lambda: self.store.list(LOG_PREFIX), attempts=self._attempts)
        self.requests += 1
        versions = {v for k in keys if (v := version_of(k)) is not None}
        missing = self.state.version + 1
        above = max(versions, default=-1)
        if above > missing and missing not in versions:
            why = "".join(f"; {x}" for x in (self._missing, *self.problems) if x)
            raise CorruptData(
                f"{self.url}: the log has a hole: version {missing} ({log_key(missing)}) is missing while "
                f"versions up to {above} exist, and no usable snapshot covers it{why}"
            )

    async def refresh(self, window: int | None = None, *, enough: Callable[[], bool] | None = None) -> int:
        """Apply every version written since the last call; the number applied.

        Reads forward in parallel windows that double while versions keep coming, so catching up
        on a long log costs O(log) round trips. The first window is `window`, or else the number
        of versions usually found (an EWMA), so a caller at the tail pays one GET and a producer
        among N others about one round trip of N GETs. A small `window` confirms a tail that was
        just caught up with (one GET when nothing new landed), without the catch-up's slowest GET.
        With `enough`, it stops after a window of versions that makes `enough()` true, without
        confirming the tail (a reader that waited for a step needs no more: the GETs of versions
        not written yet that would confirm it are left to its next wait).
        """
        async with self._refreshing:  # one reader of the log at a time: versions apply in order
            return await self._refresh(window, enough)

    async def follow(self, enough: Callable[[], bool] | None = None) -> int:
        """`refresh` for readers that share this view (ranks of one node): while another task
        reads the log, wait for it and take what it applied rather than read the log again. The
        versions applied since the call, by whichever task."""
        if not self._refreshing.locked():
            return await self.refresh(enough=enough)
        before = self.state.version
        async with self._refreshing:
            pass
        return self.state.version - before

    async def _refresh(self, first: int | None, enough: Callable[[], bool] | None = None) -> int:
        applied = 0
        if self.clock() - self.confirmed_at > self.lease / 2:
            # Rule 2 for readers too: a view this old may sit below a log clean-up.
            listed = self.clock()
            state = await self._newest_listed_snapshot()
            if state is not None and state.version > self.state.version:
                self.state = state
                self.found_at = listed
                applied += 1
        window = max(1, min(MAX_WINDOW, first or self._expected()))
        found = 0
        while True:
            started = self.clock()
            base = self.state.version + 1
            results: list[bytes | None] = [None] * window

            async def fetch(i: int) -> None:
                results[i] = await self._get(log_key(base + i))

            if window == 1:  # a reader at the tail: one GET, no task group around it
                await fetch(0)
            else:
                async with task_group() as tg:
                    for i in range(window):
                        tg.start_soon(fetch, i)
            self.requests += window
            for i, data in enumerate(results):
                if data is None:
                    self._probe_latency = self.clock() - started
                    self.confirmed_at = started
                    self._observe_growth(started)
                    return applied
                self.state.apply(base + i, data)
                if self.on_apply is not None:
                    self.on_apply(self.state)
                applied += 1
                found += 1
                self.found_at = started
            if enough is not None and enough():
                return applied
            window = min(window * 2, MAX_WINDOW)

    def _observe_growth(self, now: float) -> None:
        version, at = self._seen
        if version >= 0 and now > at:
            decay = math.exp(-(now - at) / RATE_HORIZON)
            self._versions = self._versions * decay + (self.state.version - version)
            self._seconds = self._seconds * decay + (now - at)
        self._seen = (self.state.version, now)

    def _expected(self) -> int:
        """Versions likely written since the tail was last confirmed (at least one GET)."""
        version, at = self._seen
        if self._seconds <= 0 or version != self.state.version:
            return 1
        return math.ceil(self._versions / self._seconds * (self.clock() - at))

    # -- writing -------------------------------------------------------------------------------

    async def append(
        self,
        decide: Callable[[State, int], Record | None],
        *,
        fresh: bool = False,
        conflict_delay: Callable[[int], float] | None = None,
    ) -> AppendResult:
        """Append `decide(state, lost)` at the next version, deciding again after every lost race.

        `decide` (one of `_decisions`, with the caller's intent bound) sees the state the record
        will follow and how many races this call has lost, and returns the record, or None when
        nothing is left to do (an earlier ambiguous put already landed); it raises to abort (a
        fenced producer does). A put whose answer is lost (StoreUnavailable) is retried `retries`
        times with backoff (forever with `retries=None`); the retry reads the log first, so a put
        that did land is recognised, not repeated. `fresh` reads the log to its tail before the
        first put ("listen before talk"); `conflict_delay(n)` is how long to wait after the n-th
        lost race. Returns what happened (`AppendResult`).
        """
        failures = conflicts = 0
        put_latency = 0.0
        while True:
            try:
                if fresh or failures or self.clock() - self.confirmed_at > self.lease / 2:
                    await self.refresh()
                if fresh:
                    # Listen before talk: the catch-up above waits for its slowest GET, and others
                    # may commit meanwhile; one more GET right before the put narrows the window
                    # in which a put can meet another to a single round trip.
                    fresh = False
                    await self.refresh(window=1)
                record = decide(self.state, conflicts)
                if record is None:
                    return AppendResult(None, None, conflicts, self._probe_latency, put_latency)
                why = self.state.check(record)
                if why is not None:
                    raise ValueError(f"{self.url}: refusing to write a record that would be a no-op: {why}")
                version = self.state.version + 1
                data = encode_record(record)
                self.requests += 1
                put_started = self.clock()
                won = await self.store.put_if_absent(log_key(version), data)
                put_latency = self.clock() - put_started
            except StoreUnavailable as e:
                failures += 1
                if self.retries is not None and (e.retried or failures > self.retries):
                    raise
                await anyio.sleep(STORE_BACKOFF.delay(failures, self.rng))
                continue
            if not won:
                conflicts += 1
                if conflict_delay is not None and (wait := conflict_delay(conflicts)) > 0:
                    await anyio.sleep(wait)
                await self.refresh(window=1)  # usually one version, the winner's
                continue
            if self.clock() - self.confirmed_at > self.lease / 2:
                # Rule 3: too long since the tail was confirmed to take the success at its word.
                self.confirmed_at = -math.inf
                await self.refresh()
                continue
            async with self._refreshing:  # a refresh in another task may have applied it already
                if self.state.version < version:
                    self.state.apply(version, data)
                    if self.on_apply is not None:
                        self.on_apply(self.state)
                self.confirmed_at = self.clock()
                self._observe_growth(self.confirmed_at)
            return AppendResult(version, record, conflicts, self._probe_latency, put_latency)

    async def read_version(self, version: int) -> bytes | None:
        """The record stored at `version` (None: not written), without applying it."""
        self.requests += 1
        return await self._get(log_key(version))

    # -- hints: where the log ends, what the trainer consumed ------------------------------------

    async def read_tail(self) -> Tail | None:
        """Where the log ended when its last writer wrote the tail hint, or None (see `Tail`). A
        hint: it may be behind (a slower writer's), never trusted for more than where to look."""
        data = await self._get(TAIL_KEY)
        self.requests += 1
        if data is None:
            return None
        if (tail := _tail(data)) is None:
            log.warning("%s: ignoring the unreadable %s: %r", self.url, TAIL_KEY, data[:100])
        return tail

    async def write_tail(self, state: State, beat: int = 0, leader: str = "", mark: int | None = None) -> None:
        """Point the tail hint at `state`, naming `leader` as the combiner at work and the
        consumption `mark` it commits on (see `Tail`)."""
        since, landed = state.landings(TAIL_LANDINGS)
        await self.put_tail(Tail(state.version, state.head, beat, state.rules_digest(), since, landed, leader, mark))

    async def put_tail(self, tail: Tail) -> None:
        """Write `tail` as the tail hint (a combiner taking over names itself in the one it read)."""
        hint: dict[str, Any] = {"version": tail.version, "head": tail.head, "beat": tail.beat, "rules": tail.rules}
        hint.update(since=tail.since, landed=dict(tail.landed))
        if tail.leader:
            hint["leader"] = tail.leader
        if tail.mark is not None:
            hint["mark"] = tail.mark
        await self.store.put(TAIL_KEY, orjson.dumps(hint))
        self.requests += 1

    async def read_consumed(self, job: str = MAIN_JOB) -> int | None:
        """The step training job `job` consumed last, as its reader last published it (`publish_consumed`)."""
        mark = await self.read_mark(job)
        return None if mark is None else mark[0]

    async def read_mark(self, job: str = MAIN_JOB) -> tuple[int, float] | None:
        """(step, when) of training job `job`'s consumption mark, or None (absent, or unreadable: a
        hint anyone could have written, so validated and ignored with a warning when it is bad)."""
        key = consumed_key(job)
        data = await self._get(key)
        self.requests += 1
        if data is None:
            return None
        try:
            d = orjson.loads(data[:256])
            step, ts = d["step"], d.get("ts", 0.0)
        except (ValueError, KeyError, TypeError):
            step = ts = None
        if not (type(step) is int and -1 <= step < 1 << 63 and type(ts) in (int, float) and math.isfinite(ts)):
            log.warning("%s: ignoring the unreadable %s: %r", self.url, key, data[:100])
            return None
        return step, float(ts)

    async def publish_consumed(self, step: int, now: float, job: str = MAIN_JOB) -> None:
        await self.store.put(consumed_key(job), orjson.dumps({"step": step, "ts": now}))
        self.requests += 1

    async def write_snapshot(self, state_json: bytes, version: int) -> None:
        """Store a snapshot (same bytes from every writer) and point the hint at it."""
        await self.store.put(snapshot_key(version), state_json)
        await self.store.put(HINT_KEY, orjson.dumps({"version": version}))
        self.requests += 2
