"""Mount benchmark: large-file throughput, small-file open+read latency, commit-to-first-byte,
CPU while waiting, what a FUSE request costs.

    .venv/bin/python bench/mount.py            # full run, about 1.5 minutes
    .venv/bin/python bench/mount.py --quick    # about 15 s: 64 MiB slices, fewer steps and commits
    .venv/bin/python bench/mount.py --smoke    # a few seconds: 4 MiB slices, every part once

Every stream is `file://` in a temp dir with world size 1, mounted with `lakestream mount URL MNT`
(a subprocess, default options: prefetch 2, cache 1 GiB) and always unmounted at the end
(`fusermount3 -u -z`, then SIGTERM/SIGKILL), also on an error or Ctrl-C. Reads through the mount
and of local files use the same loop: `open(path, "rb", buffering=0)` + `readinto` of a
preallocated buffer (--buffer, default 1 MiB) until EOF.

1. Large files: one step = one sample with one --large-mib field (256 MiB; 64 MiB with --quick).
   - cold: the first read of a step through the mount, timed from `open()` (the path lookup, which
     makes the mount fetch, CRC-check and index the whole slice) to EOF. The mount never held the
     slice before (a fresh step each time; steps at or below the head at mount time are never
     prefetched) and the kernel has no pages of the file. The underlying segment file IS in the
     page cache (it was just written and is read once more before mounting), so "cold" means
     "cold for the mount, warm for the store": it measures the mount's own cost, not the disk.
   - cold, disk: the same after `sync; echo 1 > /proc/sys/vm/drop_caches` (if permitted; root),
     so the segment is read from disk too; compared with a local read of a file dropped the same
     way.
   - warm: the second read of the same file (the kernel page cache, `keep_cache`); the 3rd and
     4th reads are shown apart (the 2nd read of a page also moves it to the active LRU list).
   - the mount process's CPU time over 3 idle seconds before any read (/proc/PID/stat).
   - baseline: the same bytes read from a local file whose pages are cached (read once before),
     on the temp dir's filesystem (ext4 here: large folios); for reference also from /dev/shm
     (tmpfs: 4 KiB pages, like the FUSE page cache on this kernel).
2. Small files: steps of 1,000 samples with one 4 KiB field. Per file: `os.open` + `os.read(fd,
   64 KiB)` (one read returns the whole file) + `os.close`, in name order, timed each. "cold" is
   the first pass over a step (lookups and the slice fetch go to the mount), "warm" the second
   (entries, attributes and pages cached by the kernel; open still goes to the mount). Baseline:
   the same files in a local directory (page cache warm).
3. Commit to first byte: a producer in this process commits one TGB (one 64 KiB sample) at a time
   after sleeping --gaps ms; a reader subprocess opens `rank-0/<next step>/<key>.bin` right after
   it read the previous step (so its lookup waits in the mount for the commit) and reads 1 byte.
   Commit time: when the log record appears (inotify on the log directory, IN_CREATE of the
   record's link) and, later, when `flush()` returns. Timestamps are CLOCK_MONOTONIC in both
   processes. p50/p99 are over every commit of a gap; a row below counts the commits for which
   the reader was already blocked in the lookup (opened before the record appeared) and gives
   their figures apart: with no gap a reader that falls behind measures its own lag.

4. Idle: a reader, a StreamDataset and the mount waiting for a step not committed: their CPU.
5. Requests: what one FUSE request costs the daemon, the mount's (a lookup of `rank-0/latest`,
   which has zero timeouts) against an empty pyfuse3 filesystem's served the same way (asyncio,
   the mount's wait for /dev/fuse; a stat of a file with zero timeouts), CPU of each process a
   request; then MountDataset(collate=True) over a prefilled stream of the floor's steps (16
   uint8 arrays (3, 224, 224)): the requests a step costs, by operation (`_status.json`'s
   "requests"), what they would cost the empty filesystem, and the trainer's and the daemon's
   CPU a sample. No target: it shows how much of the mount's cost is the FUSE binding's own.

Targets: cold >= 1 GB/s and >= 1/4 of the local page-cache read; warm >= 80% of it; commit to
first byte p50 < 50 ms (per gap, all must hold). 1 GB = 10^9 bytes. The load average at start
and end is printed: on a small shared machine other work moves these figures a lot.

--mount-cmd replaces `lakestream mount` (URL and MNT are appended) to try a patched mount.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import os
import shlex
import signal
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parent))

try:
    from _common import format_table, machine_description, removing, temp_dir
except Exception:  # pragma: no cover - _common is another helper's; keep this script standalone
    import shutil
    import tempfile

    def format_table(headers: Any, rows: Any, align: str | None = None) -> str:  # type: ignore[misc]
        cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
        w = [max(len(r[i]) for r in cells) for i in range(len(headers))]
        a = align or "l" + "r" * (len(headers) - 1)
        line = lambda r: "| " + " | ".join(c.ljust(x) if k == "l" else c.rjust(x) for c, x, k in zip(r, w, a)) + " |"  # noqa: E731
        rule = "|" + "|".join(("-" * (x + 1) + ":") if k == "r" else (":" + "-" * (x + 1)) for x, k in zip(w, a)) + "|"
        return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])

    def machine_description() -> str:  # type: ignore[misc]
        return f"{os.cpu_count()} CPUs"

    def temp_dir(prefix: str = "lakestream-bench-") -> Path:  # type: ignore[misc]
        return Path(tempfile.mkdtemp(prefix=prefix))

    @contextmanager
    def removing(path: Path) -> Iterator[Path]:  # type: ignore[misc]
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)


MiB = 1 << 20
KiB = 1 << 10
COLD_GBPS_TARGET = 1.0
COLD_RATIO_TARGET = 0.25
WARM_RATIO_TARGET = 0.80
LATENCY_P50_TARGET_MS = 50.0
SMALL_FILES_PER_STEP = 1000
SMALL_FILE_BYTES = 4 * KiB
LATENCY_SAMPLE_BYTES = 64 * KiB


def _lakestream_cmd() -> list[str]:
    from lakestream.testing import lakestream_command

    return lakestream_command()


def log(msg: str) -> None:
    print(f"  {msg}", file=sys.stderr, flush=True)


# -- the mount subprocess ------------------------------------------------------------------------

_MOUNTS: list[Mount] = []


def _is_mounted(path: str) -> bool:
    """From /proc/self/mountinfo (no stat of the mount point, which could block)."""
    want = os.path.realpath(path)
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                mp = line.split()[4].encode().decode("unicode_escape")
                if mp == want:
                    return True
    except OSError:
        pass
    return False


class Mount:
    """`lakestream mount URL MNT ...` in the foreground of a subprocess; `close()` always unmounts."""

    command: ClassVar[list[str]] = []  # --mount-cmd (experiments); default `lakestream mount`

    def __init__(self, url: str, mountpoint: Path, logfile: Path, *extra: str) -> None:
        self.url, self.mountpoint, self.logfile, self.extra = url, mountpoint, logfile, extra
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Mount:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        cmd = [*(Mount.command or [*_lakestream_cmd(), "mount"]), self.url, str(self.mountpoint), *self.extra]
        out = open(self.logfile, "ab")
        # Own session: a Ctrl-C in the terminal reaches only this script, which unmounts.
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=out, stdin=subprocess.DEVNULL, start_new_session=True)
        out.close()
        _MOUNTS.append(self)
        deadline = time.monotonic() + 30
        while not _is_mounted(str(self.mountpoint)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"mount failed: {shlex.join(cmd)}\n{self.logfile.read_text(errors='replace')}")
            time.sleep(0.01)
        (self.mountpoint / "_status.json").read_bytes()  # the daemon answers
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def cpu_seconds(self) -> float:
        """CPU time of the mount process so far (`task_cpu_seconds`)."""
        return task_cpu_seconds(self.pid)

    def close(self) -> None:
        if self in _MOUNTS:
            _MOUNTS.remove(self)
        if _is_mounted(str(self.mountpoint)):
            subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True, timeout=30)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def task_cpu_seconds(pid: int) -> float:
    """CPU time of process `pid` so far, to the nanosecond: the sum over its threads of
    /proc/PID/task/TID/schedstat. (utime + stime count clock ticks, 10 ms: over the floor's 19
    steps a tick is 33 µs a sample.) A thread that exited is no longer counted, which is fine
    between two calls a few seconds apart; use `proc_cpu_seconds` over longer spans."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):  # the thread exited meanwhile
            continue
    return total / 1e9


def _close_all_mounts() -> None:
    for m in _MOUNTS:
        try:
            m.close()
        except Exception as e:  # keep going: every mount must go
            print(f"warning: could not clean up the mount at {m.mountpoint}: {e}", file=sys.stderr)


def _on_signal(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


# -- helpers ---------------------------------------------------------------------------------------


def read_all(path: str | Path, buf: bytearray) -> int:
    n = 0
    with open(path, "rb", buffering=0) as f:
        while k := f.readinto(buf):
            n += k
    return n


def timed_read(path: str | Path, buf: bytearray) -> tuple[float, float, int]:
    """(seconds to open, seconds to EOF, bytes)."""
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        t1 = time.perf_counter()
        n = 0
        while k := f.readinto(buf):
            n += k
    return t1 - t0, time.perf_counter() - t0, n


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = max(0, min(len(s) - 1, round(q / 100 * len(s) + 0.5) - 1))
    return s[k]


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def fmt_us(seconds: float) -> str:
    us = seconds * 1e6
    return f"{us:.0f} µs" if us < 1000 else f"{us / 1000:.1f} ms"


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def ratio(x: float) -> str:
    return f"{x:.3f}" if x < 0.1 else f"{x:.2f}"


def yes(ok: bool) -> str:
    return "**yes**" if ok else "**NO**"


def run_async(fn: Callable[..., Any], *args: Any) -> Any:
    import anyio

    return anyio.run(fn, *args)


async def create(url: str, global_batch: int, max_sample_bytes: int = 1 << 30) -> None:
    import lakestream

    await lakestream.create(url, world_size=1, global_batch=global_batch, max_sample_bytes=max_sample_bytes)


async def produce(url: str, producer_id: str, samples: Iterator[dict[str, Any]]) -> None:
    import lakestream

    async with lakestream.open_producer(url, producer_id, max_inflight_bytes=512 * MiB) as p:
        for s in samples:
            await p.put(s)


# -- 1. large files ----------------------------------------------------------------------------


def bench_large(root: Path, a: argparse.Namespace, rows: list[list[str]], verdicts: list[tuple[str, bool]]) -> None:
    size = a.large_mib * MiB
    can_drop = not a.no_drop_caches and os.geteuid() == 0
    n_cold, n_disk = a.large_steps, (a.disk_steps if can_drop else 0)
    stream = root / "large"
    url = f"file://{stream}"
    log(f"large: producing {n_cold + n_disk} steps of one {a.large_mib} MiB field ...")
    payload = os.urandom(size)
    t0 = time.perf_counter()
    run_async(create, url, 1)
    run_async(produce, url, "big", iter({"__key__": f"big{i:04d}", "bin": payload} for i in range(n_cold + n_disk)))
    log(f"large: produced in {time.perf_counter() - t0:.1f} s")
    local = root / "local-large.bin"
    local.write_bytes(payload)
    # tmpfs (shmem) keeps 4 KiB pages unless mounted huge=...; ext4 here uses large folios
    shm_dir = Path("/dev/shm")
    shm = shm_dir / f"{root.name}-local.bin" if shm_dir.is_dir() and os.access(shm_dir, os.W_OK) else None
    if shm is not None:
        shm.write_bytes(payload)
    del payload
    buf = bytearray(a.buffer)
    for seg in (stream / "segments").rglob("*.tgb"):  # the store side is page-cached (see the docstring)
        read_all(seg, buf)
    read_all(local, buf)

    opens: list[float] = []
    cold: list[float] = []
    warm2: list[float] = []  # the second read of a file
    warm: list[float] = []  # the third and fourth
    base: list[float] = []
    shm_base: list[float] = []
    disk: list[float] = []
    disk_base: list[float] = []
    try:
        with Mount(url, root / "mnt-large", root / "mount-large.log") as mount:
            d = root / "mnt-large" / "rank-0"
            time.sleep(0.5)
            cpu0 = proc_cpu_seconds(mount.pid)  # threads may end over a long wait: counted here
            time.sleep(a.idle_seconds)
            idle_cpu = (proc_cpu_seconds(mount.pid) - cpu0) / a.idle_seconds
            for i in range(n_cold):
                path = d / f"{i:012d}" / f"big{i:04d}.bin"
                t_open, t, n = timed_read(path, buf)
                assert n == size, (path, n)
                opens.append(t_open)
                cold.append(gbps(n, t))
                for k in range(3):
                    (warm if k else warm2).append(gbps(n, timed_read(path, buf)[1]))
                    base.append(gbps(size, timed_read(local, buf)[1]))
                    if shm is not None:
                        shm_base.append(gbps(size, timed_read(shm, buf)[1]))
                log(
                    f"large step {i}: cold {cold[-1]:.2f} GB/s (open {t_open * 1000:.0f} ms), "
                    f"warm {warm2[-1]:.2f}/{warm[-2]:.2f}/{warm[-1]:.2f}, local {base[-1]:.2f}"
                )
            for i in range(n_cold, n_cold + n_disk):
                path = d / f"{i:012d}" / f"big{i:04d}.bin"
                if not drop_caches():
                    break
                _, t, n = timed_read(path, buf)
                disk.append(gbps(n, t))
                drop_caches()
                disk_base.append(gbps(size, timed_read(local, buf)[1]))
                log(f"large step {i}: disk-cold {disk[-1]:.2f} GB/s, local disk-cold {disk_base[-1]:.2f}")
    finally:
        if shm is not None:
            shm.unlink(missing_ok=True)

    b = statistics.median(base)
    c, w, w2 = statistics.median(cold), statistics.median(warm), statistics.median(warm2)
    what = f"{a.large_mib} MiB file, {a.buffer // KiB} KiB reads"
    cold_ok = c >= COLD_GBPS_TARGET and c / b >= COLD_RATIO_TARGET
    warm_ok = w2 / b >= WARM_RATIO_TARGET
    rows.append([f"cold read (mount cold, segment page-cached), median of {n_cold}", f"{c:.2f} GB/s", f"{b:.2f} GB/s", ratio(c / b),
                 f">= {COLD_GBPS_TARGET:g} GB/s and >= {COLD_RATIO_TARGET:g}x", yes(cold_ok)])  # fmt: skip
    rows.append(
        [
            "  of which open() (lookup: fetch + CRC + index of the slice)",
            fmt_ms(statistics.median(opens)),
            "",
            "",
            "",
            "",
        ]
    )
    rows.append([f"  cold read, best / worst of {n_cold}", f"{max(cold):.2f} / {min(cold):.2f} GB/s", "",
                 f"{ratio(max(cold) / b)} / {ratio(min(cold) / b)}", "", ""])  # fmt: skip
    if disk:
        db = statistics.median(disk_base)
        dc = statistics.median(disk)
        rows.append(
            [
                f"cold read, disk (drop_caches before), median of {len(disk)}",
                f"{dc:.2f} GB/s",
                f"{db:.2f} GB/s (disk)",
                ratio(dc / db),
                "info",
                "",
            ]
        )
    else:
        rows.append(
            ["cold read, disk (drop_caches)", "skipped" if a.no_drop_caches else "not permitted", "", "", "", ""]
        )
    rows.append([f"warm read = 2nd read (kernel page cache), median of {len(warm2)}", f"{w2:.2f} GB/s", f"{b:.2f} GB/s",
                 ratio(w2 / b), f">= {WARM_RATIO_TARGET:g}x local", yes(warm_ok)])  # fmt: skip
    rows.append([f"  3rd and 4th reads, median of {len(warm)}", f"{w:.2f} GB/s", f"{b:.2f} GB/s", ratio(w / b), "", ""])
    if shm_base:
        sb = statistics.median(shm_base)
        rows.append(["  for reference: local file on tmpfs (4 KiB pages, cached)", f"2nd {w2:.2f} / 3rd+ {w:.2f} GB/s",
                     f"{sb:.2f} GB/s (tmpfs)", f"{w2 / sb:.2f} / {w / sb:.2f}", "info", ""])  # fmt: skip
    rows.append([f"mount process CPU while idle ({a.idle_seconds:g} s, nothing to read or commit)",
                 f"{idle_cpu * 100:.0f}% of a core", "", "", "info", ""])  # fmt: skip
    verdicts.append((f"cold read {c:.2f} GB/s = {c / b:.2f}x local ({what})", cold_ok))
    verdicts.append((f"warm (2nd) read {w2:.2f} GB/s = {w2 / b:.2f}x local ({what})", warm_ok))


# -- 2. small files ----------------------------------------------------------------------------


def _time_files(paths: list[str]) -> list[float]:
    out = []
    pc = time.perf_counter
    for p in paths:
        t0 = pc()
        fd = os.open(p, os.O_RDONLY)
        data = os.read(fd, 64 * KiB)
        os.close(fd)
        out.append(pc() - t0)
        if len(data) != SMALL_FILE_BYTES:
            raise AssertionError((p, len(data)))
    return out


def bench_small(root: Path, a: argparse.Namespace, rows: list[list[str]], verdicts: list[tuple[str, bool]]) -> None:
    n_steps = a.small_steps
    stream = root / "small"
    url = f"file://{stream}"
    log(f"small: producing {n_steps} steps of {SMALL_FILES_PER_STEP} x {SMALL_FILE_BYTES // KiB} KiB ...")
    payloads = [os.urandom(SMALL_FILE_BYTES) for _ in range(SMALL_FILES_PER_STEP)]
    names = [f"f{j:04d}.bin" for j in range(SMALL_FILES_PER_STEP)]
    run_async(create, url, SMALL_FILES_PER_STEP)
    run_async(produce, url, "small", iter(
        {"__key__": f"f{j:04d}", "bin": payloads[j]} for _ in range(n_steps) for j in range(SMALL_FILES_PER_STEP)
    ))  # fmt: skip
    local = root / "local-small"
    for s in range(n_steps):
        (local / f"{s:012d}").mkdir(parents=True)
        for j, name in enumerate(names):
            (local / f"{s:012d}" / name).write_bytes(payloads[j])
    for s in range(n_steps):  # warm (they are, having just been written; and the dentries)
        _time_files([str(local / f"{s:012d}" / n) for n in names])

    cold: list[float] = []
    warm: list[float] = []
    base: list[float] = []
    first: list[float] = []
    head: list[float] = []  # files 1..100 of each cold pass
    tail: list[float] = []  # files 900..999
    with Mount(url, root / "mnt-small", root / "mount-small.log"):
        d = root / "mnt-small" / "rank-0"
        for s in range(n_steps):
            paths = [str(d / f"{s:012d}" / n) for n in names]
            c = _time_files(paths)
            first.append(c[0])
            head += c[1:101]
            tail += c[-100:]
            cold += c
            warm += _time_files(paths)
            base += _time_files([str(local / f"{s:012d}" / n) for n in names])
            log(f"small step {s}: cold p50 {fmt_us(pct(c, 50))}, warm p50 {fmt_us(pct(warm[-1000:], 50))}, "
                f"local p50 {fmt_us(pct(base[-1000:], 50))}")  # fmt: skip
    n = len(cold)
    bp50, bp99 = pct(base, 50), pct(base, 99)
    rows.append([f"4 KiB open+read+close p50 / p99, cold (first pass, {n} files)",
                 f"{fmt_us(pct(cold, 50))} / {fmt_us(pct(cold, 99))}", f"{fmt_us(bp50)} / {fmt_us(bp99)}",
                 f"{pct(cold, 50) / bp50:.0f}x / {pct(cold, 99) / bp99:.0f}x", "report", ""])  # fmt: skip
    rows.append(
        [
            f"  cold, first file of a step (slice fetch), median of {n_steps}",
            fmt_us(statistics.median(first)),
            "",
            "",
            "",
            "",
        ]
    )
    rows.append(
        [
            "  cold p50, files 1-100 vs 900-999 of a step",
            f"{fmt_us(pct(head, 50))} vs {fmt_us(pct(tail, 50))}",
            "",
            "",
            "",
            "",
        ]
    )
    rows.append(["4 KiB open+read+close p50 / p99, warm (second pass)",
                 f"{fmt_us(pct(warm, 50))} / {fmt_us(pct(warm, 99))}", f"{fmt_us(bp50)} / {fmt_us(bp99)}",
                 f"{pct(warm, 50) / bp50:.0f}x / {pct(warm, 99) / bp99:.0f}x", "report", ""])  # fmt: skip


# -- 3. commit to first byte -------------------------------------------------------------------

IN_CREATE = 0x100
IN_MOVED_TO = 0x80
_EVENT = struct.Struct("iIII")


class LogWatcher:
    """When each log record appears (IN_CREATE of its hard link), by inotify, in a thread."""

    def __init__(self, directory: Path) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self.fd = libc.inotify_init1(os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        if libc.inotify_add_watch(self.fd, str(directory).encode(), IN_CREATE | IN_MOVED_TO) < 0:
            raise OSError(ctypes.get_errno(), "inotify_add_watch")
        self.seen: dict[int, int] = {}  # version -> monotonic_ns
        self._stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import select

        while not self._stop:
            if not select.select([self.fd], [], [], 0.05)[0]:
                continue
            data = os.read(self.fd, 65536)
            now = time.monotonic_ns()
            pos = 0
            while pos < len(data):
                _, _, _, n = _EVENT.unpack_from(data, pos)
                name = data[pos + 16 : pos + 16 + n].rstrip(b"\0").decode()
                pos += 16 + n
                stem = name.removesuffix(".json")
                if not name.startswith(".") and stem.isdigit():
                    self.seen.setdefault(int(stem), now)

    def close(self) -> None:
        self._stop = True
        self.thread.join()
        os.close(self.fd)


READER_CODE = r"""
import os, sys, time
root, n = sys.argv[1], int(sys.argv[2])
for step in range(n):
    p = f"{root}/rank-0/{step:012d}/c{step:06d}.bin"
    t0 = time.monotonic_ns()
    fd = os.open(p, os.O_RDONLY)
    b = os.read(fd, 1)
    t = time.monotonic_ns()
    os.close(fd)
    assert len(b) == 1, p
    print(step, t0, t, flush=True)
"""


def bench_latency(root: Path, a: argparse.Namespace, rows: list[list[str]], verdicts: list[tuple[str, bool]]) -> None:
    import anyio

    import lakestream

    stream = root / "latency"
    url = f"file://{stream}"
    run_async(create, url, 1)
    gaps = [float(g) for g in a.gaps.split(",")]
    per_gap = a.latency_commits
    total = per_gap * len(gaps)
    payload = os.urandom(LATENCY_SAMPLE_BYTES)
    put_at: list[int] = []
    flushed_at: list[int] = []
    watcher = LogWatcher(stream / "_lakestream" / "log")
    try:
        with Mount(url, root / "mnt-latency", root / "mount-latency.log"):
            reader = subprocess.Popen(
                [sys.executable, "-c", READER_CODE, str(root / "mnt-latency"), str(total)],
                stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            try:

                async def producer() -> None:
                    async with lakestream.open_producer(url, "lat") as p:
                        await anyio.sleep(0.5)  # the reader is waiting for step 0
                        for step in range(total):
                            await anyio.sleep(gaps[step // per_gap] / 1000)
                            put_at.append(time.monotonic_ns())
                            await p.put({"__key__": f"c{step:06d}", "bin": payload})
                            await p.flush()
                            flushed_at.append(time.monotonic_ns())

                log(f"latency: {total} commits, gaps {gaps} ms ...")
                anyio.run(producer)
                out, _ = reader.communicate(timeout=120)
            finally:
                if reader.poll() is None:
                    reader.kill()
                    reader.wait()
    finally:
        watcher.close()
    opened_at: dict[int, int] = {}
    first_byte: dict[int, int] = {}
    for line in out.splitlines():
        s, t0, t1 = map(int, line.split())
        opened_at[s], first_byte[s] = t0, t1
    # version -> step from the records (one commit record per TGB here, but do not assume it)
    import orjson

    record_at: dict[int, int] = {}
    step = 0
    for v in sorted(watcher.seen):
        rec = orjson.loads((stream / "_lakestream" / "log" / f"{v:020d}.json").read_bytes())
        if rec.get("kind") == "commit":
            for _ in rec["tgbs"]:
                record_at[step] = watcher.seen[v]
                step += 1
    with open(root / "latency.csv", "w") as f:  # raw figures (kept with --keep)
        f.write("step,gap_ms,put_ns,record_ns,flushed_ns,open_ns,first_byte_ns\n")
        for s in range(total):
            f.write(
                f"{s},{gaps[s // per_gap]:g},{put_at[s]},{record_at[s]},{flushed_at[s]},{opened_at[s]},{first_byte[s]}\n"
            )
    all_ok = True
    for gi, gap in enumerate(gaps):
        steps = range(gi * per_gap, (gi + 1) * per_gap)
        from_rec = [(first_byte[s] - record_at[s]) / 1e9 for s in steps]
        from_flush = [(first_byte[s] - flushed_at[s]) / 1e9 for s in steps]
        from_put = [(first_byte[s] - put_at[s]) / 1e9 for s in steps]
        waiting = [s for s in steps if opened_at[s] <= record_at[s]]  # the reader was blocked in the lookup
        from_rec_w = [(first_byte[s] - record_at[s]) / 1e9 for s in waiting]
        p50 = pct(from_rec, 50)
        ok = p50 * 1000 < LATENCY_P50_TARGET_MS
        all_ok &= ok
        rows.append([f"commit -> first byte p50 / p99, {gap:g} ms between commits ({per_gap})",
                     f"{fmt_ms(p50)} / {fmt_ms(pct(from_rec, 99))}", "", "",
                     f"p50 < {LATENCY_P50_TARGET_MS:g} ms", yes(ok)])  # fmt: skip
        rows.append(["  p50 from flush() return / from put()",
                     f"{fmt_ms(pct(from_flush, 50))} / {fmt_ms(pct(from_put, 50))}", "", "", "", ""])  # fmt: skip
        rows.append([f"  reader already waiting at the commit: {len(waiting)}/{per_gap}; their p50 / p99",
                     f"{fmt_ms(pct(from_rec_w, 50))} / {fmt_ms(pct(from_rec_w, 99))}" if waiting else "-", "", "", "", ""])  # fmt: skip
        verdicts.append((f"commit -> first byte p50 {p50 * 1000:.1f} ms, p99 {pct(from_rec, 99) * 1000:.1f} ms "
                         f"with {gap:g} ms between commits", ok))  # fmt: skip


# -- 4. CPU while idle ------------------------------------------------------------------------------

IDLE_CODE = r"""
import sys, time
kind, url, start = sys.argv[1], sys.argv[2], int(sys.argv[3])
if kind == "reader":
    import anyio, lakestream

    async def main():
        async with lakestream.open_reader(url, 0) as r:
            print("ready", flush=True)
            async for batch in r.steps(start):
                print(time.monotonic_ns(), flush=True)
                return

    anyio.run(main)
else:
    from lakestream.torch import StreamDataset

    it = iter(StreamDataset(url, rank=0, world_size=1, start=start, collate=kind == "collate"))
    print("ready", flush=True)
    next(it)
    print(time.monotonic_ns(), flush=True)
    it.close()
"""


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads) so far, from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_windows(pid: int, seconds: float) -> tuple[float, float]:
    """The CPU of process `pid` as a fraction of a core over two halves of `seconds` of waiting."""
    half = seconds / 2
    c0 = proc_cpu_seconds(pid)
    time.sleep(half)
    c1 = proc_cpu_seconds(pid)
    time.sleep(half)
    c2 = proc_cpu_seconds(pid)
    return (c1 - c0) / half, (c2 - c1) / half


def bench_idle(root: Path, a: argparse.Namespace, rows: list[list[str]], verdicts: list[tuple[str, bool]]) -> None:
    """A reader (`open_reader().steps()`), a StreamDataset and the mount daemon (with a reader
    blocked in the lookup of the next step) waiting for a step that is not committed: the CPU of
    the waiting process over two halves of `--idle` seconds (after a second to settle), then how
    long after `flush()` returned the step committed at the end reached the waiter."""
    stores: list[tuple[str, Callable[[], Any]]] = [("file://", contextlib.nullcontext)]
    try:
        from _common import SeaweedS3, find_weed

        find_weed()
        stores.append(("SeaweedFS", SeaweedS3))
    except Exception as e:  # no `weed` binary: file:// only
        log(f"idle: no SeaweedFS ({e}): file:// only")
    n = 0
    for store, server in stores:
        with server() as s3:
            saved = dict(os.environ)
            if s3 is not None:
                os.environ.update(s3.env())
            try:
                for kind in ("reader", "StreamDataset", "mount"):
                    n += 1
                    url = s3.new_stream() if s3 is not None else f"file://{root}/idle-{n}"
                    run_async(create, url, 1)
                    run_async(produce, url, "idle", iter([{"__key__": "a", "bin": b"x"}]))  # step 0
                    log(f"idle: {kind} on {store}, {a.idle:g} s ...")
                    first, second, visible = _idle_one(root, n, kind, url, a.idle)
                    worst = max(first, second)
                    ok = worst < 0.01
                    rows.append([f"{kind} waiting for a step, CPU ({store}; 1st / 2nd half of {a.idle:g} s)",
                                 f"{first:.4f} / {second:.4f} of a core", "", "",
                                 "< 0.01 of a core", yes(ok)])  # fmt: skip
                    rows.append(
                        [f"  then committed: seen {fmt_ms(visible)} after flush() returned", "", "", "", "", ""]
                    )
                    verdicts.append((f"{kind} idle on {store}: {worst:.4f} of a core", ok))
            finally:
                os.environ.clear()
                os.environ.update(saved)


def _idle_one(root: Path, n: int, kind: str, url: str, seconds: float) -> tuple[float, float, float]:
    if kind == "mount":
        with Mount(url, root / f"mnt-idle-{n}", root / f"mount-idle-{n}.log", "--wait", str(seconds + 60)) as m:
            seen: list[int] = []
            waiter = threading.Thread(
                target=lambda: (os.stat(m.mountpoint / "rank-0" / f"{1:012d}"), seen.append(time.monotonic_ns()))
            )
            waiter.start()
            time.sleep(1.0)
            first, second = idle_windows(m.pid, seconds)
            run_async(produce, url, "idle", iter([{"__key__": "b", "bin": b"y"}]))
            flushed = time.monotonic_ns()
            waiter.join(30)
            return first, second, (seen[0] - flushed) / 1e9 if seen else float("nan")
    code_kind = "reader" if kind == "reader" else "dataset"
    child = subprocess.Popen([sys.executable, "-c", IDLE_CODE, code_kind, url, "1"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        if child.stdout.readline().strip() != "ready":
            raise RuntimeError(f"idle {kind}: the child did not start")
        time.sleep(1.0)
        first, second = idle_windows(child.pid, seconds)
        run_async(produce, url, "idle", iter([{"__key__": "b", "bin": b"y"}]))
        flushed = time.monotonic_ns()
        out, _ = child.communicate(timeout=60)
        return first, second, (int(out.split()[0]) - flushed) / 1e9
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


# -- 5. requests ----------------------------------------------------------------------------------

# An empty pyfuse3 filesystem, served as the mount serves (asyncio, the mount's wait for /dev/fuse):
# `f` answers lookups and getattrs with zero timeouts (each stat of it is a request) and counts
# them; `n`'s size is that count.
EMPTY_FS_CODE = r"""
import asyncio, errno, stat, sys
import pyfuse3, pyfuse3.asyncio
from lakestream_mount import _readable_soon

class Empty(pyfuse3.Operations):
    served = 0

    async def getattr(self, inode, ctx=None):
        if inode == 2:
            self.served += 1
        a = pyfuse3.EntryAttributes()
        a.st_ino = inode
        a.st_mode = stat.S_IFDIR | 0o555 if inode == pyfuse3.ROOT_INODE else stat.S_IFREG | 0o444
        a.st_size = self.served if inode == 3 else 0
        a.entry_timeout = a.attr_timeout = 0
        return a

    async def lookup(self, parent, name, ctx=None):
        if parent == pyfuse3.ROOT_INODE and name in (b"f", b"n"):
            return await self.getattr(2 if name == b"f" else 3)
        raise pyfuse3.FUSEError(errno.ENOENT)

async def main(mountpoint):
    pyfuse3.init(Empty(), mountpoint, set(pyfuse3.default_options) | {"fsname=empty", "ro"})
    print("mounted", flush=True)
    try:
        await pyfuse3.main()
    finally:
        pyfuse3.close()

pyfuse3.asyncio.enable()
pyfuse3.asyncio.wait_readable = _readable_soon(pyfuse3.asyncio.wait_readable)
asyncio.run(main(sys.argv[1]))
"""


def _stat_loop(path: Path, seconds: float) -> tuple[int, float]:
    """Stat `path` for `seconds`: (stats, CPU seconds of this process)."""
    n, c0, t0 = 0, time.process_time(), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        os.stat(path)
        n += 1
    return n, time.process_time() - c0


def _mount_requests(mountpoint: Path) -> Counter[str]:
    import json

    return Counter(json.loads((mountpoint / "_status.json").read_bytes())["requests"])


def bench_requests(root: Path, a: argparse.Namespace, rows: list[list[str]], verdicts: list[tuple[str, bool]]) -> None:
    """What a FUSE request costs: an empty pyfuse3 filesystem's stat loop against the mount's
    (a lookup of `rank-0/latest`, zero timeouts), CPU of the daemon and of the caller a request;
    then MountDataset(collate=True) over a prefilled stream of the floor's steps (16 uint8 arrays
    (3, 224, 224) a step): the requests a step costs (`_status.json`), and what they would cost
    the empty filesystem, against the trainer's and the daemon's CPU a sample."""
    import numpy as np

    from lakestream.torch import MountDataset

    empty_mp = root / "mnt-empty"
    empty_mp.mkdir()
    paths = [str(Path(__file__).resolve().parent.parent / "mount"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}  # no empty entry: not the cwd
    child = subprocess.Popen(
        [sys.executable, "-c", EMPTY_FS_CODE, str(empty_mp)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert child.stdout is not None
        if child.stdout.readline().strip() != "mounted":
            raise RuntimeError("requests: the empty filesystem did not mount")
        os.stat(empty_mp / "f")
        served0, d0 = os.stat(empty_mp / "n").st_size, task_cpu_seconds(child.pid)
        stats, caller = _stat_loop(empty_mp / "f", a.request_seconds)
        daemon = task_cpu_seconds(child.pid) - d0
        served = os.stat(empty_mp / "n").st_size - served0
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(empty_mp)], capture_output=True, timeout=30)
        child.terminate()
        child.wait(10)
    empty_daemon, empty_caller = daemon / served, caller / served
    log(f"requests: empty pyfuse3 filesystem, {stats} stats, {served} requests")

    steps = a.request_steps
    url = f"file://{root}/requests"
    run_async(create, url, 16)
    img = np.random.default_rng(0).integers(0, 255, (3, 224, 224), dtype=np.uint8)
    run_async(produce, url, "requests", iter({"__key__": f"{i:06d}", "img": img} for i in range(16 * steps)))
    with Mount(url, root / "mnt-requests", root / "mount-requests.log") as m:
        latest = m.mountpoint / "rank-0" / "latest"
        os.lstat(latest)
        r0, d0 = _mount_requests(m.mountpoint), m.cpu_seconds()
        stats, caller = _stat_loop(latest, a.request_seconds)
        daemon = m.cpu_seconds() - d0
        served = sum((_mount_requests(m.mountpoint) - r0).values())
        log(f"requests: the mount, {stats} stats of latest, {served} requests")
        mount_daemon, mount_caller = daemon / served, caller / served
        it = iter(MountDataset(m.mountpoint, 0, 1, stop=steps, collate=True, timeout=60))
        next(it)  # step 0: the mount's start and the first fetch, one-offs
        first = _mount_requests(m.mountpoint)
        r0 = _mount_requests(m.mountpoint)
        looking = r0 - first  # what a read of `_status.json` costs: taken out of the step's count
        c0, d0 = time.process_time(), m.cpu_seconds()
        read = sum(1 for _ in it)
        trainer, daemon = time.process_time() - c0, m.cpu_seconds() - d0
        per_step = _mount_requests(m.mountpoint) - r0 - looking
    assert read == steps - 1, read
    per_step_n = sum(per_step.values()) / read
    by_op = ", ".join(f"{op} {n / read:.1f}" for op, n in sorted(per_step.items()))
    samples = read * 16
    floor = per_step_n * empty_daemon / 16
    rows += [
        ["FUSE request (lookup, zero timeouts), daemon CPU; local: an empty pyfuse3 filesystem",
         fmt_us(mount_daemon), fmt_us(empty_daemon), ratio(mount_daemon / empty_daemon), "", ""],
        ["  the caller's CPU (stat)", fmt_us(mount_caller), fmt_us(empty_caller), ratio(mount_caller / empty_caller), "", ""],
        [f"MountDataset(collate) step, 16 × 147 KiB: requests ({by_op})", f"{per_step_n:.1f}", "", "", "", ""],
        ["  those requests at the empty filesystem's cost, a sample", fmt_us(floor), "", "", "", ""],
        ["  trainer + daemon CPU, a sample", f"{fmt_us(trainer / samples)} + {fmt_us(daemon / samples)}", "", "", "", ""],
    ]  # fmt: skip
    print(
        f"FUSE requests: an empty pyfuse3 filesystem spends {empty_daemon * 1e6:.0f} µs of CPU a request "
        f"(the mount {mount_daemon * 1e6:.0f}); a collated step's {per_step_n:.1f} requests would cost it "
        f"{floor * 1e6:.0f} µs a sample before any fetch (the mount's daemon spent {daemon / samples * 1e6:.0f}, "
        f"the trainer {trainer / samples * 1e6:.0f})",
        flush=True,
    )


# -- main ----------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="under a minute: 64 MiB slices, fewer steps and commits")
    ap.add_argument("--smoke", action="store_true", help="a few seconds: 4 MiB slices, every part once")
    ap.add_argument("--buffer", type=int, default=1 * MiB, help="read buffer bytes (default 1 MiB)")
    ap.add_argument("--only", default="large,small,latency,idle,requests", help="comma list of parts to run")
    ap.add_argument("--idle", type=float, help="seconds each waiter is measured idle in part 4 (20; 10 quick)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (mount logs)")
    ap.add_argument(
        "--gaps",
        dest="gaps_opt",
        metavar="MS,MS",
        help="ms between commits in part 3, comma list (default 0,100 quick; 0,25,100,400 full)",
    )
    ap.add_argument("--commits", type=int, help="commits per gap in part 3 (default 15 quick, 60 full)")
    ap.add_argument(
        "--no-drop-caches", action="store_true", help="skip the disk-cold rows (drop_caches is system-wide)"
    )
    ap.add_argument(
        "--mount-cmd", default="", help="experiments: command prefix replacing `lakestream mount` (URL MNT appended)"
    )
    a = ap.parse_args()
    a.idle_seconds = 3.0
    Mount.command = shlex.split(a.mount_cmd)
    if a.smoke:
        a.idle_seconds = 0.5
        a.large_mib, a.large_steps, a.disk_steps, a.small_steps, a.latency_commits, a.gaps = 4, 2, 1, 1, 3, "0,50"
    elif a.quick:
        a.large_mib, a.large_steps, a.disk_steps, a.small_steps, a.latency_commits, a.gaps = 64, 3, 1, 2, 15, "0,100"
    else:
        a.large_mib, a.large_steps, a.disk_steps, a.small_steps, a.latency_commits, a.gaps = (
            256,
            8,
            2,
            10,
            60,
            "0,25,100,400",
        )
    a.gaps = a.gaps_opt or a.gaps
    a.idle = a.idle or (1.0 if a.smoke else 10.0 if a.quick else 20.0)
    a.latency_commits = a.commits or a.latency_commits
    a.request_seconds, a.request_steps = (0.3, 4) if a.smoke else (2.0, 20) if a.quick else (5.0, 60)

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGHUP, _on_signal)
    t_start = time.perf_counter()
    load0 = Path("/proc/loadavg").read_text().split()[:3]
    rows: list[list[str]] = []
    verdicts: list[tuple[str, bool]] = []
    root = temp_dir("lakestream-bench-mount-")
    print(
        f"mount benchmark{' (--quick: ' + str(a.large_mib) + ' MiB slices, fewer steps)' if a.quick else ''}"
        + (f" (--smoke: {a.large_mib} MiB slices, every part once)" if a.smoke else ""),
        flush=True,
    )
    with removing(root) if not a.keep else _noop(root):
        try:
            parts = a.only.split(",")
            if "large" in parts:
                bench_large(root, a, rows, verdicts)
            if "small" in parts:
                bench_small(root, a, rows, verdicts)
            if "latency" in parts:
                bench_latency(root, a, rows, verdicts)
            if "idle" in parts:
                bench_idle(root, a, rows, verdicts)
            if "requests" in parts:
                bench_requests(root, a, rows, verdicts)
        finally:
            _close_all_mounts()  # before the temp dir goes
    print()
    print(f"machine: {machine_description()}")
    print(
        f"load average (1/5/15 min) at start {' '.join(load0)}, at end {' '.join(Path('/proc/loadavg').read_text().split()[:3])}"
    )
    print(f"command: {shlex.join(['.venv/bin/python', *sys.argv])}; mount: {shlex.join(Mount.command or ['lakestream', 'mount'])} "
          f"URL MNT (defaults); stream: file:// (world size 1); reads of {a.buffer // KiB} KiB; 1 GB = 10^9 B")  # fmt: skip
    print()
    print(
        format_table(
            ["measurement", "through the mount", "local file", "mount / local", "target", "met"], rows, "lrrrll"
        )
    )
    print()
    for what, ok in verdicts:
        print(f"{'MET    ' if ok else 'NOT MET'}  {what}")
    print(f"\ntotal {time.perf_counter() - t_start:.1f} s")
    return 0


@contextmanager
def _noop(path: Path) -> Iterator[Path]:
    print(f"keeping {path}", file=sys.stderr)
    yield path


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        _close_all_mounts()
        print("interrupted; unmounted", file=sys.stderr)
        sys.exit(130)
