"""Elastic world size: what re-sliced reads cost after a reshape, against unchanged reads of the same data.

    .venv/bin/python bench/elastic.py            # full run, about 3 minutes on 2 CPUs
    .venv/bin/python bench/elastic.py --quick    # under a minute: 6 steps, samples of 32 to 256 KiB, 5 repetitions
    .venv/bin/python bench/elastic.py --smoke    # seconds: tiny samples, every case once
    .venv/bin/python bench/elastic.py --s3       # the same on a throwaway SeaweedFS server (bench/_common.py)

Streams are `file://` in a temp dir by default (a case's streams are removed once it is measured; the segments
stay in the page cache, so reads measure the reader, not the disk). For each W→W2 in 8→4, 8→6, 8→7 and 4→8, two
streams hold the same samples, written by one producer (one `bin` field of 64 KiB to 512 KiB,
sizes drawn uniformly with a fixed seed; 32 KiB to 256 KiB with --quick; global batch 256, so
every world size here gets equal counts when it divides the batch, and stored slices of unequal
bytes): the first stays at world size W, the second gets `lakestream.reshape(url, W2,
from_step=0)` (what `lakestream reshape URL --world-size W2 --from-step 0` appends), so every step
of it is re-sliced on read (`_batching.reslice`).

1. Read amplification: for every step, the bytes that all W2 ranks fetched from the store, divided
   by the step's stored bytes (the sum of its rank slices): 1.00 is what an unchanged read fetches.
   Bytes are counted at the store boundary: the readers use a wrapper of the store object that
   records every `get_range` (key, offset, length returned), mapped back to (step, stored slice)
   through the manifest; manifest reads are not counted (the same either way). The figure is the
   largest over the steps; the total over all steps, and the stored slices fetched per step
   (W for an unchanged read), are shown beside it. Each reader's own `bytes_fetched` must agree
   with the wrapper, and every step's samples at W2 ranks must be those at W, each once, or the
   run exits 1. Targets: <= 2.00, and exactly 1.00 where W2 divides W (8→4). Two more cases,
   8→4 and 4→8 over 2 steps with a global batch of 250, which 8 does not divide, check that the
   rule holds when the stored counts are unequal (8→4: slices of 32, 32, then 31 samples dealt
   whole to new ranks of 63, 63, 62, 62; 4→8: slices of 63, 63, 62, 62 each cut in two).
2. Reader throughput: all ranks of a world, one rank after the other in this process (each a
   `lakestream.open_reader(store, rank, world, prefetch=4)` iterating `Reader.steps` over every
   step: range GETs, CRC-32 checks, decoding), timed from the first iteration to the last batch;
   the time is summed over the ranks. Samples/s and MB/s (sample bytes delivered, 10^6 bytes) of
   the re-sliced read at W2 are set beside the unchanged read at W of the same data, in the same
   run: each repetition reads both, the order alternating (unchanged first in even repetitions,
   re-sliced first in odd ones), and each figure is the median over the repetitions. The ratio is
   re-sliced / unchanged samples/s, median of the per-repetition ratios.

No target is set for the throughput; the verdicts on the amplification are printed. The load
average at start and end is printed: on a small shared machine other work moves these figures.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    KiB,
    SeaweedS3,
    fmt_bytes,
    load_average,
    machine_description,
    mb_per_s,
    median,
    print_table,
    random_pool,
    removing,
    temp_dir,
)

import lakestream
from lakestream import ObjectStore, State

CASES = [(8, 4), (8, 6), (8, 7), (4, 8)]
ODD_CASES = [(8, 4), (4, 8)]  # with a global batch that 8 does not divide


# -- counting what the readers fetch ------------------------------------------------------------------


class CountingStore:
    """An ObjectStore that passes every call to `inner` and records each `get_range`: (key, offset,
    bytes returned). Readers opened on it fetch through it, so what it records is what they read."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.url = inner.url
        self.ranges: list[tuple[str, int, int]] = []

    async def get(self, key: str) -> bytes:
        return await self.inner.get(key)

    async def get_range(self, key: str, offset: int, length: int) -> bytes:
        data = await self.inner.get_range(key, offset, length)
        self.ranges.append((key, offset, len(data)))
        return data

    async def put(self, key: str, data: bytes) -> None:
        await self.inner.put(key, data)

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        return await self.inner.put_if_absent(key, data)

    async def list(self, prefix: str) -> list[str]:
        return await self.inner.list(prefix)

    async def list_sizes(self, prefix: str) -> dict[str, int]:
        return await self.inner.list_sizes(prefix)

    async def delete(self, keys: Sequence[str]) -> None:
        await self.inner.delete(keys)

    async def aclose(self) -> None:
        pass  # the inner store belongs to the caller

    async def __aenter__(self) -> CountingStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass


# -- the data ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    steps: int
    batch: int
    min_size: int
    max_size: int
    seed: int = 1

    def sizes(self, batch: int | None = None) -> list[int]:
        rng = random.Random(self.seed)
        return [rng.randint(self.min_size, self.max_size) for _ in range(self.steps * (batch or self.batch))]


async def write_stream(store: ObjectStore, world: int, batch: int, sizes: list[int], pool: list[bytes]) -> None:
    """A stream at world size `world` holding one sample of each size, in order."""
    await lakestream.create(store, world_size=world, global_batch=batch)
    async with lakestream.open_producer(store, "bench") as p:
        for i, size in enumerate(sizes):
            await p.put({"__key__": f"s{i:08d}", "bin": pool[i % len(pool)][:size]}, cursor=i + 1)


@dataclass
class ReadRun:
    """All ranks of one world reading every step of one stream."""

    seconds: float = 0.0
    samples: int = 0
    nbytes: int = 0  # sample bytes delivered
    reader_bytes: int = 0  # the readers' own count of the bytes they fetched
    keys: dict[int, list[str]] = field(default_factory=lambda: defaultdict(list))
    ranges: list[tuple[str, int, int]] = field(default_factory=list)


async def read_all(store: ObjectStore, world: int, steps: int) -> ReadRun:
    run = ReadRun()
    counting = CountingStore(store)
    for rank in range(world):
        async with lakestream.open_reader(counting, rank, world, prefetch=4) as r:
            t0 = time.perf_counter()
            async for b in r.steps(0, steps):
                run.samples += len(b.samples)
                run.nbytes += sum(len(s["bin"]) for s in b.samples)
                run.keys[b.step] += [s["__key__"] for s in b.samples]
            run.seconds += time.perf_counter() - t0
            run.reader_bytes += r.bytes_fetched
    run.ranges = counting.ranges
    return run


@dataclass
class Amplification:
    worst: float  # the largest over the steps of fetched / stored
    total: float  # all steps: fetched / stored
    fetched_per_step: float  # bytes
    stored_per_step: float
    slices_per_step: float  # stored slices fetched per step, counting repeats
    unmapped: int  # ranges that are no stored slice of a step (should be none)


def amplification(state: State, ranges: list[tuple[str, int, int]]) -> Amplification:
    """Fetched bytes per step over its stored bytes, from the ranges a CountingStore recorded."""
    where: dict[tuple[str, int], int] = {}
    stored: dict[int, int] = {}
    for step in range(state.first_step, state.head + 1):
        entry = state.step(step)
        assert entry is not None
        for r in entry.ranks:
            where[entry.segment, r.offset] = step
        stored[step] = sum(r.length for r in entry.ranks)
    fetched: dict[int, int] = defaultdict(int)
    gets: dict[int, int] = defaultdict(int)
    unmapped = 0
    for key, offset, n in ranges:
        step = where.get((key, offset))
        if step is None:
            unmapped += 1
            continue
        fetched[step] += n
        gets[step] += 1
    steps = len(stored)
    return Amplification(
        worst=max(fetched[s] / stored[s] for s in stored),
        total=sum(fetched.values()) / sum(stored.values()),
        fetched_per_step=sum(fetched.values()) / steps,
        stored_per_step=sum(stored.values()) / steps,
        slices_per_step=sum(gets.values()) / steps,
        unmapped=unmapped,
    )


# -- the run -------------------------------------------------------------------------------------------


class Stores:
    """Opens a store for a stream name: `file://` under a temp dir, or a bucket on a SeaweedFS server."""

    def __init__(self, root: Path, s3: SeaweedS3 | None) -> None:
        self.root, self.s3 = root, s3

    def open(self, name: str) -> AbstractAsyncContextManager[ObjectStore]:
        if self.s3 is not None:
            return self.s3.store(self.s3.new_stream(name))  # type: ignore[no-any-return]
        return lakestream.open_store(f"file://{self.root / name}")

    def remove(self, name: str) -> None:
        """Free the disk and page cache a `file://` stream took (a SeaweedFS server's data goes with it)."""
        shutil.rmtree(self.root / name, ignore_errors=True)


def check_same(case: str, base: ReadRun, other: ReadRun, problems: list[str]) -> None:
    """Every step's samples at the new world size are those at the old one, each once."""
    for step, keys in base.keys.items():
        got = other.keys.get(step, [])
        if sorted(got) != sorted(keys) or len(set(got)) != len(got):
            problems.append(f"{case}: step {step} read {len(got)} samples ({len(set(got))} distinct), want {len(keys)}")


def run_case(
    stores: Stores, w: int, w2: int, wl: Workload, pool: list[bytes], reps: int, problems: list[str]
) -> tuple[list[Any], list[Any]]:
    """Amplification row and throughput row of one W→W2."""
    case = f"{w}→{w2}"

    async def go() -> tuple[list[Any], list[Any]]:
        sizes = wl.sizes()
        async with stores.open(f"w{w}-{w2}-unchanged") as base, stores.open(f"w{w}-{w2}-resliced") as resliced:
            t0 = time.perf_counter()
            await write_stream(base, w, wl.batch, sizes, pool)
            await write_stream(resliced, w, wl.batch, sizes, pool)
            state = await lakestream.reshape(resliced, w2, from_step=0)
            print(
                f"  {case}: wrote two streams of {wl.steps} steps in {time.perf_counter() - t0:.1f} s", file=sys.stderr
            )
            runs: dict[bool, list[ReadRun]] = {False: [], True: []}
            for rep in range(reps):
                for sliced in (False, True) if rep % 2 == 0 else (True, False):
                    runs[sliced].append(await read_all(resliced if sliced else base, w2 if sliced else w, wl.steps))
            for run in runs[False] + runs[True]:
                check_same(case, runs[False][0], run, problems)
                counted = sum(n for _, _, n in run.ranges)
                if run.reader_bytes != counted:
                    problems.append(
                        f"{case}: the readers counted {run.reader_bytes} bytes fetched, the store {counted}"
                    )
            amp = amplification(state, runs[True][0].ranges)
            plain = amplification(await lakestream.load_state(base), runs[False][0].ranges)
            if amp.unmapped or plain.unmapped:
                problems.append(f"{case}: {amp.unmapped + plain.unmapped} range GETs of no stored slice")
            if plain.worst != 1.0:
                problems.append(f"{case}: the unchanged read fetched {plain.worst:.4f}x the stored bytes")
        return amp_row(case, w, w2, amp), speed_row(case, runs)

    try:
        return anyio.run(go)
    finally:
        stores.remove(f"w{w}-{w2}-unchanged")
        stores.remove(f"w{w}-{w2}-resliced")


def amp_row(case: str, w: int, w2: int, amp: Amplification) -> list[Any]:
    exact = w % w2 == 0
    met = amp.worst == 1.0 if exact else amp.worst <= 2.0
    return [
        case, fmt_bytes(amp.stored_per_step), fmt_bytes(amp.fetched_per_step), f"{amp.slices_per_step:.1f} / {w}",
        f"{amp.worst:.2f}", f"{amp.total:.3f}", "= 1.00" if exact else "<= 2.00", "met" if met else "not met",
    ]  # fmt: skip


def speed_row(case: str, runs: dict[bool, list[ReadRun]]) -> list[Any]:
    def sps(r: ReadRun) -> float:
        return r.samples / r.seconds

    ratios = [sps(b) / sps(a) for a, b in zip(runs[False], runs[True])]
    cols: list[Any] = [case]
    for sliced in (False, True):
        rs = runs[sliced]
        cols += [f"{median([sps(r) for r in rs]):,.0f}", f"{median([mb_per_s(r.nbytes, r.seconds) for r in rs]):,.0f}"]
    spread = f"{min(ratios):.2f}..{max(ratios):.2f}"
    return [*cols, f"{median(ratios):.2f}", spread]


def odd_case(stores: Stores, w: int, w2: int, wl: Workload, pool: list[bytes], problems: list[str]) -> list[Any]:
    """W→W2 over 2 steps with a global batch of `batch - 6` (250; 42 with --smoke), which 8 does
    not divide: stored slices of unequal counts, and a new rank boundary inside a stored slice."""
    batch = wl.batch - 6
    case = f"{w}→{w2}, batch {batch}"

    async def go() -> list[Any]:
        sizes = wl.sizes(batch)[: 2 * batch]
        async with stores.open(f"odd{w}-{w2}-unchanged") as base, stores.open(f"odd{w}-{w2}-resliced") as resliced:
            await write_stream(base, w, batch, sizes, pool)
            await write_stream(resliced, w, batch, sizes, pool)
            state = await lakestream.reshape(resliced, w2, from_step=0)
            plain = await read_all(base, w, 2)
            run = await read_all(resliced, w2, 2)
            check_same(case, plain, run, problems)
            amp = amplification(state, run.ranges)
        return amp_row(case, w, w2, amp)

    return anyio.run(go)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer steps, smaller samples, 5 repetitions (< 1 min)")
    ap.add_argument("--smoke", action="store_true", help="tiny samples, every case once (seconds)")
    ap.add_argument("--s3", action="store_true", help="streams on a throwaway SeaweedFS server instead of file://")
    ap.add_argument("--reps", type=int, help="repetitions of each pair of reads (default 7; --quick 5; --smoke 1)")
    a = ap.parse_args(argv)
    if a.smoke:
        wl, reps = Workload(steps=2, batch=48, min_size=1 * KiB, max_size=4 * KiB), 1
    elif a.quick:
        wl, reps = Workload(steps=6, batch=256, min_size=32 * KiB, max_size=256 * KiB), 5
    else:
        wl, reps = Workload(steps=16, batch=256, min_size=64 * KiB, max_size=512 * KiB), 7
    reps = a.reps or reps
    label = "--smoke" if a.smoke else "--quick" if a.quick else "(full)"
    print(f"# Elastic world size {label}\n")
    print(f"machine: {machine_description()}")
    print(f"load average at start: {load_average()}")
    mean = (wl.min_size + wl.max_size) / 2
    print(
        f"{'SeaweedFS S3' if a.s3 else 'file:// in a temp dir'}; {wl.steps} steps of {wl.batch} samples, "
        f"{fmt_bytes(wl.min_size)} to {fmt_bytes(wl.max_size)} each (mean {fmt_bytes(mean)}, "
        f"{fmt_bytes(wl.batch * mean)} a step); {reps} repetition(s) of each pair of reads\n"
    )
    pool = random_pool(wl.max_size, 64)
    problems: list[str] = []
    amp_rows: list[list[Any]] = []
    speed_rows: list[list[Any]] = []
    with removing(temp_dir("lakestream-bench-elastic-")) as root, SeaweedS3() if a.s3 else nullcontext() as s3:
        stores = Stores(root, s3)
        for w, w2 in CASES:
            amp, speed = run_case(stores, w, w2, wl, pool, reps, problems)
            amp_rows.append(amp)
            speed_rows.append(speed)
        amp_rows += [odd_case(stores, w, w2, wl, pool, problems) for w, w2 in ODD_CASES]
    print("## 1. Read amplification (bytes fetched by all new ranks / stored bytes of the step)\n")
    headers = ["W→W2", "stored / step", "fetched / step", "slices fetched / step", "amplification (worst step)",
               "all steps", "target", "verdict"]  # fmt: skip
    print_table(headers, amp_rows, "lrrrrrll")
    print("\n## 2. Reader throughput, all ranks one after the other (median over repetitions)\n")
    headers = ["W→W2", "unchanged samples/s", "unchanged MB/s", "re-sliced samples/s", "re-sliced MB/s",
               "re-sliced / unchanged", "per repetition"]  # fmt: skip
    print_table(headers, speed_rows)
    print()
    for row in amp_rows:
        print(f"target read amplification {row[0]} {row[6]}: {row[7]} ({row[4]})")
    print(f"\nload average at end: {load_average()}")
    for p in problems:
        print(f"PROBLEM: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
