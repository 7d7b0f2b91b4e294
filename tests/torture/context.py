"""What the driver, the process roles and the checker share: the configuration, the child
processes, and `Run`, the harness's view of one torture run (its counters and failures, and the
history of the stream as an in-process follower of the log sees it)."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .children import timeout_hook

if TYPE_CHECKING:
    from .roles import ProducerSlot, ReaderSlot

TESTS = Path(__file__).resolve().parent.parent
ENTRY = str(TESTS / "torture.py")  # children run `python tests/torture.py MODE ARGS…`
REGISTERED = re.compile(r"producer (\S+) registered epoch (\d+), resuming at (.*)")  # a producer's log; cursor as JSON


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
    policies: tuple[str, ...] = ("dac", "combine", "eager", "interval")  # producer k commits with policies[k % len]
    checkpoint_every: int = 6  # steps
    gc_every: float = 3.0  # seconds (jittered)
    # GC's, forced below the 300 s floor so that orphans of live producers go within a run; above
    # `MAX_UPLOAD_AGE` (120 s), the oldest upload a commit may name, plus a minute for a commit in flight
    orphan_grace: float = 180.0
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
    replay: bool = False  # the rewind skips 1-2 ranges of steps after the checkpoint (`--skip-steps`): a replay
    fork: bool = False  # fork the stream half-way (after the rewind) and run the producers on the fork too
    drain_timeout: float = 900.0  # at most, in all; with back-pressure the drain moves at the trainer's pace
    drain_stall: float = 60.0  # the drain fails once neither the head nor any reader moved for this long
    rewind_notice_timeout: float = 30.0

    def samples_per_producer(self) -> int:
        return self.samples or int(self.rate * self.seconds * 1.3) + 40


@dataclass
class Child:
    """One incarnation of a child process; its output goes to `log`."""

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


def parse_faults(spec: str) -> dict[str, float]:
    kv = dict(item.split("=", 1) for item in spec.split(",") if item)
    return {"ambiguous": float(kv.get("ambiguous", 0)), "fail": float(kv.get("fail", 0))}


def upload_time(segment: str) -> float | None:
    """The upload time a segment key carries (None for a key of another form)."""
    from lakestream.testing import segment_upload_time

    return segment_upload_time(segment)


class Run:
    """One torture run as the harness sees it. The roles and the driver append to `failures`,
    `warnings` and `counts`; the follower (`follow`, `observe`) keeps the history of the stream."""

    def __init__(self, cfg: Config, url: str, env: dict[str, str], workdir: Path, *, log: Any = None) -> None:
        self.cfg = cfg
        self.url = url
        self.workdir = workdir
        self.rng = random.Random(cfg.seed)  # every random choice of the run, in one seeded sequence
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
        self.fig: dict[str, Any] = {}
        self.counts: Counter[str] = Counter()
        self.incs: Counter[str] = Counter()
        self.children: list[Child] = []
        self.inproc: list[Any] = []  # the in-process FaultyStores
        self.sources: dict[str, dict[str, bytes]] = {}  # producer -> {file name: bytes}
        self.producers: list[ProducerSlot] = []
        self.readers: list[ReaderSlot] = []
        self.fork_producers: list[ProducerSlot] = []  # the same producers on the fork (`Config.fork`)
        # the follower's view of the history
        self.history: dict[int, Any] = {}  # step -> Step (current history, reclaimed steps included)
        self.seen: dict[tuple[int, int], Any] = {}  # (step, version) -> Step, every TGB ever observed
        self.seen_at: dict[tuple[int, int], float] = {}  # wall time first observed
        self.by_segment: dict[str, tuple[int, int]] = {}
        self.discarded: set[tuple[int, int]] = set()
        self.deleted_by: dict[str, str] = {}  # object key -> the GC run (`gc.N`) that deleted it
        self.reclaimed_at: dict[int, float] = {}
        self.first_step = 0
        self.rewinds_seen = 0
        # (head, {producer: cursor}) right after the latest rewind record was applied: producers
        # restarted at once may commit before the driver's own refresh after the rewind command
        self.at_rewind: tuple[int, dict[str, Any]] | None = None
        # the latest rewind record as the follower applied it: to_step, version, the steps after
        # to_step just before it and just after it, the skipped TGBs, producers before and after
        self.rewind_seen: dict[str, Any] | None = None
        self.producers_seen: dict[str, tuple[int, Any]] = {}  # producer -> (epoch, cursor) at the last version
        self.latencies: list[float] = []  # when the follower saw the commit - segment upload time
        self.late_commits: list[tuple[int, int, str, float]] = []  # committed later than the orphan grace
        # what the readers journaled: (step, version, rank) -> (digest, samples, producer), as first read
        self.contents: dict[tuple[int, int, int], tuple[str, list[Any], str]] = {}
        self.meta_seen: dict[tuple[int, int], tuple[str, int, int, str]] = {}  # the mount's _meta.json
        self.events: list[dict[str, Any]] = []  # the readers' journaled events
        # the trainer's checkpoints and the rewind
        self.checkpoints: list[tuple[str, int, float]] = []  # (id, step, wall time before the call)
        self.last_checkpoint = -1
        self.rewind_info: dict[str, Any] | None = None
        self.fenced_below: dict[str, int] = {}  # producer -> first epoch after the rewind
        self.rewind_version: int | None = None
        self.rewind_wall: float | None = None
        self.rewind_mono: float | None = None
        # a replay's skipped TGBs and their records (read as the replay landed): [(Skipped, {rank: samples})]
        self.skipped: list[tuple[Any, dict[int, list[Any]]]] = []
        # the fork (`Config.fork`): its URL, a second prefix in the same bucket, and what the driver
        # saw as it forked: at_step, the source's TGBs below it and skipped TGBs it keeps, attempts
        self.fork_url = url.rstrip("/") + "-fork"
        self.fork_info: dict[str, Any] | None = None
        self.fork_store: Any = None  # the fork behind a FaultyStore: its state and final reads
        self.final_state: Any = None
        self.chaos = False
        self.abort = False
        self.t0 = time.monotonic()
        self.bucket, _, self.prefix = url[len("s3://") :].partition("/")
        self.prefix = self.prefix.strip("/")

    def now(self) -> float:
        return time.monotonic() - self.t0

    # -- child processes -----------------------------------------------------------------------

    def spawn(self, kind: str, name: str, args: list[str], *, faults: bool = True) -> Child:
        """Start `torture.py ARGS…` as incarnation n of `name`, with its own seeded faults."""
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
                [sys.executable, ENTRY, *args], env=env, stdout=f, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, cwd=self.workdir,
            )  # fmt: skip
        child = Child(kind, name, n, popen, logp, time.monotonic(), time.time())
        self.children.append(child)
        return child

    async def run_cli(
        self, *args: Any, faults: bool = True, timeout: float = 120.0, name: str = "cli"
    ) -> tuple[int, str]:
        """Run one `lakestream` command to its end: (exit status, output)."""
        import anyio

        child = self.spawn("cli", name, ["cli", *map(str, args)], faults=faults)
        deadline = time.monotonic() + timeout
        while child.poll() is None:
            if time.monotonic() > deadline:
                child.kill()
                return -9, child.text() + "\n(timed out)"
            await anyio.sleep(0.02)
        return child.popen.returncode, child.text()

    # -- the in-process store ------------------------------------------------------------------

    def faulty(self, inner: Any, seed: int) -> Any:
        """`inner` behind a FaultyStore with the run's faults and timeouts."""
        from lakestream.testing import FaultyStore

        f = parse_faults(self.cfg.faults) if self.cfg.faults else {"ambiguous": 0.0, "fail": 0.0}
        store = FaultyStore(inner, ambiguous_put=f["ambiguous"], fail_before=f["fail"], rng=random.Random(seed))
        if self.cfg.faults:
            rng = random.Random(seed + 1)
            store.hook = timeout_hook(store, self.cfg.timeout_probability, self.cfg.timeout_seconds, rng)
        self.inproc.append(store)
        return store

    def list_objects(self) -> dict[str, int]:
        """Every object under the stream prefix: {key relative to the prefix: size} (plain S3)."""
        root = self.prefix + "/" if self.prefix else ""
        out: dict[str, int] = {}
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=root):
            for o in page.get("Contents", ()):
                out[o["Key"][len(root) :]] = o["Size"]
        return out

    def account_deleted(self, before: dict[str, int], after: dict[str, int], who: str) -> None:
        for k, size in before.items():
            if k not in after:
                self.deleted_by[k] = who
                kind = (
                    "segments" if k.startswith("segments/") else "log" if "/log/" in k
                    else "snapshots" if "/snapshots/" in k else "other"
                )  # fmt: skip
                self.counts[f"deleted_{kind}"] += 1
                self.counts[f"deleted_{kind}_bytes"] += size

    # -- the follower --------------------------------------------------------------------------

    async def open_follower(self, store: Any) -> None:
        """Follow the log through `store`, seeing every version it applies: a step a rewind
        discards within one refresh is still seen."""
        import anyio

        from lakestream.testing import follower

        self.manifest = follower(store, on_apply=self.observe)
        self.manifest_lock = anyio.Lock()
        await self.manifest.load()
        self.observe(self.manifest.state)

    def observe(self, st: Any) -> None:
        """Fold the follower's new state into the history."""
        now = time.time()
        if st.first_step > self.first_step:
            for s in range(self.first_step, st.first_step):
                self.reclaimed_at.setdefault(s, now)
            self.first_step = st.first_step
        if st.rewinds != self.rewinds_seen:
            self.rewinds_seen = st.rewinds
            self.at_rewind = (st.head, {pid: p.cursor for pid, p in st.producers.items()})
            old = {s: e for s, e in self.history.items() if s >= st.first_step}
            kept = st.head
            for s in sorted(old):
                e = st.step(s)
                if e is None or e.version != old[s].version:  # a replay gives every step after it a new version
                    kept = min(kept, s - 1)
                    self.discarded.add((s, old[s].version))
                    del self.history[s]
            self.rewind_seen = {
                "to_step": kept, "version": st.version, "old": [old[s] for s in sorted(old) if s > kept],
                "new": [st.step(s) for s in range(kept + 1, st.head + 1)], "skipped": list(st.skipped),
                "producers_before": dict(self.producers_seen),
                "producers_after": {pid: (p.epoch, p.cursor) for pid, p in st.producers.items()},
            }  # fmt: skip
            for slot in self.readers:
                slot.frontier = min(slot.frontier, kept)
        self.producers_seen = {pid: (p.epoch, p.cursor) for pid, p in st.producers.items()}
        start = max(st.first_step, max(self.history, default=-1) + 1)
        for s in range(start, st.head + 1):
            e = st.step(s)
            self.history[s] = e
            key = (s, e.version)
            if key not in self.seen:
                self.seen[key] = e
                self.by_segment[e.segment] = key
                self.seen_at[key] = now
                up = upload_time(e.segment)
                if up is not None:  # (a combined commit's record time is its intent's: when it was declared)
                    self.latencies.append(now - up)
                    if now - up > self.cfg.orphan_grace:  # GC could have deleted it before the commit
                        self.late_commits.append((s, e.version, e.producer, round(now - up, 2)))

    async def follow(self) -> None:
        """Refresh the follower forever (a task of the driver's task group)."""
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
        """Refresh the follower now (retrying injected faults) and return its state."""
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
