"""The child processes of the real-process scale test (`test_scale_processes.py`):

    python tests/scale_children.py produce '{"url": …, "proc": P, "producers": K, …}'
    python tests/scale_children.py read '{"url": …, "ranks": [R, …], "world": W, …}'

Both inject the fault spec they are given (`lakestream.testing.inject_faults`) before opening
anything, count what was injected, and write a JSON report at the end.

`produce`: K combining producers `p{P}-{k}` (`open_producer(url, pid, combine=True)`), open
loop: once the go file exists (it holds the start time t0), producer k puts one global batch of
samples `{pid}-{i}` (cursor: samples put so far) at t0 + phase + j·period, phase random in
[0, period), for every such time before t0 + duration; at t0 + duration it puts `k % 4` more
samples (a leftover) and closes. The report: samples put and the final cursor of each producer, its stats, and
the store calls and injected faults of the process.

`read`: one reader per rank (`open_reader(url, rank, world)`, rank 0 publishing the consumption
mark), iterating `steps(0)` and journaling `{"t", "step", "rank", "keys"}` per step, until the
stop file (holding the final head) exists and every rank read that step.
"""

from __future__ import annotations

import json
import math
import random
import resource
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio

import lakestream
from lakestream.testing import FaultyStore, inject_faults

POLL = 0.1  # seconds between looks at the go and stop files


PHASES: list[tuple[float, str]] = [(math.inf, "start")]  # (until, name): the phase a request is counted in


def what(key: str) -> str:
    """The kind of object `key` is: log, tail, consumed, intents, snapshots, segments, …"""
    parts = key.split("/")
    return parts[1] if parts[0] == "_lakestream" and len(parts) > 1 else parts[0]


def faults(spec: str) -> tuple[list[FaultyStore], Counter[str]]:
    """Inject `spec`; the stores opened, and requests counted as "phase op object-kind"."""
    stores: list[FaultyStore] = []
    requests: Counter[str] = Counter()

    async def count(op: str, key: str) -> None:
        now = time.time()
        phase = next(name for until, name in PHASES if now < until)
        requests[f"{phase} {op} {what(key)}"] += 1

    def configure(store: FaultyStore) -> None:
        store.hook = count
        stores.append(store)

    inject_faults(spec, configure)
    return stores, requests


def counts(stores: list[FaultyStore], requests: Counter[str]) -> dict[str, Any]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "calls": dict(sum((s.calls for s in stores), Counter())),
        "injected": dict(sum((s.injected for s in stores), Counter())),
        "requests": dict(requests),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
    }


async def wait_for(path: Path) -> str:
    while not path.exists():
        await anyio.sleep(POLL)
    return path.read_text()


async def produce(args: dict[str, Any]) -> None:
    stores, requests = faults(args["faults"])
    url, proc, batch, period, duration = args["url"], args["proc"], args["batch"], args["period"], args["duration"]
    go, ready = Path(args["go"]), Path(args["ready"])
    report: dict[str, Any] = {"producers": {}}
    registered = 0

    async def one(k: int) -> None:
        nonlocal registered
        pid = f"p{proc}-{k}"
        phase = random.Random(pid).uniform(0, period)
        async with lakestream.open_producer(url, pid, combine=True) as p:
            registered += 1
            if registered == args["producers"]:
                ready.write_text(str(time.time()))
            t0 = float(await wait_for(go))
            PHASES[:] = [(t0, "register"), (t0 + duration, "produce"), (math.inf, "finish")]
            n, j = 0, 0
            while (at := t0 + phase + j * period) < t0 + duration:
                await anyio.sleep(max(0.0, at - time.time()))
                for _ in range(batch):
                    await p.put({"__key__": f"{pid}-{n}", "txt": f"{pid} {n}"}, cursor=n + 1)
                    n += 1
                j += 1
            await anyio.sleep(max(0.0, t0 + duration - time.time()))  # every producer produces for `duration`
            for _ in range(k % 4):  # a leftover, packed by the last producer to finish
                await p.put({"__key__": f"{pid}-{n}", "txt": f"{pid} {n}"}, cursor=n + 1)
                n += 1
            closing = time.time()
        s = p.stats
        report["producers"][pid] = {
            "put": n, "cursor": p.cursor, "tgbs": j, "closed_in": time.time() - closing,
            "commits": s.commits, "commit_attempts": s.commit_attempts, "waits": s.backpressure_waits,
            "visible_p50": sorted(s.ready_to_visible)[len(s.ready_to_visible) // 2] if s.ready_to_visible else None,
            "visible_max": max(s.ready_to_visible, default=None),
        }  # fmt: skip

    started = time.time()
    async with anyio.create_task_group() as tg:
        for k in range(args["producers"]):
            tg.start_soon(one, k)
    report |= counts(stores, requests) | {"seconds": time.time() - started}
    Path(args["report"]).write_text(json.dumps(report))


async def read(args: dict[str, Any]) -> None:
    stores, requests = faults(args["faults"])
    url, world, stop = args["url"], args["world"], Path(args["stop"])
    last: dict[int, int] = {}

    async def one(rank: int) -> None:
        async with lakestream.open_reader(url, rank, world) as r:
            async for b in r.steps(0):
                keys = [s["__key__"] for s in b.samples]
                journal.write(json.dumps({"t": time.time(), "step": b.step, "rank": rank, "keys": keys}) + "\n")
                last[rank] = b.step

    with Path(args["journal"]).open("a", buffering=1) as journal:  # noqa: ASYNC230 (a line per step)
        async with anyio.create_task_group() as tg:
            for rank in args["ranks"]:
                tg.start_soon(one, rank)
            head = int(await wait_for(stop))
            while any(last.get(rank, -1) < head for rank in args["ranks"]):
                await anyio.sleep(POLL)
            tg.cancel_scope.cancel()
    Path(args["report"]).write_text(json.dumps(counts(stores, requests)))


if __name__ == "__main__":
    mode, spec = sys.argv[1], json.loads(sys.argv[2])
    anyio.run({"produce": produce, "read": read}[mode], spec)
