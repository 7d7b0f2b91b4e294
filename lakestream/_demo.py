"""`lakestream demo`: producers and rank readers on one local stream, then a verification."""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter

import anyio

import lakestream

from .sources._synthetic import synthetic_sample

__all__ = ["run_demo"]


async def run_demo(directory: str, a: argparse.Namespace) -> int:
    url = f"file://{directory}/stream"
    await lakestream.create(url, world_size=a.world_size, global_batch=a.global_batch, snapshot_every=100)
    total = a.producers * a.samples
    steps_expected = -(-total // a.global_batch)  # the last producer to finish packs the others' partial batches
    print(
        f"demo: {a.producers} producers x {a.samples} samples (~{a.sample_size // 1024} KiB: image bytes, "
        f"caption, tokens, metadata) -> {a.world_size} ranks, global batch {a.global_batch}, stream {url}"
    )
    seen: list[Counter[str]] = [Counter() for _ in range(a.world_size)]
    read_steps = [0] * a.world_size
    read_bytes = [0] * a.world_size
    stats = []
    t0 = time.perf_counter()

    async def produce(k: int) -> None:
        async with lakestream.open_producer(url, f"producer-{k}") as p:
            stats.append(p.stats)
            for i in range(p.cursor or 0, a.samples):
                await p.put(synthetic_sample(i, a.sample_size, prefix=f"p{k}-"), cursor=i + 1)

    async def read(rank: int) -> None:
        async with lakestream.open_reader(url, rank) as r:
            async for batch in r.steps(0, steps_expected):
                for s in batch.samples:
                    seen[rank][s["__key__"]] += 1
                read_steps[rank] += 1
                read_bytes[rank] += batch.nbytes

    async def progress() -> None:
        while True:
            await anyio.sleep(1.0)
            done = sum(s.samples for s in stats)
            print(
                f"  {time.perf_counter() - t0:5.1f} s  put {done}/{total} samples  "
                f"read steps per rank {min(read_steps)}/{steps_expected}",
                file=sys.stderr,
            )

    async with anyio.create_task_group() as tg:
        tg.start_soon(progress)
        async with anyio.create_task_group() as work:
            for rank in range(a.world_size):
                work.start_soon(read, rank)
            for k in range(a.producers):
                work.start_soon(produce, k)
        tg.cancel_scope.cancel()
    dt = time.perf_counter() - t0

    mb = sum(read_bytes) / 1e6
    print(f"done in {dt:.2f} s: {total} samples, {steps_expected} steps, {mb:.1f} MB")
    print(f"  ingest {total / dt:,.0f} samples/s, {sum(s.bytes_uploaded for s in stats) / 1e6 / dt:.1f} MB/s")
    print(f"  read   {mb / dt:.1f} MB/s over {a.world_size} ranks ({mb / dt / a.world_size:.1f} MB/s per rank)")
    commits = sum(s.commits for s in stats)
    print(f"  {commits} commits for {sum(s.tgbs_committed for s in stats)} TGBs")

    every = Counter[str]()
    for c in seen:
        every.update(c)
    dupes = sum(1 for n in every.values() if n > 1)
    lost = total - len(every)
    report = await lakestream.verify(url)
    ok = report.ok and dupes == 0 and lost == 0 and read_steps == [steps_expected] * a.world_size
    print(
        f"verification: {'OK' if ok else 'FAILED'}: every sample in exactly one rank of one step "
        f"({len(every)} unique, {dupes} duplicated, {lost} lost); steps 0..{report.head} gap-free and read by "
        f"every rank; {report.steps} segments and {report.samples} samples checksummed, {len(report.problems)} problems"
    )
    for p in report.problems[:10]:
        print(f"  {p}")
    return 0 if ok else 1
