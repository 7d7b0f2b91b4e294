"""`lakestream mount`: each rank's committed batches as read-only files (FUSE, pyfuse3).

Needs the `mount` extra (pyfuse3) and Debian's fuse3. The core `lakestream` package never imports
this one.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import select
import signal
import subprocess
from collections.abc import Awaitable, Callable
from typing import Any

from ._mounts import mounts_at

__all__ = ["abort_connection", "fuse_connection", "parse_ranks", "run_mount", "unmount"]

log = logging.getLogger("lakestream.mount")

MAX_TASKS = 1024  # FUSE requests served at once (a reader waiting for a step holds one)


def parse_ranks(spec: str, world_size: int) -> list[int]:
    """`all`, `3`, `0-7`, `0,2,5` (or a mix: `0-3,6`) -> sorted ranks. Raises ValueError.

    Every bound is checked against the world size before any range is expanded."""
    if spec == "all":
        return list(range(world_size))
    bounds = []
    for part in spec.split(","):
        lo, dash, hi = part.strip().partition("-")
        try:
            a, b = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise ValueError(f"--ranks {spec!r}: expected 'all', 'R', 'A-B' or 'R,R,…'") from None
        if a > b:
            raise ValueError(f"--ranks {spec!r}: range {part!r} is empty")
        for r in (a, b):
            if not 0 <= r < world_size:
                raise ValueError(f"--ranks {spec!r}: rank {r} is out of range for world size {world_size}")
        bounds.append((a, b))
    ranks: set[int] = set()
    for a, b in bounds:
        ranks.update(range(a, b + 1))
    return sorted(ranks)


async def _serve(
    url: str, mountpoint: str, ranks_spec: str, world_size: int | None, job: str | None, **options: object
) -> None:
    import anyio
    import pyfuse3

    import lakestream

    from ._fs import LakeFS

    # With a job, the reader announces it and publishes the mark the mount moves (`LakeFS.looked_up`)
    marks = {"publish_consumed": True, "job": job} if job is not None else {"publish_consumed": False}
    async with lakestream.open_reader(url, None, world_size, prefetch=0, **marks) as reader:
        # `all` follows the ranks in force as the stream is reshaped; listed ranks are checked
        # against the largest world size the stream has had or is scheduled to have
        state = reader.state
        assert state.config is not None
        widest = max([state.config.world_size, *(w for _, w, _ in state.shapes)])
        ranks = None if ranks_spec == "all" else parse_ranks(ranks_spec, widest)
        fs = LakeFS(reader, ranks, mountpoint=mountpoint, **options)  # type: ignore[arg-type]
        opts = set(pyfuse3.default_options) | {"fsname=lakestream", "subtype=lakestream", "ro"}
        pyfuse3.init(fs, mountpoint, opts)
        _raise_readahead(mountpoint)
        of = f", job {job}" if job is not None else ""
        print(f"mounted {url} at {mountpoint} (ranks {ranks_spec}{of})", flush=True)  # the one line on stdout
        # What the imports and the start made lives as long as the process: out of the collector's
        # way, so that its full collections walk what serving makes, not ~47,000 objects more (one
        # took ~35 ms, about 15 µs a sample of a floor run's daemon CPU).
        gc.freeze()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, fs.shutdown)
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(fs.follow)
                await pyfuse3.main(max_tasks=MAX_TASKS)
                tg.cancel_scope.cancel()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            pyfuse3.close(unmount=not fs.detached)
            log.info("unmounted %s", mountpoint)


def _readable_soon(wait_readable: Callable[[Any], Awaitable[None]]) -> Callable[[Any], Awaitable[None]]:
    """pyfuse3's asyncio `wait_readable`, first asking the kernel (a zero-timeout poll) whether a
    request is queued already, as the pieces of a large read are: then one turn of the loop (so
    other tasks still run) instead of adding /dev/fuse to the loop's epoll set and removing it
    again, two system calls and a wakeup for every request (docs/benchmarks.md, "Thread hops")."""
    polls: dict[Any, select.poll] = {}

    async def readable(fd: Any) -> None:
        p = polls.get(fd)
        if p is None:
            p = polls[fd] = select.poll()
            p.register(fd, select.POLLIN)
        if p.poll(0):
            await asyncio.sleep(0)
            return
        await wait_readable(fd)

    return readable


def _raise_readahead(mountpoint: str, kib: int = 1024) -> None:
    """Let the kernel send 1 MiB reads instead of 128 KiB ones (best effort: needs root)."""
    try:
        for m in mounts_at(mountpoint):
            with open(f"/sys/class/bdi/{m.device}/read_ahead_kb", "w") as bdi:
                bdi.write(str(kib))
    except OSError as e:
        log.info("could not raise read-ahead of %s: %s", mountpoint, e)


def run_mount(
    url: str,
    mountpoint: str,
    *,
    ranks: str = "all",
    world_size: int | None = None,
    prefetch: int = 2,
    cache_size: int = 1 << 30,
    wait: float = 60.0,
    nonempty: bool = False,
    job: str | None = None,
) -> None:
    """Mount `url` at `mountpoint` and serve until unmounted, SIGINT or SIGTERM (blocks).

    `job`: read as that training job: announce it, and if rank 0 is served, publish its consumption
    mark (the step before the newest step of rank 0 a reader looked up); None: publish none.

    Raises OSError if `mountpoint` is not a directory, is already a mount point, or is not empty
    (unless `nonempty`: its files are hidden while mounted); ValueError if `job` is not a job name."""
    import pyfuse3.asyncio

    if job is not None:
        from lakestream._records import check_job

        check_job(job)
    mounted = mounts_at(mountpoint)  # first: a stat of a stuck FUSE mount would hang
    if mounted:
        raise OSError(f"{mountpoint} is already a mount point ({mounted[-1].fstype}); unmount it first")
    if not os.path.isdir(mountpoint):
        raise FileNotFoundError(f"mount point {mountpoint} is not a directory")
    if not nonempty and os.listdir(mountpoint):
        raise OSError(f"mount point {mountpoint} is not empty (--nonempty mounts over its files, hiding them)")
    pyfuse3.asyncio.enable()
    pyfuse3.asyncio.wait_readable = _readable_soon(pyfuse3.asyncio.wait_readable)  # type: ignore[assignment]
    asyncio.run(_serve(url, mountpoint, ranks, world_size, job, prefetch=prefetch, cache_size=cache_size, wait=wait))


FUSECTL = "/sys/fs/fuse/connections"


def unmount(mountpoint: str, *, force: bool = False) -> None:
    """Unmount; lazily, so that readers with open files do not keep the mount busy.

    `force` first aborts the FUSE connection (see `abort_connection`): for a mount whose daemon
    is gone or stuck, whose readers would otherwise wait for an answer forever.
    """
    if force and not abort_connection(mountpoint):
        raise OSError(f"{mountpoint}: no FUSE connection to abort (not a FUSE mount, or fusectl unavailable)")
    if not mounts_at(mountpoint):
        raise OSError(f"{mountpoint} is not mounted")
    r = subprocess.run(["fusermount3", "-u", "-z", mountpoint], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
        raise OSError(f"{mountpoint}: fusermount3 -u failed: {why}")


def fuse_connection(mountpoint: str) -> int | None:
    """The kernel's FUSE connection number of the (topmost) FUSE mount at `mountpoint`."""
    fuse = [m for m in mounts_at(mountpoint) if m.fstype.startswith("fuse")]
    return int(fuse[-1].device.split(":")[1]) if fuse else None


def abort_connection(mountpoint: str) -> bool:
    """Abort the FUSE connection of `mountpoint` (root; mounts fusectl if needed): every request
    pending or to come fails (ECONNABORTED, ENOTCONN), and the daemon, if any, exits. The way out
    of a mount whose daemon was killed while one of its threads waited in the kernel on a reader's
    request (an entry invalidation blocked by a lookup waiting for a step): that process cannot
    finish exiting, so the connection never closes by itself. False if there is no such mount."""
    n = fuse_connection(mountpoint)
    if n is None:
        return False
    if not os.path.exists(f"{FUSECTL}/{n}"):
        subprocess.run(["mount", "-t", "fusectl", "fusectl", FUSECTL], capture_output=True)
    try:
        with open(f"{FUSECTL}/{n}/abort", "w") as f:
            f.write("1")
    except OSError as e:
        log.warning("%s: could not abort FUSE connection %d: %s", mountpoint, n, e)
        return False
    log.warning("%s: aborted FUSE connection %d", mountpoint, n)
    return True
