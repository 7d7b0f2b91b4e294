#!/usr/bin/env python3
"""Torture test: everything at once, against a real S3 server (SeaweedFS), then check the result.

    .venv/bin/python tests/torture.py --minutes 10 [--seed N] [--keep] [--json FILE]
    .venv/bin/python -m pytest tests/test_torture.py        # the short version (about a minute)

What runs, concurrently, for the chaos phase:

* 4 producers, `lakestream produce --from-dir` over 4 directories of small files with known bytes
  (throttled with `--rate`), SIGKILLed at random moments and restarted with the same producer id;
* trainer ranks (world size 2) reading every step in order, twice over: through the Python reader
  (`open_reader`, one subprocess per rank) and through a FUSE mount (`lakestream mount`
  subprocess, one plain-`open()` reader subprocess per rank). Every step a reader consumes is
  journaled (step, manifest version, producer, keys, a hash of every field). Reader processes and
  the mount daemon are SIGKILLed at random moments and restarted where their journal ends;
* rank 0's role (this process): a checkpoint every 6 steps, once every reader has consumed the step;
* `lakestream gc --orphan-grace G --force-grace` every few seconds (sometimes SIGKILLed half-way);
  G is 30 s, below the 300 s floor on purpose, to stress the producers' re-check of held uploads
  (5 s lost committed data in a long run; see docs/guarantees.md, "Torture test");
* one `lakestream rewind --to-checkpoint` half-way: every producer is fenced (exits non-zero
  with "fenced") and is restarted, resuming from its cursor as of the checkpoint; the Python
  readers notice the rewind themselves (StepUnavailable) and the mount readers are restarted,
  both from the checkpoint's step + 1;
* injected store faults everywhere: in subprocesses through `LAKESTREAM_FAULTS` (`lakestream.testing`)
  hook (503-like failures and ambiguous puts) plus a timeout hook added by this harness's child
  wrapper (`torture.py cli ...`, which runs `lakestream._cli.main` and logs every injected fault);
  in this process through a FaultyStore wrapping the S3 store (follower, checkpoints, final reads).

Then a drain phase (no more chaos; producers restarted without a rate limit until their sources
are exhausted, readers catch up), a final GC, and the checks:

* the history (step -> version, producer, segment) observed by an in-process follower of the log is
  gap-free and agrees with the final state and with `lakestream verify`;
* every source record is in exactly one step of the final history, with its exact bytes, and each
  producer's records are in source order with the right cursor at every step. The final history is
  the reader-consumed steps below `first_step` (reclaimed by GC) plus the retained steps, read
  again at the end;
* every reader (both ranks, Python reader and mount) consumed every step of the final history, with
  the same (version, producer, samples, bytes) for a given (step, version, rank); each reclaimed
  step was consumed by every reader before the first checkpoint covering it was recorded;
* no reader failed on a retained step; StepUnavailable only where a rewind discarded a step;
* after the final GC, the bytes under `segments/` are within 10% of the retained steps' segment
  bytes (sum of Step.nbytes); after a log clean-up (in-process gc with lease 0, everything stopped)
  the whole stream prefix is too.

Child modes (used by the harness): `torture.py cli ARGS...`, `torture.py pyreader ...`,
`torture.py mntreader ...`.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
THIS = str(Path(__file__).resolve())
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from cliutil import cursor_position  # noqa: E402

CHILD_MODES = ("cli", "pyreader", "mntreader")


def _hash(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


# =================================================================================================
# Child processes
# =================================================================================================


class _LoggedCounter(Counter):  # type: ignore[type-arg]
    """FaultyStore.injected that also appends every injection to a file (survives SIGKILL)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def __setitem__(self, key: str, value: int) -> None:
        super().__setitem__(key, value)
        os.write(self._fd, f"{key}\n".encode())


def _timeout_hook(store: Any, probability: float, seconds: float, rng: random.Random) -> Any:
    """A FaultyStore hook: with `probability`, hang for `seconds`, then fail (a request timeout)."""

    async def hook(op: str, key: str) -> None:
        if probability and rng.random() < probability:
            import anyio

            from lakestream import StoreUnavailable

            store.injected[f"{op}:timeout"] += 1
            await anyio.sleep(seconds)
            raise StoreUnavailable(f"{store.url}: injected timeout of {op} {key!r} after {seconds:g}s")

    return hook


def _install_faults() -> None:
    """In a child: inject the faults of LAKESTREAM_FAULTS into every store it opens
    (`lakestream.testing.inject_faults`), count them in TORTURE_FAULT_LOG and add the timeouts of
    TORTURE_TIMEOUTS=probability:seconds:seed."""
    spec = os.environ.get("LAKESTREAM_FAULTS")
    if not spec:
        return
    from lakestream.testing import FaultyStore, inject_faults

    log_path = os.environ.get("TORTURE_FAULT_LOG")
    timeouts = os.environ.get("TORTURE_TIMEOUTS")

    def configure(faulty: FaultyStore) -> None:
        if log_path:
            faulty.injected = _LoggedCounter(log_path)
        if timeouts:
            p, s, seed = timeouts.split(":")
            faulty.hook = _timeout_hook(faulty, float(p), float(s), random.Random(int(seed)))

    inject_faults(spec, configure)


class _Journal:
    """One JSON line per consumed step or event, appended with one write(2) each."""

    def __init__(self, path: str, slot: str, inc: int) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.slot, self.inc = slot, inc

    def write(self, record: dict[str, Any]) -> None:
        record = {"t": time.time(), "slot": self.slot, "inc": self.inc, **record}
        os.write(self.fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())

    def event(self, event: str, **kw: Any) -> None:
        self.write({"event": event, "pid": os.getpid(), **kw})


def _child_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url")
    ap.add_argument("--mnt")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--start", type=int, required=True)
    ap.add_argument("--journal", required=True)
    ap.add_argument("--slot", required=True)
    ap.add_argument("--inc", type=int, required=True)
    return ap.parse_args(argv)


def _pyreader(argv: list[str]) -> int:
    import anyio

    import lakestream

    a = _child_args(argv)
    j = _Journal(a.journal, a.slot, a.inc)
    j.event("start", step=a.start)
    at = a.start

    async def run() -> None:
        nonlocal at
        async with lakestream.open_store(a.url) as store, lakestream.open_reader(store, a.rank, raw=True) as r:
            async for b in r.steps(a.start):
                samples = [
                    [s["__key__"], sorted([f, _hash(v), len(v)] for f, v in s.items() if f != "__key__")]
                    for s in b.samples
                ]
                j.write({"step": b.step, "version": b.version, "producer": b.producer, "rank": a.rank,
                         "samples": samples})  # fmt: skip
                at = b.step + 1

    try:
        anyio.run(run)
    except lakestream.StepUnavailable as e:
        j.event("unavailable", step=at, error=str(e))
        print(f"pyreader: StepUnavailable at step {at}: {e}", file=sys.stderr)
        return 3
    except Exception as e:
        j.event("error", step=at, error=f"{type(e).__name__}: {e}")
        traceback.print_exc()
        return 1
    return 0


def _mount_instance(mnt: str) -> tuple[int | None, dict[str, Any] | None]:
    """(mount instance id: the mtime every file of a mount carries, _status.json), or (None, None)."""
    path = os.path.join(mnt, "_status.json")
    try:
        mtime = os.stat(path).st_mtime_ns
        with open(path, "rb") as f:
            return mtime, json.loads(f.read())
    except (OSError, ValueError):
        return None, None


def _mntreader(argv: list[str]) -> int:
    """Read rank `--rank`'s steps from `--start` on through the mount with plain os/open calls.

    An error is retried; it is journaled as an error only if the mount was up, the same instance,
    before and after it (a SIGKILLed mount daemon is the harness's doing, not a reader failure),
    and the step is retained and committed.
    """
    a = _child_args(argv)
    j = _Journal(a.journal, a.slot, a.inc)
    j.event("start", step=a.start)
    step = a.start
    failures: Counter[int] = Counter()
    while True:
        inst, _status = _mount_instance(a.mnt)
        if inst is None:
            time.sleep(0.05)
            continue
        d = os.path.join(a.mnt, f"rank-{a.rank}", f"{step:012d}")
        try:
            names = sorted(os.listdir(d))
            with open(os.path.join(d, "_meta.json"), "rb") as f:
                meta = json.loads(f.read())
            data: dict[str, bytes] = {}
            for name in names:
                if name != "_meta.json":
                    with open(os.path.join(d, name), "rb") as f:
                        data[name] = f.read()
            with open(os.path.join(d, "_meta.json"), "rb") as f:
                meta2 = json.loads(f.read())
        except OSError as e:
            inst2, status2 = _mount_instance(a.mnt)
            if inst2 is None or inst2 != inst:
                time.sleep(0.05)  # the mount went away (killed daemon): wait for the next one
                continue
            assert status2 is not None
            if e.errno == errno.ENOENT and step > status2["head_step"]:
                continue  # the lookup's wait for the step ran out: look again
            if e.errno == errno.ENOENT and step < status2["first_step"]:
                j.event("reclaimed", step=step, error=str(e), first_step=status2["first_step"])
                return 4
            failures[step] += 1
            if failures[step] == 3:  # not a race with the status (head, first step) we looked at
                j.event("error", step=step, errno=e.errno, error=str(e), status={
                    k: status2.get(k) for k in ("head_step", "first_step", "version")})  # fmt: skip
            time.sleep(0.1)
            continue
        problem = None
        if meta != meta2:
            problem = f"_meta.json changed during the read: version {meta.get('version')} -> {meta2.get('version')}"
        elif meta["step"] != step or meta["rank"] != a.rank:
            problem = f"_meta.json is for step {meta['step']} rank {meta['rank']}"
        elif set(data) != set(meta["files"]) or any(len(data[n]) != meta["files"][n] for n in data):
            problem = f"files {sorted(data)} do not match _meta.json {meta['files']}"
        if problem is not None:
            failures[step] += 1
            if failures[step] == 3:
                j.event("error", step=step, error=problem)
            time.sleep(0.1)
            continue
        fields: dict[str, list[list[Any]]] = defaultdict(list)
        for name, b in data.items():
            key, _, fld = name.partition(".")
            fields[key].append([fld, _hash(b), len(b)])
        samples = [[k, sorted(fields[k])] for k in meta["keys"]]
        j.write({
            "step": step, "version": meta["version"], "producer": meta["producer"], "rank": a.rank,
            "epoch": meta["epoch"], "seq": meta["seq"], "segment": meta["segment"], "samples": samples,
        })  # fmt: skip
        step += 1


def child_main(argv: list[str]) -> int:
    mode, rest = argv[0], argv[1:]
    _install_faults()
    if mode == "cli":
        from lakestream._cli import main

        return main(rest)
    if mode == "pyreader":
        return _pyreader(rest)
    if mode == "mntreader":
        return _mntreader(rest)
    raise SystemExit(f"unknown child mode {mode!r}")


# =================================================================================================
# The harness
# =================================================================================================


@dataclass
class Config:
    seconds: float = 45.0  # chaos phase
    seed: int = 1
    producers: int = 4
    world_size: int = 2
    global_batch: int = 8
    rate: float = 10.0  # samples per second per producer during the chaos phase
    samples: int = 0  # per producer (0: from rate and seconds)
    max_bin: int = 4000  # bytes of a sample's random `bin` field, at most
    snapshot_every: int = 16
    keep_checkpoints: int = 3
    max_steps_ahead: int = 0
    checkpoint_every: int = 6  # steps
    gc_every: float = 3.0  # seconds (jittered)
    orphan_grace: float = 30.0  # 5 s lost data in a long run (upload-to-commit latency reached 12 s)
    producer_kill_every: float = 2.5  # mean seconds between SIGKILLs of some producer
    reader_kill_every: float = 6.0  # ... of some reader process
    mount_kill_every: float = 20.0  # ... of the mount daemon
    gc_kill_probability: float = 0.2
    restart_delay: float = 1.0  # at most, uniform
    faults: str = "ambiguous=0.02,fail=0.02"  # LAKESTREAM_FAULTS without the seed ('' for none)
    timeout_probability: float = 0.003
    timeout_seconds: float = 1.0
    mount: bool = True
    rewind_at: float = 0.5  # fraction of the chaos phase
    drain_timeout: float = 900.0  # at most, in all; with back-pressure the drain moves at the trainer's pace
    drain_stall: float = 60.0  # the drain fails once neither the head nor any reader moved for this long
    rewind_notice_timeout: float = 30.0

    def samples_per_producer(self) -> int:
        return self.samples or int(self.rate * self.seconds * 1.3) + 40


@dataclass
class Child:
    kind: str
    name: str
    inc: int
    popen: subprocess.Popen[bytes]
    log: Path
    started: float  # time.monotonic()
    started_wall: float
    killed: bool = False

    def poll(self) -> int | None:
        return self.popen.poll()

    def kill(self, wait: bool = True) -> bool:
        """SIGKILL. A process blocked in a FUSE request the daemon is serving (a lookup waiting for
        a step) dies only once the daemon answers: `wait=False` does not wait for that."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.killed = True
            if wait:
                self.popen.wait()
            return True
        return False

    def text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, n: int = 15) -> str:
        return "\n".join(self.text().splitlines()[-n:])


@dataclass
class ProducerSlot:
    pid: str
    src: Path
    files: int
    inflight: int
    policy: str
    child: Child | None = None
    state: str = "restart"  # running, restart (at restart_at), done
    restart_at: float = 0.0
    drain: bool = False
    incarnations: int = 0
    kills: int = 0
    fenced: int = 0
    expect_resume: int | None = None  # cursor the next incarnation must resume at (after a rewind)


@dataclass
class ReaderSlot:
    name: str
    kind: str  # py or mnt
    rank: int
    journal: Path
    child: Child | None = None
    state: str = "restart"  # running, restart, held (until the mount shows a rewind), stopped
    restart_at: float = 0.0
    frontier: int = -1  # every step up to here consumed, in the current history
    consumed: dict[int, int] = field(default_factory=dict)  # step -> version last consumed
    reads: dict[tuple[int, int], float] = field(default_factory=dict)  # (step, version) -> first read (wall)
    offset: int = 0
    buf: bytes = b""
    entries: int = 0
    kills: int = 0
    restarts: int = 0
    rewind_exits: int = 0
    saw_discarded_at: float | None = None  # monotonic time it consumed a step a rewind discarded
    incarnations: int = 0
    failed: int = 0


@dataclass
class Report:
    ok: bool
    failures: list[str]
    warnings: list[str]
    figures: dict[str, Any]
    workdir: str

    def summary(self) -> str:
        f = self.figures
        lines = [
            f"torture: {'OK' if self.ok else 'FAILED'}  seed {f.get('seed')}  duration {f.get('duration_s', 0):.1f} s "
            f"(chaos {f.get('chaos_s', 0):.1f} s, drain {f.get('drain_s', 0):.1f} s, "
            f"checks {f.get('check_s', 0):.1f} s)",
        ]
        for k, v in f.items():
            if k not in ("seed",):
                lines.append(f"  {k}: {v}")
        for w in self.warnings:
            lines.append(f"  WARNING: {w}")
        for x in self.failures:
            lines.append(f"  FAIL: {x}")
        return "\n".join(lines)


REGISTERED = re.compile(r"producer (\S+) registered epoch (\d+), resuming at (.*)")  # the cursor as JSON


def parse_faults(spec: str) -> dict[str, float]:
    kv = dict(item.split("=", 1) for item in spec.split(",") if item)
    return {"ambiguous": float(kv.get("ambiguous", 0)), "fail": float(kv.get("fail", 0))}


class Torture:
    def __init__(self, cfg: Config, url: str, env: dict[str, str], workdir: Path, *, log: Any = None) -> None:
        self.cfg = cfg
        self.url = url
        self.workdir = workdir
        self.rng = random.Random(cfg.seed)
        self.out = log or (lambda msg: print(msg, flush=True))
        ours = ("LAKESTREAM_FAULTS", "TORTURE_FAULT_LOG", "TORTURE_TIMEOUTS")
        self.env = {k: v for k, v in os.environ.items() if k not in ours}
        self.env.update(env)
        self.env["PYTHONUNBUFFERED"] = "1"
        self.logs = workdir / "logs"
        self.faultlogs = workdir / "faults"
        self.journals = workdir / "journals"
        for d in (self.logs, self.faultlogs, self.journals):
            d.mkdir(parents=True, exist_ok=True)
        self.mnt = workdir / "mnt"
        self.failures: list[str] = []
        self.warnings: list[str] = []
        self.incs: Counter[str] = Counter()
        self.children: list[Child] = []
        # the follower's view of the history
        self.history: dict[int, Any] = {}  # step -> Step (current history, reclaimed steps included)
        self.seen: dict[tuple[int, int], Any] = {}  # (step, version) -> Step, every TGB ever observed
        self.seen_at: dict[tuple[int, int], float] = {}  # wall time first observed
        self.by_segment: dict[str, tuple[int, int]] = {}
        self.discarded: set[tuple[int, int]] = set()
        self.reclaimed_at: dict[int, float] = {}
        self.first_step = 0
        self.rewinds_seen = 0
        self.latencies: list[float] = []  # commit record ts - segment upload time
        self.late_commits: list[tuple[int, int, str, float]] = []  # committed later than the orphan grace
        # (step, version, rank) -> (digest, samples, producer), as first read
        self.contents: dict[tuple[int, int, int], tuple[str, list[Any], str]] = {}
        self.checkpoints: list[tuple[str, int, float]] = []  # (id, step, wall time before the call)
        self.last_checkpoint = -1
        self.events: list[dict[str, Any]] = []
        self.meta_seen: dict[tuple[int, int], tuple[str, int, int, str]] = {}
        self.fig: dict[str, Any] = {}
        self.counts: Counter[str] = Counter()
        self.gc_child: Child | None = None
        self.gc_before: dict[str, int] = {}
        self.gc_kill_at: float | None = None
        self.gc_seconds: list[float] = []
        self.next_gc = 0.0
        self.mount_child: Child | None = None
        self.mount_state = "restart"
        self.mount_restart_at = 0.0
        self.mount_ready = False
        self.rewind_info: dict[str, Any] | None = None
        self.fenced_below: dict[str, int] = {}  # producer -> first epoch after the rewind
        self.rewind_version: int | None = None
        self.rewind_wall: float | None = None
        self.rewind_mono: float | None = None
        self.chaos = False
        self.draining = False
        self.abort = False
        self.t0 = time.monotonic()
        self.bucket, _, self.prefix = url[len("s3://") :].partition("/")
        self.prefix = self.prefix.strip("/")

    # -- processes ---------------------------------------------------------------------------

    def spawn(self, kind: str, name: str, args: list[str], *, faults: bool = True) -> Child:
        self.incs[name] += 1
        n = self.incs[name]
        logp = self.logs / f"{name}.{n}.log"
        env = dict(self.env)
        if faults and self.cfg.faults:
            seed = self.rng.randrange(1, 1 << 31)
            env["LAKESTREAM_FAULTS"] = f"{self.cfg.faults},seed={seed}"
            env["TORTURE_FAULT_LOG"] = str(self.faultlogs / f"{name}.{n}.log")
            env["TORTURE_TIMEOUTS"] = f"{self.cfg.timeout_probability}:{self.cfg.timeout_seconds}:{seed + 1}"
        with open(logp, "wb") as f:
            popen = subprocess.Popen(
                [sys.executable, THIS, *args], env=env, stdout=f, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, cwd=self.workdir,
            )  # fmt: skip
        child = Child(kind, name, n, popen, logp, time.monotonic(), time.time())
        self.children.append(child)
        return child

    async def run_cli(
        self, *args: Any, faults: bool = True, timeout: float = 120.0, name: str = "cli"
    ) -> tuple[int, str]:
        import anyio

        child = self.spawn("cli", name, ["cli", *map(str, args)], faults=faults)
        deadline = time.monotonic() + timeout
        while child.poll() is None:
            if time.monotonic() > deadline:
                child.kill()
                return -9, child.text() + "\n(timed out)"
            await anyio.sleep(0.02)
        return child.popen.returncode, child.text()

    def now(self) -> float:
        return time.monotonic() - self.t0

    # -- in-process store ----------------------------------------------------------------------

    def faulty(self, inner: Any, seed: int) -> Any:
        from lakestream.testing import FaultyStore

        f = parse_faults(self.cfg.faults) if self.cfg.faults else {"ambiguous": 0.0, "fail": 0.0}
        store = FaultyStore(inner, ambiguous_put=f["ambiguous"], fail_before=f["fail"], rng=random.Random(seed))
        if self.cfg.faults:
            rng = random.Random(seed + 1)
            store.hook = _timeout_hook(store, self.cfg.timeout_probability, self.cfg.timeout_seconds, rng)
        self.inproc.append(store)
        return store

    # -- the follower --------------------------------------------------------------------------

    def observe(self, st: Any) -> None:
        """Fold the follower's new state into the history."""
        now = time.time()
        if st.first_step > self.first_step:
            for s in range(self.first_step, st.first_step):
                self.reclaimed_at.setdefault(s, now)
            self.first_step = st.first_step
        if st.rewinds != self.rewinds_seen:
            self.rewinds_seen = st.rewinds
            for s in sorted(self.history):
                if s < st.first_step:
                    continue
                e = st.step(s)
                if e is None or e.version != self.history[s].version:
                    self.discarded.add((s, self.history[s].version))
                    del self.history[s]
            for slot in self.readers:
                slot.frontier = min(slot.frontier, st.head)
        start = max(st.first_step, max(self.history, default=-1) + 1)
        for s in range(start, st.head + 1):
            e = st.step(s)
            self.history[s] = e
            key = (s, e.version)
            if key not in self.seen:
                self.seen[key] = e
                self.by_segment[e.segment] = key
                self.seen_at[key] = now
                up = _upload_time(e.segment)
                if up is not None:
                    self.latencies.append(e.ts - up)
                    if e.ts - up > self.cfg.orphan_grace:  # GC could have deleted it before the commit
                        self.late_commits.append((s, e.version, e.producer, round(e.ts - up, 2)))

    async def follow(self) -> None:
        import anyio

        import lakestream

        while True:
            try:
                t = time.monotonic()
                async with self.manifest_lock:
                    await self.manifest.refresh()
                if time.monotonic() - t > 5:
                    self.out(f"[{self.now():7.1f}] follower: a refresh took {time.monotonic() - t:.1f} s")
            except lakestream.StoreError as e:
                self.counts["follower_errors"] += 1
                self.out(f"[{self.now():7.1f}] follower: {e}")
            self.observe(self.manifest.state)
            await anyio.sleep(0.05)

    async def refresh(self) -> Any:
        import lakestream

        for _ in range(20):
            try:
                async with self.manifest_lock:
                    await self.manifest.refresh()
                break
            except lakestream.StoreError:
                continue
        self.observe(self.manifest.state)
        return self.manifest.state

    # -- journals ------------------------------------------------------------------------------

    def tail(self, slot: ReaderSlot) -> None:
        try:
            with open(slot.journal, "rb") as f:
                f.seek(slot.offset)
                data = f.read()
        except FileNotFoundError:
            return
        slot.offset += len(data)
        lines = (slot.buf + data).split(b"\n")
        slot.buf = lines.pop()
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                self.failures.append(f"{slot.name}: malformed journal line {line[:200]!r}")
                continue
            if "event" in rec:
                self.on_event(slot, rec)
            else:
                self.on_entry(slot, rec)

    def on_entry(self, slot: ReaderSlot, rec: dict[str, Any]) -> None:
        step, version, rank = rec["step"], rec["version"], rec["rank"]
        samples = rec["samples"]
        digest = _hash(json.dumps(samples, separators=(",", ":")).encode())
        key = (step, version, rank)
        have = self.contents.get(key)
        if have is None:
            self.contents[key] = (digest, samples, rec["producer"])
        elif have[0] != digest or have[2] != rec["producer"]:
            self.failures.append(
                f"{slot.name}: step {step} version {version} rank {rank}: producer {rec['producer']} / samples "
                f"differ from an earlier read ({have[2]})"
            )
        if rank != slot.rank:
            self.failures.append(f"{slot.name}: read rank {rank}, expected {slot.rank}")
        if "segment" in rec:  # the mount's _meta.json names the TGB: it must be the one the log has
            self.meta_seen[(step, version)] = (rec["producer"], rec["epoch"], rec["seq"], rec["segment"])
        slot.consumed[step] = version
        slot.reads.setdefault((step, version), rec["t"])
        slot.entries += 1
        if (step, version) in self.discarded and slot.saw_discarded_at is None:
            slot.saw_discarded_at = time.monotonic()

    def on_event(self, slot: ReaderSlot, rec: dict[str, Any]) -> None:
        rec = dict(rec, reader=slot.name)
        self.events.append(rec)
        if rec["event"] == "start":
            return
        error = rec.get("error", "")[:300]
        self.out(f"[{self.now():7.1f}] {slot.name}: {rec['event']} at step {rec.get('step')}: {error}")

    def on_discarded(self, event: dict[str, Any]) -> bool:
        """Whether a reader's error names the segment of a TGB a rewind discarded."""
        m = re.search(r"object (segments/\S+?\.tgb)", event.get("error", ""))
        return m is not None and self.by_segment.get(m[1]) in self.discarded

    def advance(self, slot: ReaderSlot) -> None:
        f = slot.frontier
        while True:
            e = self.history.get(f + 1)
            if e is None or slot.consumed.get(f + 1) != e.version:
                break
            f += 1
        slot.frontier = f

    # -- producers -----------------------------------------------------------------------------

    def start_producer(self, p: ProducerSlot) -> None:
        args = ["cli", "-v", "produce", self.url, "--producer-id", p.pid, "--from-dir", str(p.src),
                "--max-inflight-bytes", str(p.inflight), "--commit-policy", p.policy]  # fmt: skip
        if not p.drain and self.cfg.rate > 0:
            args += ["--rate", str(self.cfg.rate)]
        if p.drain:  # no rate, and TGBs pipelined into group commits: the drain is over quickly
            args[args.index("--max-inflight-bytes") + 1] = str(1 << 20)
        p.child = self.spawn("producer", p.pid, args)
        p.state = "running"
        p.incarnations += 1

    def kill_producer(self, p: ProducerSlot, *, count: bool = True) -> None:
        assert p.child is not None
        if p.child.poll() is not None:  # it exited on its own first: handle that
            self.on_producer_exit(p)
            return
        p.child.kill()
        if count:
            p.kills += 1
            self.counts["kills_producer"] += 1
        self.check_resume(p)
        p.state = "restart"
        p.restart_at = time.monotonic() + self.rng.uniform(0, self.cfg.restart_delay)

    def check_resume(self, p: ProducerSlot) -> None:
        """After a rewind, the first incarnation that registers must resume at the rewind's cursor."""
        if p.expect_resume is None or p.child is None or self.rewind_mono is None:
            return
        m = REGISTERED.search(p.child.text())
        if m is None or self.registered_before_rewind(p, m):
            return
        got = cursor_position(json.loads(m[3]))
        if got != p.expect_resume:
            self.failures.append(f"{p.pid}: after the rewind it resumed at {got}, expected {p.expect_resume}")
        else:
            self.counts["resumes_checked_after_rewind"] += 1
        p.expect_resume = None

    def registered_before_rewind(self, p: ProducerSlot, m: re.Match[str]) -> bool:
        """Whether this incarnation registered before the rewind landed, by its epoch (the rewind
        raises every producer's epoch); one started while the rewind command ran may have."""
        return int(m[2]) < self.fenced_below.get(p.pid, 1 << 62)

    def on_producer_exit(self, p: ProducerSlot) -> None:
        assert p.child is not None
        rc = p.child.popen.returncode
        self.check_resume(p)
        if rc == 0:
            m = REGISTERED.search(p.child.text())
            if m is not None and p.pid in self.fenced_below and int(m[2]) < self.fenced_below[p.pid]:
                self.failures.append(f"{p.pid} epoch {m[2]}, fenced by the rewind, exited 0\n{p.child.tail()}")
            p.state = "done"
            return
        text = p.child.text()
        m = REGISTERED.search(text)
        if (
            rc > 0
            and "fenced" in text
            and self.rewind_mono is not None
            and (m is None or self.registered_before_rewind(p, m))
        ):
            p.fenced += 1
            self.counts["fenced_exits"] += 1
        elif rc < 0:
            self.failures.append(f"{p.pid} incarnation {p.child.inc}: signal {-rc}, not ours\n{p.child.tail()}")
        else:
            self.failures.append(f"{p.pid} incarnation {p.child.inc}: exit {rc}\n{p.child.tail()}")
        p.state = "restart"
        p.restart_at = time.monotonic() + self.rng.uniform(0, self.cfg.restart_delay)

    # -- readers -------------------------------------------------------------------------------

    def start_reader(self, r: ReaderSlot) -> None:
        start = r.frontier + 1
        if start < self.first_step:
            self.failures.append(f"{r.name}: would restart at step {start}, below the first step {self.first_step}")
            r.state = "stopped"
            return
        r.incarnations += 1
        common = ["--rank", str(r.rank), "--start", str(start), "--journal", str(r.journal), "--slot", r.name,
                  "--inc", str(r.incarnations)]  # fmt: skip
        if r.kind == "py":
            r.child = self.spawn("reader", r.name, ["pyreader", "--url", self.url, *common])
        else:
            r.child = self.spawn("reader", r.name, ["mntreader", "--mnt", str(self.mnt), *common], faults=False)
        r.state = "running"
        r.saw_discarded_at = None
        if r.incarnations > 1:
            r.restarts += 1
            self.counts["restarts_reader"] += 1

    def kill_reader(self, r: ReaderSlot, *, count: bool = True, hold: bool = False) -> None:
        assert r.child is not None
        if r.child.poll() is not None:  # it exited on its own first
            self.on_reader_exit(r)
            if hold:
                r.state = "held"
            return
        if r.child.kill(wait=r.kind == "py") and count:
            r.kills += 1
            self.counts[f"kills_{r.kind}reader"] += 1
        self.tail(r)
        r.state = "held" if hold else "restart"
        r.restart_at = time.monotonic() + self.rng.uniform(0, self.cfg.restart_delay)

    def on_reader_exit(self, r: ReaderSlot) -> None:
        assert r.child is not None
        rc = r.child.popen.returncode
        self.tail(r)
        text = r.child.text()
        last_error = next((e for e in reversed(self.events) if e["reader"] == r.name and e["event"] == "error"), None)
        if r.kind == "py" and rc == 3 and "discarded by a rewind" in text and r.saw_discarded_at is not None:
            r.rewind_exits += 1
            self.counts["reader_rewind_exits"] += 1
            r.saw_discarded_at = None
        elif (
            r.kind == "py"
            and rc == 1
            and last_error is not None
            and (
                self.on_discarded(last_error)
                or ("does not follow" in last_error.get("error", "") and r.saw_discarded_at is not None)
            )
        ):
            last_error["tolerated"] = True
            self.counts["reader_errors_on_discarded_steps"] += 1
            msg = (
                "a Python reader still on the history a rewind discarded failed with CorruptData ('the segment "
                "of a committed step is missing': GC had deleted the discarded step's segment) instead of "
                "StepUnavailable"
                if "does not follow" not in last_error.get("error", "")
                else "a Python reader still on the history a rewind discarded failed with ValueError 'apply: version "
                "N does not follow N' (fetch tasks refreshing the manifest concurrently)"
            )
            if msg not in self.warnings:
                self.warnings.append(msg)
        else:
            self.failures.append(f"{r.name} incarnation {r.child.inc}: exit {rc}\n{r.child.tail()}")
            r.failed += 1
            if r.failed >= 3:
                self.failures.append(f"{r.name} failed 3 times: stopping the run")
                r.state = "stopped"
                self.abort = True
                return
        r.state = "restart"
        r.restart_at = time.monotonic() + self.rng.uniform(0, self.cfg.restart_delay)

    # -- mount ---------------------------------------------------------------------------------

    def start_mount(self) -> None:
        self.unmount()
        self.mnt.mkdir(exist_ok=True)
        args = ["cli", "mount", self.url, str(self.mnt), "--ranks", "all", "--world-size", str(self.cfg.world_size),
                "--wait", "5"]  # fmt: skip
        self.mount_child = self.spawn("mount", "mount", args)
        self.mount_state = "starting"
        self.mount_ready = False

    def unmount(self) -> None:
        from mountutil import is_mounted

        if self.mnt.exists() and is_mounted(self.mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], capture_output=True, timeout=30)

    def kill_mount(self) -> None:
        assert self.mount_child is not None
        if self.mount_child.kill(wait=False):
            self.counts["kills_mount"] += 1
        self.reap_mount(self.mount_child, 5.0)
        self.unmount()
        self.mount_state = "restart"
        self.mount_ready = False
        self.mount_restart_at = time.monotonic() + self.rng.uniform(0, self.cfg.restart_delay)

    def reap_mount(self, child: Child, timeout: float) -> None:
        """Wait for a killed mount daemon. One killed while a thread of it waited in the kernel on
        a reader's request (an entry invalidation after the rewind, blocked by a lookup waiting
        for a step) cannot finish exiting, and its readers wait forever: abort its FUSE
        connection, as an operator would (`lakestream umount --force`), and count it."""
        from lakestream_mount import abort_connection

        try:
            child.popen.wait(timeout)
            return
        except subprocess.TimeoutExpired:
            pass
        if abort_connection(str(self.mnt)):
            self.counts["mount_connections_aborted"] += 1
        try:
            child.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.failures.append(
                f"mount daemon {child.name}.{child.inc} did not exit, even after its FUSE connection was aborted"
            )

    async def mount_status(self) -> dict[str, Any] | None:
        import anyio
        import anyio.to_thread

        with anyio.move_on_after(2):
            _, status = await anyio.to_thread.run_sync(_mount_instance, str(self.mnt), abandon_on_cancel=True)
            return status
        return None

    # -- GC ------------------------------------------------------------------------------------

    def list_objects(self) -> dict[str, int]:
        """Every object under the stream prefix: {key relative to the prefix: size}."""
        root = self.prefix + "/" if self.prefix else ""
        out: dict[str, int] = {}
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=root):
            for o in page.get("Contents", ()):
                out[o["Key"][len(root) :]] = o["Size"]
        return out

    async def start_gc(self) -> None:
        import anyio.to_thread

        self.gc_before = await anyio.to_thread.run_sync(self.list_objects)
        self.gc_child = self.spawn(
            "gc", "gc", ["cli", "gc", self.url, "--orphan-grace", str(self.cfg.orphan_grace), "--force-grace"]
        )
        self.gc_kill_at = None
        if self.chaos and self.rng.random() < self.cfg.gc_kill_probability:
            self.gc_kill_at = time.monotonic() + self.rng.uniform(0.3, 1.2)

    async def on_gc_exit(self) -> None:
        import anyio.to_thread

        assert self.gc_child is not None
        rc = self.gc_child.popen.returncode
        after = await anyio.to_thread.run_sync(self.list_objects)
        self.account_deleted(self.gc_before, after)
        text = self.gc_child.text()
        self.gc_seconds.append(time.monotonic() - self.gc_child.started)
        if m := re.search(r"\((\d+) recent uploads kept\)", text):
            self.counts["gc_recent_uploads_kept"] += int(m[1])
        if rc == 0:
            self.counts["gc_ok"] += 1
        elif self.gc_child.killed:
            self.counts["gc_killed"] += 1
        elif "injected" in text:
            self.counts["gc_failed_injected_fault"] += 1
        else:
            self.failures.append(f"gc exit {rc}\n{self.gc_child.tail()}")
        self.gc_child = None
        self.next_gc = time.monotonic() + self.rng.uniform(0.5, 1.5) * self.cfg.gc_every

    def account_deleted(self, before: dict[str, int], after: dict[str, int]) -> None:
        for k, size in before.items():
            if k not in after:
                kind = (
                    "segments" if k.startswith("segments/") else "log" if "/log/" in k
                    else "snapshots" if "/snapshots/" in k else "other"
                )  # fmt: skip
                self.counts[f"deleted_{kind}"] += 1
                self.counts[f"deleted_{kind}_bytes"] += size

    # -- checkpoints and the rewind -----------------------------------------------------------

    async def maybe_checkpoint(self) -> None:
        import lakestream

        # A trainer checkpoints every `checkpoint_every` steps: at the next multiple after the
        # newest retained checkpoint, once every reader has consumed it.
        frontier = min(r.frontier for r in self.readers)
        last = self.last_checkpoint  # a rewind drops the checkpoints after its step: its step then
        c = max(last + self.cfg.checkpoint_every, self.first_step)
        if frontier < c or c not in self.history:
            return
        # the invariant the lifecycle relies on: every reader consumed every step up to c
        for r in self.readers:
            for s in range(max(self.first_step, last + 1), c + 1):
                assert r.consumed.get(s) == self.history[s].version, (r.name, s)
        cid = f"ck-{len(self.checkpoints) + 1:04d}"
        t = time.time()
        try:
            await lakestream.checkpoint(self.store, cid, c)
        except Exception as e:
            self.failures.append(f"checkpoint {cid} at step {c}: {type(e).__name__}: {e}")
            return
        self.checkpoints.append((cid, c, t))
        self.last_checkpoint = c

    async def rewind(self) -> None:
        import anyio

        st = await self.refresh()
        if not st.checkpoints:
            return
        ck = self.rng.choice(st.checkpoints)
        head_before, rewinds_before = st.head, st.rewinds
        self.out(f"[{self.now():7.1f}] rewind to checkpoint {ck.id} at step {ck.step} (head {head_before})")
        # the trainer stops: the mount readers stop; the Python readers are left to notice
        for r in self.readers:
            if r.kind == "mnt" and r.state == "running":
                self.kill_reader(r, count=False, hold=True)
            elif r.kind == "mnt":
                r.state = "held"
        self.rewind_mono = time.monotonic()
        self.rewind_wall = time.time()
        rc, text = await self.run_cli("rewind", self.url, "--to-checkpoint", ck.id, name="rewind")
        if rc != 0:
            self.failures.append(f"rewind exit {rc}\n{text}")
        st = await self.refresh()
        applied = st.rewinds - rewinds_before
        self.rewind_info = {"to_checkpoint": ck.id, "to_step": ck.step, "head_before": head_before,
                            "discarded_steps": head_before - ck.step, "records_applied": applied}  # fmt: skip
        self.rewind_version = st.version
        self.last_checkpoint = ck.step
        for r in self.readers:
            if r.kind == "py" and r.state == "running" and any(s > ck.step for s in r.consumed):
                r.saw_discarded_at = time.monotonic()  # it must raise StepUnavailable (or be killed first)
        if applied != 1:
            self.warnings.append(
                f"one `lakestream rewind` call applied {applied} rewind records (an ambiguous put of the rewind "
                "record is not recognised on retry: the rewind is applied again)"
            )
        if st.head != ck.step:
            self.failures.append(f"after the rewind the head is {st.head}, not the checkpoint's step {ck.step}")
        # each producer resumes from its cursor as of the checkpoint's step
        last: dict[str, Any] = {}
        for s in range(0, ck.step + 1):
            e = self.history.get(s)
            if e is not None:
                last[e.producer] = e
        for p in self.producers:
            ps = st.producers.get(p.pid)
            if ps is not None:
                self.fenced_below[p.pid] = ps.epoch
            want = last[p.pid].cursor if p.pid in last else None
            if ps is not None and ps.cursor != want:
                self.failures.append(f"after the rewind {p.pid}'s cursor is {ps.cursor}, expected {want}")
            p.expect_resume = cursor_position(want)
            if p.state == "done":
                p.state = "restart"
                p.restart_at = time.monotonic()
            elif p.state == "restart":
                pass
            # a running producer must now exit with "fenced": on_producer_exit checks it
        await anyio.lowlevel.checkpoint()

    # -- the main loop -------------------------------------------------------------------------

    async def tick_processes(self) -> None:
        mono = time.monotonic()
        for p in self.producers:
            if p.state == "running" and p.child is not None and p.child.poll() is not None:
                self.on_producer_exit(p)
            if p.state == "restart" and mono >= p.restart_at:
                self.start_producer(p)
        if self.cfg.mount:
            m = self.mount_child
            if self.mount_state in ("starting", "running") and m is not None and m.poll() is not None:
                self.failures.append(f"mount daemon exited {m.popen.returncode}\n{m.tail()}")
                self.unmount()
                self.mount_state = "restart"
                self.mount_restart_at = mono + 1.0
            if self.mount_state == "restart" and mono >= self.mount_restart_at:
                self.start_mount()
            if self.mount_state == "starting":
                status = await self.mount_status()
                if status is not None:
                    self.mount_state = "running"
                    self.mount_ready = True
                    self.counts["mount_starts"] += 1
        for r in self.readers:
            self.tail(r)
            if r.state == "running" and r.child is not None and r.child.poll() is not None:
                self.on_reader_exit(r)
            if r.state == "held" and self.mount_ready and self.rewind_version is not None:
                status = await self.mount_status()
                if status is not None and status["version"] >= self.rewind_version and status["head_step"] >= 0:
                    r.state = "restart"
                    r.restart_at = mono
            if r.state == "restart" and mono >= r.restart_at:
                self.start_reader(r)
            self.advance(r)
            # a Python reader that consumed a step the rewind discarded should raise StepUnavailable
            if (
                r.kind == "py" and r.state == "running" and r.saw_discarded_at is not None
                and mono - r.saw_discarded_at > self.cfg.rewind_notice_timeout
            ):  # fmt: skip
                self.warnings.append(
                    f"{r.name} had consumed steps a rewind discarded and had not raised StepUnavailable "
                    f"{self.cfg.rewind_notice_timeout:g} s later (it waits for its next step number to be "
                    "committed again before it checks): killed and restarted"
                )
                r.saw_discarded_at = None
                self.kill_reader(r, count=False)
        if self.gc_child is not None:
            if self.gc_kill_at is not None and mono >= self.gc_kill_at:
                self.gc_child.kill()
                self.gc_kill_at = None
            if self.gc_child.poll() is not None:
                await self.on_gc_exit()
        elif mono >= self.next_gc:
            await self.start_gc()

    def chaos_tick(self, schedule: dict[str, float]) -> None:
        mono = time.monotonic()
        if mono >= schedule["producer"]:
            schedule["producer"] = mono + self.rng.expovariate(1 / self.cfg.producer_kill_every)
            running = [p for p in self.producers if p.state == "running"]
            if running:
                self.kill_producer(self.rng.choice(running))
        if mono >= schedule["reader"]:
            schedule["reader"] = mono + self.rng.expovariate(1 / self.cfg.reader_kill_every)
            running = [r for r in self.readers if r.state == "running"]
            if running:
                self.kill_reader(self.rng.choice(running))
        if self.cfg.mount and mono >= schedule["mount"]:
            schedule["mount"] = mono + self.rng.expovariate(1 / self.cfg.mount_kill_every)
            if self.mount_state == "running":
                self.kill_mount()

    async def run(self) -> Report:
        import anyio
        import botocore.config
        import botocore.session
        from cliutil import make_source_dir

        import lakestream
        from lakestream._manifest import Manifest

        cfg = self.cfg
        t_start = time.monotonic()
        self.s3 = botocore.session.get_session().create_client(
            "s3", endpoint_url=self.env["AWS_ENDPOINT_URL"], region_name=self.env.get("AWS_REGION", "us-east-1"),
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
            config=botocore.config.Config(s3={"addressing_style": "path"}, retries={"total_max_attempts": 5}),
        )  # fmt: skip
        # sources: 4 directories of small files with known bytes
        n = cfg.samples_per_producer()
        src_rng = random.Random(cfg.seed * 7919 + 1)
        self.sources: dict[str, dict[str, bytes]] = {}
        self.producers = []
        policies = ["dac", "dac", "eager", "interval"]
        for k in range(cfg.producers):
            pid = f"prod-{k}"
            src = self.workdir / "src" / pid
            self.sources[pid] = make_source_dir(src, f"p{k}", n, src_rng, max_bin=cfg.max_bin)
            inflight = 1 if k % 2 else 64 << 10  # one TGB per commit, or a few pipelined
            self.producers.append(ProducerSlot(pid, src, len(self.sources[pid]), inflight, policies[k % len(policies)]))
        self.readers = [
            ReaderSlot(f"{kind}{rank}", kind, rank, self.journals / f"{kind}{rank}.jsonl")
            for kind in (("py", "mnt") if cfg.mount else ("py",))
            for rank in range(cfg.world_size)
        ]
        self.out(
            f"torture: seed {cfg.seed}, {cfg.seconds:g} s of chaos, {cfg.producers} producers x {n} samples "
            f"({sum(len(v) for v in self.sources.values())} files), world size {cfg.world_size}, global batch "
            f"{cfg.global_batch}, faults {cfg.faults or 'none'} + timeouts {cfg.timeout_probability:g}, "
            f"orphan grace {cfg.orphan_grace:g} s, max steps ahead {cfg.max_steps_ahead}, workdir {self.workdir}"
        )
        # init (with faults: create is retried until it says created or exists)
        for _attempt in range(10):
            rc, text = await self.run_cli(
                "init", self.url, "--world-size", cfg.world_size, "--global-batch", cfg.global_batch,
                "--snapshot-every", cfg.snapshot_every, "--keep-checkpoints", cfg.keep_checkpoints,
                "--max-steps-ahead", cfg.max_steps_ahead, name="init",
            )  # fmt: skip
            if rc == 0:
                break
            self.counts["init_retries"] += 1
        else:
            raise RuntimeError(f"init failed:\n{text}")

        self.inproc: list[Any] = []
        inner = lakestream.open_store(self.url)
        self.store = self.faulty(inner, cfg.seed * 1000 + 1)
        follower_store = self.faulty(inner, cfg.seed * 1000 + 2)
        self.manifest = Manifest(follower_store)
        self.manifest.on_apply = self.observe  # every version: a step a rewind discards at once is still seen
        self.manifest_lock = anyio.Lock()
        await self.manifest.load()
        self.observe(self.manifest.state)

        t_chaos = time.monotonic()
        self.fig["setup_s"] = round(t_chaos - t_start, 1)
        chaos_end = t_chaos + cfg.seconds
        rewind_time = t_chaos + cfg.rewind_at * cfg.seconds if cfg.rewind_at > 0 else None
        schedule = {
            "producer": t_chaos + self.rng.expovariate(1 / cfg.producer_kill_every),
            "reader": t_chaos + self.rng.expovariate(1 / cfg.reader_kill_every),
            # at least one mount kill in any run
            "mount": t_chaos + self.rng.uniform(0.15, 0.45) * cfg.seconds,
        }
        self.next_gc = t_chaos + cfg.gc_every
        self.chaos = True
        drain_deadline = None
        t_drain = None
        drain_moved: tuple[int, ...] = ()
        drain_last_move = time.monotonic()
        next_progress = time.monotonic() + 5.0
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.follow)
                while True:
                    await self.tick_processes()
                    await self.maybe_checkpoint()
                    mono = time.monotonic()
                    if self.chaos:
                        self.chaos_tick(schedule)
                        if rewind_time is not None and mono >= rewind_time:
                            if any(True for _ in self.manifest.state.checkpoints):
                                await self.rewind()
                                rewind_time = None
                            else:
                                rewind_time = mono + 1.0
                        if mono >= chaos_end:
                            self.chaos = False
                            self.draining = True
                            t_drain = mono
                            drain_deadline = mono + cfg.drain_timeout
                            drain_moved, drain_last_move = (), mono
                            self.out(f"[{self.now():7.1f}] chaos over; draining")
                            for p in self.producers:
                                p.drain = True
                                if p.state == "running":
                                    self.kill_producer(p, count=False)
                                    self.counts["drain_restarts"] += 1
                    else:
                        assert drain_deadline is not None
                        head = self.manifest.state.head
                        moved = (head, *(r.frontier for r in self.readers))
                        if moved != drain_moved:
                            drain_moved, drain_last_move = moved, mono
                        done = all(p.state == "done" for p in self.producers)
                        if done and all(r.frontier >= head for r in self.readers) and self.gc_child is None:
                            st = await self.refresh()
                            if st.head == head and all(r.frontier >= head for r in self.readers):
                                break
                        if mono > drain_deadline or mono - drain_last_move > cfg.drain_stall:
                            self.failures.append(
                                f"drain did not finish (it ran {mono - t_drain:.0f} s, the last "
                                f"{mono - drain_last_move:.0f} s without progress): producers "
                                f"{[(p.pid, p.state) for p in self.producers]}, head {head}, readers "
                                f"{[(r.name, r.state, r.frontier) for r in self.readers]}"
                            )
                            break
                    if self.abort:
                        break
                    if mono >= next_progress:
                        next_progress = mono + 5.0
                        self.progress()
                    await anyio.sleep(0.05)
                tg.cancel_scope.cancel()
            t_checks = time.monotonic()
            await self.finish()
            await self.verify()
        except Exception:
            self.failures.append(f"harness error:\n{traceback.format_exc()}")
            t_checks = time.monotonic()
        finally:
            self.cleanup()
            for s in self.inproc[:1]:
                with contextlib.suppress(Exception):
                    await s.aclose()
        end = time.monotonic()
        self.fig.update(
            {
                "seed": cfg.seed,
                "duration_s": round(end - t_start, 1),
                "chaos_s": round((t_drain or end) - t_chaos, 1),
                "drain_s": round(t_checks - (t_drain or t_checks), 1),
                "check_s": round(end - t_checks, 1),
            }
        )
        self.figures()
        return Report(not self.failures, self.failures, self.warnings, self.fig, str(self.workdir))

    def progress(self) -> None:
        st = self.manifest.state
        self.out(
            f"[{self.now():7.1f}] head {st.head} first {st.first_step} v{st.version}; producers "
            + " ".join(f"{p.pid[-1]}:{p.state[0]}" for p in self.producers)
            + "; readers "
            + " ".join(f"{r.name}:{r.state[0]}{r.frontier}" for r in self.readers)
            + f"; mount {self.mount_state}; ckpts {len(self.checkpoints)} "
            + ",".join(f"{c.id}@{c.step}" for c in st.checkpoints)
        )

    def cleanup(self) -> None:
        for c in self.children:
            c.kill()
        if self.cfg.mount:
            with contextlib.suppress(Exception):
                self.unmount()

    # -- the end -------------------------------------------------------------------------------

    async def finish(self) -> None:
        """Stop everything, run the final GC (no producer is alive: grace 0 is safe)."""
        import anyio

        for p in getattr(self, "producers", []):  # only after a failed drain is one still running
            if p.child is not None and p.child.kill():
                self.out(f"[{self.now():7.1f}] {p.pid} still running after the drain: killed")
        for r in self.readers:
            if r.child is not None:
                r.child.kill(wait=False)
        if self.mount_child is not None:
            # ending the daemon aborts the FUSE requests the killed mount readers may be blocked in
            self.unmount()
            self.mount_child.popen.send_signal(signal.SIGTERM)
            try:
                self.mount_child.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.failures.append(f"the mount daemon did not exit within 10 s of SIGTERM\n{self.mount_child.tail()}")
                self.mount_child.kill(wait=False)
                self.reap_mount(self.mount_child, 5.0)
        for r in self.readers:
            if r.child is not None:
                try:
                    r.child.popen.wait(30)
                except subprocess.TimeoutExpired:
                    self.failures.append(f"{r.name} did not die within 30 s of SIGKILL")
            self.tail(r)
            r.state = "stopped"
        while self.gc_child is not None and self.gc_child.poll() is None:
            await anyio.sleep(0.05)
        if self.gc_child is not None:
            await self.on_gc_exit()
        self.out(f"[{self.now():7.1f}] stopped readers, gc and mount")
        await self.refresh()
        for _attempt in range(10):
            before = self.list_objects()
            rc, text = await self.run_cli("gc", self.url, "--orphan-grace", 0, "--force-grace", name="gc-final")
            self.account_deleted(before, self.list_objects())
            if rc == 0:
                self.counts["gc_ok"] += 1
                self.fig["final_gc"] = text.strip().splitlines()[-1]
                break
            self.counts["gc_failed_injected_fault"] += 1
        else:
            self.failures.append(f"final gc failed 10 times:\n{text}")
        await self.refresh()

    async def verify(self) -> None:
        import anyio

        import lakestream

        cfg = self.cfg
        st = await self.refresh()
        fails = self.failures
        # -- the history ---------------------------------------------------------------------
        if st.rejected:
            fails.append(f"rejected log records: {st.rejected[:5]}")
        missing = [s for s in range(st.head + 1) if s not in self.history]
        if missing:
            fails.append(f"the follower never saw steps {missing[:20]} of the final history")
        for e in st.steps:
            h = self.history.get(e.step)
            if h is None or h.to_list() != e.to_list():
                fails.append(f"step {e.step}: follower history {h} differs from the final state {e}")
                break
        for p in self.producers:
            ps = st.producers.get(p.pid)
            if ps is None or cursor_position(ps.cursor) != p.files:
                fails.append(f"{p.pid}: final cursor {ps.cursor if ps else None}, expected {p.files}")
        self.out(f"[{self.now():7.1f}] final gc done; checking")
        # -- read every retained step again (in-process reader over the faulty store) ---------
        final: dict[tuple[int, int], list[Any]] = {}
        for rank in range(cfg.world_size):
            try:
                async with lakestream.open_reader(self.store, rank, raw=True) as r:
                    async for b in r.steps(st.first_step, st.head + 1):
                        samples = [
                            [s["__key__"], sorted([f, _hash(v), len(v)] for f, v in s.items() if f != "__key__")]
                            for s in b.samples
                        ]
                        final[(b.step, rank)] = samples
                        key = (b.step, b.version, rank)
                        digest = _hash(json.dumps(samples, separators=(",", ":")).encode())
                        have = self.contents.get(key)
                        if have is not None and (have[0] != digest or have[2] != b.producer):
                            fails.append(f"step {b.step} rank {rank}: the final read differs from the readers'")
                        self.contents.setdefault(key, (digest, samples, b.producer))
            except Exception as e:
                fails.append(f"final read of rank {rank} failed on a retained step: {type(e).__name__}: {e}")
        self.out(f"[{self.now():7.1f}] retained steps read again")
        # -- every reader consumed every step of the final history ----------------------------
        for r in self.readers:
            lost = [s for s in range(st.head + 1) if (s, self.history[s].version) not in r.reads] if not missing else []
            if lost:
                fails.append(f"{r.name} never consumed steps {lost[:20]} ({len(lost)}) of the final history")
        # reclaimed steps: consumed by every reader before the first checkpoint covering them
        late = []
        for s in range(st.first_step):
            v = self.history[s].version if s in self.history else None
            committed = self.seen_at.get((s, v), 0.0)
            covering = [t for _, c, t in self.checkpoints if c >= s and t >= committed]
            deadline = min(covering) if covering else None
            for r in self.readers:
                t = r.reads.get((s, v))
                if t is None or deadline is None or t > deadline or t > self.reclaimed_at.get(s, float("inf")):
                    late.append((r.name, s, t, deadline))
        if late:
            fails.append(f"reclaimed steps not consumed before their checkpoint: {late[:10]} ({len(late)})")
        # every journal entry is a TGB the follower saw, with the same producer
        unknown = [
            (s, v) for (s, v, _), (_, _, prod) in self.contents.items()
            if (s, v) not in self.seen or self.seen[(s, v)].producer != prod
        ]  # fmt: skip
        if unknown:
            fails.append(f"readers consumed (step, version)s the log never had: {unknown[:10]}")
        for (s, v), meta in self.meta_seen.items():
            e = self.seen.get((s, v))
            if e is None or meta != (e.producer, e.epoch, e.seq, e.segment):
                fails.append(f"step {s} version {v}: the mount's _meta.json says {meta}, the log {e}")
                break
        # -- exactly once ----------------------------------------------------------------------
        expected: dict[str, list[Any]] = {}
        order: dict[str, list[tuple[str, int]]] = {}  # producer -> [(key, cursor after it)]
        for pid, files in self.sources.items():
            fields: dict[str, list[Any]] = defaultdict(list)
            names = sorted(files)
            ends: dict[str, int] = {}
            for i, name in enumerate(names):
                key, _, fld = name.partition(".")
                fields[key].append([fld, _hash(files[name]), len(files[name])])
                ends[key] = i + 1
            for key in fields:
                expected[key] = sorted(fields[key])
            order[pid] = sorted(ends.items(), key=lambda kv: kv[1])
        where: dict[str, list[int]] = defaultdict(list)
        got: dict[str, list[Any]] = {}
        step_keys: dict[int, list[str]] = {}
        for s in range(st.head + 1):
            e = self.history.get(s)
            if e is None:
                continue
            keys = []
            for rank in range(cfg.world_size):
                samples = final.get((s, rank)) if s >= st.first_step else None
                if samples is None:
                    c = self.contents.get((s, e.version, rank))
                    samples = c[1] if c is not None else None
                if samples is None:
                    fails.append(f"step {s} rank {rank}: no reader has its samples (reclaimed before it was read?)")
                    continue
                for key, flds in samples:
                    where[key].append(s)
                    got[key] = flds
                    keys.append(key)
            step_keys[s] = keys
        dupes = {k: v for k, v in where.items() if len(v) > 1}
        lost_keys = sorted(set(expected) - set(where))
        extra = sorted(set(where) - set(expected))
        wrong = sorted(k for k in expected if k in got and got[k] != expected[k])
        if dupes:
            fails.append(f"{len(dupes)} records in more than one step, e.g. {sorted(dupes.items())[:5]}")
        if lost_keys:
            fails.append(f"{len(lost_keys)} records lost, e.g. {lost_keys[:10]}")
        if extra:
            fails.append(f"{len(extra)} unknown records, e.g. {extra[:10]}")
        if wrong:
            fails.append(f"{len(wrong)} records with other bytes, e.g. {wrong[:10]}")
        # each producer's records in source order, TGB by TGB, with the cursor after the last one
        for pid, seq in order.items():
            pos = 0
            for s in sorted(step_keys):
                e = self.history[s]
                if e.producer != pid:
                    continue
                n = len(step_keys[s])
                want = {k for k, _ in seq[pos : pos + n]}
                if set(step_keys[s]) != want:
                    fails.append(f"step {s} ({pid}): records are not the next {n} of its source")
                    break
                pos += n
                if cursor_position(e.cursor) != seq[pos - 1][1]:
                    fails.append(f"step {s} ({pid}): cursor {e.cursor}, expected {seq[pos - 1][1]}")
                    break
        # -- reader failures -------------------------------------------------------------------
        for ev in self.events:
            kind = ev["event"]
            if kind == "start":
                continue
            if kind == "unavailable" and "discarded by a rewind" in ev.get("error", ""):
                continue
            if ev.get("tolerated"):
                continue
            fails.append(f"{ev['reader']}: {kind} at step {ev.get('step')}: {ev.get('error')}")
        self.out(f"[{self.now():7.1f}] contents checked")
        # -- stored bytes ------------------------------------------------------------------------
        objects = self.list_objects()
        seg_bytes = sum(v for k, v in objects.items() if k.startswith("segments/"))
        retained = sum(e.nbytes for e in st.steps)
        self.fig["stored_after_final_gc"] = (
            f"segments {seg_bytes} B vs retained steps' segment bytes {retained} B "
            f"({seg_bytes / retained:.3f}x); whole stream prefix {sum(objects.values())} B in {len(objects)} objects"
            if retained
            else f"segments {seg_bytes} B, nothing retained"
        )
        if retained and abs(seg_bytes - retained) > 0.1 * retained:
            fails.append(f"after the final GC, {seg_bytes} B of segments for {retained} B of retained steps")
        # log clean-up: nothing runs any more, so a lease of 0 is safe here
        report = None
        for _attempt in range(10):
            try:
                report = await lakestream.gc(self.store, orphan_grace=0, force_grace=True, lease=0)
                break
            except lakestream.StoreError:
                continue
        if report is not None:
            self.counts["deleted_log_cleanup"] = report.log_versions_deleted + report.snapshots_deleted
        objects2 = self.list_objects()
        total = sum(objects2.values())
        self.fig["stored_after_log_cleanup"] = (
            f"{total} B in {len(objects2)} objects ({total / retained:.3f}x the retained segment bytes)"
            if retained
            else total
        )
        if retained and abs(total - retained) > 0.1 * retained:
            fails.append(f"after the log clean-up, {total} B stored for {retained} B of retained steps")
        self.out(f"[{self.now():7.1f}] log cleaned up")
        rc, text = await self.run_cli("verify", self.url, faults=False, name="verify")
        self.fig["verify"] = text.strip().splitlines()[-1] if text.strip() else ""
        if rc != 0:
            fails.append(f"lakestream verify failed:\n{text}")
        st2 = await lakestream.load_state(self.store)
        if st2.steps != st.steps or st2.first_step != st.first_step:
            fails.append("the state after the log clean-up differs from the state before it")
        self.final_state = st
        await anyio.lowlevel.checkpoint()

    def figures(self) -> None:
        c = self.counts
        st = getattr(self, "final_state", None) or getattr(getattr(self, "manifest", None), "state", None)
        sources = getattr(self, "sources", {})
        records = sum(len({n.partition(".")[0] for n in files}) for files in sources.values())
        files = sum(len(v) for v in sources.values())
        inj: Counter[str] = Counter()
        for path in self.faultlogs.glob("*.log"):
            for line in path.read_text().splitlines():
                inj[line.rsplit(":", 1)[-1]] += 1
        sub = sum(inj.values())
        for store in getattr(self, "inproc", []):
            for k, v in store.injected.items():
                inj[k.rsplit(":", 1)[-1]] += v
        kills = c["kills_producer"] + c["kills_pyreader"] + c["kills_mntreader"] + c["kills_mount"] + c["gc_killed"]
        lat = sorted(self.latencies)
        fig: dict[str, Any] = {
            "records": f"{records} source records in {files} files"
            + (", every one in exactly one step" if not self.failures else ""),
            "kills": f"{kills} SIGKILLs: producers {c['kills_producer']}, Python readers {c['kills_pyreader']}, "
            f"mount readers {c['kills_mntreader']}, mount daemons {c['kills_mount']}, gc {c['gc_killed']}",
            "restarts": f"producer incarnations {sum(p.incarnations for p in getattr(self, 'producers', []))} "
            f"(drain restarts {c['drain_restarts']}), reader restarts {c['restarts_reader']}, "
            f"mounts {c['mount_starts']} ({c['mount_connections_aborted']} killed daemons wedged in the kernel, "
            "their FUSE connections aborted)",
            "fenced": f"{c['fenced_exits']} producer exits 'fenced' after the rewind; "
            f"{c['resumes_checked_after_rewind']} resumes at the rewound cursor checked; "
            f"{c['reader_rewind_exits']} Python readers raised StepUnavailable for a discarded step, "
            f"{c['reader_errors_on_discarded_steps']} failed with CorruptData on one",
            "faults_injected": f"{sum(inj.values())} ({', '.join(f'{k} {v}' for k, v in sorted(inj.items()))}); "
            f"{sub} in subprocesses, {sum(inj.values()) - sub} in-process",
            "gc_runs": f"{c['gc_ok']} ok, {c['gc_failed_injected_fault']} failed on an injected fault, "
            f"{c['gc_killed']} killed"
            + (f"; {statistics.mean(self.gc_seconds):.1f} s each on average" if self.gc_seconds else "")
            + f"; {c['gc_recent_uploads_kept']} times an unreferenced upload younger than the grace was kept",
            "bytes_reclaimed": f"segments {c['deleted_segments']} objects / {c['deleted_segments_bytes']} B; "
            f"log versions {c['deleted_log']}, snapshots {c['deleted_snapshots']} "
            f"(+{c['deleted_log_cleanup']} log versions and snapshots in the final clean-up)",
            "rewinds": f"{1 if self.rewind_info else 0} ({self.rewind_info})",
            "checkpoints": len(self.checkpoints),
            "reads": ", ".join(f"{r.name} {r.entries}" for r in getattr(self, "readers", [])),
            "init_retries": c["init_retries"],
        }
        if st is not None:
            fig["steps"] = (
                f"{st.head + 1} in the final history ({st.first_step} reclaimed, {len(st.steps)} retained), "
                f"manifest version {st.version}, {len(self.seen)} TGBs committed in all "
                f"({len(self.discarded)} discarded by the rewind)"
            )
        if lat:
            fig["commit_latency_s"] = (
                f"segment upload to commit record: p50 {statistics.median(lat):.2f}, "
                f"p99 {lat[int(0.99 * (len(lat) - 1))]:.2f}, max {lat[-1]:.2f} (orphan grace {self.cfg.orphan_grace:g})"
            )
        fig["commits_later_than_the_grace"] = f"{len(self.late_commits)} {self.late_commits[:5]}"
        self.fig.update(fig)


def _upload_time(segment: str) -> float | None:
    from lakestream._producer import parse_segment_key

    parsed = parse_segment_key(segment)
    return parsed[3] if parsed else None


# =================================================================================================
# Entry points
# =================================================================================================


def run(cfg: Config, url: str, env: dict[str, str], workdir: Path) -> Report:
    """Run the torture test against the stream `url` (a fresh s3:// prefix) with the AWS_* `env`."""
    import anyio

    saved = dict(os.environ)
    os.environ.update(env)  # the in-process S3 store reads the standard AWS variables
    os.environ.pop("LAKESTREAM_FAULTS", None)  # in-process faults are explicit FaultyStores
    try:
        return anyio.run(Torture(cfg, url, env, workdir).run)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=None, help="chaos phase length (default 10)")
    ap.add_argument("--seconds", type=float, default=None)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--rate", type=float, default=15.0, help="samples/s per producer during chaos")
    ap.add_argument("--orphan-grace", type=float, default=Config.orphan_grace, help="of the periodic GC, seconds")
    ap.add_argument("--max-steps-ahead", type=int, default=Config.max_steps_ahead, help="back-pressure (0: off)")
    ap.add_argument("--faults", default=Config.faults, help="LAKESTREAM_FAULTS without seed ('' for none)")
    ap.add_argument("--timeouts", type=float, default=Config.timeout_probability, help="timeout probability per call")
    ap.add_argument("--no-mount", action="store_true")
    ap.add_argument("--no-rewind", action="store_true")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the work directory even if the run passes")
    ap.add_argument("--json", type=Path, default=None, help="write the report as JSON here")
    a = ap.parse_args(argv)
    seconds = a.seconds if a.seconds is not None else 60 * (a.minutes if a.minutes is not None else 10)
    seed = a.seed if a.seed is not None else random.randrange(1, 1 << 30)
    cfg = Config(
        seconds=seconds, seed=seed, rate=a.rate, orphan_grace=a.orphan_grace, max_steps_ahead=a.max_steps_ahead,
        faults=a.faults, timeout_probability=a.timeouts, mount=not a.no_mount, rewind_at=0 if a.no_rewind else 0.5,
        snapshot_every=64 if seconds > 120 else 16,
    )  # fmt: skip
    if cfg.mount and not os.access("/dev/fuse", os.R_OK | os.W_OK):
        print("torture: /dev/fuse is not usable: running without the mount", file=sys.stderr)
        cfg.mount = False
    from s3server import S3Server

    workdir = a.workdir or Path(tempfile.mkdtemp(prefix="lakestream-torture-"))
    workdir.mkdir(parents=True, exist_ok=True)
    with S3Server() as server:
        report = run(cfg, server.new_bucket(), server.env(), workdir)
    print(report.summary(), flush=True)
    if a.json:
        a.json.write_text(json.dumps(asdict(report), indent=2, default=str))
    if report.ok and not a.keep and a.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"work directory kept: {workdir}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in CHILD_MODES:
        sys.exit(child_main(sys.argv[1:]))
    sys.exit(main())
