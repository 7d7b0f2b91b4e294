"""`lakestream mount`: each rank's committed batches as read-only files (FUSE, pyfuse3).

Needs the `mount` extra (pyfuse3) and Debian's fuse3. The core `lakestream` package never imports
this one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess

__all__ = ["parse_ranks", "run_mount", "unmount"]

log = logging.getLogger("lakestream.mount")


def parse_ranks(spec: str, world_size: int) -> list[int]:
    """`all`, `3`, `0-7`, `0,2,5` (or a mix: `0-3,6`) -> sorted ranks. Raises ValueError."""
    if spec == "all":
        return list(range(world_size))
    ranks: set[int] = set()
    for part in spec.split(","):
        lo, dash, hi = part.strip().partition("-")
        try:
            a, b = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise ValueError(f"--ranks {spec!r}: expected 'all', 'R', 'A-B' or 'R,R,…'") from None
        if a > b:
            raise ValueError(f"--ranks {spec!r}: range {part!r} is empty")
        ranks.update(range(a, b + 1))
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad:
        raise ValueError(f"--ranks {spec!r}: rank {bad[0]} is out of range for world size {world_size}")
    return sorted(ranks)


async def _serve(url: str, mountpoint: str, ranks_spec: str, world_size: int | None, **options: object) -> None:
    import anyio
    import pyfuse3

    import lakestream

    from ._fs import LakeFS

    async with lakestream.open_reader(url, None, world_size, prefetch=0) as reader:
        assert reader.world_size is not None
        ranks = parse_ranks(ranks_spec, reader.world_size)
        fs = LakeFS(reader, ranks, mountpoint=mountpoint, **options)  # type: ignore[arg-type]
        opts = set(pyfuse3.default_options) | {"fsname=lakestream", "subtype=lakestream", "ro"}
        pyfuse3.init(fs, mountpoint, opts)
        _raise_readahead(mountpoint)
        log.warning("mounted %s at %s (ranks %s)", url, mountpoint, ranks_spec)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, fs.shutdown)
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(fs.follow)
                await pyfuse3.main()
                tg.cancel_scope.cancel()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            pyfuse3.close(unmount=not fs.detached)
            log.warning("unmounted %s", mountpoint)


def _raise_readahead(mountpoint: str, kib: int = 1024) -> None:
    """Let the kernel send 1 MiB reads instead of 128 KiB ones (best effort: needs root)."""
    target = os.fsencode(os.path.abspath(mountpoint)).replace(b" ", b"\\040")
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            for line in f:
                fields = line.split(b" ")
                if len(fields) > 4 and fields[4] == target:
                    with open(f"/sys/class/bdi/{fields[2].decode()}/read_ahead_kb", "w") as bdi:
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
) -> None:
    """Mount `url` at `mountpoint` and serve until unmounted, SIGINT or SIGTERM (blocks)."""
    import pyfuse3.asyncio

    if not os.path.isdir(mountpoint):
        raise FileNotFoundError(f"mount point {mountpoint} is not a directory")
    pyfuse3.asyncio.enable()
    asyncio.run(_serve(url, mountpoint, ranks, world_size, prefetch=prefetch, cache_size=cache_size, wait=wait))


def unmount(mountpoint: str) -> None:
    """Unmount; lazily, so that readers with open files do not keep the mount busy."""
    subprocess.run(["fusermount3", "-u", "-z", mountpoint], check=True)
