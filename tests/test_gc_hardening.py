"""GC under pressure: a grace that would delete live uploads, a full disk, and what GC reports."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from cliutil import describe, run_cli

import lakestream
from lakestream import StoreFull
from lakestream._gc import MIN_ORPHAN_GRACE


async def test_a_grace_below_the_floor_is_refused_unless_forced(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/s"
    await lakestream.create(url, world_size=1, global_batch=1)
    for grace in (0, 1.0, MIN_ORPHAN_GRACE - 1):
        with pytest.raises(ValueError, match="below the safe floor"):
            await lakestream.gc(url, orphan_grace=grace)
    for grace in (-1, float("nan")):
        with pytest.raises(ValueError, match="non-negative"):
            await lakestream.gc(url, orphan_grace=grace, force_grace=True)
    await lakestream.gc(url, orphan_grace=0, force_grace=True)
    r = run_cli("gc", url, "--orphan-grace", 0, check=False)
    assert r.stderr.count("\n") == 1 and "below the safe floor of 300 s" in r.stderr, describe(r)
    r = run_cli("gc", url, "--orphan-grace", -5, "--force-grace", check=False)
    assert r.stderr.count("\n") == 1 and "non-negative" in r.stderr, describe(r)


async def test_gc_at_the_floor_keeps_a_running_producers_uploads(tmp_path: Path) -> None:
    """The reproduction of the loss with `--orphan-grace 0`, at the floor: an upload waiting for
    its commit survives a GC run, and every committed step stays readable."""
    url = f"file://{tmp_path}/s"
    await lakestream.create(url, world_size=1, global_batch=1)
    async with lakestream.open_producer(url, "p", policy="interval") as p:
        for i in range(20):
            await p.put({"__key__": f"k{i}", "txt": "x" * 1000}, cursor=i + 1)
            if i % 5 == 0:
                report = await lakestream.gc(url, orphan_grace=MIN_ORPHAN_GRACE)
                assert report.segments_deleted == 0
    report = await lakestream.verify(url)
    assert report.ok and report.samples == 20, report.problems


async def test_gc_reports_the_bytes_it_really_freed(tmp_path: Path) -> None:
    root = tmp_path / "s"
    url = f"file://{root}"
    await lakestream.create(url, world_size=2, global_batch=2, keep_checkpoints=1)
    async with lakestream.open_producer(url, "p") as p:
        for i in range(20):
            await p.put({"__key__": f"k{i}", "bin": os.urandom(50_000)}, cursor=i + 1)
    await lakestream.checkpoint(url, "c", 6)
    dry = await lakestream.gc(url, dry_run=True)
    assert dry.bytes_freed > 6 * 100_000 and "would free" in dry.summary() and "would reclaim" in dry.summary()
    sizes = {str(p.relative_to(root)): p.stat().st_size for p in (root / "segments").rglob("*.tgb")}
    report = await lakestream.gc(url)
    gone = [k for k in sizes if not (root / k).exists()]
    assert sorted(gone) == sorted(report.deleted) and report.segments_deleted == 6
    assert report.bytes_freed == dry.bytes_freed == sum(sizes[k] for k in gone)
    assert f"free {report.bytes_freed / 1e6:.1f} MB" in report.summary()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 3 MiB filesystem (tmpfs), so that a write really meets ENOSPC."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


async def test_a_full_disk_names_the_stream_leaves_no_temporaries_and_gc_frees_it(small_disk: Path) -> None:
    root = small_disk / "s"
    url = f"file://{root}"
    await lakestream.create(url, world_size=1, global_batch=1, keep_checkpoints=1)
    blob = os.urandom(200_000)
    with pytest.raises(StoreFull) as caught:
        async with lakestream.open_producer(url, "p") as p:
            for i in range(100):
                await p.put({"__key__": f"k{i}", "bin": blob}, cursor=i + 1)
                if i == 5:
                    await p.flush()
                    await lakestream.checkpoint(url, "c0", 5)  # steps 0..4 may go
    message = str(caught.value)
    assert str(root) in message and "segments/p/" in message and "gc" in message, message
    assert not [p for p in root.rglob("*") if p.name.endswith(".tmp")], "a failed put left a temporary file"
    state = await lakestream.load_state(url)
    assert state.head >= 5 and state.watermark == 5

    fd = os.open(small_disk / "filler", os.O_WRONLY | os.O_CREAT)  # fill what the failed put left free
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    with pytest.raises(StoreFull, match=r"no space|No space"):
        await lakestream.checkpoint(url, "c1", state.head)
    # The disk is full: GC deletes the steps below the watermark first, then writes its record.
    r = run_cli("gc", url, check=True)
    assert "reclaim steps below 5" in r.stdout and "delete 5 segments" in r.stdout, describe(r)
    state = await lakestream.load_state(url)
    assert state.first_step == 5
    report = await lakestream.verify(url)
    assert report.ok and report.samples == state.head - 4, report.problems
    r = run_cli("checkpoint", url, "--id", "c1", "--step", state.head, check=True)


async def test_gc_removes_temporaries_left_by_killed_puts(tmp_path: Path) -> None:
    root = tmp_path / "s"
    url = f"file://{root}"
    await lakestream.create(url, world_size=1, global_batch=1)
    stale = root / "segments" / "p" / ".1-0-0000.tgb.0123abcd.tmp"
    fresh = root / "segments" / "p" / ".1-1-0000.tgb.4567ef01.tmp"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"x" * 1000)
    fresh.write_bytes(b"y" * 10)
    old = stale.stat().st_mtime - 2 * 3600
    os.utime(stale, (old, old))
    report = await lakestream.gc(url)
    assert not stale.exists() and fresh.exists()  # an upload in progress is left alone
    assert report.temporaries_deleted == 1 and report.bytes_freed == 1000
