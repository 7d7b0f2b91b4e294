"""Ingest benchmark: producer MB/s, reader MB/s per rank, and read amplification.

    .venv/bin/python bench/ingest.py            # full run, a few minutes
    .venv/bin/python bench/ingest.py --quick    # under a minute: fewer samples per config
    .venv/bin/python bench/ingest.py --smoke    # seconds: 256 KiB TGBs of 4 KiB samples, 1 MiB per config

For each store (`file://` in a temp dir; SeaweedFS started here on free loopback ports), each
producer count (1 and 4: coroutines in this one process, each with its own store client) and each
sample size (4 KiB, 1 MiB, 16 MiB of os.urandom bytes, one `bin` field per sample):

1. ingest: the producers `put` their samples and `close` (everything committed); MB/s is payload
   bytes over the time from the moment all producers are registered until the last close returns
   (registration is timed apart: `reg s`). Stores are durable (the file store fsyncs, the default).
2. read: one reader per rank, one rank at a time (as if each rank were alone on its host), reads
   every step with `Reader.steps()`, which range-GETs, CRC-checks and decodes its slices (default
   prefetch 4). MB/s is the rank-slice bytes (sum of `batch.nbytes`) over the time from the first
   `steps()` iteration to the last batch (opening the reader, i.e. loading the manifest, is a
   one-off and not timed). Each rank's figure sums several passes (a fresh reader each) to at
   least --reps passes and --min-seconds; the table shows the median over ranks.
3. baseline, same ranks, passes interleaved with the reader's (same page-cache state, same rule):
   `file://`: plain `open()` + `seek` + `read(length)` of each step's rank range of the segment
   files, one after the other; S3: plain aiobotocore range GETs of the same ranges, as many in
   flight as the reader keeps (1 + prefetch), no checks, no decoding.
4. read amplification = `Reader.bytes_fetched` / sum of `batch.nbytes`; "store amp." counts every
   byte the reader got from its store (manifest log included) over the same denominator.
5. diagnostics (a second table): each TGB's seal-to-commit latency (`ProducerStats.ready_to_visible`)
   and the process's minor page faults per MiB the readers returned.

With `--codec` it runs only the codec section instead: the checksums a segment may carry, timed on
this machine over slice-sized buffers of random bytes (best of 5 runs), and the reader CPU per
sample (process time, the reader's threads included, over wall-clock samples) of StreamDataset
over a `file://` stream of array samples (one uint8 (3, 224, 224) array and a text field each, 16
per step, world size 1; read twice, the second pass timed, so the page cache is warm), with
`collate=True` (one tensor per step, views of the fetched slice) and `collate=False` (per-sample
dicts of tensors, then `torch.stack`, as a trainer would).

With `--floor` it runs only the floor section, which also ends the default run and `--smoke`:
CPU per sample of the producer (`open_producer` / `put` / `close`), StreamDataset(collate=True)
and MountDataset(collate=True) through a real `lakestream mount` (the daemon's CPU from /proc
counted), against obstore PUT / GET of the same bytes (one object per step, turned into one uint8
tensor with `np.frombuffer`) on SeaweedFS and plain writes / reads on file://, for uint8
(3, 224, 224) arrays and a short key, 16 a step, world size 1; each pair side by side in
alternating rounds (the file:// reads, `Reader.steps` against plain reads, each timed over 3
passes and 50 ms at least a round). Targets: producer <= 2x the PUT floor, StreamDataset <= 1.5x
and MountDataset (trainer + daemon) <= 2.5x the GET floor (SeaweedFS), file:// Reader >= 0.5x
page-cached reads.

Targets (file://): reader MB/s at least 0.5x the plain-read baseline; read amplification <= 1.02.
The verdicts are printed; nothing is tuned to meet them. The 1-minute load average is printed at
the start and the end: figures from a machine busy with other work vary a lot.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import shlex
import shutil
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    KiB,
    MiB,
    SeaweedS3,
    fmt_bytes,
    format_table,
    load_average,
    machine_description,
    mb_per_s,
    median,
    random_pool,
    removing,
    temp_dir,
)

import lakestream
from lakestream.testing import log_key  # the baseline's warm-up GET

WORLD_SIZE = 4
TGB_BYTES = 16 * MiB  # global batch = TGB_BYTES / sample size, at least one sample per rank
PREFETCH = 4  # the Reader default, stated here so the S3 baseline keeps as many GETs in flight
READ_AMP_TARGET = 1.02
RATIO_TARGET = 0.5


# -- a store wrapper that counts what the reader gets ------------------------------------------


class CountingStore:
    """Delegates to `inner`, counting GET requests and bytes (manifest log included)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.url = inner.url
        self.get_bytes = 0
        self.gets = 0

    async def get(self, key: str) -> bytes:
        data = await self.inner.get(key)
        self.gets += 1
        self.get_bytes += len(data)
        return data

    async def get_range(self, key: str, offset: int, length: int) -> bytes:
        data = await self.inner.get_range(key, offset, length)
        self.gets += 1
        self.get_bytes += len(data)
        return data

    async def put(self, key: str, data: bytes) -> None:
        await self.inner.put(key, data)

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        return await self.inner.put_if_absent(key, data)

    async def list(self, prefix: str) -> list[str]:
        return await self.inner.list(prefix)

    async def delete(self, keys: list[str]) -> None:
        await self.inner.delete(keys)

    async def aclose(self) -> None:
        await self.inner.aclose()

    def __getattr__(self, name: str) -> Any:  # anything the protocol grows later
        return getattr(self.inner, name)

    async def __aenter__(self) -> CountingStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


# -- one configuration -------------------------------------------------------------------------


@dataclass
class Backend:
    name: str  # "file" or "s3"
    s3: SeaweedS3 | None = None
    tmp: Path | None = None
    n: int = 0

    def new_url(self) -> str:
        self.n += 1
        if self.s3 is not None:
            return self.s3.new_stream(f"stream-{self.n}")
        assert self.tmp is not None
        return f"file://{self.tmp}/stream-{self.n}"

    def store(self, url: str) -> Any:
        if self.s3 is not None:
            return self.s3.store(url)
        return lakestream.open_store(url)

    def discard(self, url: str) -> None:
        """Free the disk (and page cache) of a measured file:// stream; S3 data goes with the server."""
        if self.s3 is None:
            shutil.rmtree(url[len("file://") :], ignore_errors=True)


@dataclass
class Result:
    store: str
    producers: int
    sample: int
    global_batch: int
    steps: int
    payload: int
    register_s: float
    ingest_s: float  # the fastest ingest run
    ingest_runs: list[float]  # MB/s of every ingest run
    commits: int
    attempts: int
    reader: list[float]  # MB/s per (rank, rep)
    baseline: list[float]
    read_amp: float
    store_amp: float
    faults_per_mib: float  # minor page faults of the process per MiB read, reader passes
    visible: list[float]  # each TGB's seconds from sealed to committed (ProducerStats.ready_to_visible)

    @property
    def ingest_mbs(self) -> float:
        return mb_per_s(self.payload, self.ingest_s)

    @property
    def ratio(self) -> float:
        return median(self.reader) / median(self.baseline)


async def produce(
    backend: Backend, url: str, producers: int, per_producer: int, pool: list[bytes]
) -> tuple[float, float, list[Any]]:
    """Run the producers; (registration seconds, ingest seconds, their stats)."""
    registered = 0
    all_registered = anyio.Event()
    t_reg0 = time.perf_counter()
    t_start = 0.0
    stats: list[Any] = []

    async def one(k: int) -> None:
        nonlocal registered, t_start
        async with backend.store(url) as store, lakestream.open_producer(store, f"producer-{k}") as p:
            stats.append(p.stats)
            registered += 1
            if registered == producers:
                t_start = time.perf_counter()
                all_registered.set()
            await all_registered.wait()
            n = len(pool)
            base = k * per_producer
            for i in range(per_producer):
                await p.put({"bin": pool[(base + i) % n]}, cursor=i + 1)
            # leaving the block closes: commits everything and waits for it

    async with anyio.create_task_group() as tg:
        for k in range(producers):
            tg.start_soon(one, k)
    t_end = time.perf_counter()
    return t_start - t_reg0, t_end - t_start, stats


async def read_rank(inner: Any, rank: int, steps: int) -> tuple[float, int, int, int, int]:
    """One pass of a fresh reader over `rank`'s slices of every step, on store `inner` (shared by
    the passes, as one process shares its store; each pass counts its own GETs).

    (seconds, slice bytes, Reader.bytes_fetched, store GET bytes, minor page faults). The clock
    runs from the first `steps()` iteration to the last batch: opening the reader (loading the
    manifest, a one-off per reader) is not in it, but the store bytes include it.
    """
    store = CountingStore(inner)
    nbytes = 0
    async with lakestream.open_reader(store, rank, WORLD_SIZE, prefetch=PREFETCH) as reader:
        f0 = minor_faults()
        t0 = time.perf_counter()
        async for batch in reader.steps(0, steps):
            nbytes += batch.nbytes
        seconds = time.perf_counter() - t0
        faults = minor_faults() - f0
        fetched = reader.bytes_fetched
    return seconds, nbytes, fetched, store.get_bytes, faults


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def baseline_file(root: Path, state: Any, rank: int) -> tuple[float, int]:
    """Plain reads of each step's rank range from the segment files; (seconds, bytes)."""
    total = 0
    t0 = time.perf_counter()
    for n in range(state.first_step, state.head + 1):
        entry = state.step(n)
        r = entry.ranks[rank]
        with open(root.joinpath(*entry.segment.split("/")), "rb", buffering=0) as f:
            f.seek(r.offset)
            data = f.read(r.length)
        total += len(data)
    return time.perf_counter() - t0, total


@asynccontextmanager
async def raw_s3_client(s3: SeaweedS3, url: str) -> AsyncIterator[Any]:
    """A plain aiobotocore client for the baseline, warmed up (credentials, connection) with a
    GET of the stream's first log record, as the reader's `open` warms its own."""
    import aiobotocore.session
    from aiobotocore.config import AioConfig

    bucket, _, prefix = url[len("s3://") :].partition("/")
    config = AioConfig(
        s3={"addressing_style": "path"},
        retries={"total_max_attempts": 1},
        max_pool_connections=64,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    async with aiobotocore.session.get_session().create_client("s3", config=config, **s3.store_options()) as client:
        resp = await client.get_object(Bucket=bucket, Key=f"{prefix}/{log_key(0)}")
        async with resp["Body"] as body:
            await body.read()
        yield client


async def baseline_s3(client: Any, url: str, state: Any, rank: int) -> tuple[float, int]:
    """Plain range GETs of the rank's ranges, 1 + PREFETCH in flight; (seconds, bytes)."""
    bucket, _, prefix = url[len("s3://") :].partition("/")
    total = 0
    sem = anyio.Semaphore(1 + PREFETCH)

    async def get(key: str, offset: int, length: int) -> None:
        nonlocal total
        try:
            resp = await client.get_object(Bucket=bucket, Key=key, Range=f"bytes={offset}-{offset + length - 1}")
            async with resp["Body"] as body:
                data = await body.read()
            total += len(data)
        finally:
            sem.release()

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for n in range(state.first_step, state.head + 1):
            r = state.step(n).ranks[rank]
            await sem.acquire()
            tg.start_soon(get, f"{prefix}/{state.step(n).segment}", r.offset, r.length)
    return time.perf_counter() - t0, total


async def run_config(
    backend: Backend,
    producers: int,
    sample: int,
    target_payload: int,
    ingest_reps: int,
    reps: int,
    min_seconds: float,
    pool: list[bytes],
) -> Result:
    gb = max(WORLD_SIZE, TGB_BYTES // sample)
    # Whole TGBs only, at least one per producer, about target_payload bytes in all.
    tgbs_per_producer = max(1, round(target_payload / (sample * gb * producers)))
    per_producer = tgbs_per_producer * gb
    payload = producers * per_producer * sample
    # Ingest `ingest_reps` times, each into a new stream; keep the fastest run (the one least
    # disturbed by whatever else the machine runs) and read the stream of the last one.
    runs: list[tuple[float, float, list[Any]]] = []
    url = ""
    for _ in range(ingest_reps):
        if url:
            backend.discard(url)
        url = backend.new_url()
        async with backend.store(url) as store:
            await lakestream.create(store, world_size=WORLD_SIZE, global_batch=gb)
        runs.append(await produce(backend, url, producers, per_producer, pool))
    reg_s, ingest_s, stats = min(runs, key=lambda r: r[1])
    async with backend.store(url) as store:
        state = await lakestream.load_state(store)
    steps = state.head + 1 - state.first_step
    assert steps == producers * tgbs_per_producer, (steps, producers, tgbs_per_producer)

    # Per rank: alternate baseline and reader passes until each has run `reps` passes and
    # `min_seconds` in all (so page-cache-fast passes are not timed one millisecond at a time).
    reader: list[float] = []
    base: list[float] = []
    amp = store_amp = 0.0
    faults = 0
    read_bytes = 0
    async with AsyncExitStack() as stack:
        inner = await stack.enter_async_context(backend.store(url))
        raw = None if backend.s3 is None else await stack.enter_async_context(raw_s3_client(backend.s3, url))
        for rank in range(WORLD_SIZE):
            b_t = b_n = r_t = r_n = 0.0
            b_k = r_k = 0
            while b_k < reps or r_k < reps or b_t < min_seconds or r_t < min_seconds:
                if b_k < reps or b_t < min_seconds:
                    if raw is None:
                        s_, n_ = baseline_file(Path(url[len("file://") :]), state, rank)
                    else:
                        s_, n_ = await baseline_s3(raw, url, state, rank)
                    b_t, b_n, b_k = b_t + s_, b_n + n_, b_k + 1
                if r_k < reps or r_t < min_seconds:
                    s_, n_, fetched, got, f_ = await read_rank(inner, rank, state.head + 1)
                    r_t, r_n, r_k = r_t + s_, r_n + n_, r_k + 1
                    amp = max(amp, fetched / n_)
                    store_amp = max(store_amp, got / n_)
                    faults += f_
                    read_bytes += n_
            assert b_n / b_k == r_n / r_k, (b_n, b_k, r_n, r_k)
            base.append(mb_per_s(int(b_n), b_t))
            reader.append(mb_per_s(int(r_n), r_t))
    backend.discard(url)
    return Result(
        store=backend.name,
        producers=producers,
        sample=sample,
        global_batch=gb,
        steps=steps,
        payload=payload,
        register_s=reg_s,
        ingest_s=ingest_s,
        ingest_runs=[mb_per_s(payload, r[1]) for r in runs],
        commits=sum(s.commits for s in stats),
        attempts=sum(s.commit_attempts for s in stats),
        reader=reader,
        baseline=base,
        read_amp=amp,
        store_amp=store_amp,
        faults_per_mib=faults / (read_bytes / MiB),
        visible=[x for st in stats for x in st.ready_to_visible],
    )


# -- the run -----------------------------------------------------------------------------------


HEADERS = [
    "store",
    "prod.",
    "sample",
    "global batch (TGB)",
    "steps",
    "data",
    "reg s",
    "ingest MB/s",
    "commits (attempts)",
    "reader MB/s/rank",
    "baseline MB/s",
    "reader/baseline",
    "read amp.",
    "store amp.",
]


def row(r: Result) -> list[str]:
    return [
        "file://" if r.store == "file" else "SeaweedFS",
        str(r.producers),
        fmt_bytes(r.sample),
        f"{r.global_batch} ({fmt_bytes(r.global_batch * r.sample)})",
        str(r.steps),
        fmt_bytes(r.payload),
        f"{r.register_s:.2f}",
        f"{r.ingest_mbs:.0f}",
        f"{r.commits} ({r.attempts})",
        f"{median(r.reader):.0f}",
        f"{median(r.baseline):.0f}",
        f"{r.ratio:.2f}",
        f"{r.read_amp:.3f}",
        f"{r.store_amp:.3f}",
    ]


async def main_async(a: argparse.Namespace) -> int:
    sizes = [int(s) for s in a.sizes]
    target = a.mib * MiB
    results: list[Result] = []
    pools = {}
    for size in sizes:
        gb = max(WORLD_SIZE, TGB_BYTES // size)
        pools[size] = random_pool(size, 2 * gb, max_bytes=128 * MiB)

    async def run_backend(backend: Backend) -> None:
        for producers in a.producers:
            for size in sizes:
                t0 = time.perf_counter()
                r = await run_config(
                    backend, producers, size, target, a.ingest_reps, a.reps, a.min_seconds, pools[size]
                )
                results.append(r)
                print(
                    f"  {backend.name:4} producers={producers} sample={fmt_bytes(size):>6}: "
                    f"ingest {r.ingest_mbs:6.0f} MB/s, "
                    f"reader {median(r.reader):6.0f} MB/s/rank ({r.ratio:.2f}x baseline), "
                    f"amp {r.read_amp:.3f}  [{time.perf_counter() - t0:.1f} s]",
                    file=sys.stderr,
                    flush=True,
                )

    if "file" in a.stores:
        with removing(temp_dir()) as tmp:
            await run_backend(Backend("file", tmp=tmp))
    if "s3" in a.stores:
        with SeaweedS3() as s3:
            print(f"  SeaweedFS up at {s3.endpoint_url} in {s3.startup_s:.1f} s", file=sys.stderr, flush=True)
            await run_backend(Backend("s3", s3=s3))

    print()
    print(format_table(HEADERS, [row(r) for r in results]))
    print()
    print("diagnostics: MB/s of every ingest run (the table shows the fastest); of that run, seconds from")
    print("sealing a TGB to its commit (ProducerStats.ready_to_visible); minor page faults of this process")
    print("per MiB the readers returned (a fault: a fresh page of a buffer it allocated)")
    print()
    print(
        format_table(
            [
                "store",
                "prod.",
                "sample",
                "ingest MB/s, runs",
                "ingest s",
                "seal-to-commit p50 s",
                "max s",
                "reader faults/MiB",
            ],
            [
                [
                    "file://" if r.store == "file" else "SeaweedFS",
                    r.producers,
                    fmt_bytes(r.sample),
                    " ".join(f"{x:.0f}" for x in r.ingest_runs),
                    f"{r.ingest_s:.2f}",
                    f"{median(r.visible):.2f}",
                    f"{max(r.visible, default=float('nan')):.2f}",
                    f"{r.faults_per_mib:.0f}",
                ]
                for r in results
            ],
        )
    )
    print()
    ok = True
    for r in results:
        if r.store != "file":
            continue
        met_ratio = r.ratio >= RATIO_TARGET
        met_amp = r.read_amp <= READ_AMP_TARGET
        ok &= met_ratio and met_amp
        print(
            f"target file:// {r.producers} prod. {fmt_bytes(r.sample):>6}: reader/baseline {r.ratio:.2f} "
            f"(>= {RATIO_TARGET}: {'met' if met_ratio else 'NOT MET'}), read amp. {r.read_amp:.3f} "
            f"(<= {READ_AMP_TARGET}: {'met' if met_amp else 'NOT MET'})"
        )
    amp_all = all(r.read_amp <= READ_AMP_TARGET for r in results)
    print(f"read amplification <= {READ_AMP_TARGET} on every store: {'met' if amp_all else 'NOT MET'}")
    if any(r.store == "file" for r in results):
        print(f"all file:// targets: {'met' if ok else 'NOT MET'}")
    return 0


# -- codec: checksums and reader CPU per sample with and without collate --------------------------


def checksum_figures() -> list[list[str]]:
    import zlib

    import crc32c
    import xxhash

    rows = []
    for size in (int(2.35e6), 147 * KiB, 64 * KiB):
        buf = os.urandom(size)
        reps = max(20, int(2e8 // size))
        for name, fn in (("zlib.crc32", zlib.crc32), ("crc32c", crc32c.crc32c), ("xxh3-64", xxhash.xxh3_64_intdigest)):
            best = math.inf
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(reps):
                    fn(buf)
                best = min(best, (time.perf_counter() - t) / reps)
            rows.append([fmt_bytes(size), name, f"{best * 1e6:.1f}", f"{size / best / 1e9:.1f}"])
    return rows


def copy_figures(tmp: Path) -> list[list[str]]:
    """The kernel's copy of a page-cached read by where the buffer starts: `preadv` of a 2 MiB
    file into memory 0, 16, 64 and 2,048 bytes past the source modulo a page, and into a pooled
    buffer placed for it (`pool.take(n, src)`). Best of 5 passes of 20 reads, GB/s."""
    import numpy as np

    from lakestream._buffers import PAGE, pool

    n = 2 << 20
    path = tmp / "copy-source"
    path.write_bytes(os.urandom(n))
    block = np.zeros(n + 2 * PAGE, np.uint8)
    page = -block.__array_interface__["data"][0] % PAGE  # the first page-aligned byte of `block`
    targets = [
        (f"{d} bytes past the source", lambda d=d: block[page + d : page + d + n].data) for d in (0, 16, 64, 2048)
    ]
    targets.append(("pool.take(n, src)", lambda: pool.take(n, 0)))
    rows = []
    fd = os.open(path, os.O_RDONLY)
    try:
        for name, buffer in targets:
            best = math.inf
            for _ in range(5):
                buf = buffer()
                t = time.perf_counter()
                for _ in range(20):
                    os.preadv(fd, [buf], 0)
                best = min(best, (time.perf_counter() - t) / 20)
                del buf
            rows.append([name, f"{best * 1e6:.0f}", f"{n / best / 1e9:.1f}"])
    finally:
        os.close(fd)
    return rows


def read_cpu(url: str, steps: int, collate: bool) -> float:
    """Process CPU seconds per sample of one StreamDataset pass (after one untimed pass)."""
    import torch

    from lakestream.torch import StreamDataset

    def one_pass() -> int:
        n = 0
        for item in StreamDataset(url, rank=0, world_size=1, stop=steps, collate=collate):
            if collate:
                x = item["img"]
                n += len(item["keys"])
            else:
                x = torch.stack([s["img"] for s in item["samples"]])
                n += len(item["samples"])
            assert x.shape[1:] == (3, 224, 224)
        return n

    one_pass()
    c0 = time.process_time()
    n = one_pass()
    return (time.process_time() - c0) / n


async def codec_stream(url: str, steps: int) -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    pool = [rng.integers(0, 256, (3, 224, 224), dtype=np.uint8) for _ in range(32)]
    await lakestream.create(url, world_size=1, global_batch=16)
    async with lakestream.open_producer(url, "p") as p:
        for i in range(steps * 16):
            await p.put({"img": pool[i % len(pool)], "txt": f"sample {i}"})


def codec_main(a: argparse.Namespace) -> int:
    print()
    print("checksums over random bytes (best of 5):")
    print(format_table(["buffer", "checksum", "µs", "GB/s"], checksum_figures()))
    steps = 8 if a.smoke else 40 if a.quick else 150
    with removing(temp_dir()) as tmp:
        print()
        print(
            "the kernel's copy of a 2 MiB page-cached read (preadv) by where the buffer starts in a page (best of 5):"
        )
        print(format_table(["buffer", "µs", "GB/s"], copy_figures(tmp)))
        url = f"file://{tmp}/codec"
        anyio.run(codec_stream, url, steps)
        rows = []
        for collate in (True, False):
            cpu = [read_cpu(url, steps, collate) for _ in range(1 if a.smoke else 3)]
            rows.append([f"collate={collate}", str(steps * 16), f"{median(cpu) * 1e6:.0f}", f"{min(cpu) * 1e6:.0f}"])
    print()
    print("StreamDataset reader CPU per sample, file:// stream, uint8 (3, 224, 224) + text, 16 per step:")
    print(format_table(["items", "samples", "CPU µs/sample (median)", "(min)"], rows))
    return 0


# -- floor: CPU per sample against the object store's own ---------------------------------------

FLOOR_SHAPE = (3, 224, 224)  # uint8: 147 KiB, the e2e bench's samples
FLOOR_BATCH = 16  # samples per step, world size 1
PRODUCER_TARGET = 2.0  # producer CPU <= 2x the PUT floor's
STREAM_TARGET = 1.5  # StreamDataset (collate) <= 1.5x the GET floor's
MOUNT_TARGET = 2.5  # MountDataset (collate, trainer + mount daemon) <= 2.5x the GET floor's
FILE_READER_TARGET = 0.5  # file:// reader MB/s >= 0.5x page-cached plain reads


def fuse_usable() -> bool:
    return (
        os.path.exists("/dev/fuse") and os.access("/dev/fuse", os.R_OK | os.W_OK) and bool(shutil.which("fusermount3"))
    )


@dataclass
class FloorStore:
    """Where one floor run writes: a SeaweedFS bucket (`s3`) or a temp dir (`tmp`)."""

    name: str  # "s3" or "file"
    s3: SeaweedS3 | None = None
    tmp: Path | None = None
    client: Any = None  # the plain obstore client of the floors (s3)
    bucket: str = ""

    def url(self, name: str) -> str:
        if self.s3 is not None:
            return f"s3://{self.bucket}/{name}"
        assert self.tmp is not None
        return f"file://{self.tmp}/{name}"

    @property
    def label(self) -> str:
        return "SeaweedFS" if self.s3 is not None else "file://"


def floor_steps(pool: list[Any]) -> list[Any]:
    """The distinct steps' bytes as uint8 arrays of (FLOOR_BATCH, *FLOOR_SHAPE), built before any timing."""
    import numpy as np

    return [np.stack(pool[i : i + FLOOR_BATCH]) for i in range(0, len(pool), FLOOR_BATCH)]


async def put_floor(fs: FloorStore, prefix: str, steps: int, step_arrays: list[Any]) -> float:
    """The PUT floor: each step's bytes (already in memory, one buffer) stored as one object with
    plain obstore `put` (s3) or written and fsynced to one file (file://). CPU seconds."""
    import obstore

    c0 = time.process_time()
    for n in range(steps):
        data = memoryview(step_arrays[n % len(step_arrays)]).cast("B")
        if fs.s3 is not None:
            await obstore.put_async(fs.client, f"{prefix}/{n:06d}", data, use_multipart=False)
        else:
            assert fs.tmp is not None
            fd = os.open(fs.tmp / prefix / f"{n:06d}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                while data:
                    data = data[os.write(fd, data) :]
                os.fsync(fd)
            finally:
                os.close(fd)
    return time.process_time() - c0


async def get_floor(fs: FloorStore, prefix: str, steps: int) -> float:
    """The GET floor: each step's object fetched whole (obstore `get`, or `open` + `read` of the
    page-cached file), `np.frombuffer` -> one uint8 tensor per step. CPU seconds from after step 0."""
    import warnings

    import numpy as np
    import obstore
    import torch

    c0 = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: the buffer is read-only
        for n in range(steps):
            if n == 1:
                c0 = time.process_time()
            if fs.s3 is not None:
                result = await obstore.get_async(fs.client, f"{prefix}/{n:06d}")
                data: Any = await result.bytes_async()
            else:
                assert fs.tmp is not None
                with open(fs.tmp / prefix / f"{n:06d}", "rb", buffering=0) as f:  # noqa: ASYNC230 (plain, on purpose)
                    data = f.read()
            x = torch.from_numpy(np.frombuffer(data, np.uint8).reshape(FLOOR_BATCH, *FLOOR_SHAPE))
            assert x.shape[0] == FLOOR_BATCH
    return time.process_time() - c0


async def produce_floor(url: str, steps: int, pool: list[Any]) -> float:
    """The producer: `open_producer` / `put` of every sample (a uint8 array and a short key) /
    `close` (everything committed). CPU seconds from the producer's registration to the close."""
    await lakestream.create(url, world_size=1, global_batch=FLOOR_BATCH)
    async with lakestream.open_producer(url, "p") as p:
        c0 = time.process_time()
        for i in range(steps * FLOOR_BATCH):
            await p.put({"__key__": f"{i:06d}", "img": pool[i % len(pool)]})
    return time.process_time() - c0


def stream_floor(url: str, steps: int) -> float:
    """StreamDataset(collate=True) over the stream's steps: CPU seconds from after step 0."""
    from lakestream.torch import StreamDataset

    c0 = 0.0
    n = 0
    for item in StreamDataset(url, rank=0, world_size=1, stop=steps, collate=True):
        if n == 0:
            c0 = time.process_time()
        assert item["img"].shape == (FLOOR_BATCH, *FLOOR_SHAPE)
        n += 1
    assert n == steps, n
    return time.process_time() - c0


def mount_floor(fs: FloorStore, url: str, steps: int, logfile: Path) -> tuple[float, float]:
    """MountDataset(collate=True) through `lakestream mount URL MNT` (bench/mount.py's `Mount`, a
    subprocess): (trainer CPU seconds, mount daemon CPU seconds), both from after step 0."""
    from lakestream.torch import MountDataset
    from mount import Mount

    assert fs.tmp is not None
    with Mount(url, fs.tmp / f"mnt-{url.rsplit('/', 1)[1]}", logfile) as m:
        c0 = d0 = 0.0
        n = 0
        for item in MountDataset(m.mountpoint, rank=0, world_size=1, stop=steps, collate=True, timeout=60):
            if n == 0:
                c0, d0 = time.process_time(), m.cpu_seconds()
            assert item["img"].shape == (FLOOR_BATCH, *FLOOR_SHAPE)
            n += 1
        assert n == steps, n
        return time.process_time() - c0, m.cpu_seconds() - d0


FILE_PASSES = 3  # the floor's file:// passes a side a round, at least ...
FILE_PASS_SECONDS = 0.05  # ... and at least this long (a 20-step pass takes ~6 ms: a scheduler tick moves it)


async def file_reader_pass(url: str, steps: int) -> tuple[float, float, int]:
    """`Reader.steps()` (collate) over a file:// stream, a fresh reader (opening it is not timed):
    (wall seconds, CPU seconds, slice bytes)."""
    nbytes = 0
    async with lakestream.open_reader(url, 0, 1, collate=True) as reader:
        t0, c0 = time.perf_counter(), time.process_time()
        async for batch in reader.steps(0, steps):
            nbytes += batch.nbytes
        return time.perf_counter() - t0, time.process_time() - c0, nbytes


def file_plain_pass(root: Path, state: Any) -> tuple[float, float, int]:
    """Plain `open` + `seek` + `read` of the same byte ranges: (wall seconds, CPU seconds, bytes)."""
    t0, c0 = time.perf_counter(), time.process_time()
    nbytes = 0
    for n in range(state.first_step, state.head + 1):
        entry = state.step(n)
        r = entry.ranks[0]
        with open(root.joinpath(*entry.segment.split("/")), "rb", buffering=0) as f:
            f.seek(r.offset)
            nbytes += len(f.read(r.length))
    return time.perf_counter() - t0, time.process_time() - c0, nbytes


async def file_passes(one: Callable[[], Awaitable[tuple[float, float, int]]]) -> tuple[float, float, int, int]:
    """`one` pass after another, FILE_PASSES of them and FILE_PASS_SECONDS at least: (wall
    seconds, CPU seconds, bytes, passes), summed over the passes."""
    wall = cpu = 0.0
    nbytes = passes = 0
    while passes < FILE_PASSES or wall < FILE_PASS_SECONDS:
        w, c, b = await one()
        wall, cpu, nbytes, passes = wall + w, cpu + c, nbytes + b, passes + 1
    return wall, cpu, nbytes, passes


@dataclass
class FloorRun:
    store: str
    samples: int  # per round, written
    put: list[float] = field(default_factory=list)  # CPU s per sample, one a round
    producer: list[float] = field(default_factory=list)
    get: list[float] = field(default_factory=list)  # from after step 0
    stream: list[float] = field(default_factory=list)
    mount_trainer: list[float] = field(default_factory=list)
    mount_daemon: list[float] = field(default_factory=list)
    reader_mbs: list[float] = field(default_factory=list)  # file:// only
    plain_mbs: list[float] = field(default_factory=list)
    reader_cpu: list[float] = field(default_factory=list)
    plain_cpu: list[float] = field(default_factory=list)


def ratios(xs: list[float], ys: list[float]) -> float:
    """The median of the per-round ratios x / y."""
    return median([x / y for x, y in zip(xs, ys)])


async def floor_round(fs: FloorStore, k: int, steps: int, pool: list[Any], step_arrays: list[Any], run: FloorRun,
                      mount: bool, logfile: Path) -> None:  # fmt: skip
    """One round: every pair measured once, the floor first in even rounds, the library first in odd ones."""
    per = steps * FLOOR_BATCH
    after0 = (steps - 1) * FLOOR_BATCH
    prefix, url = f"floor-{k}", fs.url(f"stream-{k}")
    if fs.tmp is not None and fs.s3 is None:
        (fs.tmp / prefix).mkdir()
    floor_first = k % 2 == 0
    for which in ("floor", "lib") if floor_first else ("lib", "floor"):
        if which == "floor":
            run.put.append(await put_floor(fs, prefix, steps, step_arrays) / per)
        else:
            run.producer.append(await produce_floor(url, steps, pool) / per)
    for which in ("floor", "lib") if floor_first else ("lib", "floor"):
        if which == "floor":
            run.get.append(await get_floor(fs, prefix, steps) / after0)
        else:
            run.stream.append(await anyio.to_thread.run_sync(stream_floor, url, steps) / after0)
    if mount:
        trainer, daemon = await anyio.to_thread.run_sync(mount_floor, fs, url, steps, logfile)
        run.mount_trainer.append(trainer / after0)
        run.mount_daemon.append(daemon / after0)
    if fs.s3 is None:
        root = Path(url[len("file://") :])
        state = await lakestream.load_state(url)

        async def plain() -> tuple[float, float, int]:
            return file_plain_pass(root, state)

        async def lib() -> tuple[float, float, int]:
            return await file_reader_pass(url, steps)

        await file_passes(lib)  # both read, untimed: the page cache is warm for both
        await file_passes(plain)
        for which in ("floor", "lib") if floor_first else ("lib", "floor"):
            if which == "floor":
                wall, cpu, nbytes, passes = await file_passes(plain)
                run.plain_mbs.append(mb_per_s(nbytes, wall))
                run.plain_cpu.append(cpu / (passes * per))
            else:
                wall, cpu, nbytes, passes = await file_passes(lib)
                run.reader_mbs.append(mb_per_s(nbytes, wall))
                run.reader_cpu.append(cpu / (passes * per))


async def floor_async(a: argparse.Namespace) -> int:
    import numpy as np

    steps = 4 if a.smoke else 20 if a.quick else 40
    rounds = a.floor_rounds or (1 if a.smoke else 3 if a.quick else 5)
    rng = np.random.default_rng(0)
    pool = [rng.integers(0, 256, FLOOR_SHAPE, dtype=np.uint8) for _ in range(2 * FLOOR_BATCH)]
    step_arrays = floor_steps(pool)
    mount = fuse_usable()
    print()
    print(
        f"## Against the object-store floor: uint8 {FLOOR_SHAPE} arrays ({fmt_bytes(math.prod(FLOOR_SHAPE))}) and "
        f"a short key, {FLOOR_BATCH} a step, world size 1, {steps} steps ({steps * FLOOR_BATCH} samples) a round, "
        f"{rounds} round(s), floor and library alternating first",
        flush=True,
    )
    if not mount:
        print("MountDataset rows skipped: /dev/fuse (or fusermount3) is not usable here", flush=True)
    runs: list[FloorRun] = []
    with removing(temp_dir()) as tmp:
        logfile = tmp / "mount.log"
        for name in a.stores:
            if name == "s3":
                with SeaweedS3() as s3:
                    import obstore.store

                    bucket = s3.new_bucket("").removeprefix("s3://")
                    env = s3.env()
                    saved = {k: os.environ.get(k) for k in env}
                    os.environ.update(env)  # the library (and the mount subprocess) find the server here
                    try:
                        client = obstore.store.S3Store(
                            bucket,
                            config={
                                "endpoint": s3.endpoint_url,
                                "access_key_id": env["AWS_ACCESS_KEY_ID"],
                                "secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
                                "region": env["AWS_REGION"],
                                "virtual_hosted_style_request": False,
                            },
                            client_options={"allow_http": True},
                        )
                        fs = FloorStore("s3", s3=s3, tmp=tmp, client=client, bucket=bucket)
                        await obstore.put_async(client, "warm-up", b"x")  # the client's connection
                        run = FloorRun(fs.label, steps * FLOOR_BATCH)
                        for k in range(rounds):
                            await floor_round(fs, k, steps, pool, step_arrays, run, mount, logfile)
                        runs.append(run)
                    finally:
                        for k, v in saved.items():
                            if v is None:
                                os.environ.pop(k, None)
                            else:
                                os.environ[k] = v
            else:
                fs = FloorStore("file", tmp=tmp / "file")
                fs.tmp.mkdir()  # type: ignore[union-attr]
                run = FloorRun(fs.label, steps * FLOOR_BATCH)
                for k in range(rounds):
                    await floor_round(fs, k, steps, pool, step_arrays, run, mount, logfile)
                runs.append(run)
            print(f"  floor rounds on {run.store} done", file=sys.stderr, flush=True)

    def us(xs: list[float]) -> str:
        return f"{median(xs) * 1e6:,.0f}"

    rows = []
    for r in runs:
        put_kind = "obstore put" if r.store == "SeaweedFS" else "write + fsync"
        get_kind = "obstore get" if r.store == "SeaweedFS" else "read (page cache)"
        rows.append([r.store, f"producer (open_producer, put, close) / {put_kind}", us(r.producer), us(r.put),
                     f"{ratios(r.producer, r.put):.2f}"])  # fmt: skip
        rows.append([r.store, f"StreamDataset(collate=True) / {get_kind}", us(r.stream), us(r.get),
                     f"{ratios(r.stream, r.get):.2f}"])  # fmt: skip
        if r.mount_trainer:
            both = [t + d for t, d in zip(r.mount_trainer, r.mount_daemon)]
            rows.append([r.store, f"MountDataset(collate=True), trainer + daemon / {get_kind}",
                         f"{us(r.mount_trainer)} + {us(r.mount_daemon)} = {us(both)}", us(r.get),
                         f"{ratios(both, r.get):.2f}"])  # fmt: skip
        if r.reader_cpu:
            rows.append([r.store, "Reader.steps (collate) / plain open, seek, read", us(r.reader_cpu), us(r.plain_cpu),
                         f"{ratios(r.reader_cpu, r.plain_cpu):.2f}"])  # fmt: skip
    print()
    print("CPU per sample (µs, process and all its threads; the mount daemon's from /proc), median over rounds;")
    print("ratio: median over rounds of library / floor, measured side by side in each round")
    print(format_table(["store", "library / floor", "library µs/sample", "floor µs/sample", "ratio"], rows))
    for r in runs:
        if r.reader_mbs:
            print()
            print(
                f"file:// throughput: Reader.steps (collate) {median(r.reader_mbs):,.0f} MB/s, plain reads "
                f"{median(r.plain_mbs):,.0f} MB/s (page cache warm), ratio {ratios(r.reader_mbs, r.plain_mbs):.2f}"
            )
    print()

    def verdict(label: str, ratio: float, bound: float, at_most: bool) -> None:
        ok = ratio <= bound if at_most else ratio >= bound
        print(f"target {label} {'<=' if at_most else '>='} {bound}x: {'met' if ok else 'NOT met'} ({ratio:.2f}x)")

    for r in runs:
        if r.store == "SeaweedFS":
            verdict("producer / PUT floor (SeaweedFS)", ratios(r.producer, r.put), PRODUCER_TARGET, True)
            verdict("StreamDataset / GET floor (SeaweedFS)", ratios(r.stream, r.get), STREAM_TARGET, True)
            if r.mount_trainer:
                both = [t + d for t, d in zip(r.mount_trainer, r.mount_daemon)]
                verdict("MountDataset + daemon / GET floor (SeaweedFS)", ratios(both, r.get), MOUNT_TARGET, True)
            else:
                print("target MountDataset + daemon / GET floor (SeaweedFS): skipped (no usable /dev/fuse)")
        elif r.reader_mbs:
            verdict("file:// Reader / plain read MB/s", ratios(r.reader_mbs, r.plain_mbs), FILE_READER_TARGET, False)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer samples per config and one repetition (< 1 min)")
    ap.add_argument("--smoke", action="store_true", help="every code path in seconds: 256 KiB TGBs, small samples")
    ap.add_argument("--stores", nargs="+", choices=["file", "s3"], default=["file", "s3"])
    ap.add_argument("--producers", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--sizes", nargs="+", type=int, default=[4 * KiB, MiB, 16 * MiB], help="sample sizes in bytes")
    ap.add_argument(
        "--mib", type=int, help="payload per config in MiB (default 512, quick 64), whole TGBs, >= 1 per producer"
    )
    ap.add_argument("--ingest-reps", type=int, help="ingest runs per config, the fastest is shown (default 2, quick 1)")
    ap.add_argument("--reps", type=int, help="at least this many read passes per rank (default 3, quick 1)")
    ap.add_argument("--min-seconds", type=float, help="at least this long reading per rank (default 0.5, quick 0.1)")
    ap.add_argument("--codec", action="store_true", help="only the codec section: checksums, collate vs per-sample")
    ap.add_argument("--floor", action="store_true", help="only the floor section: CPU per sample against obstore's")
    ap.add_argument("--floor-rounds", type=int, help="rounds of the floor section (default 5, quick 3, smoke 1)")
    a = ap.parse_args(argv)
    if a.smoke:  # whole TGBs of 256 KiB: the smallest configuration that still runs every path
        global TGB_BYTES
        TGB_BYTES = 256 * KiB
        a.sizes = [4 * KiB] if a.sizes == ap.get_default("sizes") else a.sizes
        a.producers = [1, 2] if a.producers == ap.get_default("producers") else a.producers
        a.mib = a.mib or 1
        a.ingest_reps = a.ingest_reps or 2
        a.reps = a.reps or 1
        a.min_seconds = 0.01 if a.min_seconds is None else a.min_seconds
    if a.mib is None:
        a.mib = 64 if a.quick else 512
    if a.ingest_reps is None:
        a.ingest_reps = 1 if a.quick else 2
    if a.reps is None:
        a.reps = 1 if a.quick else 3
    if a.min_seconds is None:
        a.min_seconds = 0.1 if a.quick else 0.5
    cmd = shlex.join([".venv/bin/python", "bench/ingest.py", *(sys.argv[1:] if argv is None else argv)])
    print(f"$ {cmd}")
    print(f"machine: {machine_description()}")
    print(
        f"world size {WORLD_SIZE}; TGB ~{fmt_bytes(TGB_BYTES)}: global batch = max({WORLD_SIZE}, "
        f"{fmt_bytes(TGB_BYTES)} / sample); ~{a.mib} MiB of random payload per config; fastest of "
        f"{a.ingest_reps} ingest run(s); read passes per rank >= {a.reps} and >= {a.min_seconds} s; "
        "producers are coroutines in one process; MB/s = 10^6 bytes/s",
        flush=True,
    )
    print(f"load average at start: {load_average()}", flush=True)
    t0 = time.perf_counter()
    if a.codec:
        rc = codec_main(a)
    elif a.floor:
        rc = anyio.run(floor_async, a)
    else:
        rc = anyio.run(main_async, a) or anyio.run(floor_async, a)
    print(f"load average at end: {load_average()}; total time {time.perf_counter() - t0:.1f} s")
    return rc


if __name__ == "__main__":
    sys.exit(main())
