"""The chaos driver: the schedule of the run, and the entry points `run` and `main`.

One loop, every 50 ms: tick the process roles (restart what is due, handle exits, start the next
GC), let the trainer checkpoint, and during the chaos phase, kill what the schedule says is due:
a producer every `producer_kill_every` seconds on average (exponential), a reader process every
`reader_kill_every`, the mount daemon every `mount_kill_every` (its first kill between 15% and 45%
of the phase, so every run has one), and the rewind at `rewind_at` of the phase (or at the first
checkpoint after it: on a starved machine the readers may not have let the trainer checkpoint by then,
and the phase runs on, by at most its length again, until the rewind is done); with `Config.replay`
that rewind is a replay (`--skip-steps`), to a checkpoint with steps after it. Every random
choice comes from one `random.Random(seed)`. After the chaos, the drain (producers restarted
without a rate limit until their sources are exhausted, readers catch up), then `finish` (stop
everything, a final GC) and the checker.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

from . import checker
from .checker import Report
from .children import sample_fields
from .context import Config, Run
from .roles import Gc, Mount, Producers, ProducerSlot, Readers, ReaderSlot


class Driver:
    def __init__(self, cfg: Config, url: str, env: dict[str, str], workdir: Path, *, log: Any = None) -> None:
        self.run = Run(cfg, url, env, workdir, log=log)
        self.producers = Producers(self.run)
        self.readers = Readers(self.run)
        self.mount = Mount(self.run)
        self.gc = Gc(self.run)
        self.fork_kill_at: float | None = None  # the first SIGKILL of a producer of the fork: one in any run

    # -- the trainer: checkpoints and the rewind -------------------------------------------------

    async def maybe_checkpoint(self) -> None:
        """A trainer checkpoints every `checkpoint_every` steps: at the next multiple after the
        newest retained checkpoint, once every reader has consumed it."""
        import lakestream

        run = self.run
        frontier = min(r.frontier for r in run.readers)
        last = run.last_checkpoint  # a rewind drops the checkpoints after its step: its step then
        c = max(last + run.cfg.checkpoint_every, run.first_step)
        if frontier < c or c not in run.history:
            return
        # the invariant the lifecycle relies on: every reader consumed every step up to c
        for r in run.readers:
            for s in range(max(run.first_step, last + 1), c + 1):
                assert r.consumed.get(s) == run.history[s].version, (r.name, s)
        cid = f"ck-{len(run.checkpoints) + 1:04d}"
        t = time.time()
        try:
            await lakestream.checkpoint(run.store, cid, c)
        except Exception as e:
            run.failures.append(f"checkpoint {cid} at step {c}: {type(e).__name__}: {e}")
            return
        run.checkpoints.append((cid, c, t))
        run.last_checkpoint = c

    async def rewind(self) -> None:
        """`lakestream rewind --to-checkpoint` to a random retained checkpoint. The mount readers
        are held until the mount shows the rewind; the Python readers are left to notice it; every
        producer must exit "fenced" and resume at its cursor as of the checkpoint."""
        import anyio

        run = self.run
        st = await run.refresh()
        if not st.checkpoints:
            return
        ck = run.rng.choice(st.checkpoints)
        head_before, rewinds_before = st.head, st.rewinds
        run.out(f"[{run.now():7.1f}] rewind to checkpoint {ck.id} at step {ck.step} (head {head_before})")
        self.trainer_stops()
        rc, text = await run.run_cli("rewind", run.url, "--to-checkpoint", ck.id, name="rewind")
        if rc != 0:
            run.failures.append(f"rewind exit {rc}\n{text}")
        st = await run.refresh()
        applied = st.rewinds - rewinds_before
        run.rewind_info = {"to_checkpoint": ck.id, "to_step": ck.step, "head_before": head_before,
                           "discarded_steps": head_before - ck.step, "records_applied": applied}  # fmt: skip
        run.rewind_version = st.version
        run.last_checkpoint = ck.step
        for r in run.readers:
            if r.kind == "py" and r.state == "running" and any(s > ck.step for s in r.consumed):
                r.saw_discarded_at = time.monotonic()  # it must raise StepUnavailable (or be killed first)
        if applied != 1:
            run.warnings.append(
                f"one `lakestream rewind` call applied {applied} rewind records (an ambiguous put of the rewind "
                "record is not recognised on retry: the rewind is applied again)"
            )
        run.failures.extend(checker.check_rewind_resumes_at_checkpoint(run, ck.step))
        # each producer resumes from its cursor as of the checkpoint's step
        cursors = checker.cursors_at(run, ck.step)
        for p in run.producers:
            ps = st.producers.get(p.pid)
            if ps is not None:
                run.fenced_below[p.pid] = ps.epoch
            p.expect_resume = checker.cursor_position(cursors.get(p.pid))
            if p.state == "done":
                p.state = "restart"
                p.restart_at = time.monotonic()
            # a running producer must now exit with "fenced": Producers.on_exit checks it
        await anyio.lowlevel.checkpoint()

    def trainer_stops(self) -> None:
        """Before a rewind or replay the trainer stops: the mount readers are held (until the mount
        shows it), the Python readers are left to notice it; the moment is noted."""
        for r in self.run.readers:
            if r.kind == "mnt" and r.state == "running":
                self.readers.kill(r, count=False, hold=True)
            elif r.kind == "mnt":
                r.state = "held"
        self.run.rewind_mono = time.monotonic()
        self.run.rewind_wall = time.time()

    def skip_ranges(self, first: int, last: int) -> tuple[tuple[int, int], ...]:
        """1 or 2 random ranges of steps in first..last (inclusive), rising and disjoint; every
        step skipped only when there is one."""
        rng, n = self.run.rng, last - first + 1
        cuts = sorted(rng.sample(range(first, last + 1), min(n, 2 * rng.randint(1, 2))))
        ranges = [(cuts[i], cuts[i + 1]) for i in range(0, len(cuts) - 1, 2)] or [(cuts[0], cuts[0])]
        return tuple((a, min(b, a + max(0, n // 4 - 1))) for a, b in ranges)  # a quarter of them at most each

    async def replay(self) -> bool:
        """`lakestream rewind --to-checkpoint C --skip-steps …` to a random retained checkpoint with
        steps after it (False: none yet): a replay. The mount readers are held until the mount shows
        it; the Python readers are left to notice it; no producer is fenced or moved back. A failed
        command is run again unless the follower shows that its rewind record landed (at most
        once: a retry in the same command recognises its own landed record). The skipped TGBs'
        records are read at once, before a reclaim past them lets GC delete their segments."""
        import anyio

        import lakestream

        run = self.run
        st = await run.refresh()
        cks = [c for c in st.checkpoints if c.step < st.head]
        if not cks:
            return False
        ck = run.rng.choice(cks)
        head_before, rewinds_before = st.head, st.rewinds
        skip = self.skip_ranges(ck.step + 1, head_before)
        spec = ",".join(f"{a}-{b}" for a, b in skip)
        run.out(f"[{run.now():7.1f}] replay from checkpoint {ck.id} at step {ck.step} (head {head_before}), "
                f"skipping steps {spec}")  # fmt: skip
        self.trainer_stops()  # as for a rewind
        attempts = 0
        while True:
            attempts += 1
            rc, text = await run.run_cli(
                "rewind", run.url, "--to-checkpoint", ck.id, "--skip-steps", spec, name="replay"
            )
            st = await run.refresh()
            applied = st.rewinds - rewinds_before
            if rc != 0 and applied:
                run.counts["replay_failed_but_landed"] += 1
            if rc == 0 or applied or attempts == 10:
                break
            run.counts["replay_retries"] += 1
        if rc == 0 and "replayed" not in text:
            run.failures.append(f"replay: exit 0 without saying 'replayed'\n{text}")
        if applied != 1:
            run.failures.append(f"the replay applied {applied} rewind records in {attempts} attempts\n{text}")
            run.rewind_version = st.version  # let the held mount readers go on
            return True
        seen = run.rewind_seen
        assert seen is not None
        run.rewind_info = {"to_checkpoint": ck.id, "to_step": ck.step, "head_before": head_before,
                           "skip": spec, "replayed_steps": len(seen["new"]), "skipped_tgbs": len(seen["skipped"]),
                           "attempts": attempts, "failed_but_landed": run.counts["replay_failed_but_landed"]}  # fmt: skip
        run.rewind_version = seen["version"]
        run.last_checkpoint = ck.step
        for r in run.readers:
            if r.kind == "py" and r.state == "running" and any(s > ck.step for s in r.consumed):
                r.saw_discarded_at = time.monotonic()  # it must raise StepUnavailable (or be killed first)
        run.failures.extend(checker.check_replay_keeps_the_rest_in_order(run, ck.step, skip))
        # the skipped TGBs' records, while their segments exist (GC keeps them until a reclaim passes them)
        for k in seen["skipped"]:
            per_rank: dict[int, list[Any]] = {}
            for rank in range(run.cfg.world_size):
                try:
                    async with lakestream.open_reader(run.store, rank, raw=True) as rd:
                        b = await rd.fetch_slice(k.step)
                except Exception as e:
                    run.failures.append(f"reading skipped step {k.step.step} rank {rank}: {type(e).__name__}: {e}")
                    continue
                per_rank[rank] = [[x["__key__"], sample_fields(x)] for x in b.samples]
            run.skipped.append((k, per_rank))
        await anyio.lowlevel.checkpoint()
        return True

    async def fork(self) -> bool:
        """`lakestream fork URL FORK --at-step S`, S the newest retained checkpoint's step + 1 (False:
        no checkpoint yet), run again until it succeeds (it finishes one cut short; the checker runs
        it once more at the end, when it must change nothing); then the same producers (ids,
        sources) on the fork, each to resume at its cursor as of S, one of them SIGKILLed within
        a few seconds. The fork must hold the source's TGBs below S as the follower saw them."""
        run = self.run
        st = await run.refresh()
        if not st.checkpoints:
            return False
        at = max(c.step for c in st.checkpoints) + 1
        run.out(f"[{run.now():7.1f}] fork at step {at} (head {st.head}) to {run.fork_url}")
        attempts = 0
        while True:
            attempts += 1
            rc, text = await run.run_cli("fork", run.url, run.fork_url, "--at-step", at, name="fork")
            if rc == 0 or attempts == 10:
                break
            run.counts["fork_retries"] += 1
        if rc != 0 or "forked" not in text:
            run.failures.append(f"fork: exit {rc} in {attempts} attempts\n{text}")
            return True
        head = st.head
        st = await run.refresh()
        hold = next((f.hold for f in st.forks if f.url == run.fork_url), None)
        if hold is None:
            run.failures.append(f"fork: the source does not list the fork: {st.forks}")
            return True
        fst = await checker.fork_state(run)
        resume = checker.cursors_before_fork(run, at)
        run.fork_info = {
            "at_step": at, "hold": hold, "attempts": attempts, "head": head,
            "steps": [run.history[s] for s in range(at) if s in run.history],
            "skipped": [k for k in st.skipped if k.at < at - 1],
            "cursors": {pid: p.cursor for pid, p in fst.producers.items()},
            "resume": {pid: checker.cursor_position(resume.get(pid)) for pid in run.sources},
        }  # fmt: skip
        run.failures.extend(checker.check_fork_shares_the_source_steps(run, fst))
        for p in run.producers:
            q = ProducerSlot(p.pid, p.src, p.files, p.inflight, p.policy, fork=True, restart_at=time.monotonic())
            q.expect_resume = run.fork_info["resume"][p.pid]
            run.fork_producers.append(q)
        self.fork_kill_at = time.monotonic() + run.rng.uniform(1.0, 3.0)
        return True

    # -- the schedule ----------------------------------------------------------------------------

    async def tick_processes(self) -> None:
        mono = time.monotonic()
        self.producers.tick(mono)
        if self.run.cfg.mount:
            await self.mount.tick(mono)
        await self.readers.tick(mono, self.mount)
        await self.gc.tick(mono)

    def chaos_tick(self, schedule: dict[str, float]) -> None:
        """Kill what is due: a producer, a reader process, the mount daemon."""
        run = self.run
        mono = time.monotonic()
        if mono >= schedule["producer"]:
            schedule["producer"] = mono + run.rng.expovariate(1 / run.cfg.producer_kill_every)
            running = [p for p in run.producers + run.fork_producers if p.state == "running"]
            if running:
                self.producers.kill(run.rng.choice(running))
        if mono >= schedule["reader"]:
            schedule["reader"] = mono + run.rng.expovariate(1 / run.cfg.reader_kill_every)
            running_r = [r for r in run.readers if r.state == "running"]
            if running_r:
                self.readers.kill(run.rng.choice(running_r))
        if self.fork_kill_at is not None and mono >= self.fork_kill_at:
            running = [p for p in run.fork_producers if p.state == "running"]
            if running:
                self.producers.kill(run.rng.choice(running))
                self.fork_kill_at = None
        if run.cfg.mount and mono >= schedule["mount"]:
            schedule["mount"] = mono + run.rng.expovariate(1 / run.cfg.mount_kill_every)
            if self.mount.state == "running":
                self.mount.kill()

    # -- setup -----------------------------------------------------------------------------------

    def make_sources(self) -> int:
        """4 directories of small files with known bytes, one per producer; the readers' slots."""
        from cliutil import make_source_dir

        run, cfg = self.run, self.run.cfg
        n = cfg.samples_per_producer()
        src_rng = random.Random(cfg.seed * 7919 + 1)
        policies = cfg.policies
        for k in range(cfg.producers):
            pid = f"prod-{k}"
            src = run.workdir / "src" / pid
            run.sources[pid] = make_source_dir(src, f"p{k}", n, src_rng, max_bin=cfg.max_bin)
            inflight = 1 if k % 2 else 64 << 10  # one TGB per commit, or a few pipelined
            run.producers.append(ProducerSlot(pid, src, len(run.sources[pid]), inflight, policies[k % len(policies)]))
        run.readers = [
            ReaderSlot(f"{kind}{rank}", kind, rank, run.journals / f"{kind}{rank}.jsonl")
            for kind in (("py", "mnt") if cfg.mount else ("py",))
            for rank in range(cfg.world_size)
        ]
        return n

    async def init_stream(self) -> None:
        """`lakestream init` (with faults: retried until it says created or exists)."""
        run, cfg = self.run, self.run.cfg
        for _attempt in range(10):
            rc, text = await run.run_cli(
                "init", run.url, "--world-size", cfg.world_size, "--global-batch", cfg.global_batch,
                "--snapshot-every", cfg.snapshot_every, "--keep-checkpoints", cfg.keep_checkpoints,
                "--max-steps-ahead", cfg.max_steps_ahead, name="init",
            )  # fmt: skip
            if rc == 0:
                break
            run.counts["init_retries"] += 1
        else:
            raise RuntimeError(f"init failed:\n{text}")

    # -- the run ---------------------------------------------------------------------------------

    async def __call__(self) -> Report:
        import anyio
        import botocore.config
        import botocore.session

        import lakestream

        run, cfg = self.run, self.run.cfg
        t_start = time.monotonic()
        run.s3 = botocore.session.get_session().create_client(
            "s3", endpoint_url=run.env["AWS_ENDPOINT_URL"], region_name=run.env.get("AWS_REGION", "us-east-1"),
            aws_access_key_id=run.env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=run.env["AWS_SECRET_ACCESS_KEY"],
            config=botocore.config.Config(s3={"addressing_style": "path"}, retries={"total_max_attempts": 5}),
        )  # fmt: skip
        n = self.make_sources()
        run.out(
            f"torture: seed {cfg.seed}, {cfg.seconds:g} s of chaos, {cfg.producers} producers x {n} samples "
            f"({sum(len(v) for v in run.sources.values())} files), world size {cfg.world_size}, global batch "
            f"{cfg.global_batch}, faults {cfg.faults or 'none'} + timeouts {cfg.timeout_probability:g}, "
            f"orphan grace {cfg.orphan_grace:g} s, max steps ahead {cfg.max_steps_ahead}, workdir {run.workdir}"
        )
        await self.init_stream()
        inner = lakestream.open_store(run.url)
        run.store = run.faulty(inner, cfg.seed * 1000 + 1)  # checkpoints and the final reads
        await run.open_follower(run.faulty(inner, cfg.seed * 1000 + 2))
        if cfg.fork:  # the fork's final reads
            run.fork_store = run.faulty(lakestream.open_store(run.fork_url), cfg.seed * 1000 + 3)

        t_chaos = time.monotonic()
        run.fig["setup_s"] = round(t_chaos - t_start, 1)
        chaos_end = t_chaos + cfg.seconds
        rewind_time = t_chaos + cfg.rewind_at * cfg.seconds if cfg.rewind_at > 0 else None
        fork_time = t_chaos + (cfg.rewind_at or 0.5) * cfg.seconds if cfg.fork else None  # after the rewind
        schedule = {
            "producer": t_chaos + run.rng.expovariate(1 / cfg.producer_kill_every),
            "reader": t_chaos + run.rng.expovariate(1 / cfg.reader_kill_every),
            # at least one mount kill in any run
            "mount": t_chaos + run.rng.uniform(0.15, 0.45) * cfg.seconds,
        }
        self.gc.next_at = t_chaos + cfg.gc_every
        run.chaos = True
        drain_deadline = None
        t_drain = None
        drain_moved: tuple[int, ...] = ()
        drain_last_move = time.monotonic()
        next_progress = time.monotonic() + 5.0
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(run.follow)
                while True:
                    await self.tick_processes()
                    await self.maybe_checkpoint()
                    mono = time.monotonic()
                    if run.chaos:
                        self.chaos_tick(schedule)
                        if rewind_time is not None and mono >= rewind_time:
                            if cfg.replay:
                                rewind_time = None if await self.replay() else mono + 1.0
                            elif any(True for _ in run.manifest.state.checkpoints):
                                await self.rewind()
                                rewind_time = None
                            else:
                                rewind_time = mono + 1.0
                        if (
                            fork_time is not None and mono >= fork_time and rewind_time is None
                            and (run.rewind_wall is None or any(t > run.rewind_wall for _, _, t in run.checkpoints))
                        ):  # fmt: skip
                            fork_time = None if await self.fork() else mono + 1.0
                        pending = rewind_time is not None or fork_time is not None or self.fork_kill_at is not None
                        if mono >= chaos_end and (not pending or mono >= chaos_end + cfg.seconds):
                            run.chaos = False
                            if fork_time is not None:
                                run.failures.append("the fork was not made: no checkpoint after the rewind")
                            t_drain = mono
                            drain_deadline = mono + cfg.drain_timeout
                            drain_moved, drain_last_move = (), mono
                            run.out(f"[{run.now():7.1f}] chaos over; draining")
                            for p in run.producers + run.fork_producers:
                                p.drain = True
                                if p.state == "running":
                                    self.producers.kill(p, count=False)
                                    run.counts["drain_restarts"] += 1
                    else:
                        assert drain_deadline is not None and t_drain is not None
                        head = run.manifest.state.head
                        moved = (head, *(r.frontier for r in run.readers),
                                 *((p.state, p.incarnations) for p in run.fork_producers))  # fmt: skip
                        if moved != drain_moved:
                            drain_moved, drain_last_move = moved, mono
                        done = all(p.state == "done" for p in run.producers + run.fork_producers)
                        if done and all(r.frontier >= head for r in run.readers) and self.gc.child is None:
                            st = await run.refresh()
                            if st.head == head and all(r.frontier >= head for r in run.readers):
                                break
                        if mono > drain_deadline or mono - drain_last_move > cfg.drain_stall:
                            run.failures.append(
                                f"drain did not finish (it ran {mono - t_drain:.0f} s, the last "
                                f"{mono - drain_last_move:.0f} s without progress): producers "
                                f"{[(p.name, p.state) for p in run.producers + run.fork_producers]}, head {head}, readers "
                                f"{[(r.name, r.state, r.frontier) for r in run.readers]}"
                            )
                            break
                    if run.abort:
                        break
                    if mono >= next_progress:
                        next_progress = mono + 5.0
                        self.progress()
                    await anyio.sleep(0.05)
                tg.cancel_scope.cancel()
            t_checks = time.monotonic()
            await self.finish()
            await checker.check_all(run)
        except Exception:
            run.failures.append(f"harness error:\n{traceback.format_exc()}")
            t_checks = time.monotonic()
        finally:
            self.cleanup()
            for s in run.inproc[:1] + ([run.fork_store] if cfg.fork else []):
                with contextlib.suppress(Exception):
                    await s.aclose()
        end = time.monotonic()
        run.fig.update(
            {
                "seed": cfg.seed,
                "duration_s": round(end - t_start, 1),
                "chaos_s": round((t_drain or end) - t_chaos, 1),
                "drain_s": round(t_checks - (t_drain or t_checks), 1),
                "check_s": round(end - t_checks, 1),
            }
        )
        checker.figures(run, self.gc.seconds)
        return Report(not run.failures, run.failures, run.warnings, run.fig, str(run.workdir))

    def progress(self) -> None:
        run = self.run
        st = run.manifest.state
        run.out(
            f"[{run.now():7.1f}] head {st.head} first {st.first_step} v{st.version}; producers "
            + " ".join(f"{p.pid[-1]}:{p.state[0]}" for p in run.producers)
            + (
                " fork " + " ".join(f"{p.pid[-1]}:{p.state[0]}" for p in run.fork_producers)
                if run.fork_producers
                else ""
            )
            + "; readers "
            + " ".join(f"{r.name}:{r.state[0]}{r.frontier}" for r in run.readers)
            + f"; mount {self.mount.state}; ckpts {len(run.checkpoints)} "
            + ",".join(f"{c.id}@{c.step}" for c in st.checkpoints)
        )

    def cleanup(self) -> None:
        for c in self.run.children:
            c.kill()
        if self.run.cfg.mount:
            with contextlib.suppress(Exception):
                self.mount.unmount()

    async def finish(self) -> None:
        """Stop everything, run the final GC (no producer is alive: grace 0 is safe)."""
        run = self.run
        for p in run.producers + run.fork_producers:  # only after a failed drain is one still running
            if p.child is not None and p.child.kill():
                run.out(f"[{run.now():7.1f}] {p.name} still running after the drain: killed")
        for r in run.readers:
            if r.child is not None:
                r.child.kill(wait=False)
        if self.mount.child is not None:
            self.mount.stop()
        for r in run.readers:
            if r.child is not None:
                try:
                    r.child.popen.wait(30)
                except subprocess.TimeoutExpired:
                    run.failures.append(f"{r.name} did not die within 30 s of SIGKILL")
            self.readers.tail(r)
            r.state = "stopped"
        await self.gc.wait()
        run.out(f"[{run.now():7.1f}] stopped readers, gc and mount")
        await run.refresh()
        for _attempt in range(10):
            before = run.list_objects()
            rc, text = await run.run_cli("gc", run.url, "--orphan-grace", 0, "--force-grace", name="gc-final")
            run.account_deleted(before, run.list_objects(), "gc-final")
            if rc == 0:
                run.counts["gc_ok"] += 1
                run.fig["final_gc"] = text.strip().splitlines()[-1]
                break
            run.counts["gc_failed_injected_fault"] += 1
        else:
            run.failures.append(f"final gc failed 10 times:\n{text}")
        if run.fork_info is not None:  # the fork's own segments only; no producer of it is alive either
            for _attempt in range(10):
                rc, text = await run.run_cli("gc", run.fork_url, "--orphan-grace", 0, "--force-grace", name="gc-fork")
                if rc == 0:
                    run.fork_info["final_gc"] = text.strip().splitlines()[-1]
                    break
            else:
                run.failures.append(f"final gc of the fork failed 10 times:\n{text}")
        await run.refresh()


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
        return anyio.run(Driver(cfg, url, env, workdir))
    finally:
        os.environ.clear()
        os.environ.update(saved)


def main(argv: list[str] | None = None, *, description: str = "") -> int:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--minutes", type=float, default=None, help="chaos phase length (default 10)")
    ap.add_argument("--seconds", type=float, default=None)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--rate", type=float, default=15.0, help="samples/s per producer during chaos")
    ap.add_argument("--orphan-grace", type=float, default=Config.orphan_grace, help="of the periodic GC, seconds")
    ap.add_argument("--max-steps-ahead", type=int, default=Config.max_steps_ahead, help="back-pressure (0: off)")
    ap.add_argument("--faults", default=Config.faults, help="LAKESTREAM_FAULTS without seed ('' for none)")
    ap.add_argument("--timeouts", type=float, default=Config.timeout_probability, help="timeout probability per call")
    ap.add_argument(
        "--policies",
        default=",".join(Config.policies),
        help="commit policies, producer k takes the k-th (cycling); e.g. combine,combine,combine,dac",
    )
    ap.add_argument("--no-mount", action="store_true")
    ap.add_argument("--no-rewind", action="store_true")
    ap.add_argument(
        "--replay", action="store_true", help="the half-way rewind skips 1-2 ranges of steps (--skip-steps): a replay"
    )
    ap.add_argument(
        "--fork", action="store_true", help="fork the stream half-way (after the rewind) and produce to the fork too"
    )
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the work directory even if the run passes")
    ap.add_argument("--json", type=Path, default=None, help="write the report as JSON here")
    a = ap.parse_args(argv)
    seconds = a.seconds if a.seconds is not None else 60 * (a.minutes if a.minutes is not None else 10)
    seed = a.seed if a.seed is not None else random.randrange(1, 1 << 30)
    cfg = Config(
        seconds=seconds, seed=seed, rate=a.rate, orphan_grace=a.orphan_grace, max_steps_ahead=a.max_steps_ahead,
        faults=a.faults, timeout_probability=a.timeouts, mount=not a.no_mount, rewind_at=0 if a.no_rewind else 0.5,
        snapshot_every=64 if seconds > 120 else 16, policies=tuple(a.policies.split(",")), replay=a.replay,
        fork=a.fork,
    )  # fmt: skip
    if cfg.fork and cfg.max_steps_ahead:
        ap.error("--fork needs --max-steps-ahead 0: nothing reads the fork, back-pressure would hold its producers")
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
