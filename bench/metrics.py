"""Metrics overhead: ingest and reader throughput with Prometheus metrics off and on, side by side.

    .venv/bin/python bench/metrics.py            # full run, a few minutes
    .venv/bin/python bench/metrics.py --quick    # under a minute
    .venv/bin/python bench/metrics.py --smoke    # seconds: every part, tiny

One process, world size 8, a fresh stream per run on each store: `file://` in a temp dir (durable:
the file store fsyncs) and an in-process memory store (no I/O at all: the worst case for any
per-TGB cost). Runs alternate off, on, off, on, ... (so both see the same page cache and the same
background load), and each figure is the median over its runs:

1. ingest: one producer puts N samples of 4 KiB (one `bin` field; small samples make per-TGB costs
   count the most) in TGBs of 64 samples and closes; samples/s from the first put to the close.
2. read: one reader per rank, one rank after the other, reads every step (`Reader.steps`, CRC
   checks, decoding); steps/s over all ranks from the first iteration to the last batch.

"off" is `lakestream.metrics.set_enabled(False)`: the engine calls its no-op recorders, as it does
without prometheus_client installed. "on" records everything, with /metrics served from this
process and scraped every 0.5 s by a thread (a scrape is what a Prometheus server would add).
Then the cost of one recorder call is timed apart (a million calls each), and multiplied by the
calls per TGB and per step, to say what the overhead would be if nothing else varied.

Target: metrics cost < 3 % of ingest and reader throughput. The verdict is printed; nothing is
tuned to meet it. On a shared machine run-to-run noise may exceed the overhead itself: the spread
of the runs is printed beside the medians.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import threading
import time
import timeit
import urllib.request
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import load_average, machine_description, median, print_table, temp_dir

import lakestream
import lakestream.metrics as metrics
from lakestream._store import MemoryStore

WORLD = 8
BATCH = 64
SIZE = 4 << 10


async def ingest(url: Any, n: int, payload: bytes) -> float:
    """Samples/s of one producer putting `n` samples and closing."""
    await lakestream.create(url, world_size=WORLD, global_batch=BATCH)
    async with lakestream.open_producer(url, "bench") as p:
        t0 = time.perf_counter()
        for i in range(n):
            await p.put({"__key__": f"s{i:08d}", "bin": payload})
        await p.close()
        seconds = time.perf_counter() - t0
    return n / seconds


async def read(url: Any) -> float:
    """Steps/s of every rank's reader, one after the other."""
    steps = 0
    seconds = 0.0
    for rank in range(WORLD):
        async with lakestream.open_reader(url, rank) as r:
            head = r.state.head
            t0 = time.perf_counter()
            async for _ in r.steps(0, head + 1):
                steps += 1
            seconds += time.perf_counter() - t0
    return steps / seconds


class Scraper:
    """Scrapes /metrics every `interval` seconds from a thread while running."""

    def __init__(self, port: int, interval: float = 0.5) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.interval = interval
        self.scrapes = 0
        self.bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with urllib.request.urlopen(self.url, timeout=10) as r:
                self.bytes = len(r.read())
            self.scrapes += 1

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def per_call_costs() -> dict[str, float]:
    """Microseconds per recorder call with metrics on (a million calls each, best of 3)."""
    metrics.set_enabled(True)
    rec: Any = metrics._Producer("bench://calls", "p")
    reader: Any = metrics._Reader("bench://calls", "0")

    class _Ref:
        ranks = tuple((0, 512, 0, 8) for _ in range(WORLD))

    class _Tgb:
        ref = _Ref()

    class _Result:
        conflicts, version = 0, 1

    tgb, result = _Tgb(), _Result()
    n = 200_000
    calls = {
        "committed (per TGB)": lambda: rec.committed(tgb, 0.01),
        "uploaded (per TGB)": lambda: rec.uploaded(4096),
        "appended (per commit)": lambda: rec.appended(result),
        "stalled (per step read)": lambda: reader.stalled(0.001),
        "fetched (per slice read)": lambda: reader.fetched(4096),
        "no-op recorder call": lambda: metrics.NOOP_PRODUCER.uploaded(4096),
    }
    return {k: min(timeit.repeat(f, number=n, repeat=3)) / n * 1e6 for k, f in calls.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer samples and runs (< 1 min)")
    ap.add_argument("--smoke", action="store_true", help="every part in seconds")
    a = ap.parse_args(argv)
    if not metrics.AVAILABLE:
        print("bench/metrics.py needs the metrics extra (prometheus-client)", file=sys.stderr)
        return 1
    n, runs = (512, 1) if a.smoke else (8_192, 3) if a.quick else (32_768, 7)
    print("# Metrics overhead\n")
    print(machine_description())
    print(f"load average at start: {load_average()}\n")
    print(f"{n} samples of {SIZE >> 10} KiB per ingest run, TGBs of {BATCH}, world size {WORLD}, {runs} runs each\n")
    port = metrics.serve(0)
    payload = os.urandom(SIZE)
    base = temp_dir("lakestream-bench-metrics-")
    figures: dict[tuple[str, str, bool], list[float]] = {}
    scraped = (0, 0)
    try:
        for _ in range(runs):
            for store in ("file://", "memory"):
                for on in (False, True):
                    metrics.set_enabled(on)
                    # one URL for every run (a fresh directory): the series are those of one stream
                    target: Any = f"file://{base / 's'}" if store == "file://" else MemoryStore("memory://b")
                    with Scraper(port) if on else contextlib.nullcontext() as sc:
                        up = anyio.run(ingest, target, n, payload)
                        down = anyio.run(read, target)
                    if sc is not None:
                        scraped = (scraped[0] + sc.scrapes, max(scraped[1], sc.bytes))
                    figures.setdefault((store, "ingest", on), []).append(up)
                    figures.setdefault((store, "read", on), []).append(down)
                    shutil.rmtree(base / "s", ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        metrics.set_enabled(True)
    rows = []
    ab_met = True  # every A/B cost under 3 %, or inside the runs' own spread
    noisy = False
    for store in ("file://", "memory"):
        for path, unit in (("ingest", "samples/s"), ("read", "steps/s")):
            off, on = figures[store, path, False], figures[store, path, True]
            cost = 1 - median(on) / median(off)
            spread = (max(off) - min(off)) / median(off)  # how much runs with the same setting differ
            within = abs(cost) <= spread
            noisy |= within and abs(cost) >= 0.03
            ab_met &= cost < 0.03 or within
            rows.append([
                store, f"{path} ({unit})", f"{median(off):,.0f}", f"{median(on):,.0f}", f"{cost:+.1%}",
                f"{spread:.0%}", f"{min(off):,.0f}..{max(off):,.0f}", f"{min(on):,.0f}..{max(on):,.0f}",
            ])  # fmt: skip
    headers = ["store", "path", "metrics off", "metrics on", "cost", "off: spread", "off: runs", "on: runs"]
    print_table(headers, rows, "llrrrrrr")
    print(f"\n{scraped[0]} scrapes during the 'on' runs, the last of {scraped[1]:,} bytes\n")
    costs = per_call_costs()
    print_table(["recorder call", "µs per call"], [[k, f"{v:.2f}"] for k, v in costs.items()])
    per_tgb = costs["committed (per TGB)"] + costs["uploaded (per TGB)"] + costs["appended (per commit)"]
    ingest_off = median(figures["memory", "ingest", False])
    tgb_share = per_tgb * 1e-6 * ingest_off / BATCH
    print(f"\nrecording per TGB: {per_tgb:.2f} µs, {tgb_share:.3%} of a TGB's time at {ingest_off:,.0f} samples/s "
          "(memory)")  # fmt: skip
    per_step = costs["stalled (per step read)"] + costs["fetched (per slice read)"]
    read_off = median(figures["memory", "read", False])
    step_share = per_step * 1e-6 * read_off
    print(f"recording per step read: {per_step:.2f} µs, {step_share:.3%} of a step's time at {read_off:,.0f} "
          "steps/s (memory)")  # fmt: skip
    print(f"\nload average at end: {load_average()}")
    estimate_met = tgb_share < 0.03 and step_share < 0.03
    print(f"target metrics cost < 3% of ingest and read throughput, per-call estimate: "
          f"{'met' if estimate_met else 'NOT met'} ({tgb_share:.2%} ingest, {step_share:.2%} read)")  # fmt: skip
    verdict = "met" if ab_met and not noisy else "inconclusive (runs differ more than that)" if ab_met else "NOT met"
    print(f"target metrics cost < 3% of ingest and read throughput, A/B medians: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
