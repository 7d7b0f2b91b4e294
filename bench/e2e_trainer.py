"""One trainer rank of bench/e2e.py: a loop with a simulated accelerator, fed by one of the pipelines.

    e2e_trainer.py MODE --rank R --world W --batch B --steps N --step-ms MS --out result.json [...]

MODE: `ceiling` (one batch held in memory: the accelerator alone), `colocated` (a DataLoader with
--workers processes reading the WebDataset shards from S3 and decoding them here), `stream`
(`lakestream.torch.StreamDataset`), `mount` (`lakestream.torch.MountDataset` on a mount; both
with `collate=True`, one tensor a step, unless --per-sample),
`nats` (a JetStream pull consumer on this rank's subject; these three hand their batches to the
loop through one background thread and a queue of --prefetch batches), `mosaic` (Mosaic Streaming's
`StreamingDataset` over MDS shards on S3, in its own virtual environment).

Each step: ask for a batch and time until it is held as one uint8 tensor (B, 3, 224, 224) (the
data stall), copy it whole into a preallocated staging tensor (touching every byte, as a copy to
the device would), then sleep --step-ms (the accelerator's step). The CPU time of this process
and its children (DataLoader workers), minus
the staging copies, is the trainer's CPU spent on data: from the first batch held to the end
(steady state; what it took to get the first batch is reported apart). Imports are done before
the clock starts. Writes one JSON object to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

if os.environ.get("E2E_MOSAIC") == "1":  # Mosaic's dataset wrappers for public datasets need torchvision
    import types

    for _name in ("vision", "text", "multimodal"):
        sys.modules[f"streaming.{_name}"] = types.ModuleType(f"streaming.{_name}")

import torch
import torch.utils.data
from e2e_work import CROP, decode_slice, image_digest, proc_cpu, s3_shard_dataset, tree_cpu

Batch = tuple[torch.Tensor, list[str]]


def colocated(a: argparse.Namespace) -> Iterator[Batch]:
    keys = json.loads(Path(a.shard_list).read_text())
    ds = s3_shard_dataset(a.bucket, keys)
    loader = torch.utils.data.DataLoader(ds, batch_size=a.batch, num_workers=a.workers, prefetch_factor=a.prefetch)
    for item in loader:
        yield item["img"], list(item["__key__"])


def _stack(samples: list[dict[str, Any]]) -> Batch:
    if not samples:
        return torch.empty((0, 3, CROP, CROP), dtype=torch.uint8), []
    return torch.stack([s["img"] for s in samples]), [s["__key__"] for s in samples]


def pumped(batches: Iterator[Batch], depth: int) -> Iterator[Batch]:
    """`batches` produced by a background thread into a queue of `depth`, as a DataLoader's
    pin-memory thread does: what the data plane does per batch (decoding a slice, stacking)
    overlaps the accelerator's step instead of adding to the stall. Errors are re-raised here."""
    q: queue.Queue[Any] = queue.Queue(maxsize=depth)
    end = object()

    def run() -> None:
        try:
            for b in batches:
                q.put(b)
            q.put(end)
        except BaseException as e:
            q.put(e)

    threading.Thread(target=run, daemon=True, name="pump").start()
    while (item := q.get()) is not end:
        if isinstance(item, BaseException):
            raise item
        yield item


def _batch(item: dict[str, Any], collate: bool) -> Batch:
    """A step's batch: the `img` tensor of a collated item (one block, no per-sample decode), or
    the samples of a per-sample item stacked."""
    if collate:
        return item["img"], list(item["keys"])
    return _stack(item["samples"])


def stream(a: argparse.Namespace) -> Iterator[Batch]:
    from lakestream.torch import StreamDataset

    ds = StreamDataset(a.source, a.rank, a.world, stop=a.steps, prefetch=a.prefetch, collate=a.collate)
    return pumped((_batch(item, a.collate) for item in ds), a.prefetch)


def mount(a: argparse.Namespace) -> Iterator[Batch]:
    from lakestream.torch import MountDataset

    ds = MountDataset(a.source, a.rank, a.world, stop=a.steps, collate=a.collate)
    return pumped((_batch(item, a.collate) for item in ds), a.prefetch)


def nats_batches(a: argparse.Namespace) -> Iterator[Batch]:
    """A JetStream pull consumer in a background thread, up to --prefetch messages ahead."""
    import asyncio

    import nats

    q: queue.Queue[Any] = queue.Queue(maxsize=a.prefetch)

    async def pump() -> None:
        loop = asyncio.get_running_loop()
        nc = await nats.connect(a.source, max_reconnect_attempts=-1)
        try:
            js = nc.jetstream(timeout=30)
            sub = await js.pull_subscribe(f"e2e.rank.{a.rank}", durable=f"rank{a.rank}", stream="E2E")
            got = 0
            while got < a.steps:
                try:
                    msgs = await sub.fetch(min(a.prefetch, a.steps - got), timeout=5)
                except nats.errors.TimeoutError:
                    continue
                for m in msgs:
                    keys, _, imgs = decode_slice(bytes(m.data))
                    await loop.run_in_executor(None, q.put, (torch.from_numpy(imgs.copy()), keys))
                    await m.ack()
                    got += 1
        finally:
            await nc.close()

    def run() -> None:
        try:
            asyncio.run(pump())
        except BaseException as e:
            q.put(e)

    threading.Thread(target=run, daemon=True, name="nats-pump").start()
    for _ in range(a.steps):
        item = q.get()
        if isinstance(item, BaseException):
            raise item
        yield item


def mosaic(a: argparse.Namespace) -> Iterator[Batch]:
    from streaming import StreamingDataset

    ds = StreamingDataset(remote=a.source, local=a.cache, batch_size=a.batch, shuffle=False)
    loader = torch.utils.data.DataLoader(ds, batch_size=a.batch, num_workers=a.workers,
                                         prefetch_factor=a.prefetch if a.workers else None)  # fmt: skip
    for item in loader:
        yield item["img"], list(item["key"])


def ceiling(a: argparse.Namespace) -> Iterator[Batch]:
    batch = torch.randint(0, 256, (a.batch, 3, CROP, CROP), dtype=torch.uint8)
    for i in range(a.steps):
        yield batch, [f"c{i}-{j}" for j in range(a.batch)]


PIPELINES: dict[str, Callable[[argparse.Namespace], Iterator[Batch]]] = {
    "ceiling": ceiling, "colocated": colocated, "stream": stream, "mount": mount, "nats": nats_batches,
    "mosaic": mosaic,
}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=sorted(PIPELINES))
    ap.add_argument("--source", default="", help="stream URL, mount point, NATS URL or MDS remote")
    ap.add_argument("--bucket", default="")
    ap.add_argument("--shard-list", default="", help="JSON list of this rank's shard keys (colocated)")
    ap.add_argument("--cache", default="", help="Mosaic's local cache directory")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--step-ms", type=float, required=True)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--prefetch", type=int, default=4)
    ap.add_argument("--per-sample", dest="collate", action="store_false",
                    help="stream, mount: per-sample items stacked here, not collate=True's one tensor a step")  # fmt: skip
    ap.add_argument("--launched", type=float, default=0.0, help="time.time() when the pipeline was started")
    ap.add_argument("--also-pid", type=int, default=0, help="a process on this node whose CPU counts too (the mount)")
    ap.add_argument("--progress", default="", help="a file this rank keeps its count of steps done in")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    # The loader's thread must not keep the loop waiting for the GIL up to the default 5 ms switch
    # interval when the accelerator step ends; every pipeline runs with the same setting.
    sys.setswitchinterval(0.0005)
    progress = os.open(a.progress, os.O_WRONLY | os.O_CREAT) if a.progress else -1
    staging = torch.empty((a.batch, 3, CROP, CROP), dtype=torch.uint8)
    step_s = a.step_ms / 1000
    launched = a.launched or time.time()

    asks: list[float] = []  # seconds since the first batch was held, when the step asked
    stalls: list[float] = []
    keys: list[str] = []
    digests: list[int] = []  # image_digest of each sample held, in the order of `keys`
    touch = 0.0
    error = ""
    t_first = t_end = 0.0
    if a.mode in ("stream", "mount"):
        import lakestream.torch  # noqa: F401  (imports are not the pipeline's cost)
    elif a.mode == "nats":
        import nats  # noqa: F401
    elif a.mode == "colocated":
        import botocore.session  # noqa: F401  (imported once here: forked workers inherit it)
    elif a.mode == "mosaic":
        import streaming  # noqa: F401

    def node_cpu() -> float:
        return tree_cpu() + (proc_cpu(a.also_pid) if a.also_pid else 0.0)

    if progress >= 0:
        os.pwrite(progress, b"%10d" % 0, 0)  # ready: imports done, the loader is created next
    cpu0 = node_cpu()
    cpu_first = cpu_end = cpu0
    it = PIPELINES[a.mode](a)
    first_wall = 0.0
    try:
        while len(stalls) < a.steps:
            t_ask = time.perf_counter()
            try:
                imgs, ks = next(it)
            except StopIteration:
                break
            t_have = time.perf_counter()
            if not stalls:
                t_first, first_wall = t_have, time.time()
                cpu_first = node_cpu()
            asks.append(t_ask - t_first)
            stalls.append(t_have - t_ask)
            keys += ks
            c = time.thread_time()
            staging[: imgs.shape[0]].copy_(imgs)
            if a.mode != "ceiling":  # what arrived, sample by sample (checked against the dataset)
                digests += [image_digest(staging[j].numpy()) for j in range(imgs.shape[0])]
            touch += time.thread_time() - c
            time.sleep(step_s)
            t_end = time.perf_counter()
            if progress >= 0:
                os.pwrite(progress, b"%10d" % len(stalls), 0)
    except Exception as e:  # what a training loop sees when its input pipeline fails
        # DataLoader's SIGCHLD handler raises again when another worker exits (as a killed
        # worker's siblings do): not while this is reported.
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        traceback.print_exc()
    cpu_end = node_cpu()
    steps = len(stalls)
    result = {
        "mode": a.mode,
        "rank": a.rank,
        "steps": steps,
        "samples": len(keys),
        "keys": keys,
        "digests": digests,
        "asks": asks,
        "stalls": stalls,
        "run_s": t_end - t_first if steps else 0.0,
        "steps_per_s": steps / (t_end - t_first) if steps and t_end > t_first else 0.0,
        "ttfb_s": first_wall - launched if steps else float("nan"),
        "data_cpu": cpu_end - cpu_first - touch,  # steady state: from the first batch held to the end
        "startup_cpu": cpu_first - cpu0,  # creating the loader and getting the first batch
        "touch_cpu": touch,
        "error": error,
        "error_after_s": time.perf_counter() - t_first if error and steps else 0.0,
    }
    Path(a.out).write_text(json.dumps(result))
    os._exit(0)  # do not wait for loader threads and workers: the figures are written


if __name__ == "__main__":
    main()
