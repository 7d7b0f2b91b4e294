"""S3 client benchmark: CPU per PUT and per GET, aiobotocore against obstore, side by side.

    .venv/bin/python bench/s3client.py            # full run, a few minutes
    .venv/bin/python bench/s3client.py --quick    # about a minute: fewer objects and rounds
    .venv/bin/python bench/s3client.py --smoke    # seconds: every part, tiny

One SeaweedFS server (started as the other benches start it, bench/_common.py), one process, two
`s3://` stores pointed at it, one on each S3 client (`LAKESTREAM_S3_CLIENT=aiobotocore` and
`=obstore` as each is opened).
Two object sizes: 2.35 MB (one step of 16 samples of ~147 KiB, a segment) and 4 KiB (a manifest
record). For each size, client and round, the store PUTs N fresh objects (`put`, one at a time),
then GETs each whole as the reader fetches a slice (`get_range`, one at a time), then deletes
them. CPU is the process's (`time.process_time`: every thread, so the clients' own threads count),
over the N calls, divided by N; wall time gives throughput. The clients take turns in every round
(the order alternates), so drift in the machine's load falls on both; the table shows the median
over the rounds, and the ratio aiobotocore / obstore of each (> 1: obstore is cheaper).

A second table: whole-object `get`s of a small object (300 bytes, a log version) and of a key
that is not there (a 404: a follower of the log looking for the next version), one at a time, on
aiobotocore, on obstore with every GET through obstore (`LAKESTREAM_S3_LEAN_GET=0`) and on obstore
with its default lean GET path (`_store/_lean.py`); CPU per call, median over the rounds, the
readers taking turns in every round.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import KiB, SeaweedS3, format_table, load_average, machine_description

CLIENTS = ("aiobotocore", "obstore")
SIZES = {"2.35 MB": 2_350_000, "4 KiB": 4 * KiB}
MODES = {  # objects per size per client per round, rounds
    "full": ({"2.35 MB": 100, "4 KiB": 1000}, 5),
    "quick": ({"2.35 MB": 40, "4 KiB": 300}, 3),
    "smoke": ({"2.35 MB": 3, "4 KiB": 10}, 1),
}
WARMUP = 3  # calls of each kind before a client is measured (connections, first-use imports)
SMALL = 300  # bytes: a version of the log
SMALL_CALLS = {"full": 2000, "quick": 600, "smoke": 10}  # gets of each kind per round and reader
READERS = {"aiobotocore": ("aiobotocore", "0"), "obstore": ("obstore", "0"), "obstore, lean GET": ("obstore", "1")}


def open_client(client: str, url: str, options: dict[str, Any], lean: str = "1") -> Any:
    """A store on `client`, chosen as a user chooses it (LAKESTREAM_S3_CLIENT and
    LAKESTREAM_S3_LEAN_GET, read on open)."""
    import lakestream

    os.environ["LAKESTREAM_S3_CLIENT"] = client
    os.environ["LAKESTREAM_S3_LEAN_GET"] = lean
    try:
        return lakestream.open_store(url, **options)
    finally:
        del os.environ["LAKESTREAM_S3_CLIENT"], os.environ["LAKESTREAM_S3_LEAN_GET"]


async def measure(store: Any, data: bytes, n: int, tag: str) -> dict[str, float]:
    """CPU seconds per call and MB/s of n PUTs, then n whole-object GETs, of `data`."""
    keys = [f"{tag}/{i:05d}" for i in range(n)]
    c0, t0 = time.process_time(), time.perf_counter()
    for k in keys:
        await store.put(k, data)
    c1, t1 = time.process_time(), time.perf_counter()
    got = 0
    for k in keys:
        got += len(await store.get_range(k, 0, len(data)))
    c2, t2 = time.process_time(), time.perf_counter()
    if got != n * len(data):
        raise SystemExit(f"{tag}: read {got} bytes, expected {n * len(data)}")
    await store.delete(keys)
    mb = n * len(data) / 1e6
    return {"put_cpu": (c1 - c0) / n, "get_cpu": (c2 - c1) / n, "put_mbs": mb / (t1 - t0), "get_mbs": mb / (t2 - t1)}


async def measure_small(store: Any, n: int, tag: str) -> dict[str, float]:
    """CPU seconds per call of n whole-object `get`s of a small object, then of a missing key."""
    from lakestream import ObjectNotFound

    key = f"{tag}/v"
    await store.put(key, os.urandom(SMALL))
    c0 = time.process_time()
    for _ in range(n):
        await store.get(key)
    c1 = time.process_time()
    for _ in range(n):
        try:
            await store.get(f"{tag}/missing")
        except ObjectNotFound:
            pass
        else:
            raise SystemExit(f"{tag}/missing: found")
    c2 = time.process_time()
    await store.delete([key])
    return {"hit": (c1 - c0) / n, "miss": (c2 - c1) / n}


async def run_small(s3: SeaweedS3, n: int, rounds: int) -> dict[str, list[dict[str, float]]]:
    options = s3.store_options()
    stores = {r: open_client(c, s3.new_stream(f"small-{c}"), options, lean) for r, (c, lean) in READERS.items()}
    results: dict[str, list[dict[str, float]]] = {}
    try:
        for r, store in stores.items():
            await measure_small(store, WARMUP, f"warmup-{r[:3]}")
        for i in range(rounds):
            for r in READERS if i % 2 == 0 else reversed(list(READERS)):
                results.setdefault(r, []).append(await measure_small(stores[r], n, f"r{i}"))
    finally:
        for store in stores.values():
            await store.aclose()
    return results


def report_small(results: dict[str, list[dict[str, float]]]) -> None:
    cpu = {(r, k): statistics.median(f[k] for f in results[r]) for r in READERS for k in ("hit", "miss")}
    rows = [
        [
            what,
            *(f"{cpu[r, k] * 1e6:,.0f}" for r in READERS),
            f"{cpu['obstore', k] / cpu['obstore, lean GET', k]:.2f}",
        ]
        for what, k in ((f"{SMALL} B object", "hit"), ("missing key (404)", "miss"))
    ]
    headers = ["whole-object get", *(f"{r} CPU µs" for r in READERS), "obstore / lean"]
    print(format_table(headers, rows, "lrrrr"))


async def run(s3: SeaweedS3, counts: dict[str, int], rounds: int) -> dict[tuple[str, str], list[dict[str, float]]]:
    options = s3.store_options()
    stores = {c: open_client(c, s3.new_stream(f"s3client-{c}"), options) for c in CLIENTS}
    payloads = {label: os.urandom(size) for label, size in SIZES.items()}
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    try:
        for store in stores.values():
            for label, data in payloads.items():
                await measure(store, data, WARMUP, f"warmup-{label}")
        for r in range(rounds):
            for label, data in payloads.items():
                for c in CLIENTS if r % 2 == 0 else reversed(CLIENTS):
                    figures = await measure(stores[c], data, counts[label], f"r{r}-{label.replace(' ', '')}")
                    results.setdefault((label, c), []).append(figures)
    finally:
        for store in stores.values():
            await store.aclose()
    return results


def report(results: dict[tuple[str, str], list[dict[str, float]]]) -> list[str]:
    rows = []
    verdicts = []
    for label in SIZES:
        for op in ("put", "get"):
            cpu = {c: statistics.median(f[f"{op}_cpu"] for f in results[label, c]) for c in CLIENTS}
            mbs = {c: statistics.median(f[f"{op}_mbs"] for f in results[label, c]) for c in CLIENTS}
            ratio = cpu["aiobotocore"] / cpu["obstore"] if cpu["obstore"] else float("inf")
            verdicts.append(ratio)
            rows.append(
                [
                    label,
                    op.upper(),
                    f"{cpu['aiobotocore'] * 1e6:,.0f}",
                    f"{cpu['obstore'] * 1e6:,.0f}",
                    f"{ratio:.2f}",
                    f"{mbs['aiobotocore']:,.1f}",
                    f"{mbs['obstore']:,.1f}",
                ]
            )
    headers = [
        "object",
        "op",
        "aiobotocore CPU µs",
        "obstore CPU µs",
        "aiobotocore / obstore",
        "aiobotocore MB/s",
        "obstore MB/s",
    ]
    print(format_table(headers, rows, "llrrrrr"))
    cheaper = "obstore" if all(v > 1 for v in verdicts) else "aiobotocore" if all(v < 1 for v in verdicts) else None
    print()
    print(f"cheaper in CPU on every row: {cheaper or 'neither (mixed)'}")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer objects and rounds (about a minute)")
    ap.add_argument("--smoke", action="store_true", help="every part, tiny (seconds)")
    a = ap.parse_args(argv)
    mode = "smoke" if a.smoke else "quick" if a.quick else "full"
    counts, rounds = MODES[mode]
    t0 = time.perf_counter()
    print("# S3 client benchmark: CPU per PUT and per GET, aiobotocore against obstore")
    print()
    print(f"machine: {machine_description()}")
    print(f"mode: {mode}; per round and client: " + ", ".join(f"{n} × {label}" for label, n in counts.items()))
    print(f"{rounds} rounds, sequential calls, one SeaweedFS server on loopback")
    print(f"load average at start: {load_average()}", flush=True)
    with SeaweedS3() as s3:
        results = asyncio.run(run(s3, counts, rounds))
        small = asyncio.run(run_small(s3, SMALL_CALLS[mode], rounds))
    print()
    report(results)
    print()
    print(f"whole-object gets, {SMALL_CALLS[mode]} of each kind per round and reader, {rounds} rounds:")
    report_small(small)
    print(f"load average at end: {load_average()}; total time {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
