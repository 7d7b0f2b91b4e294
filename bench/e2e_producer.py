"""A producer of bench/e2e.py: its share of the WebDataset shards through `train_transform`, into
a Lakestream stream (`lakestream.produce`) or onto NATS JetStream subjects (one per rank).

    e2e_producer.py lakestream URL --id p0 --shards DIR --out stats.json
    e2e_producer.py nats NATS_URL --id p0 --shards DIR --ranks R --batch B --out stats.json

The shards are this producer's share, copied to DIR (its local disk) by the benchmark; each mode
resumes where its last incarnation left off when started again with the same command: Lakestream
from the cursor committed with the last TGB, the broker producer from a cursor it keeps in a
JetStream key-value bucket after each global batch is acknowledged, re-publishing a batch cut
short by a crash under the same message ids (JetStream drops the duplicates).
On a normal exit it writes a JSON line of figures to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e_work import TRANSFORM_CPU, encode_slice, train_transform, tree_cpu

SUBJECT = "e2e.rank.{}"
FIRST: list[float] = []  # when the first sample was transformed (perf_counter), seen by report_progress
STREAM = "E2E"
KV = "e2e-cursors"


def run_lakestream(a: argparse.Namespace) -> dict[str, Any]:
    import anyio

    import lakestream

    async def main() -> Any:
        return await lakestream.produce(
            a.target, a.id, f"wds:{a.shards}/*.tar", map=train_transform, workers=0, rate=a.rate
        )

    report = anyio.run(main)
    return {"samples": report.stats.samples if hasattr(report.stats, "samples") else TRANSFORM_CPU[1],
            "resumed_at": report.resumed_at is not None}  # fmt: skip


def run_nats(a: argparse.Namespace) -> dict[str, Any]:
    import nats
    from nats.js.errors import KeyNotFoundError

    from lakestream.sources import open_source

    async def main() -> dict[str, Any]:
        nc = await nats.connect(a.target, max_reconnect_attempts=-1)
        js = nc.jetstream(timeout=30)
        kv = await js.key_value(KV)
        try:
            entry = await kv.get(a.id)
            saved = json.loads(entry.value or b"null")
        except KeyNotFoundError:
            saved = None
        cursor, seq = (saved["cursor"], saved["seq"]) if saved else (None, 0)
        it = iter(open_source(f"wds:{a.shards}/*.tar").iterate(cursor))
        gb = a.batch * a.ranks

        def next_batch() -> tuple[list[dict[str, Any]], Any]:
            out: list[dict[str, Any]] = []
            after = None
            for record, cursor in it:
                out.append(train_transform(record))
                after = cursor
                if len(out) == gb:
                    break
            return out, after

        async def publish(samples: list[dict[str, Any]], after: Any, n: int) -> None:
            acks = [
                js.publish(
                    SUBJECT.format(r), encode_slice(samples[r :: a.ranks]), headers={"Nats-Msg-Id": f"{a.id}-{n}-{r}"}
                )
                for r in range(a.ranks)
            ]
            await asyncio.gather(*acks)
            await kv.put(a.id, json.dumps({"cursor": after, "seq": n + 1}).encode())

        pending: asyncio.Task[None] | None = None
        published = 0
        t0 = time.perf_counter()
        while True:
            if a.rate > 0 and (ahead := t0 + published / a.rate - time.perf_counter()) > 0:
                await asyncio.sleep(ahead)
            samples, after = await asyncio.to_thread(next_batch)
            if pending is not None:
                await pending
            if not samples:
                break
            pending = asyncio.create_task(publish(samples, after, seq))
            seq += 1
            published += len(samples)
        await nc.drain()
        return {"samples": published, "resumed_at": saved is not None}

    return asyncio.run(main())


def report_progress(path: str) -> None:
    """Keep `path` holding the count of samples transformed (what the benchmark times a fault by)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    while True:
        if TRANSFORM_CPU[1] and not FIRST:
            FIRST.append(time.perf_counter())
        os.pwrite(fd, b"%10d" % TRANSFORM_CPU[1], 0)
        time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["lakestream", "nats"])
    ap.add_argument("target", help="stream URL, or the NATS server URL")
    ap.add_argument("--id", required=True)
    ap.add_argument("--shards", required=True, help="directory holding this producer's tar shards")
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--batch", type=int, default=16, help="samples per rank per step (nats)")
    ap.add_argument("--progress", default="", help="a file kept holding the count of samples transformed")
    ap.add_argument("--rate", type=float, default=0.0, help="samples per second at most (0: no limit)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.mode == "lakestream":  # imports are not the data plane's cost
        import lakestream
    else:
        import nats  # noqa: F401

        import lakestream.sources  # noqa: F401
    if a.progress:
        threading.Thread(target=report_progress, args=(a.progress,), daemon=True).start()
    cpu0, t0 = tree_cpu(), time.perf_counter()
    res = run_lakestream(a) if a.mode == "lakestream" else run_nats(a)
    res.update(
        cpu=tree_cpu() - cpu0,
        transform_cpu=TRANSFORM_CPU[0],
        transformed=TRANSFORM_CPU[1],
        seconds=time.perf_counter() - t0,
        first_s=FIRST[0] - t0 if FIRST else 0.0,  # start-up: until the first sample was transformed
    )
    with open(a.out, "a") as f:
        f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
