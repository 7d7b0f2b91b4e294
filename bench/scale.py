"""Scale: thousands of producers and hundreds of readers on S3, the library's own code on a simulated clock.

    .venv/bin/python bench/scale.py --quick --json   # (64, 3, 8), (1024, 10, 64), (4096, 30, 512); < 10 min
    .venv/bin/python bench/scale.py --smoke          # one tiny row, seconds
    .venv/bin/python bench/scale.py --rows 256,10,32 --duration 120

What runs is the library itself: `lakestream.create`, `open_producer` (Producer, its Manifest and
commit policy), `open_reader` (Reader.steps, Reader.checkpoint), through the public API,
on anyio's trio backend under `trio.testing.MockClock(autojump_threshold=0)`: time only passes in
sleeps, and jumps to the next one as soon as every task waits. The store is
`lakestream.testing.SimulatedS3`: S3's latencies (PUT median 60 ms, p99 200 ms; GET 25 / 100 ms),
the first conditional PUT to arrive wins, 3,500 PUT/s and 5,500 GET/s on `_lakestream/` answered
503 SlowDown beyond, retried inside the store as `S3Store` retries them (10 s at most). Client CPU
takes no simulated time (work the library sends to a thread runs inline), and neither does the
simulation's own bookkeeping. docs/scale.md describes the model and what it leaves out.

The load of a row (N, D, R): a stream of world size R, global batch R (one tiny sample per rank),
`max_steps_ahead` 32. N producers (coroutines) start over the first `--ramp` seconds; each seals
one TGB every N/D seconds (open loop, from a random phase: together D TGBs, i.e. steps, per
second), putting its R samples at once. R readers (one `Reader` per rank; the 8 ranks of a node
share one log follower, `open_reader(follower=...)`, as ranks reading through their node's mount
do; the nodes load their followers at once, as a job's nodes start together) read in lock-step: the
trainer takes step s once every rank has it, spends 1/D s on it, and rank 0 then records a
checkpoint every `--checkpoint-every` steps (`Reader.checkpoint` on rank 0's reader; the trainer
waits for the call to return, which records in the background); no rank asks for step s + 1
before that. Rank 0's reader publishes the consumption mark back-pressure counts from.

Figures are taken over a window of `--duration` simulated seconds that starts `--warmup` seconds
after the last producer registered (or, if they never all register, at `--warmup`):

    consumed_steps_per_s   steps the trainer took in the window / its length
    visible_p50_s/_p99_s   seal (the TGB's last put returned) -> its log version landed in the store,
                           over the TGBs committed in the window
    requests_per_tgb       producers' store requests (retries and 503s included) / TGBs committed
    log_gets_per_s         GETs and LISTs under _lakestream/ (everyone's) per second; log_puts_per_s alike
    rate_503               503 answers / requests (everyone's, every prefix)
    max_lead_steps         max of head - last step taken, over the window
    jain                   Jain's index of the producers' served fractions (TGBs committed by the end /
                           TGBs due 5 s before it), over producers with a TGB due
    checkpoint_block_p99_ms  how long recording a checkpoint blocked the trainer (every call of the run)
    committed_fraction     TGBs committed in the window / D x its length

A row whose simulation outruns `--budget` CPU seconds (or `--max-rss-gb`) is cut short and says
so (`truncated`, `simulated_s`). `--json` prints one JSON object per row on stdout.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import os
import random
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import format_table, inline_to_thread

import lakestream
from lakestream import metrics
from lakestream._manifest import Manifest
from lakestream._retry import _RNG
from lakestream._state import State
from lakestream.testing import LOG_PREFIX, SimulatedS3

WALL0 = 1_700_000_000.0  # the simulated wall clock's reading at simulated time 0
MAX_STEPS_AHEAD = 32
RANKS_PER_NODE = 8
SAMPLE = {"x": b"\x00" * 8}
JAIN_GRACE = 5.0  # seconds before the end after which a due TGB is not counted against a producer
GET_OPS = ("get", "get_range", "list")

# (N, D, R, CPU-seconds budget, warm-up s, window s): the 4,096-producer row simulates 12 CPU seconds
# a second, so --quick measures it over 20 s after 5 (its full minute: --rows 4096,30,512 --budget 1200).
QUICK = [(64, 3, 8, 90.0, 10.0, 60.0), (1024, 10, 64, 180.0, 10.0, 60.0), (4096, 30, 512, 500.0, 5.0, 20.0)]
SMOKE = [(4, 4, 2, 60.0, 2.0, 8.0)]

COLUMNS = [
    "producers", "steps_per_s_demand", "readers", "consumed_steps_per_s", "visible_p50_s", "visible_p99_s",
    "requests_per_tgb", "log_gets_per_s", "log_puts_per_s", "rate_503", "max_lead_steps", "jain",
    "checkpoint_block_p99_ms", "committed_fraction",
]  # fmt: skip


# -- the process: simulated time everywhere the library would otherwise leave it -------------------


def prepare_process(seed: int) -> None:
    anyio.to_thread.run_sync = inline_to_thread  # type: ignore[assignment]
    metrics.set_enabled(False)  # scrape-time bookkeeping of thousands of clients: not measured here
    _RNG.seed(seed)  # the jitter of retries that are given no random source
    ids = random.Random(seed)  # producers' tokens and segment keys' random part (they order listings and sets)
    uuid.uuid4 = lambda: uuid.UUID(int=ids.getrandbits(128), version=4)  # type: ignore[assignment]
    try:
        import trio._core._run as trio_run  # trio shuffles the order of runnable tasks

        trio_run._r.seed(seed)
        # and orders timers due at one instant by `id()` of their cancel scopes: by memory layout,
        # which differs from process to process. By the order they were set instead.
        order = itertools.count()

        def add(self: Any, deadline: float, cancel_scope: Any) -> None:
            heapq.heappush(self._heap, (deadline, next(order), cancel_scope))
            self._active += 1

        trio_run.Deadlines.add = add
    except (ImportError, AttributeError):  # pragma: no cover - another trio
        pass


def now() -> float:
    return anyio.current_time()


def wall() -> float:
    return WALL0 + anyio.current_time()


async def sleep_until(t: float) -> None:
    if (left := t - now()) > 0:
        await anyio.sleep(left)


# -- one row -----------------------------------------------------------------------------------------


@dataclass
class Row:
    n: int
    d: float
    r: int
    warmup: float
    duration: float
    ramp: float
    checkpoint_every: int
    budget: float
    max_rss: float
    seed: int
    combine: bool = True


class _Truth:
    """The log as it lands in the store (read from the bucket's memory, no requests): the head over
    time, and when each step became visible."""

    def __init__(self) -> None:
        self.state = State()
        self.waiting: dict[int, bytes] = {}
        self.landed: dict[int, float] = {}  # version -> simulated time it was written
        self.on_head: Callable[[int], None] | None = None

    def write(self, key: str, data: bytes, t: float) -> None:
        if not key.startswith(LOG_PREFIX):
            return
        stem = key.rsplit("/", 1)[-1].removesuffix(".json")
        if not stem.isdigit():
            return
        self.waiting[int(stem)] = data
        self.landed[int(stem)] = t
        head = self.state.head
        while (v := self.state.version + 1) in self.waiting:
            self.state.apply(v, self.waiting.pop(v))
        if self.state.head != head and self.on_head is not None:
            self.on_head(self.state.head)


@dataclass
class _Run:
    row: Row
    bucket: SimulatedS3
    truth: _Truth
    start_real: float
    start_cpu: float
    registered: list[float] = field(default_factory=list)
    window: tuple[float, float] | None = None
    counters_at_start: tuple[Counter[Any], Counter[Any]] | None = None
    sealed: dict[tuple[str, int], float] = field(default_factory=dict)
    first_due: dict[str, float] = field(default_factory=dict)
    taken: list[tuple[int, float]] = field(default_factory=list)  # (step, simulated time the trainer took it)
    consumed: int = -1
    max_lead: int = 0
    blocks: list[float] = field(default_factory=list)
    checkpoint_errors: list[str] = field(default_factory=list)
    truncated: str = ""
    rss_peak: float = 0.0
    reader0: lakestream.Reader | None = None  # rank 0's, which records the checkpoints

    def in_window(self) -> bool:
        """After the warm-up, until the window opens (a run that never opens one is measured from
        there), and in the window."""
        return now() >= (self.row.warmup if self.window is None else self.window[0])

    def head_moved(self, head: int) -> None:
        if self.in_window():
            self.max_lead = max(self.max_lead, head - self.consumed)


class _Gate:
    """A value that only grows, and a way to wait for it to reach something."""

    def __init__(self, value: int) -> None:
        self.value = value
        self._changed = anyio.Event()

    def set(self, value: int) -> None:
        self.value = value
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_for(self, value: int) -> None:
        while self.value < value:
            await self._changed.wait()


async def _producer(run: _Run, i: int) -> None:
    row = run.row
    rng = random.Random(row.seed * 1_000_003 + i)
    pid = f"p{i:05d}"
    period = row.n / row.d
    start = rng.uniform(0, row.ramp)
    first = start + rng.uniform(0, period)  # the first TGB is due then, the next one period later …
    run.first_due[pid] = first
    await sleep_until(start)
    store = run.bucket.client("producer")
    manifest = Manifest(store, clock=now, retries=None, rng=random.Random(rng.random()))
    opts = {"combine": True} if row.combine else {"policy": lakestream.DacPolicy(rng=random.Random(rng.random()))}
    async with lakestream.open_producer(store, pid, manifest=manifest, clock=now, wall=wall, **opts) as p:
        run.registered.append(now())
        k = 0
        while True:
            await sleep_until(first + k * period)
            for j in range(row.r):
                await p.put(SAMPLE, cursor=k * row.r + j + 1)
            run.sealed[(pid, k)] = now()  # a fresh producer's k-th TGB has sequence number k
            k += 1


async def _rank(
    run: _Run, rank: int, follower: Manifest, have: dict[int, int], all_have: _Gate, released: _Gate
) -> None:
    store = follower.store
    async with lakestream.open_reader(store, rank, run.row.r, follower=follower, clock=now) as reader:
        if rank == 0:
            run.reader0 = reader
        async for batch in reader.steps(0):
            s = batch.step
            have[s] = have.get(s, 0) + 1
            if have[s] == run.row.r:
                all_have.set(s)
            await released.wait_for(s)


async def _trainer(run: _Run, all_have: _Gate, released: _Gate) -> None:
    row = run.row
    s = 0
    while True:
        await all_have.wait_for(s)
        run.consumed = s
        run.taken.append((s, now()))
        await anyio.sleep(1 / row.d)
        if (s + 1) % row.checkpoint_every == 0:
            started = now()
            try:
                assert run.reader0 is not None  # rank 0 read step s: its reader is open
                await run.reader0.checkpoint(f"step-{s}", s)
            except lakestream.LakestreamError as e:
                run.checkpoint_errors.append(f"step {s}: {type(e).__name__}: {e}")
            run.blocks.append(now() - started)
        released.set(s)
        s += 1


def _rss_gb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9
    except OSError:  # pragma: no cover - not Linux
        return 0.0


async def _watch(run: _Run) -> None:
    """Open the window once every producer registered (+ warm-up); end the run when it closes or
    the CPU or memory budget runs out (then the window is what was simulated after the warm-up)."""
    row = run.row
    early: tuple[Counter[Any], Counter[Any]] | None = None  # the counters at the warm-up's end
    while True:
        await anyio.sleep(0.05)
        t = now()
        if early is None and t >= row.warmup:
            early = (run.bucket.requests.copy(), run.bucket.throttled.copy())
        if run.window is None and len(run.registered) == row.n:
            run.window = (t + row.warmup, t + row.warmup + row.duration)
        if run.window is not None and run.counters_at_start is None and t >= run.window[0]:
            run.counters_at_start = (run.bucket.requests.copy(), run.bucket.throttled.copy())
            run.max_lead = max(0, run.truth.state.head - run.consumed)
        if run.window is not None and t >= run.window[1]:
            return
        run.rss_peak = max(run.rss_peak, rss := _rss_gb())
        cpu = time.process_time() - run.start_cpu
        if cpu > row.budget or rss > row.max_rss:
            run.truncated = (
                f"CPU budget of {row.budget:.0f} s" if cpu > row.budget else f"memory ({rss:.1f} GB)"
            ) + f" ran out at {t:.1f} simulated s"
            if len(run.registered) < row.n:
                run.truncated += f" with {len(run.registered)} of {row.n} producers registered"
            if run.counters_at_start is None:  # the window never opened: measure after the warm-up
                run.window = (row.warmup, t) if early is not None else (0.0, t)
                run.counters_at_start = early or (Counter(), Counter())
            assert run.window is not None
            run.window = (run.window[0], t)
            return


async def _load_follower(run: _Run, node: int, followers: dict[int, Manifest]) -> None:
    follower = Manifest(run.bucket.client("reader"), clock=now, retries=None, rng=random.Random(run.row.seed + node))
    await follower.load()
    followers[node] = follower


async def run_row(row: Row) -> dict[str, Any]:
    bucket = SimulatedS3(rng=random.Random(row.seed))
    truth = _Truth()
    bucket.on_write = truth.write
    run = _Run(row, bucket, truth, time.perf_counter(), time.process_time())
    truth.on_head = run.head_moved
    await lakestream.create(
        bucket.client("admin"), world_size=row.r, global_batch=row.r, max_steps_ahead=MAX_STEPS_AHEAD
    )
    have: dict[int, int] = {}
    all_have, released = _Gate(-1), _Gate(-1)
    async with anyio.create_task_group() as tg:
        for i in range(row.n):
            tg.start_soon(_producer, run, i)
        # The ranks of a node follow the log once, as through a mount; the nodes load theirs at once, as a
        # job's nodes start together (one after another, 64 of them took 19 simulated s at 4,096 producers).
        followers: dict[int, Manifest] = {}
        async with anyio.create_task_group() as loading:
            for node in range(0, row.r, RANKS_PER_NODE):
                loading.start_soon(_load_follower, run, node, followers)
        for node, follower in sorted(followers.items()):
            for rank in range(node, min(node + RANKS_PER_NODE, row.r)):
                tg.start_soon(_rank, run, rank, follower, have, all_have, released)
        tg.start_soon(_trainer, run, all_have, released)
        await _watch(run)
        tg.cancel_scope.cancel()
    return figures(run)


# -- figures -------------------------------------------------------------------------------------------


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[max(0, math.ceil(q * len(v)) - 1)]


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, digits)


def figures(run: _Run) -> dict[str, Any]:
    row, bucket, truth = run.row, run.bucket, run.truth
    assert run.window is not None and run.counters_at_start is not None
    w0, w1 = run.window
    span = max(w1 - w0, 1e-9)
    requests = bucket.requests - run.counters_at_start[0]
    throttled = bucket.throttled - run.counters_at_start[1]
    state = truth.state
    committed_in_window = 0
    visible: list[float] = []
    committed_by: Counter[str] = Counter()
    for step in state.steps:
        at = truth.landed[step.version]
        committed_by[step.producer] += 1
        if w0 <= at < w1:
            committed_in_window += 1
            sealed = run.sealed.get((step.producer, step.seq))
            if sealed is not None:
                visible.append(at - sealed)
    consumed = sum(1 for _, t in run.taken if w0 <= t < w1)
    producer_requests = sum(c for (who, _, _), c in requests.items() if who == "producer")
    log_gets = sum(c for (_, op, area), c in requests.items() if area.startswith("_lakestream") and op in GET_OPS)
    log_puts = sum(c for (_, op, area), c in requests.items() if area.startswith("_lakestream") and op not in GET_OPS)
    total = sum(requests.values())
    served = []
    period = row.n / row.d
    for pid, first in run.first_due.items():
        due = math.floor((w1 - JAIN_GRACE - first) / period) + 1 if w1 - JAIN_GRACE >= first else 0
        if due > 0:
            served.append(min(1.0, committed_by[pid] / due))
    jain = sum(served) ** 2 / (len(served) * sum(x * x for x in served)) if served and any(served) else None
    top = sorted(requests.items(), key=lambda kv: -kv[1])[:6]
    return {
        "producers": row.n,
        "steps_per_s_demand": row.d,
        "readers": row.r,
        "consumed_steps_per_s": _round(consumed / span, 2),
        "visible_p50_s": _round(_pct(visible, 0.50), 3),
        "visible_p99_s": _round(_pct(visible, 0.99), 3),
        "requests_per_tgb": _round(producer_requests / committed_in_window if committed_in_window else math.inf, 1),
        "log_gets_per_s": _round(log_gets / span, 0),
        "log_puts_per_s": _round(log_puts / span, 0),
        "rate_503": _round(sum(throttled.values()) / total if total else 0.0, 4),
        "max_lead_steps": run.max_lead,
        "jain": _round(jain, 3),
        "checkpoint_block_p99_ms": _round(None if not run.blocks else 1000 * (_pct(run.blocks, 0.99) or 0.0), 0),
        "committed_fraction": _round(committed_in_window / (row.d * span), 3),
        # context
        "window_s": [round(w0, 1), round(w1, 1)],
        "simulated_s": round(span, 1),
        "registered": len(run.registered),
        "all_registered_at_s": round(max(run.registered), 1) if len(run.registered) == row.n else None,
        "head_step": state.head,
        "last_step_taken": run.consumed,
        "versions": state.version,
        "checkpoints": len(run.blocks),
        "checkpoints_retained": len(run.truth.state.checkpoints),
        "checkpoint_errors": run.checkpoint_errors[:3],
        "top_requests_per_s": {f"{who} {op} {area}": round(c / span, 1) for (who, op, area), c in top},
        "throttled_per_s": {
            f"{who} {op} {area}": round(c / span, 1) for (who, op, area), c in throttled.most_common(3)
        },
        "truncated": run.truncated,
        "wall_s": round(time.perf_counter() - run.start_real, 1),
        "cpu_s": round(time.process_time() - run.start_cpu, 1),
        "rss_peak_gb": round(run.rss_peak, 2),
        "seed": row.seed,
    }


# -- main ----------------------------------------------------------------------------------------------


def _simulate(row: Row) -> dict[str, Any]:
    import trio.testing

    prepare_process(row.seed)
    clock = trio.testing.MockClock(autojump_threshold=0)
    result: dict[str, Any] = anyio.run(run_row, row, backend="trio", backend_options={"clock": clock})
    return result


def _parse_row(text: str) -> tuple[int, float, int]:
    try:
        n, d, r = text.split(",")
        return int(n), float(d), int(r)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected N,D,R (producers, steps/s, readers)") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the three rows of docs/scale.md (< 10 min; see QUICK)")
    ap.add_argument("--smoke", action="store_true", help="one tiny row (seconds)")
    ap.add_argument("--rows", nargs="+", type=_parse_row, metavar="N,D,R", help="rows to run")
    ap.add_argument("--json", action="store_true", help="print one JSON object per row on stdout")
    ap.add_argument(
        "--duration", type=float, help="simulated seconds measured (default 60; by row for --quick, --smoke)"
    )
    ap.add_argument("--warmup", type=float, help="simulated seconds after registration (default 10; by row likewise)")
    ap.add_argument("--ramp", type=float, default=5.0, help="producers start over this many seconds (5)")
    ap.add_argument("--checkpoint-every", type=int, help="steps between checkpoints (default 100; --smoke 5)")
    ap.add_argument("--budget", type=float, help="CPU seconds per row before it is cut short (default by row)")
    ap.add_argument("--max-rss-gb", type=float, default=8.0, help="cut a row short past this memory (8 GB)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--commit",
        choices=["combine", "direct"],
        default="combine",
        help="producers declare TGBs for a combiner (combine, default) or commit them themselves with DAC",
    )
    a = ap.parse_args(argv)
    rows = [(n, d, r, 600.0, 10.0, 60.0) for n, d, r in a.rows] if a.rows else SMOKE if a.smoke else QUICK
    every = a.checkpoint_every or (5 if a.smoke else 100)
    results = []
    for n, d, r, budget, warmup, duration in rows:
        warmup = a.warmup if a.warmup is not None else warmup
        duration = a.duration if a.duration is not None else duration
        row = Row(
            n, d, r, warmup, duration, a.ramp, every, a.budget or budget, a.max_rss_gb, a.seed, a.commit == "combine"
        )
        print(f"scale: N={n} D={d:g} R={r} ...", file=sys.stderr, flush=True)
        res = _simulate(row)
        results.append(res)
        if a.json:
            print(json.dumps(res), flush=True)
        else:
            print(json.dumps(res), file=sys.stderr, flush=True)
    if not a.json:
        print(format_table(COLUMNS, [[res[c] for c in COLUMNS] for res in results]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
