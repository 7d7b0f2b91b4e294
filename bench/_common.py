"""Shared helpers for the benchmarks in bench/: a SeaweedFS server, timing, payloads, tables.

    from _common import SeaweedS3, Stopwatch, machine_description, print_table, random_pool

Benchmarks are run as scripts (`.venv/bin/python bench/NAME.py`), so this module is imported by
its plain name (bench/ is on sys.path as the script's directory). The S3 server is the same
`weed server` the test suite starts (tests/s3server.py, reused as is).
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))

from s3server import S3Server, WeedNotFound, find_weed  # noqa: E402  (tests/s3server.py, after the path)

__all__ = [
    "REPO",
    "KiB",
    "MiB",
    "SeaweedS3",
    "Stopwatch",
    "WeedNotFound",
    "fmt_bytes",
    "format_table",
    "load_average",
    "machine_description",
    "mb_per_s",
    "median",
    "print_table",
    "random_pool",
    "removing",
    "temp_dir",
    "timed",
    "unique",
]

KiB = 1 << 10
MiB = 1 << 20


# -- the S3 server ---------------------------------------------------------------------------


class SeaweedS3:
    """A throwaway SeaweedFS S3 server on free loopback ports, for one benchmark run.

        with SeaweedS3() as s3:
            store = s3.store(s3.new_stream())   # an S3Store with this server's endpoint and keys

    Stopping sends SIGTERM, then SIGKILL after a few seconds, and removes the data directory.
    """

    def __init__(self) -> None:
        self.server = S3Server(find_weed())
        self.startup_s = 0.0
        self._bucket: str | None = None

    def __enter__(self) -> SeaweedS3:
        t0 = time.perf_counter()
        self.server.start()
        self.startup_s = time.perf_counter() - t0
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()

    @property
    def endpoint_url(self) -> str:
        return self.server.endpoint_url

    def new_bucket(self, prefix: str = "stream") -> str:
        """A fresh, empty bucket: `s3://BUCKET/PREFIX`. Mind the limit below: prefer `new_stream`."""
        return self.server.new_bucket(prefix)

    def new_stream(self, name: str | None = None) -> str:
        """`s3://BUCKET/NAME` for a new stream, all in one bucket made on first use.

        One bucket, not one per stream: each SeaweedFS bucket is a collection that grows 7 volumes
        of its own, and with the test server's settings (`-volume.max=0`, volumes of 1024 MB) the
        free disk allows ~77 in all, so the 12th bucket that gets data fails every PutObject with
        InternalError ("No writable volumes and no free volumes left").
        """
        if self._bucket is None:
            self._bucket = self.server.new_bucket("").removeprefix("s3://")
        return f"s3://{self._bucket}/{name or unique('stream')}"

    def store_options(self) -> dict[str, Any]:
        """Keyword options for `lakestream.open_store(url, **options)` that point at this server."""
        return {
            "endpoint_url": self.server.endpoint_url,
            "aws_access_key_id": self.server.access_key,
            "aws_secret_access_key": self.server.secret_key,
            "region_name": self.server.region,
        }

    def store(self, url: str) -> Any:
        """A new S3Store (its own client and connection pool) for `url` on this server."""
        import lakestream

        return lakestream.open_store(url, **self.store_options())

    def env(self) -> dict[str, str]:
        """The AWS_* variables for a subprocess."""
        return self.server.env()


# -- payloads --------------------------------------------------------------------------------


def random_pool(sample_size: int, count: int, *, max_bytes: int = 256 * MiB) -> list[bytes]:
    """Up to `count` distinct incompressible payloads of `sample_size` bytes (os.urandom), at
    most `max_bytes` in all (at least one): benchmarks reuse them cyclically."""
    n = max(1, min(count, max_bytes // max(1, sample_size)))
    return [os.urandom(sample_size) for _ in range(n)]


# -- timing ----------------------------------------------------------------------------------


@dataclass
class Stopwatch:
    """Wall-clock intervals: `with sw: ...` adds one; `sw.total`, `sw.laps`."""

    laps: list[float] = field(default_factory=list)
    _t0: float = 0.0

    def __enter__(self) -> Stopwatch:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.laps.append(time.perf_counter() - self._t0)

    @property
    def total(self) -> float:
        return sum(self.laps)

    @property
    def last(self) -> float:
        return self.laps[-1]


@contextmanager
def timed(label: str, *, stream: Any = sys.stderr) -> Iterator[None]:
    """Print `label ... N.N s` around a block (progress output, not results)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        print(f"  {label}: {time.perf_counter() - t0:.2f} s", file=stream, flush=True)


def mb_per_s(nbytes: int, seconds: float) -> float:
    """Decimal megabytes (10^6 bytes) per second, the unit every table here uses."""
    return nbytes / 1e6 / seconds if seconds > 0 else float("inf")


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            v = n / size
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n:.0f} B"


# -- tables and the machine ------------------------------------------------------------------


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A Markdown pipe table, padded so it also reads well in a terminal.

    `align` has one letter per column, `l` or `r` (default: first column left, the rest right).
    """
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    align = align or "l" + "r" * (len(headers) - 1)

    def line(row: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(row, widths, align)) + " |"

    rule = (
        "|"
        + "|".join(("-" * (w + 1) + ":") if a == "r" else (":" + "-" * (w + 1)) for w, a in zip(widths, align))
        + "|"
    )
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> None:
    print(format_table(headers, rows, align), flush=True)


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_description() -> str:
    """One paragraph: CPU count and model, memory (`free -h`), kernel, Python, the weed version."""
    cpus = _run(["nproc"]) or str(os.cpu_count())
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    for line in _run(["free", "-h"]).splitlines():
        if line.startswith("Mem:"):
            parts = line.split()
            mem = f"{parts[1]} RAM ({parts[-1]} available)"
    try:
        weed = "SeaweedFS " + _run([find_weed(), "version"]).splitlines()[0]
    except (WeedNotFound, IndexError):
        weed = "weed not found"
    return (
        f"{cpus} CPUs ({model or platform.processor() or 'unknown model'}), {mem or 'unknown memory'}, "
        f"Linux {platform.release()}, Python {platform.python_version()}, {weed}"
    )


def load_average() -> str:
    """The 1-minute load average and what it means on this machine, e.g. '0.12 on 2 CPUs'.

    Benchmarks print it at their start and end: figures taken while other work ran are suspect.
    """
    try:
        one = os.getloadavg()[0]
    except OSError:
        return "unknown"
    return f"{one:.2f} on {os.cpu_count()} CPUs"


def temp_dir(prefix: str = "lakestream-bench-") -> Path:
    """A fresh directory under $TMPDIR; the caller removes it (see `removing`)."""
    import tempfile

    return Path(tempfile.mkdtemp(prefix=prefix))


@contextmanager
def removing(path: Path) -> Iterator[Path]:
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def inline_to_thread(func: Callable[..., Any], *args: Any, **_: Any) -> Any:
    """`anyio.to_thread.run_sync` for a process on simulated time (scale.py, tail.py): the call
    runs on the event loop, taking no simulated time. (A thread would let the mock clock jump
    while it works, and cost threads.)"""
    import anyio.lowlevel

    await anyio.lowlevel.checkpoint()
    return func(*args)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"
