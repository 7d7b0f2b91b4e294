"""The process roles, as the harness runs them: how each is spawned, killed, restarted and
journaled. The code that runs inside each process is in `children.py`.

* producers (`ProducerSlot`, `Producers`): `lakestream produce --from-dir`, restarted with the same
  producer id after a SIGKILL or a "fenced" exit (not after a replay, which fences none); after
  the rewind, the first incarnation that registers must resume at the checkpoint's cursor. The
  fork's producers (`fork`: same ids, same sources, on the fork's URL) are never fenced; the first
  incarnation of each that registers must resume at the source's cursor as of the fork step;
* readers (`ReaderSlot`, `Readers`): a Python reader and a mount reader per rank, restarted where
  their journal's frontier ends; the harness tails their journals;
* the mount daemon (`Mount`): `lakestream mount`, killed and remounted;
* GC (`Gc`): `lakestream gc --orphan-grace G --force-grace` every few seconds, sometimes killed
  half-way; what each run deleted is counted from listings before and after.

State moves between "running", "restart" (at `restart_at`), "held" (a mount reader during the
rewind), "done" (a producer at the end of its source) and "stopped".
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import checker
from .children import mount_instance
from .context import REGISTERED, Child, Run

# -- producers -------------------------------------------------------------------------------------


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
    expect_resume: int | None = None  # cursor the next incarnation must resume at (after a rewind, or on the fork)
    fork: bool = False  # it produces to the fork

    @property
    def name(self) -> str:
        """Its children's name (log files, fault logs)."""
        return f"fork-{self.pid}" if self.fork else self.pid


class Producers:
    def __init__(self, run: Run) -> None:
        self.run = run

    def start(self, p: ProducerSlot) -> None:
        run = self.run
        url = run.fork_url if p.fork else run.url
        args = ["cli", "-v", "produce", url, "--producer-id", p.pid, "--from-dir", str(p.src),
                "--max-inflight-bytes", str(p.inflight), "--commit-policy", p.policy]  # fmt: skip
        if not p.drain and run.cfg.rate > 0:
            args += ["--rate", str(run.cfg.rate)]
        if p.drain:  # no rate, and TGBs pipelined into group commits: the drain is over quickly
            args[args.index("--max-inflight-bytes") + 1] = str(1 << 20)
        p.child = run.spawn("producer", p.name, args)
        p.state = "running"
        p.incarnations += 1

    def kill(self, p: ProducerSlot, *, count: bool = True) -> None:
        assert p.child is not None
        run = self.run
        if p.child.poll() is not None:  # it exited on its own first: handle that
            self.on_exit(p)
            return
        p.child.kill()
        if count:
            p.kills += 1
            run.counts["kills_fork_producer" if p.fork else "kills_producer"] += 1
        self.check_resume(p)
        p.state = "restart"
        p.restart_at = time.monotonic() + run.rng.uniform(0, run.cfg.restart_delay)

    def on_exit(self, p: ProducerSlot) -> None:
        """An exit of its own: 0 at the end of its source, "fenced" after the rewind; else a failure."""
        assert p.child is not None
        run = self.run
        rc = p.child.popen.returncode
        self.check_resume(p)
        if rc == 0:
            m = REGISTERED.search(p.child.text())
            if m is not None and not p.fork and p.pid in run.fenced_below and int(m[2]) < run.fenced_below[p.pid]:
                run.failures.append(f"{p.pid} epoch {m[2]}, fenced by the rewind, exited 0\n{p.child.tail()}")
            p.state = "done"
            return
        text = p.child.text()
        m = REGISTERED.search(text)
        if (
            rc > 0
            and "fenced" in text
            and run.rewind_mono is not None
            and not run.cfg.replay  # a replay fences no producer
            and not p.fork  # nothing fences the fork's
            and (m is None or checker.registered_before_rewind(run, p, m))
        ):
            p.fenced += 1
            run.counts["fenced_exits"] += 1
        elif rc < 0:
            run.failures.append(f"{p.pid} incarnation {p.child.inc}: signal {-rc}, not ours\n{p.child.tail()}")
        else:
            run.failures.append(f"{p.pid} incarnation {p.child.inc}: exit {rc}\n{p.child.tail()}")
        p.state = "restart"
        p.restart_at = time.monotonic() + run.rng.uniform(0, run.cfg.restart_delay)

    def check_resume(self, p: ProducerSlot) -> None:
        if p.fork:
            checker.check_fork_producer_resumes_at_the_fork_step(self.run, p)
        else:
            checker.check_resume_after_rewind(self.run, p)

    def tick(self, mono: float) -> None:
        for p in self.run.producers + self.run.fork_producers:
            if p.state == "running" and p.child is not None and p.child.poll() is not None:
                self.on_exit(p)
            if p.state == "restart" and mono >= p.restart_at:
                self.start(p)


# -- readers ---------------------------------------------------------------------------------------


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


class Readers:
    def __init__(self, run: Run) -> None:
        self.run = run

    def start(self, r: ReaderSlot) -> None:
        """Start the next incarnation at the slot's frontier + 1."""
        run = self.run
        start = r.frontier + 1
        if start < run.first_step:
            run.failures.append(f"{r.name}: would restart at step {start}, below the first step {run.first_step}")
            r.state = "stopped"
            return
        r.incarnations += 1
        common = ["--rank", str(r.rank), "--start", str(start), "--journal", str(r.journal), "--slot", r.name,
                  "--inc", str(r.incarnations)]  # fmt: skip
        if r.kind == "py":
            r.child = run.spawn("reader", r.name, ["pyreader", "--url", run.url, *common])
        else:
            r.child = run.spawn("reader", r.name, ["mntreader", "--mnt", str(run.mnt), *common], faults=False)
        r.state = "running"
        r.saw_discarded_at = None
        if r.incarnations > 1:
            r.restarts += 1
            run.counts["restarts_reader"] += 1

    def kill(self, r: ReaderSlot, *, count: bool = True, hold: bool = False) -> None:
        assert r.child is not None
        run = self.run
        if r.child.poll() is not None:  # it exited on its own first
            self.on_exit(r)
            if hold:
                r.state = "held"
            return
        if r.child.kill(wait=r.kind == "py") and count:
            r.kills += 1
            run.counts[f"kills_{r.kind}reader"] += 1
        self.tail(r)
        r.state = "held" if hold else "restart"
        r.restart_at = time.monotonic() + run.rng.uniform(0, run.cfg.restart_delay)

    def on_exit(self, r: ReaderSlot) -> None:
        """An exit of its own: StepUnavailable after the rewind (expected), an error on a step the
        rewind discarded (tolerated, with a warning), or a failure (three stop the run)."""
        assert r.child is not None
        run = self.run
        rc = r.child.popen.returncode
        self.tail(r)
        text = r.child.text()
        last_error = next((e for e in reversed(run.events) if e["reader"] == r.name and e["event"] == "error"), None)
        if r.kind == "py" and rc == 3 and "discarded by a rewind" in text and r.saw_discarded_at is not None:
            r.rewind_exits += 1
            run.counts["reader_rewind_exits"] += 1
            r.saw_discarded_at = None
        elif (
            r.kind == "py"
            and rc == 1
            and last_error is not None
            and (
                self.names_a_discarded_segment(last_error)
                or ("does not follow" in last_error.get("error", "") and r.saw_discarded_at is not None)
            )
        ):
            last_error["tolerated"] = True
            run.counts["reader_errors_on_discarded_steps"] += 1
            msg = (
                "a Python reader still on the history a rewind discarded failed with CorruptData ('the segment "
                "of a committed step is missing': GC had deleted the discarded step's segment) instead of "
                "StepUnavailable"
                if "does not follow" not in last_error.get("error", "")
                else "a Python reader still on the history a rewind discarded failed with ValueError 'apply: version "
                "N does not follow N' (fetch tasks refreshing the manifest concurrently)"
            )
            if msg not in run.warnings:
                run.warnings.append(msg)
        else:
            run.failures.append(f"{r.name} incarnation {r.child.inc}: exit {rc}\n{r.child.tail()}")
            r.failed += 1
            if r.failed >= 3:
                run.failures.append(f"{r.name} failed 3 times: stopping the run")
                r.state = "stopped"
                run.abort = True
                return
        r.state = "restart"
        r.restart_at = time.monotonic() + run.rng.uniform(0, run.cfg.restart_delay)

    def names_a_discarded_segment(self, event: dict[str, Any]) -> bool:
        """Whether a reader's error names the segment of a TGB a rewind discarded."""
        m = re.search(r"object (segments/\S+?\.tgb)", event.get("error", ""))
        return m is not None and self.run.by_segment.get(m[1]) in self.run.discarded

    # -- the journal ---------------------------------------------------------------------------

    def tail(self, slot: ReaderSlot) -> None:
        """Read the journal's new lines."""
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
                self.run.failures.append(f"{slot.name}: malformed journal line {line[:200]!r}")
                continue
            if "event" in rec:
                self.on_event(slot, rec)
            else:
                self.on_entry(slot, rec)

    def on_entry(self, slot: ReaderSlot, rec: dict[str, Any]) -> None:
        """A consumed step: the same (step, version, rank) must always read the same."""
        run = self.run
        step, version, rank = rec["step"], rec["version"], rec["rank"]
        samples = rec["samples"]
        key = (step, version, rank)
        fails = checker.check_same_read(run, key, samples, rec["producer"], who=slot.name)
        run.failures.extend(fails)
        if rank != slot.rank:
            run.failures.append(f"{slot.name}: read rank {rank}, expected {slot.rank}")
        if "segment" in rec:  # the mount's _meta.json names the TGB: it must be the one the log has
            run.meta_seen[(step, version)] = (rec["producer"], rec["epoch"], rec["seq"], rec["segment"])
        slot.consumed[step] = version
        slot.reads.setdefault((step, version), rec["t"])
        slot.entries += 1
        if (step, version) in run.discarded and slot.saw_discarded_at is None:
            slot.saw_discarded_at = time.monotonic()

    def on_event(self, slot: ReaderSlot, rec: dict[str, Any]) -> None:
        rec = dict(rec, reader=slot.name)
        self.run.events.append(rec)
        if rec["event"] == "start":
            return
        error = rec.get("error", "")[:300]
        self.run.out(f"[{self.run.now():7.1f}] {slot.name}: {rec['event']} at step {rec.get('step')}: {error}")

    def advance(self, slot: ReaderSlot) -> None:
        """Move the frontier over the steps consumed in the current history."""
        f = slot.frontier
        while True:
            e = self.run.history.get(f + 1)
            if e is None or slot.consumed.get(f + 1) != e.version:
                break
            f += 1
        slot.frontier = f

    async def tick(self, mono: float, mount: Mount) -> None:
        run = self.run
        for r in run.readers:
            self.tail(r)
            if r.state == "running" and r.child is not None and r.child.poll() is not None:
                self.on_exit(r)
            if r.state == "held" and mount.ready and run.rewind_version is not None:
                status = await mount.status()
                if status is not None and status["version"] >= run.rewind_version and status["head_step"] >= 0:
                    r.state = "restart"
                    r.restart_at = mono
            if r.state == "restart" and mono >= r.restart_at:
                self.start(r)
            self.advance(r)
            # a Python reader that consumed a step the rewind discarded should raise StepUnavailable
            if (
                r.kind == "py" and r.state == "running" and r.saw_discarded_at is not None
                and mono - r.saw_discarded_at > run.cfg.rewind_notice_timeout
            ):  # fmt: skip
                run.warnings.append(
                    f"{r.name} had consumed steps a rewind discarded and had not raised StepUnavailable "
                    f"{run.cfg.rewind_notice_timeout:g} s later (it waits for its next step number to be "
                    "committed again before it checks): killed and restarted"
                )
                r.saw_discarded_at = None
                self.kill(r, count=False)


# -- the mount daemon ------------------------------------------------------------------------------


class Mount:
    def __init__(self, run: Run) -> None:
        self.run = run
        self.child: Child | None = None
        self.state = "restart"  # starting, running, restart (at restart_at)
        self.restart_at = 0.0
        self.ready = False

    def start(self) -> None:
        run = self.run
        self.unmount()
        run.mnt.mkdir(exist_ok=True)
        args = ["cli", "mount", run.url, str(run.mnt), "--ranks", "all", "--world-size", str(run.cfg.world_size),
                "--wait", "5"]  # fmt: skip
        self.child = run.spawn("mount", "mount", args)
        self.state = "starting"
        self.ready = False

    def unmount(self) -> None:
        from mountutil import is_mounted

        mnt = self.run.mnt
        if mnt.exists() and is_mounted(mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True, timeout=30)

    def kill(self) -> None:
        assert self.child is not None
        run = self.run
        if self.child.kill(wait=False):
            run.counts["kills_mount"] += 1
        self.reap(self.child, 5.0)
        self.unmount()
        self.state = "restart"
        self.ready = False
        self.restart_at = time.monotonic() + run.rng.uniform(0, run.cfg.restart_delay)

    def reap(self, child: Child, timeout: float) -> None:
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
        if abort_connection(str(self.run.mnt)):
            self.run.counts["mount_connections_aborted"] += 1
        try:
            child.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.run.failures.append(
                f"mount daemon {child.name}.{child.inc} did not exit, even after its FUSE connection was aborted"
            )

    async def status(self) -> dict[str, Any] | None:
        """The mount's _status.json, or None (not mounted, or no answer within 2 s)."""
        import anyio
        import anyio.to_thread

        with anyio.move_on_after(2):
            _, status = await anyio.to_thread.run_sync(mount_instance, str(self.run.mnt), abandon_on_cancel=True)
            return status
        return None

    async def tick(self, mono: float) -> None:
        run = self.run
        m = self.child
        if self.state in ("starting", "running") and m is not None and m.poll() is not None:
            run.failures.append(f"mount daemon exited {m.popen.returncode}\n{m.tail()}")
            self.unmount()
            self.state = "restart"
            self.restart_at = mono + 1.0
        if self.state == "restart" and mono >= self.restart_at:
            self.start()
        if self.state == "starting":
            status = await self.status()
            if status is not None:
                self.state = "running"
                self.ready = True
                run.counts["mount_starts"] += 1

    def stop(self) -> None:
        """SIGTERM the daemon (after a lazy unmount): that aborts the FUSE requests killed mount
        readers may be blocked in."""
        import signal

        assert self.child is not None
        run = self.run
        self.unmount()
        self.child.popen.send_signal(signal.SIGTERM)
        try:
            self.child.popen.wait(10)
        except subprocess.TimeoutExpired:
            run.failures.append(f"the mount daemon did not exit within 10 s of SIGTERM\n{self.child.tail()}")
            self.child.kill(wait=False)
            self.reap(self.child, 5.0)


# -- GC --------------------------------------------------------------------------------------------


class Gc:
    def __init__(self, run: Run) -> None:
        self.run = run
        self.child: Child | None = None
        self.before: dict[str, int] = {}
        self.kill_at: float | None = None
        self.seconds: list[float] = []
        self.next_at = 0.0

    async def start(self) -> None:
        """`lakestream gc` with the run's grace; during the chaos, sometimes killed half-way."""
        import anyio.to_thread

        run = self.run
        self.before = await anyio.to_thread.run_sync(run.list_objects)
        self.child = run.spawn(
            "gc", "gc", ["cli", "gc", run.url, "--orphan-grace", str(run.cfg.orphan_grace), "--force-grace"]
        )
        self.kill_at = None
        if run.chaos and run.rng.random() < run.cfg.gc_kill_probability:
            self.kill_at = time.monotonic() + run.rng.uniform(0.3, 1.2)

    async def on_exit(self) -> None:
        import anyio.to_thread

        assert self.child is not None
        run = self.run
        rc = self.child.popen.returncode
        after = await anyio.to_thread.run_sync(run.list_objects)
        run.account_deleted(self.before, after, f"gc.{self.child.inc}")
        text = self.child.text()
        self.seconds.append(time.monotonic() - self.child.started)
        if m := re.search(r"\((\d+) recent uploads kept\)", text):
            run.counts["gc_recent_uploads_kept"] += int(m[1])
        if rc == 0:
            run.counts["gc_ok"] += 1
        elif self.child.killed:
            run.counts["gc_killed"] += 1
        elif "injected" in text:
            run.counts["gc_failed_injected_fault"] += 1
        else:
            run.failures.append(f"gc exit {rc}\n{self.child.tail()}")
        self.child = None
        self.next_at = time.monotonic() + run.rng.uniform(0.5, 1.5) * run.cfg.gc_every

    async def tick(self, mono: float) -> None:
        if self.child is not None:
            if self.kill_at is not None and mono >= self.kill_at:
                self.child.kill()
                self.kill_at = None
            if self.child.poll() is not None:
                await self.on_exit()
        elif mono >= self.next_at:
            await self.start()

    async def wait(self) -> None:
        """Let a running GC finish and account for it."""
        import anyio

        while self.child is not None and self.child.poll() is None:
            await anyio.sleep(0.05)
        if self.child is not None:
            await self.on_exit()
