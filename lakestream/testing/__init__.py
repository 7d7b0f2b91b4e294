"""Test support for Lakestream and for what is built on it. The library itself never imports it.

* `FaultyStore` wraps any store and injects latency, throttling (503 SlowDown), lost answers of
  puts that landed, failures and arbitrary hooks, all from one seeded `random.Random`;
  `S3_LATENCY_OPS` is S3's latencies per operation, `S3_LIKE` an older, faster profile.
* `inject_faults(spec)` makes every store that `lakestream.open_store` opens from then on, in
  this process, a FaultyStore: how a test injects faults into a whole process (a CLI child, a
  producer or mount subprocess) that it starts with `python -m lakestream.testing SPEC ARGS…`.
  SPEC is `ambiguous=P,fail=P,latency=s3|none,get_rate=R,put_rate=R,seed=N` (`parse_faults`),
  the rates shared by every store of the process.
* `follower(store, on_apply=…)`: a Manifest that calls `on_apply(state)` after each version it
  applies, so a checker sees every version, even a step that a rewind discards within one refresh.
* `SimulatedS3`: an in-process model of S3 (latencies, first conditional PUT to arrive wins,
  per-prefix request rates answered 503 SlowDown) whose calls take simulated time, for running
  the real clients under a mock clock (`bench/scale.py`); `client(label)` is its ObjectStore.
* `S3Server`: a throwaway SeaweedFS S3 server on loopback (what `lakestream dev-s3` runs).
* `run_command(argv)` runs the `lakestream` command in this process; `lakestream_command()` is the
  argv that runs it in a subprocess with this interpreter.
* The store layout a test or benchmark looks at from outside: `LOG_PREFIX`, `SNAPSHOT_PREFIX`,
  `log_key(version)`, `segment_upload_time(key)`; `write_synthetic_log` fills a fresh stream with
  a long log of old producers' commits (a large manifest for benchmarks).
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict

from .._devs3 import S3Server, WeedNotFound, find_weed, free_ports
from .._layout import LOG_PREFIX, SNAPSHOT_PREFIX, log_key, parse_segment_key
from .._manifest import Manifest
from .._state import State
from .._store import ObjectStore, set_store_wrapper
from ._faulty import S3_LATENCY_OPS, S3_LIKE, Buckets, FaultyStore
from ._simstore import S3_LATENCY, S3_RATES, SimulatedS3, SimulatedStore

__all__ = [
    "LOG_PREFIX",
    "S3_LATENCY",
    "S3_LATENCY_OPS",
    "S3_LIKE",
    "S3_RATES",
    "SNAPSHOT_PREFIX",
    "FaultyStore",
    "S3Server",
    "SimulatedS3",
    "SimulatedStore",
    "WeedNotFound",
    "find_weed",
    "follower",
    "free_ports",
    "inject_faults",
    "lakestream_command",
    "log_key",
    "parse_faults",
    "run_command",
    "segment_upload_time",
    "write_synthetic_log",
]


class FaultOptions(TypedDict):
    """The FaultyStore options of a fault spec."""

    ambiguous_put: float
    fail_before: float
    latency: dict[str, tuple[float, float]]
    get_rate: float
    put_rate: float


FAULT_SPEC = "ambiguous=P,fail=P,latency=s3|none,get_rate=R,put_rate=R,seed=N"
LATENCIES: dict[str, dict[str, tuple[float, float]]] = {"s3": S3_LATENCY_OPS, "none": {}}


def parse_faults(spec: str) -> tuple[FaultOptions, int | None]:
    """`ambiguous=P,fail=P,latency=s3|none,get_rate=R,put_rate=R,seed=N` -> (FaultyStore options,
    seed). Raises ValueError."""
    try:
        kv = dict(item.split("=", 1) for item in spec.split(",") if item)
        ambiguous, fail = float(kv.pop("ambiguous", 0)), float(kv.pop("fail", 0))
        get_rate, put_rate = float(kv.pop("get_rate", "inf")), float(kv.pop("put_rate", "inf"))
        latency = kv.pop("latency", "none")
        seed = int(kv.pop("seed", 0)) or None
    except ValueError as e:
        raise ValueError(f"faults {spec!r}: expected {FAULT_SPEC} ({e})") from None
    if kv:
        raise ValueError(
            f"faults {spec!r}: unknown keys {sorted(kv)} (ambiguous, fail, latency, get_rate, put_rate, seed)"
        )
    if not (0 <= ambiguous <= 1 and 0 <= fail <= 1):
        raise ValueError(f"faults {spec!r}: ambiguous and fail are probabilities, in [0, 1]")
    if not (get_rate > 0 and put_rate > 0):
        raise ValueError(f"faults {spec!r}: get_rate and put_rate are requests per second, above 0")
    if latency not in LATENCIES:
        raise ValueError(f"faults {spec!r}: latency is one of {', '.join(LATENCIES)}, not {latency!r}")
    faults = FaultOptions(
        ambiguous_put=ambiguous, fail_before=fail, latency=LATENCIES[latency], get_rate=get_rate, put_rate=put_rate
    )
    return faults, seed


def inject_faults(spec: str | None, configure: Callable[[FaultyStore], None] | None = None) -> None:
    """Wrap every store opened from now on in this process in a FaultyStore with `spec`'s faults
    (None: stop); they share one set of token buckets, so the rates are the process's. `configure`
    may adjust each one (count injections, add a hook)."""
    if spec is None:
        set_store_wrapper(None)
        return
    faults, seed = parse_faults(spec)
    buckets: Buckets = {}

    def wrap(store: ObjectStore) -> ObjectStore:
        faulty = FaultyStore(store, rng=random.Random(seed), buckets=buckets, **faults)
        if configure is not None:
            configure(faulty)
        return faulty

    set_store_wrapper(wrap)


def follower(store: ObjectStore, *, on_apply: Callable[[State], None] | None = None) -> Manifest:
    """A Manifest of the stream on `store` (`load()`, `refresh()`, `.state`) that calls
    `on_apply(state)` after each version it applies."""
    manifest = Manifest(store)
    manifest.on_apply = on_apply
    return manifest


def segment_upload_time(key: str) -> float | None:
    """The upload time (Unix seconds) a segment key carries, or None if `key` is not one."""
    parsed = parse_segment_key(key)
    return parsed[3] if parsed else None


def run_command(argv: list[str]) -> int:
    """The `lakestream` command with `argv`, in this process: its exit status."""
    from .._cli import main as cli

    return cli(argv)


def lakestream_command() -> list[str]:
    """The argv prefix that runs the `lakestream` command with this interpreter: the console
    script beside it, or the interpreter running `run_command`."""
    script = Path(sys.executable).with_name("lakestream")
    if script.exists() and os.access(script, os.X_OK):
        return [str(script)]
    return [
        sys.executable,
        "-c",
        "import sys; from lakestream.testing import run_command; sys.exit(run_command(sys.argv[1:]))",
    ]


async def write_synthetic_log(
    store: ObjectStore, versions: int, *, producers: int = 64, age: float = 86_400.0
) -> State:
    """Append versions 1..`versions` to the fresh stream on `store` (version 0 only), straight to
    the store: `producers` old producers register (`old00`, …), then commit one TGB each in turn,
    all `age` seconds ago; then write a snapshot of the state at the tail. Returns that state.
    For benchmarks of a large manifest: the segments the commits name do not exist."""
    from .._records import CommitRecord, RegisterRecord, TgbRef, encode_record

    state = State()
    state.apply(0, await store.get(log_key(0)))
    ts = time.time() - age
    v = 1

    async def put(record: RegisterRecord | CommitRecord) -> None:
        nonlocal v
        data = encode_record(record)
        await store.put(log_key(v), data)
        why = state.apply(v, data)
        assert why is None, why
        v += 1

    for k in range(producers):
        await put(RegisterRecord(producer=f"old{k:02d}", epoch=1, token=f"t{k}", ts=ts))
    seq = [-1] * producers
    while v <= versions:
        k = v % producers
        seq[k] += 1
        tgb = TgbRef(segment=f"segments/old{k:02d}/1-{seq[k]}-0.tgb", ranks=((0, 1100, 0, 1),), cursor=seq[k] + 1)
        await put(CommitRecord(producer=f"old{k:02d}", epoch=1, seq=seq[k], tgbs=(tgb,), ts=ts))
    await Manifest(store).write_snapshot(state.to_json(), state.version)
    return state


def main(argv: list[str]) -> int:
    """`python -m lakestream.testing SPEC ARGS…`: the `lakestream` command with SPEC's faults."""
    if not argv:
        print(f"usage: python -m lakestream.testing {FAULT_SPEC} COMMAND [ARGS…]", file=sys.stderr)
        return 2
    try:
        inject_faults(argv[0])
    except ValueError as e:
        print(f"lakestream.testing: {e}", file=sys.stderr)
        return 2
    return run_command(argv[1:])
