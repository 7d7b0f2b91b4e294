"""The checker: one function per guarantee (docs/guarantees.md), named after it, each returning the
failures it found (an empty list: the guarantee held in this run).

Checked while the run goes on, as the journals and the log come in:

* `check_same_read` (atomic visibility): every read of one (step, version, rank) — by a Python
  reader, through the mount, or the final read — has the same producer and the same bytes;
* `check_rewind_resumes_at_checkpoint`: after the rewind the head is the checkpoint's step and
  every producer's committed cursor is its cursor as of that step; `check_resume_after_rewind`:
  the first incarnation of each producer registered after the rewind resumes there;
* `check_replay_keeps_the_rest_in_order` (with `--replay`, instead of those two): right after the
  replay the steps after the checkpoint are the old ones but the skipped, in order, the same TGBs;
  the skipped ones are the state's skipped list; no producer's epoch or cursor moved;
* with `--fork`: `check_fork_shares_the_source_steps` as it forks (and again at the end);
  `check_fork_producer_resumes_at_the_fork_step`: the first incarnation of each producer that
  registers on the fork resumes at the source's cursor as of the fork step.

Checked at the end (`check_all`, in this order):

* `check_gap_free_order`: the follower saw every step of the final history, and its history agrees
  with the final state (and the skipped TGBs it keeps with the replay's); no log record was rejected;
* `check_sources_finished`: every producer's final cursor is the end of its source;
* `check_every_reader_consumed_the_final_history`;
* `check_reclaimed_steps_were_consumed_first`: each step GC reclaimed was consumed by every reader
  before the first checkpoint covering it was recorded;
* `check_atomic_visibility`: everything a reader consumed is a TGB the log has, from the same
  producer; the mount's `_meta.json` names the TGB the log has;
* `check_exactly_once`: every source record is in exactly one step, or in one TGB a replay
  skipped, with its bytes;
* `check_source_order`: each producer's records are in source order, TGB by TGB (skipped ones in
  their place), with the right cursor at every step;
* `check_readers_failed_only_on_discarded_steps`;
* `check_storage_reclaimed`: after the final GC the segment bytes are those of the retained steps
  (within 10%), and after a log clean-up the whole stream prefix is at most 10% and 64 KiB (the
  log's own objects) over them;
* `check_verify_passes`: `lakestream verify`;
* with `--fork` (`check_fork`): `check_fork_shares_the_source_steps`, `check_sources_finished` on
  the fork, the fork's final read (`read_fork_steps`: its shared steps read the bytes the source's
  readers read), `check_fork_exactly_once` and `check_fork_source_order` over the fork's final
  history, `check_verify_passes` of the fork, `check_fork_run_again_changes_nothing`,
  `check_a_forked_source_refuses_delete`, `check_unfork_releases_the_source`.
"""

from __future__ import annotations

import json
import re
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cliutil import cursor_position

from .children import digest, sample_fields
from .context import REGISTERED, Run

if TYPE_CHECKING:
    from .roles import ProducerSlot

__all__ = ["Report", "check_all", "cursor_position", "figures"]


@dataclass
class Report:
    ok: bool
    failures: list[str]
    warnings: list[str]
    figures: dict[str, Any]
    workdir: str

    def summary(self) -> str:
        f = self.figures
        lines = [
            f"torture: {'OK' if self.ok else 'FAILED'}  seed {f.get('seed')}  duration {f.get('duration_s', 0):.1f} s "
            f"(chaos {f.get('chaos_s', 0):.1f} s, drain {f.get('drain_s', 0):.1f} s, "
            f"checks {f.get('check_s', 0):.1f} s)",
        ]
        for k, v in f.items():
            if k not in ("seed",):
                lines.append(f"  {k}: {v}")
        for w in self.warnings:
            lines.append(f"  WARNING: {w}")
        for x in self.failures:
            lines.append(f"  FAIL: {x}")
        return "\n".join(lines)


def journal_digest(samples: list[Any]) -> str:
    """What two reads of one (step, version, rank) are compared by."""
    return digest(json.dumps(samples, separators=(",", ":")).encode())


# =================================================================================================
# While the run goes on
# =================================================================================================


def check_same_read(
    run: Run, key: tuple[int, int, int], samples: list[Any], producer: str, *, who: str | None = None
) -> list[str]:
    """Atomic visibility: a (step, version, rank) reads the same (producer, keys, bytes) whoever
    reads it. The first read of each is kept in `run.contents`; `who` None is the final read."""
    d = journal_digest(samples)
    have = run.contents.get(key)
    if have is None:
        run.contents[key] = (d, samples, producer)
        return []
    if have[0] == d and have[2] == producer:
        return []
    step, version, rank = key
    if who is None:
        return [f"step {step} rank {rank}: the final read differs from the readers'"]
    return [
        f"{who}: step {step} version {version} rank {rank}: producer {producer} / samples "
        f"differ from an earlier read ({have[2]})"
    ]


def cursors_at(run: Run, step: int) -> dict[str, Any]:
    """Each producer's cursor as of `step` (its last TGB at or below it) in the follower's history."""
    last: dict[str, Any] = {}
    for s in range(0, step + 1):
        e = run.history.get(s)
        if e is not None:
            last.update(e.cursors())  # a step that packs leftovers moves each packed producer's cursor
    return last


def check_rewind_resumes_at_checkpoint(run: Run, step: int) -> list[str]:
    """Right after a rewind to the checkpoint at `step` (the state the follower saw when it applied
    the rewind record, before any restarted producer committed again): the head is `step`, and
    every producer's committed cursor is its cursor as of `step`."""
    if run.at_rewind is None:
        return ["the follower never saw the rewind record"]
    head, committed = run.at_rewind
    fails = []
    if head != step:
        fails.append(f"after the rewind the head is {head}, not the checkpoint's step {step}")
    cursors = cursors_at(run, step)
    for p in run.producers:
        want = cursors.get(p.pid)
        if p.pid in committed and committed[p.pid] != want:
            fails.append(f"after the rewind {p.pid}'s cursor is {committed[p.pid]}, expected {want}")
    return fails


def check_replay_keeps_the_rest_in_order(run: Run, step: int, skip: tuple[tuple[int, int], ...]) -> list[str]:
    """A replay to the checkpoint at `step` skipping `skip` (ranges of steps, inclusive), as the
    follower applied its record: the steps after `step` are the old ones but the skipped, in
    order, the same TGBs (segment, producer, epoch, seq, slices, cursor) at new step numbers and
    the record's version; the skipped steps' TGBs are the state's skipped list, as they were, each
    after the new step its predecessor became; no producer is fenced and no cursor moves."""
    seen = run.rewind_seen
    if seen is None:
        return ["the follower never saw the replay's rewind record"]
    if seen["to_step"] != step:
        return [f"the replay kept the steps up to {seen['to_step']}, not up to the checkpoint's step {step}"]
    gone = {n for a, b in skip for n in range(a, b + 1)}
    old, new, skipped = seen["old"], seen["new"], seen["skipped"]
    fails = []
    if [e.step for e in old] != list(range(step + 1, step + 1 + len(old))) or not gone <= {e.step for e in old}:
        fails.append(f"before the replay the follower had steps {[e.step for e in old][:20]}, skipping {sorted(gone)}")
    want_new, want_skipped = [], []
    for e in old:
        if e.step in gone:
            want_skipped.append([step + len(want_new), e.to_list()])
        else:
            want_new.append([step + 1 + len(want_new), seen["version"], *e.to_list()[2:]])
    got_new = [e.to_list() for e in new]
    if got_new != want_new:
        diff = next((i for i, (a, b) in enumerate(zip(got_new, want_new, strict=False)) if a != b), None)
        fails.append(
            f"after the replay the steps after {step} are {len(got_new)} TGBs, expected the {len(want_new)} old ones "
            f"but the skipped, in order (first difference at index {diff}: "
            f"{got_new[diff][:6] if diff is not None else ''})"
        )
    if [k.to_list() for k in skipped] != want_skipped:
        fails.append(f"after the replay the skipped TGBs are {[[k.at, k.step.step] for k in skipped][:10]}, expected "
                     f"{[[a, e[0]] for a, e in want_skipped][:10]} (after step, was step; or they differ)")  # fmt: skip
    before, after = seen["producers_before"], seen["producers_after"]
    for pid, (epoch, cursor) in before.items():
        if after.get(pid) != (epoch, cursor):
            fails.append(f"{pid}: (epoch, cursor) {(epoch, cursor)} before the replay, {after.get(pid)} after it")
    return fails


def registered_before_rewind(run: Run, p: ProducerSlot, m: re.Match[str]) -> bool:
    """Whether this incarnation registered before the rewind landed, by its epoch (the rewind
    raises every producer's epoch); one started while the rewind command ran may have."""
    return int(m[2]) < run.fenced_below.get(p.pid, 1 << 62)


def check_resume_after_rewind(run: Run, p: ProducerSlot) -> None:
    """After a rewind, the first incarnation that registers must resume at the rewind's cursor
    (called as each incarnation ends; counts the resumes checked)."""
    if run.rewind_mono is not None:
        _check_first_resume(run, p, f"{p.pid}: after the rewind it", "resumes_checked_after_rewind", after_rewind=True)


def _check_first_resume(run: Run, p: ProducerSlot, who: str, counter: str, *, after_rewind: bool = False) -> None:
    """The incarnation that just ended registered at `p.expect_resume` (if it registered, after
    the rewind with `after_rewind`): counted in `counter`, else a failure of `who` resumed at …."""
    if p.expect_resume is None or p.child is None:
        return
    m = REGISTERED.search(p.child.text())
    if m is None or (after_rewind and registered_before_rewind(run, p, m)):
        return
    got = cursor_position(json.loads(m[3]))
    if got != p.expect_resume:
        run.failures.append(f"{who} resumed at {got}, expected {p.expect_resume}")
    else:
        run.counts[counter] += 1
    p.expect_resume = None


def cursors_before_fork(run: Run, at_step: int) -> dict[str, Any]:
    """Each producer's cursor after the source's history below `at_step` as the follower saw it:
    its steps, and the TGBs the replay skipped that a fork there keeps (after a step below
    `at_step - 1`; one after step `at_step - 1` is produced again, as after a rewind to it)."""
    from lakestream._state import _in_order

    last: dict[str, Any] = {}
    steps = [run.history[s] for s in range(at_step) if s in run.history]
    for e in _in_order(steps, [k for k, _ in run.skipped if k.at < at_step - 1]):
        last.update(e.cursors())
    return last


def check_fork_producer_resumes_at_the_fork_step(run: Run, p: ProducerSlot) -> None:
    """A fork's producers resume exactly where the source's were at the fork step: the first
    incarnation of each that registers on the fork resumes at that cursor (called as each
    incarnation ends; counts the resumes checked)."""
    _check_first_resume(run, p, f"{p.name}: its first incarnation on the fork", "fork_resumes_checked")


def check_fork_shares_the_source_steps(run: Run, fst: Any) -> list[str]:
    """The fork's steps below its fork step S are the source's TGBs as the source had them when it
    forked (segment keys, producers, epochs, seqs, slices, cursors; version 0), each read from the
    source's store, from the source's first step then (its hold) on; the skipped TGBs it keeps are
    the source's then; the source's history below S is still that; every producer's cursor on the
    fork is its cursor as of S."""
    info = run.fork_info
    assert info is not None
    at = info["at_step"]

    def entry(e: Any) -> list[Any]:  # a TGB but its version
        return [e.step, *e.to_list()[2:]]

    fails = []
    if fst.base is None or (fst.base.source, fst.base.at_step) != (run.url, at):
        fails.append(f"the fork's base is {fst.base}, not {run.url} at step {at}")
        return fails
    if fst.first_step != info["hold"]:
        fails.append(f"the fork's first step is {fst.first_step}, not the source's when it forked ({info['hold']})")
    want = [entry(e) for e in info["steps"] if e.step >= fst.first_step]
    got = [entry(fst.step(s)) for s in range(fst.first_step, min(at, fst.head + 1))]
    if got != want:
        diff = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
        fails.append(
            f"the fork's steps {fst.first_step}..{at - 1} are not the source's TGBs as it forked: {len(got)} vs "
            f"{len(want)}, first difference at step {fst.first_step + diff}"
        )
    if any(fst.step(s).version != 0 or not fst.base.holds(fst.step(s)) for s in range(fst.first_step, at)):
        fails.append("a step of the fork below its fork step is not the source's (version 0, epoch below the fork's)")
    if any(fst.base.holds(fst.step(s)) for s in range(at, fst.head + 1)):
        fails.append("a step of the fork from its fork step on is read from the source")
    now = [entry(run.history[s]) for s in range(fst.first_step, at) if s in run.history]
    if now != want:
        fails.append(f"the source's steps {fst.first_step}..{at - 1} changed after the fork")
    kept = [[k.at, entry(k.step)] for k in fst.skipped if fst.base.holds(k.step)]
    if kept != [[k.at, entry(k.step)] for k in info["skipped"]]:
        fails.append(f"the fork keeps skipped TGBs {[[k[0], k[1][0]] for k in kept]}, not the source's below its step")
    for p in run.fork_producers:
        if p.pid in info["cursors"] and cursor_position(info["cursors"][p.pid]) != info["resume"].get(p.pid):
            fails.append(
                f"{p.name}: the fork's cursor is {info['cursors'][p.pid]}, the source's at step {at} was at "
                f"{info['resume'].get(p.pid)}"
            )
    return fails


# =================================================================================================
# At the end
# =================================================================================================


def check_gap_free_order(run: Run, st: Any) -> list[str]:
    """One gap-free order: the follower saw every step 0..head of the final history, and what it
    saw is what the final state says; the log has no rejected record."""
    fails = []
    if st.rejected:
        fails.append(f"rejected log records: {st.rejected[:5]}")
    missing = [s for s in range(st.head + 1) if s not in run.history]
    if missing:
        fails.append(f"the follower never saw steps {missing[:20]} of the final history")
    for e in st.steps:
        h = run.history.get(e.step)
        if h is None or h.to_list() != e.to_list():
            fails.append(f"step {e.step}: follower history {h} differs from the final state {e}")
            break
    kept, skipped = [k.to_list() for k in st.skipped], [k.to_list() for k, _ in run.skipped]
    if kept != skipped[len(skipped) - len(kept) :]:  # reclaims drop them from the front
        have = [[k.at, k.step.step] for k in st.skipped][:5]
        fails.append(
            f"the final state keeps skipped TGBs {have}, not the last of the replay's "
            f"{[[k.at, k.step.step] for k, _ in run.skipped][:5]} (after step, was step)"
        )
    return fails


def check_sources_finished(run: Run, st: Any) -> list[str]:
    """Every producer's final committed cursor is the end of its source."""
    fails = []
    for p in run.producers:
        ps = st.producers.get(p.pid)
        if ps is None or cursor_position(ps.cursor) != p.files:
            fails.append(f"{p.pid}: final cursor {ps.cursor if ps else None}, expected {p.files}")
    return fails


async def read_retained_steps(run: Run, st: Any) -> tuple[dict[tuple[int, int], list[Any]], list[str]]:
    """Read every retained step of every rank again (in-process reader over the faulty store):
    {(step, rank): samples}, and the failures (a read that differs, a read that fails)."""
    import lakestream

    fails: list[str] = []
    final: dict[tuple[int, int], list[Any]] = {}
    for rank in range(run.cfg.world_size):
        try:
            async with lakestream.open_reader(run.store, rank, raw=True) as r:
                async for b in r.steps(st.first_step, st.head + 1):
                    samples = [[s["__key__"], sample_fields(s)] for s in b.samples]
                    final[(b.step, rank)] = samples
                    fails += check_same_read(run, (b.step, b.version, rank), samples, b.producer)
        except Exception as e:
            fails.append(f"final read of rank {rank} failed on a retained step: {type(e).__name__}: {e}")
    return final, fails


def check_every_reader_consumed_the_final_history(run: Run, st: Any) -> list[str]:
    if any(s not in run.history for s in range(st.head + 1)):
        return []  # check_gap_free_order reported it
    fails = []
    for r in run.readers:
        lost = [s for s in range(st.head + 1) if (s, run.history[s].version) not in r.reads]
        if lost:
            fails.append(f"{r.name} never consumed steps {lost[:20]} ({len(lost)}) of the final history")
    return fails


def check_reclaimed_steps_were_consumed_first(run: Run, st: Any) -> list[str]:
    """Each step below first_step was consumed by every reader before the first checkpoint that
    covers it (recorded after the step was committed) and before GC reclaimed it."""
    late = []
    for s in range(st.first_step):
        v = run.history[s].version if s in run.history else None
        committed = run.seen_at.get((s, v), 0.0)
        covering = [t for _, c, t in run.checkpoints if c >= s and t >= committed]
        deadline = min(covering) if covering else None
        for r in run.readers:
            t = r.reads.get((s, v))
            if t is None or deadline is None or t > deadline or t > run.reclaimed_at.get(s, float("inf")):
                late.append((r.name, s, t, deadline))
    if late:
        return [f"reclaimed steps not consumed before their checkpoint: {late[:10]} ({len(late)})"]
    return []


def check_atomic_visibility(run: Run) -> list[str]:
    """Every journal entry is a TGB the follower saw, from the same producer; the mount's
    `_meta.json` names the same TGB (producer, epoch, seq, segment) as the log."""
    fails = []
    unknown = [
        (s, v) for (s, v, _), (_, _, prod) in run.contents.items()
        if (s, v) not in run.seen or run.seen[(s, v)].producer != prod
    ]  # fmt: skip
    if unknown:
        fails.append(f"readers consumed (step, version)s the log never had: {unknown[:10]}")
    for (s, v), meta in run.meta_seen.items():
        e = run.seen.get((s, v))
        if e is None or meta != (e.producer, e.epoch, e.seq, e.segment):
            fails.append(f"step {s} version {v}: the mount's _meta.json says {meta}, the log {e}")
            break
    return fails


def final_history_samples(
    run: Run, st: Any, final: dict[tuple[int, int], list[Any]]
) -> tuple[dict[int, list[Any]], list[str]]:
    """{step: [[key, fields], …] of every rank} for the final history: the retained steps as read
    again at the end, the reclaimed ones as the readers consumed them."""
    fails = []
    out: dict[int, list[Any]] = {}
    for s in range(st.head + 1):
        e = run.history.get(s)
        if e is None:
            continue
        records = []
        for rank in range(run.cfg.world_size):
            samples = final.get((s, rank)) if s >= st.first_step else None
            if samples is None:
                c = run.contents.get((s, e.version, rank))
                samples = c[1] if c is not None else None
            if samples is None:
                fails.append(f"step {s} rank {rank}: no reader has its samples (reclaimed before it was read?)")
                continue
            records.extend(samples)
        out[s] = records
    return out, fails


def source_records(run: Run) -> tuple[dict[str, list[Any]], dict[str, list[tuple[str, int]]]]:
    """From the source files: {key: fields} and {producer: [(key, cursor after it)]} in order."""
    expected: dict[str, list[Any]] = {}
    order: dict[str, list[tuple[str, int]]] = {}
    for pid, files in run.sources.items():
        fields: dict[str, list[Any]] = defaultdict(list)
        ends: dict[str, int] = {}
        for i, name in enumerate(sorted(files)):
            key, _, fld = name.partition(".")
            fields[key].append([fld, digest(files[name]), len(files[name])])
            ends[key] = i + 1
        for key in fields:
            expected[key] = sorted(fields[key])
        order[pid] = sorted(ends.items(), key=lambda kv: kv[1])
    return expected, order


def skipped_records(run: Run) -> list[tuple[Any, list[Any]]]:
    """The TGBs a replay skipped, [(Skipped, [[key, fields], …] of every rank)], in `at` order."""
    return [(k, [x for rank in sorted(per_rank) for x in per_rank[rank]]) for k, per_rank in run.skipped]


def check_exactly_once(
    run: Run, by_step: dict[int, list[Any]], skipped: list[tuple[Any, list[Any]]] | None = None
) -> list[str]:
    """Exactly once: every source record is in exactly one step of the final history or in exactly
    one TGB a replay skipped (never both), with its exact bytes, and nothing else is. `skipped`:
    [(Skipped, records)] kept with the history (the replay's: `skipped_records`)."""
    expected, _ = source_records(run)
    where: dict[str, list[str]] = defaultdict(list)
    got: dict[str, list[Any]] = {}
    for s, records in by_step.items():
        for key, flds in records:
            where[key].append(f"step {s}")
            got[key] = flds
    for k, records in skipped_records(run) if skipped is None else skipped:
        for key, flds in records:
            where[key].append(f"skipped step {k.step.step} (version {k.step.version})")
            got[key] = flds
    fails = []
    dupes = {k: v for k, v in where.items() if len(v) > 1}
    lost_keys = sorted(set(expected) - set(where))
    extra = sorted(set(where) - set(expected))
    wrong = sorted(k for k in expected if k in got and got[k] != expected[k])
    if dupes:
        fails.append(f"{len(dupes)} records in more than one step, e.g. {sorted(dupes.items())[:5]}")
    if lost_keys:
        fails.append(f"{len(lost_keys)} records lost, e.g. {lost_keys[:10]}")
    if extra:
        fails.append(f"{len(extra)} unknown records, e.g. {extra[:10]}")
    if wrong:
        fails.append(f"{len(wrong)} records with other bytes, e.g. {wrong[:10]}")
    return fails


def check_source_order(
    run: Run,
    by_step: dict[int, list[Any]],
    history: dict[int, Any] | None = None,
    skipped: list[tuple[Any, list[Any]]] | None = None,
) -> list[str]:
    """Each producer's records are in source order, TGB by TGB, and each step's committed cursor
    is the position after its last record. A step that packs leftovers holds, for each producer it
    names, the next records of that producer's source, and its cursor after them. The TGBs a replay
    skipped count in their place in the history (after their step `at`; `_state._in_order`).
    `history` ({step: Step}) and `skipped` ([(Skipped, records)]): the follower's and the replay's."""
    from lakestream._state import _in_order

    history = run.history if history is None else history
    skipped = skipped_records(run) if skipped is None else skipped
    _, order = source_records(run)
    owner = {k: pid for pid, seq in order.items() for k, _ in seq}
    pos = dict.fromkeys(order, 0)
    done: set[str] = set()  # producers already failed: one failure each
    fails = []
    records = {history[s].segment: by_step[s] for s in by_step}  # a TGB's segment names it
    records.update({k.step.segment: r for k, r in skipped})
    tgbs = _in_order([history[s] for s in sorted(by_step)], [k for k, _ in skipped])
    was_skipped = {k.step.segment for k, _ in skipped}
    for e in tgbs:
        s = f"{e.step} (skipped by the replay)" if e.segment in was_skipped else str(e.step)
        mine: dict[Any, set[str]] = defaultdict(set)
        for k, _ in records[e.segment]:
            mine[owner.get(k)].add(k)
        named = dict(e.cursors())
        if not set(mine) <= set(named):
            fails.append(f"step {s}: records of {sorted(map(str, set(mine) - set(named)))} it does not name")
        for pid, cursor in named.items():
            if pid in done or pid not in order:
                continue
            seq, n = order[pid], len(mine.get(pid, ()))
            if not n or mine[pid] != {k for k, _ in seq[pos[pid] : pos[pid] + n]}:
                fails.append(f"step {s} ({pid}): records are not the next {n} of its source")
                done.add(pid)
                continue
            pos[pid] += n
            if cursor_position(cursor) != seq[pos[pid] - 1][1]:
                fails.append(f"step {s} ({pid}): cursor {cursor}, expected {seq[pos[pid] - 1][1]}")
                done.add(pid)
    return fails


def check_readers_failed_only_on_discarded_steps(run: Run) -> list[str]:
    """No reader failed on a retained step: StepUnavailable only where the rewind discarded one
    (and the errors the roles tolerated, with a warning)."""
    fails = []
    for ev in run.events:
        kind = ev["event"]
        if kind == "start":
            continue
        if kind == "unavailable" and "discarded by a rewind" in ev.get("error", ""):
            continue
        if ev.get("tolerated"):
            continue
        fails.append(f"{ev['reader']}: {kind} at step {ev.get('step')}: {ev.get('error')}")
    return fails


LOG_ALLOWANCE = 64 << 10  # bytes of log objects left after a clean-up beyond 10% of the retained steps'


def _segment_bytes(objects: dict[str, int]) -> int:
    return sum(v for k, v in objects.items() if k.startswith("segments/"))


async def check_storage_reclaimed(run: Run, st: Any) -> list[str]:
    """After the final GC, the bytes under `segments/` are within 10% of the retained steps'
    segment bytes; after a log clean-up (gc with lease 0: nothing runs any more) they still are,
    the whole stream prefix is at most 10% and LOG_ALLOWANCE over them, and the state is the same
    as before it."""
    import lakestream

    fails = []
    objects = run.list_objects()
    seg_bytes = _segment_bytes(objects)
    retained = sum(e.nbytes for e in st.steps) + sum(k.step.nbytes for k in st.skipped)  # GC keeps skipped TGBs
    run.fig["stored_after_final_gc"] = (
        f"segments {seg_bytes} B vs retained steps' segment bytes {retained} B "
        f"({seg_bytes / retained:.3f}x); whole stream prefix {sum(objects.values())} B in {len(objects)} objects"
        if retained
        else f"segments {seg_bytes} B, nothing retained"
    )
    if retained and abs(seg_bytes - retained) > 0.1 * retained:
        fails.append(f"after the final GC, {seg_bytes} B of segments for {retained} B of retained steps")
    # log clean-up: nothing runs any more, so a lease of 0 is safe here
    report = None
    for _attempt in range(10):
        try:
            report = await lakestream.gc(run.store, orphan_grace=0, force_grace=True, lease=0)
            break
        except lakestream.StoreError:
            continue
    if report is not None:
        run.counts["deleted_log_cleanup"] = report.log_versions_deleted + report.snapshots_deleted
    objects2 = run.list_objects()
    total = sum(objects2.values())
    run.fig["stored_after_log_cleanup"] = (
        f"{total} B in {len(objects2)} objects ({total / retained:.3f}x the retained segment bytes)"
        if retained
        else total
    )
    # The log's own objects (the newest snapshot, the versions after it, the stream's records) are
    # a few tens of KB however few steps are retained: allowed on top of 10% over the retained
    # bytes, so that a run ending with a dozen steps retained is not taken for a leak (every log
    # version and snapshot before clean-up are hundreds of KB even then).
    seg2 = _segment_bytes(objects2)
    if retained and abs(seg2 - retained) > 0.1 * retained:
        fails.append(f"after the log clean-up, {seg2} B of segments for {retained} B of retained steps")
    if retained and total - retained > 0.1 * retained + LOG_ALLOWANCE:
        fails.append(
            f"after the log clean-up, {total} B stored for {retained} B of retained steps "
            f"(allowed: 10% more and {LOG_ALLOWANCE} B for the log's own objects)"
        )
    return fails


async def check_state_unchanged_by_cleanup(run: Run, st: Any) -> list[str]:
    import lakestream

    st2 = await lakestream.load_state(run.store)
    if st2.steps != st.steps or st2.first_step != st.first_step:
        return ["the state after the log clean-up differs from the state before it"]
    return []


async def check_verify_passes(run: Run, url: str | None = None, label: str = "verify") -> list[str]:
    rc, text = await run.run_cli("verify", url or run.url, faults=False, name=label)
    run.fig[label] = text.strip().splitlines()[-1] if text.strip() else ""
    return [f"lakestream verify {url or run.url} failed:\n{text}"] if rc != 0 else []


# -- the fork (`Config.fork`) ----------------------------------------------------------------------


async def fork_state(run: Run) -> Any:
    """The fork's state, read in-process through its faulty store (injected faults retried)."""
    import lakestream

    for _attempt in range(20):
        try:
            return await lakestream.load_state(run.fork_store)
        except lakestream.StoreUnavailable:
            continue
    return await lakestream.load_state(run.fork_store)


async def read_fork_steps(run: Run, fst: Any) -> tuple[dict[tuple[int, int], list[Any]], list[str]]:
    """Read every step of the fork of every rank (those below its fork step from the source's
    store, after every GC of the source): {(step, rank): samples}, and the failures (a read that
    fails, a shared step that reads other bytes than the source's readers read)."""
    import lakestream

    assert run.fork_info is not None
    fails: list[str] = []
    final: dict[tuple[int, int], list[Any]] = {}
    for rank in range(run.cfg.world_size):
        try:
            async with lakestream.open_reader(run.fork_store, rank, raw=True) as r:
                async for b in r.steps(fst.first_step, fst.head + 1):
                    final[(b.step, rank)] = [[x["__key__"], sample_fields(x)] for x in b.samples]
        except Exception as e:
            fails.append(f"final read of the fork's rank {rank} failed: {type(e).__name__}: {e}")
    for (s, rank), samples in sorted(final.items()):
        e = run.history.get(s)
        have = run.contents.get((s, e.version, rank)) if e is not None and s < run.fork_info["at_step"] else None
        if have is not None and have[0] != journal_digest(samples):
            fails.append(f"the fork's step {s} rank {rank} reads other bytes than the source's readers read")
    return final, fails


def fork_history(
    run: Run, fst: Any, source_steps: dict[int, list[Any]], final: dict[tuple[int, int], list[Any]]
) -> tuple[dict[int, Any], dict[int, list[Any]], list[tuple[Any, list[Any]]], list[str]]:
    """The fork's final history: ({step: Step}, {step: records of every rank}, [(Skipped, records)]).
    Below its first step (reclaimed by the source before it forked) the source's steps as its
    readers consumed them; from it on the fork's, as read at the end; its skipped TGBs are the
    source's before step S - 1 (`check_fork_shares_the_source_steps` checks the fork keeps those
    the source had not reclaimed), with the records read as the replay landed."""
    fails = []
    history: dict[int, Any] = {}
    by_step: dict[int, list[Any]] = {}
    unread = []
    for s in range(fst.head + 1):
        if s < fst.first_step:
            if s in run.history and s in source_steps:
                history[s], by_step[s] = run.history[s], source_steps[s]
            continue
        records = []
        for rank in range(run.cfg.world_size):
            if (s, rank) not in final:
                unread.append((s, rank))
                continue
            records.extend(final[(s, rank)])
        history[s], by_step[s] = fst.step(s), records
    if unread:
        fails.append(f"{len(unread)} (step, rank)s of the fork were not read, e.g. {unread[:10]}")
    at = run.fork_info["at_step"] if run.fork_info is not None else 0
    skipped = [(k, r) for k, r in skipped_records(run) if k.at < at - 1]  # those a reclaim dropped before it too
    return history, by_step, skipped, fails


def check_fork_exactly_once(run: Run, by_step: dict[int, list[Any]], skipped: list[tuple[Any, list[Any]]]) -> list[str]:
    """Exactly once on the fork: every source record is in exactly one step of the fork's final
    history (below its fork step the source's, after it its own) or in one skipped TGB it keeps
    from the source, with its exact bytes."""
    return [f"fork: {x}" for x in check_exactly_once(run, by_step, skipped)]


def check_fork_source_order(
    run: Run, by_step: dict[int, list[Any]], history: dict[int, Any], skipped: list[tuple[Any, list[Any]]]
) -> list[str]:
    """Source order on the fork: each producer's records in source order through the source's steps
    and then the fork's own, with the right cursor at every step."""
    return [f"fork: {x}" for x in check_source_order(run, by_step, history, skipped)]


async def check_fork_run_again_changes_nothing(run: Run, fst: Any) -> list[str]:
    """`lakestream fork` run again at the end (again after an injected fault) succeeds and changes
    neither the fork nor the source's record of it."""
    import lakestream

    assert run.fork_info is not None
    before = [(f.url, f.at_step, f.hold) for f in (await lakestream.load_state(run.url)).forks]
    for _attempt in range(10):
        rc, text = await run.run_cli("fork", run.url, run.fork_url, "--at-step", run.fork_info["at_step"], name="fork")
        if rc == 0 or "injected" not in text:
            break
    fails = [] if rc == 0 else [f"lakestream fork run again at the end: exit {rc}\n{text}"]
    after = [(f.url, f.at_step, f.hold) for f in (await lakestream.load_state(run.url)).forks]
    if after != before:
        fails.append(f"lakestream fork run again changed the source's forks: {before} -> {after}")
    if (await fork_state(run)).version != fst.version:
        fails.append("lakestream fork run again changed the fork")
    return fails


async def check_a_forked_source_refuses_delete(run: Run) -> list[str]:
    """While the fork exists, `lakestream delete SRC --yes` is refused, naming the fork."""
    rc, text = await run.run_cli("delete", run.url, "--yes", faults=False, name="delete-source")
    assert run.fork_info is not None
    run.fork_info["delete"] = text.strip().splitlines()[-1] if text.strip() else ""
    if rc == 0 or f"forks read its steps ({run.fork_url})" not in text:
        return [f"lakestream delete of the source with a fork: exit {rc}, not refused naming the fork\n{text}"]
    return []


async def check_unfork_releases_the_source(run: Run) -> list[str]:
    """`lakestream unfork` (run again after a failure) makes the fork read its source no more, then
    the source's `gc` reclaims the steps it kept for the fork (up to its watermark), and `status`
    of the source lists no forks."""
    import lakestream

    info = run.fork_info
    assert info is not None
    fails = []
    for name, args, says in (("unfork", ("unfork", run.fork_url), "unforked"),
                             ("gc-unforked", ("gc", run.url, "--orphan-grace", 0, "--force-grace"), "")):  # fmt: skip
        for _attempt in range(10):
            rc, text = await run.run_cli(*args, name=name)
            if rc == 0:
                break
            run.counts[f"{name}_retries"] += 1
        if rc != 0 or says not in text:
            fails.append(f"lakestream {name} failed 10 times (or said nothing):\n{text}")
            return fails
    statuses = []
    for url in (run.url, run.fork_url):
        rc, text = await run.run_cli("status", url, "--json", faults=False, name="status")
        try:
            statuses.append(json.loads(text[text.index("{") :]))
        except ValueError:
            return [f"lakestream status {url} --json: exit {rc}\n{text}"]
    src, fork = statuses
    if src.get("forks") != []:
        fails.append(f"after unfork, status of the source lists forks {src.get('forks')}")
    if fork.get("fork_of") is None or fork["fork_of"].get("reads_it") is not False:
        fails.append(f"after unfork, status of the fork says fork_of {fork.get('fork_of')}")
    st = await lakestream.load_state(run.url)
    info["unforked"] = f"the source's first step {info['hold']} -> {st.first_step} (watermark {st.watermark})"
    if st.first_step < st.watermark:
        fails.append(
            f"after unfork and gc the source's first step is {st.first_step}, below its watermark {st.watermark}"
        )
    return fails


async def check_fork(run: Run, source_steps: dict[int, list[Any]]) -> list[str]:
    """Every check of the fork, in order; `source_steps` the source's final history's records."""
    fst = await fork_state(run)
    fails = check_fork_shares_the_source_steps(run, fst)
    fails += check_sources_finished(run, fst)
    final, read_fails = await read_fork_steps(run, fst)
    fails += read_fails
    history, by_step, skipped, history_fails = fork_history(run, fst, source_steps, final)
    fails += history_fails
    fails += check_fork_exactly_once(run, by_step, skipped)
    fails += check_fork_source_order(run, by_step, history, skipped)
    assert run.fork_info is not None
    run.fork_info["final"] = (
        f"{fst.head + 1} steps ({run.fork_info['at_step']} the source's, {fst.first_step} reclaimed before the fork; "
        f"{fst.head + 1 - run.fork_info['at_step']} its own), {len(fst.skipped)} skipped TGBs kept"
    )
    run.out(f"[{run.now():7.1f}] fork checked")
    fails += await check_verify_passes(run, run.fork_url, "verify_fork")
    fails += await check_fork_run_again_changes_nothing(run, fst)
    fails += await check_a_forked_source_refuses_delete(run)
    fails += await check_unfork_releases_the_source(run)
    return [x if x.startswith("fork") else f"fork: {x}" for x in fails]


def check_no_retained_segment_deleted(run: Run, st: Any) -> list[str]:
    """No GC run deleted the segment of a step the final state retains (named by run)."""
    fails = []
    for key, who in run.deleted_by.items():
        at = run.by_segment.get(key)
        if at is None or at in run.discarded or at[0] < st.first_step or at[0] > st.head:
            continue
        if (e := st.step(at[0])) is not None and e.segment == key:
            fails.append(f"{who} deleted {key}, the segment of retained step {at[0]} (version {at[1]})")
    return fails[:10] + ([f"... {len(fails) - 10} more"] if len(fails) > 10 else [])


async def check_all(run: Run) -> None:
    """Every end-of-run check, in order, into `run.failures`."""
    import anyio

    st = await run.refresh()
    fails = run.failures
    fails += check_gap_free_order(run, st)
    fails += check_no_retained_segment_deleted(run, st)
    fails += check_sources_finished(run, st)
    run.out(f"[{run.now():7.1f}] final gc done; checking")
    final, read_fails = await read_retained_steps(run, st)
    fails += read_fails
    run.out(f"[{run.now():7.1f}] retained steps read again")
    fails += check_every_reader_consumed_the_final_history(run, st)
    fails += check_reclaimed_steps_were_consumed_first(run, st)
    fails += check_atomic_visibility(run)
    by_step, sample_fails = final_history_samples(run, st, final)
    fails += sample_fails
    fails += check_exactly_once(run, by_step)
    fails += check_source_order(run, by_step)
    fails += check_readers_failed_only_on_discarded_steps(run)
    run.out(f"[{run.now():7.1f}] contents checked")
    fails += await check_storage_reclaimed(run, st)
    run.out(f"[{run.now():7.1f}] log cleaned up")
    fails += await check_verify_passes(run)
    fails += await check_state_unchanged_by_cleanup(run, st)
    if run.fork_info is not None:
        fails += await check_fork(run, by_step)
    run.final_state = st
    await anyio.lowlevel.checkpoint()


# =================================================================================================
# The figures
# =================================================================================================


def figures(run: Run, gc_seconds: list[float]) -> None:
    """What happened, as printed in the report (`run.fig`)."""
    c = run.counts
    st = run.final_state or getattr(getattr(run, "manifest", None), "state", None)
    sources = run.sources
    records = sum(len({n.partition(".")[0] for n in files}) for files in sources.values())
    files = sum(len(v) for v in sources.values())
    inj: Counter[str] = Counter()
    for path in run.faultlogs.glob("*.log"):
        for line in path.read_text().splitlines():
            inj[line.rsplit(":", 1)[-1]] += 1
    sub = sum(inj.values())
    for store in run.inproc:
        for k, v in store.injected.items():
            inj[k.rsplit(":", 1)[-1]] += v
    kills = c["kills_producer"] + c["kills_pyreader"] + c["kills_mntreader"] + c["kills_mount"] + c["gc_killed"]
    lat = sorted(run.latencies)
    fig: dict[str, Any] = {
        "records": f"{records} source records in {files} files"
        + (", every one in exactly one step" if not run.failures else "")
        + (" or one TGB the replay skipped" if run.skipped and not run.failures else ""),
        "kills": f"{kills} SIGKILLs: producers {c['kills_producer']}, Python readers {c['kills_pyreader']}, "
        f"mount readers {c['kills_mntreader']}, mount daemons {c['kills_mount']}, gc {c['gc_killed']}",
        "restarts": f"producer incarnations {sum(p.incarnations for p in run.producers)} "
        f"(drain restarts {c['drain_restarts']}), reader restarts {c['restarts_reader']}, "
        f"mounts {c['mount_starts']} ({c['mount_connections_aborted']} killed daemons wedged in the kernel, "
        "their FUSE connections aborted)",
        "fenced": f"{c['fenced_exits']} producer exits 'fenced' after the rewind; "
        f"{c['resumes_checked_after_rewind']} resumes at the rewound cursor checked; "
        f"{c['reader_rewind_exits']} Python readers raised StepUnavailable for a discarded step, "
        f"{c['reader_errors_on_discarded_steps']} failed with CorruptData on one",
        "faults_injected": f"{sum(inj.values())} ({', '.join(f'{k} {v}' for k, v in sorted(inj.items()))}); "
        f"{sub} in subprocesses, {sum(inj.values()) - sub} in-process",
        "gc_runs": f"{c['gc_ok']} ok, {c['gc_failed_injected_fault']} failed on an injected fault, "
        f"{c['gc_killed']} killed"
        + (f"; {statistics.mean(gc_seconds):.1f} s each on average" if gc_seconds else "")
        + f"; {c['gc_recent_uploads_kept']} times an unreferenced upload younger than the grace was kept",
        "bytes_reclaimed": f"segments {c['deleted_segments']} objects / {c['deleted_segments_bytes']} B; "
        f"log versions {c['deleted_log']}, snapshots {c['deleted_snapshots']} "
        f"(+{c['deleted_log_cleanup']} log versions and snapshots in the final clean-up)",
        "rewinds": f"{1 if run.rewind_info else 0} ({run.rewind_info})",
        "skipped": f"{len(run.skipped)} TGBs skipped by the replay, "
        f"{sum(len(r) for _, r in skipped_records(run))} records in them",
        "checkpoints": len(run.checkpoints),
        "reads": ", ".join(f"{r.name} {r.entries}" for r in run.readers),
        "init_retries": c["init_retries"],
    }
    if run.fork_info is not None:
        i, fp = run.fork_info, run.fork_producers
        fig["fork"] = (
            f"at step {i['at_step']} (head {i['head']}; the source keeps its steps from {i['hold']} for it), "
            f"{i['attempts']} attempt(s); its producers: {sum(p.incarnations for p in fp)} incarnations, "
            f"{c['kills_fork_producer']} SIGKILLs, {c['fork_resumes_checked']} first resumes at the fork step "
            f"checked; {i.get('final', 'not checked')}; final gc: {i.get('final_gc')}; delete of the source: "
            f"{i.get('delete')}; unfork (and gc): {i.get('unforked')}"
        )
    if st is not None:
        fig["steps"] = (
            f"{st.head + 1} in the final history ({st.first_step} reclaimed, {len(st.steps)} retained), "
            f"manifest version {st.version}, {len(run.seen)} TGBs committed in all "
            f"({len(run.discarded)} discarded by the rewind)"
        )
    if lat:
        fig["commit_latency_s"] = (
            f"segment upload to the commit seen by the follower: p50 {statistics.median(lat):.2f}, "
            f"p99 {lat[int(0.99 * (len(lat) - 1))]:.2f}, max {lat[-1]:.2f} (orphan grace {run.cfg.orphan_grace:g})"
        )
    fig["commits_later_than_the_grace"] = f"{len(run.late_commits)} {run.late_commits[:5]}"
    run.fig.update(fig)
