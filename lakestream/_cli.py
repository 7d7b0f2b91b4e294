"""The `lakestream` command."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import orjson

import lakestream

from ._dac import DacPolicy
from ._errors import LakestreamError
from ._sources import dir_source, synthetic_source

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="lakestream", description="Transactional global batches on object storage.")
    ap.add_argument("-v", "--verbose", action="count", default=0)
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("init", help="create a stream (same config again: no-op)")
    p.add_argument("url")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--snapshot-every", type=int, default=1000)
    p.add_argument("--keep-checkpoints", type=int, default=3)
    p.add_argument("--max-steps-ahead", type=int, default=0)
    p.add_argument("--max-sample-bytes", type=int, default=1 << 30)

    p = sub.add_parser("produce", help="produce samples from a directory or a synthetic source")
    p.add_argument("url")
    p.add_argument("--producer-id", required=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-dir", metavar="DIR")
    src.add_argument("--synthetic", type=int, metavar="N", help="N synthetic samples")
    p.add_argument("--sample-size", type=int, default=64 << 10, help="synthetic sample bytes")
    p.add_argument("--work-ms", type=float, default=0.0, help="synthetic CPU work per sample")
    p.add_argument("--max-inflight-bytes", type=int, default=256 << 20)
    p.add_argument("--commit-policy", choices=["dac", "eager", "backoff", "interval"], default="dac")
    p.add_argument("--max-commit-delay", type=float, default=None, help="DAC latency ceiling, seconds")
    p.add_argument("--rate", type=float, default=0.0, help="synthetic samples per second (0: as fast as possible)")
    p.add_argument("--stats-json", action="store_true", help="print the producer's figures as one JSON line")

    p = sub.add_parser("read", help="write a rank's samples of committed steps to files")
    p.add_argument("url")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--out", metavar="DIR")
    p.add_argument("--from-step", type=int, default=None)
    p.add_argument("--to-step", type=int, default=None, help="last step, inclusive (waits for it)")

    p = sub.add_parser("status", help="show the manifest state")
    p.add_argument("url")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("checkpoint", help="record that the trainer's checkpoint at a step is durable")
    p.add_argument("url")
    p.add_argument("--id", required=True)
    p.add_argument("--step", type=int, required=True)

    p = sub.add_parser("release", help="drop a retained checkpoint")
    p.add_argument("url")
    p.add_argument("--id", required=True)

    p = sub.add_parser("rewind", help="discard the steps after a checkpoint and fence every producer")
    p.add_argument("url")
    to = p.add_mutually_exclusive_group(required=True)
    to.add_argument("--to-checkpoint", metavar="ID")
    to.add_argument("--to-step", type=int, metavar="S")

    p = sub.add_parser("gc", help="reclaim steps below the watermark, delete what nothing needs")
    p.add_argument("url")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--orphan-grace", type=float, default=3600.0, metavar="SECONDS",
                   help="age at which an uncommitted upload of a live producer is deleted (at least 300)")  # fmt: skip
    p.add_argument("--force-grace", action="store_true",
                   help="allow an --orphan-grace below 300 s: only when no producer of the stream is running")  # fmt: skip

    p = sub.add_parser("verify", help="check every invariant and checksum")
    p.add_argument("url")

    p = sub.add_parser("mount", help="show committed batches as read-only files (FUSE)")
    p.add_argument("url")
    p.add_argument("mountpoint")
    p.add_argument("--ranks", default="all", help="all, R, A-B or R,R,... (default all)")
    p.add_argument("--world-size", type=int, default=None, help="fail unless the stream has this world size")
    p.add_argument("--prefetch", type=int, default=2, help="committed steps to fetch ahead per rank")
    p.add_argument("--cache-size", type=int, default=1 << 30, help="slice cache bytes")
    p.add_argument("--wait", type=float, default=60.0, help="seconds a lookup waits for a step to commit")
    p.add_argument("--nonempty", action="store_true", help="mount over a directory that is not empty (hiding its files)")

    p = sub.add_parser("umount", help="unmount a lakestream mount")
    p.add_argument("mountpoint")
    p.add_argument("--force", action="store_true",
                   help="abort the FUSE connection first (a mount whose daemon was killed and hangs its readers)")  # fmt: skip

    p = sub.add_parser("demo", help="run producers and rank readers on a local stream")
    p.add_argument("--dir", help="stream directory (default: a temporary one, removed afterwards)")
    p.add_argument("--producers", type=int, default=4)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--samples", type=int, default=4000, help="samples per producer")
    p.add_argument("--sample-size", type=int, default=32 << 10)
    return ap


# -- commands -----------------------------------------------------------------------------------


async def _init(a: argparse.Namespace) -> int:
    created = await lakestream.create(
        a.url, world_size=a.world_size, global_batch=a.global_batch, snapshot_every=a.snapshot_every,
        keep_checkpoints=a.keep_checkpoints, max_steps_ahead=a.max_steps_ahead, max_sample_bytes=a.max_sample_bytes,
    )  # fmt: skip
    print(f"{'created' if created else 'exists, same config'}: {a.url}")
    return 0


async def _iterate(it: Iterator[Any]) -> Any:
    """Next item of a blocking iterator, from a worker thread; None at the end."""
    return await anyio.to_thread.run_sync(next, it, None)


async def _produce(a: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    policy: Any = a.commit_policy
    if a.max_commit_delay is not None:
        if policy != "dac":
            raise ValueError("--max-commit-delay applies to --commit-policy dac")
        policy = DacPolicy(max_commit_delay=a.max_commit_delay)
    async with (
        lakestream.open_store(a.url) as store,
        lakestream.open_producer(store, a.producer_id, max_inflight_bytes=a.max_inflight_bytes, policy=policy) as p,
    ):
        start = p.cursor or 0
        if a.from_dir is not None:
            it = dir_source(a.from_dir, start)
        else:
            it = synthetic_source(a.synthetic, a.sample_size, start=start, prefix=f"{a.producer_id}-", work_ms=a.work_ms)
        n = 0
        while (item := await _iterate(it)) is not None:
            sample, cursor = item
            await p.put(sample, cursor=cursor)
            n += 1
            if a.rate > 0 and (ahead := t0 + n / a.rate - time.perf_counter()) > 0:
                await anyio.sleep(ahead)
    dt = time.perf_counter() - t0
    s = p.stats
    if a.stats_json:
        lat = sorted(s.ready_to_visible)
        figures = {
            "producer": a.producer_id, "epoch": p.epoch, "policy": p.policy_name, "seconds": dt,
            "samples": s.samples, "tgbs": s.tgbs_committed, "commits": s.commits, "conflicts": s.conflicts,
            "commit_attempts": s.commit_attempts, "bytes": s.bytes_uploaded,
            "requests": getattr(store, "requests", None), "ready_to_visible": lat,
        }  # fmt: skip
        print(orjson.dumps(figures).decode())
    print(
        f"producer {a.producer_id} epoch {p.epoch}: resumed at {start}, {s.samples} samples, "
        f"{s.tgbs_committed} TGBs in {s.commits} commits, {s.bytes_uploaded / 1e6:.1f} MB in {dt:.2f} s"
    )
    return 0


def _write_step(out: Path, batch: lakestream.RankBatch) -> None:
    final = out / f"{batch.step:012d}"
    if final.exists():
        shutil.rmtree(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{batch.step:012d}.", dir=out))
    for sample in batch.samples:
        key = sample["__key__"]
        for field, value in sample.items():
            if field != "__key__":
                (tmp / f"{key}.{field}").write_bytes(value)
    os.rename(tmp, final)


async def _read(a: argparse.Namespace) -> int:
    out = Path(a.out) if a.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    async with lakestream.open_reader(a.url, a.rank, raw=True) as r:
        start = a.from_step if a.from_step is not None else r.state.first_step
        stop = a.to_step + 1 if a.to_step is not None else r.state.head + 1
        n = nbytes = 0
        async for batch in r.steps(start, stop):
            n += 1
            nbytes += batch.nbytes
            if out is not None:
                await anyio.to_thread.run_sync(_write_step, out, batch)
            else:
                keys = ",".join(s["__key__"] for s in batch.samples)
                print(f"step {batch.step}: {len(batch)} samples ({batch.nbytes} bytes) {keys}")
    print(f"rank {a.rank}: {n} steps, {nbytes / 1e6:.1f} MB", file=sys.stderr)
    return 0


async def _checkpoint(a: argparse.Namespace) -> int:
    done = await lakestream.checkpoint(a.url, a.id, a.step)
    print(f"checkpoint {a.id} at step {a.step}: {'recorded' if done else 'already recorded'}")
    return 0


async def _release(a: argparse.Namespace) -> int:
    done = await lakestream.release(a.url, a.id)
    print(f"checkpoint {a.id}: {'released' if done else 'was not retained'}")
    return 0


async def _rewind(a: argparse.Namespace) -> int:
    state = await lakestream.rewind(a.url, to_checkpoint=a.to_checkpoint, to_step=a.to_step)
    print(f"rewound {a.url} to step {state.head}; every producer is fenced and resumes from its cursor there")
    return 0


async def _gc(a: argparse.Namespace) -> int:
    report = await lakestream.gc(a.url, dry_run=a.dry_run, orphan_grace=a.orphan_grace, force_grace=a.force_grace)
    print(report.summary())
    return 0


def status_dict(state: lakestream.State) -> dict[str, Any]:
    assert state.config is not None
    return {
        "head_step": state.head,
        "first_step": state.first_step,
        "version": state.version,
        "world_size": state.config.world_size,
        "global_batch": state.config.global_batch,
        "config": state.config.to_dict(),
        "producers": {
            k: {"epoch": p.epoch, "seq": p.seq, "cursor": p.cursor, "last_commit": p.last_ts, "tgbs": p.tgbs}
            for k, p in sorted(state.producers.items())
        },
        "checkpoints": [{"id": c.id, "step": c.step} for c in state.checkpoints],
        "watermark": state.watermark,
        "rejected": [{"version": v, "reason": why} for v, why in state.rejected],
    }


async def _status(a: argparse.Namespace) -> int:
    state = await lakestream.load_state(a.url)
    d = status_dict(state)
    if a.json:
        sys.stdout.write(orjson.dumps(d, option=orjson.OPT_INDENT_2).decode() + "\n")
        return 0
    print(f"stream {a.url}: world size {d['world_size']}, global batch {d['global_batch']}")
    print(f"  steps {d['first_step']}..{d['head_step']}, manifest version {d['version']}, watermark {d['watermark']}")
    for pid, p in d["producers"].items():
        print(f"  producer {pid}: epoch {p['epoch']}, seq {p['seq']}, cursor {p['cursor']!r}")
    for r in d["rejected"]:
        print(f"  malformed record at version {r['version']}: {r['reason']}")
    return 0


async def _verify(a: argparse.Namespace) -> int:
    report = await lakestream.verify(a.url)
    for problem in report.problems:
        print(f"FAIL {problem}")
    print(
        f"{'OK' if report.ok else 'FAILED'}: {a.url}: steps {report.first_step}..{report.head} ({report.steps}), "
        f"{report.samples} samples, {report.bytes / 1e6:.1f} MB, version {report.version}, "
        f"{len(report.problems)} problems"
    )
    return 0 if report.ok else 1


async def _demo(a: argparse.Namespace) -> int:
    from ._demo import run_demo

    if a.dir:
        return await run_demo(a.dir, a)
    with tempfile.TemporaryDirectory(prefix="lakestream-demo-") as d:
        return await run_demo(d, a)


def _mount_module():  # type: ignore[no-untyped-def]
    try:
        import lakestream_mount
    except ImportError as e:
        raise OSError(f"the mount needs the 'mount' extra (pyfuse3) and fuse3: {e}") from e
    return lakestream_mount


def _mount(a: argparse.Namespace) -> int:
    _mount_module().run_mount(
        a.url, a.mountpoint, ranks=a.ranks, world_size=a.world_size, prefetch=a.prefetch,
        cache_size=a.cache_size, wait=a.wait, nonempty=a.nonempty,
    )  # fmt: skip
    return 0


def _umount(a: argparse.Namespace) -> int:
    _mount_module().unmount(a.mountpoint, force=a.force)
    return 0


COMMANDS = {
    "init": _init, "produce": _produce, "read": _read, "status": _status, "verify": _verify, "demo": _demo,
    "checkpoint": _checkpoint, "release": _release, "rewind": _rewind, "gc": _gc,
}  # fmt: skip
SYNC_COMMANDS = {"mount": _mount, "umount": _umount}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:
        if args.command in SYNC_COMMANDS:
            return SYNC_COMMANDS[args.command](args)
        return anyio.run(COMMANDS[args.command], args)
    except KeyboardInterrupt:
        return 130
    except (LakestreamError, OSError, ValueError, ImportError, subprocess.CalledProcessError) as e:
        print(f"lakestream {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
