"""The tail: a trainer waiting on a live stream, on the library's own code under simulated time.

One producer commits one step at a time at a given cadence; a trainer takes each step the moment
it is committed, through the mount's follower (`LakeFS.follow` and a lookup's wait, as a
`lakestream mount` serves a path walk) and through a Reader (`Reader.steps`). For each, the bench
counts the reads of the log a step (GETs of `_lakestream/log/` by that follower) and how long
after a step's log version landed the follower learned of it (lag p50 / p90 / max), over the
steps after a warm-up, on the simulated store of `lakestream.testing` (`SimulatedS3`) under
`trio.testing.MockClock`: a local store's latency (a GET 0.5-2 ms) and S3's (25-60 ms).

Cadences: `steady` (80-100 ms between commits), `regular` (125 ms +- 5 ms), `irregular` (50 ms
plus an exponential of mean 70 ms). A follower at the tail must look again and again; fewer reads
cost its node CPU and its store requests, a shorter lag costs the trainer less stall.

    .venv/bin/python bench/tail.py            # every cadence and store, 150 steps each (~1 min)
    .venv/bin/python bench/tail.py --quick    # 80 steps each
    .venv/bin/python bench/tail.py --smoke    # one cadence, 40 steps (tests/test_bench.py)
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mount"))

from _common import format_table, inline_to_thread

import lakestream
from lakestream._layout import log_key
from lakestream._manifest import Manifest
from lakestream.testing import SimulatedS3

LATENCY = {
    "local": {"put": (0.001, 0.003), "get": (0.0005, 0.002)},
    "S3": {"put": (0.025, 0.06), "get": (0.025, 0.06)},
}
CADENCE: dict[str, Callable[[int], float]] = {
    "steady": lambda i: 0.1 - 0.02 * random.Random(i).random(),
    "regular": lambda i: 0.125 + 0.01 * (random.Random(i).random() - 0.5),
    "irregular": lambda i: 0.05 + random.Random(i).expovariate(1 / 0.07),
}
WARM = 20  # steps before the window: the pace is learned


def simulated(main: Callable[[], Any]) -> None:
    from trio.testing import MockClock

    anyio.to_thread.run_sync = inline_to_thread  # type: ignore[assignment]
    anyio.run(main, backend="trio", backend_options={"clock": MockClock(autojump_threshold=0)})


async def produce(bucket: SimulatedS3, pause: Callable[[int], float]) -> None:
    now = anyio.current_time
    async with lakestream.open_producer(bucket.client("producer"), "p", clock=now, wall=lambda: 1e9 + now()) as p:
        for i in range(1_000_000):
            await p.put({"__key__": f"s{i}", "txt": "x"}, cursor=i + 1)
            await p.flush()
            await anyio.sleep(pause(i))


def log_gets(bucket: SimulatedS3, who: str, before: Any) -> int:
    return sum(c for (w, _, area), c in (bucket.requests - before).items() if w == who and area == "_lakestream/log/")


def mount_run(store: str, cadence: str, steps: int, seed: int) -> tuple[float, list[float]]:
    """The mount's follower and a lookup's wait for each step in turn: (reads a step, lags)."""
    from lakestream_mount._fs import LakeFS

    bucket = SimulatedS3(rng=random.Random(seed), latency=LATENCY[store])
    lags: list[float] = []
    reads = 0

    async def main() -> None:
        nonlocal reads
        now = anyio.current_time
        await lakestream.create(bucket.client("admin"), world_size=1, global_batch=1)
        async with anyio.create_task_group() as tg:
            tg.start_soon(produce, bucket, CADENCE[cadence])
            async with lakestream.open_reader(bucket.client("mount"), None, prefetch=0, clock=now) as reader:
                fs = LakeFS(reader, None, prefetch=0, poll_interval=(0.002, 0.5), clock=now)
                async with anyio.create_task_group() as following:
                    await following.start(fs.follow)
                    before = None
                    for step in range(WARM + steps):
                        assert await fs._wait_for(step, 0)
                        if step == WARM:
                            before = bucket.requests.copy()
                        elif step > WARM:
                            lags.append(now() - bucket.created[log_key(reader.state.step(step).version)])
                    reads = log_gets(bucket, "mount", before)
                    following.cancel_scope.cancel()
            tg.cancel_scope.cancel()

    simulated(main)
    return reads / len(lags), lags


def reader_run(store: str, cadence: str, steps: int, seed: int) -> tuple[float, list[float]]:
    """A Reader taking each step as soon as it is committed: (reads a step, lags)."""
    bucket = SimulatedS3(rng=random.Random(seed), latency=LATENCY[store])
    lags: list[float] = []
    reads = 0

    async def main() -> None:
        nonlocal reads
        now = anyio.current_time
        await lakestream.create(bucket.client("admin"), world_size=1, global_batch=1)
        known: dict[int, float] = {}
        async with anyio.create_task_group() as tg:
            tg.start_soon(produce, bucket, CADENCE[cadence])
            follower = Manifest(bucket.client("reader"), clock=now, retries=None, rng=random.Random(seed))
            follower.on_apply = lambda state: known.setdefault(state.version, now())
            async with lakestream.open_reader(bucket.client("reader"), 0, 1, follower=follower, clock=now) as r:
                before, since = None, 0.0
                async for batch in r.steps(0, WARM + steps + 1):
                    if batch.step == WARM:
                        before, since = bucket.requests.copy(), now()
                until = now()
            tg.cancel_scope.cancel()
        lags.extend(t - bucket.created[log_key(v)] for v, t in known.items() if since < t <= until)
        reads = log_gets(bucket, "reader", before)

    simulated(main)
    return reads / len(lags), lags


def ms(values: list[float], q: float) -> str:
    ordered = sorted(values)
    return f"{1e3 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]:.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--steps", type=int, help="steps measured per case (default 150, quick 80, smoke 40)")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    steps = a.steps or (40 if a.smoke else 80 if a.quick else 150)
    cadences = ["steady"] if a.smoke else list(CADENCE)
    print(f"## The tail: {steps} steps a case after {WARM} to learn the pace, seed {a.seed}, simulated time")
    rows = []
    for cadence in cadences:
        for store in LATENCY:
            for who, run in (("mount", mount_run), ("Reader", reader_run)):
                reads, lags = run(store, cadence, steps, a.seed)
                rows.append([cadence, store, who, f"{reads:.2f}", ms(lags, 0.5), ms(lags, 0.9), ms(lags, 1.0)])
                print(f"  {cadence} {store} {who} done", file=sys.stderr, flush=True)
    headers = ["cadence", "store", "follower", "log reads / step", "lag p50 ms", "p90 ms", "max ms"]
    print(format_table(headers, rows, align="lllrrrr"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
