"""Crash tests with real processes: `lakestream produce` killed with SIGKILL and restarted, and a
stopped ("zombie") incarnation that wakes up after a newer one registered.

Every producer runs as its own `lakestream produce` subprocess against a file:// stream and a
stream on the real S3 server (SeaweedFS). The checks are end to end: what every rank reads back
(`lakestream read --out` and the Python reader) against the source files, and `lakestream verify`.
"""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest
from cliutil import cursor_position, describe, make_source_dir, read_out_dir, run_cli, spawn_cli

import lakestream
from lakestream._manifest import SNAPSHOT_PREFIX, log_key
from lakestream._state import State

REGISTERED = re.compile(r"producer (\S+) registered epoch (\d+), resuming at (.*)")  # the cursor as JSON


@dataclass
class Stream:
    url: str
    env: dict[str, str]


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def stream(request: pytest.FixtureRequest, tmp_path: Path) -> Stream:
    if request.param == "file":
        return Stream(f"file://{tmp_path / 'stream'}", {})
    server = request.getfixturevalue("s3_server")
    return Stream(request.getfixturevalue("s3_url"), server.env())


def _finish(proc: subprocess.Popen[str], timeout: float = 120.0) -> tuple[str, str]:
    """Wait for a process and collect its output (closes its pipes)."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"{proc.args} did not finish within {timeout} s\n{out}\n{err}") from None


def _kill(proc: subprocess.Popen[str]) -> tuple[str, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    return proc.communicate()


def _reap(proc: subprocess.Popen[str]) -> None:
    """Whatever happened: the process is gone (stopped or not) and its pipes are closed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)  # a SIGKILL ends a stopped process too
    proc.wait()
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def _wait_registered(proc: subprocess.Popen[str]) -> re.Match[str] | None:
    """Read the stderr of a `lakestream -v produce` until it logs its registration (None: it exited first)."""
    assert proc.stderr is not None
    for line in proc.stderr:
        if m := REGISTERED.search(line):
            return m
    return None


# -- exactly-once under SIGKILL ---------------------------------------------------------------------


async def _wait_for_commit(url: str, pid: str, epoch: int, proc: subprocess.Popen[str]) -> bool:
    """Follow the log until incarnation `epoch` of `pid` has committed a TGB (False: it exited first)."""
    async with lakestream.open_reader(url, 0) as r:
        seen = 0
        while proc.poll() is None:
            steps = r.state.steps
            if any(s.producer == pid and s.epoch == epoch for s in steps[seen:]):
                return True
            seen = len(steps)
            await anyio.sleep(0.005)
            await r.refresh()
    return False


@dataclass
class Driver:
    """Runs one producer id as `lakestream produce` processes: start, SIGKILL, restart, until one exits 0.

    Each incarnation that is to be killed is killed either early (within `early` seconds of its
    registration, usually before it commits anything) or mid-stream: once it has committed a TGB,
    after a random fraction of `window` seconds (so at any point of its upload/commit cycle).
    """

    stream: Stream
    pid: str
    src: Path
    files: int  # in src: the cursor once everything is committed
    rng: random.Random
    kills_wanted: int
    window: float
    inflight: int  # --max-inflight-bytes
    early: float = 0.05
    starts: int = 0
    kills: int = 0
    resumed_at: list[int] = field(default_factory=list)

    def run(self) -> None:
        args: list[Any] = ["-v", "produce", self.stream.url, "--producer-id", self.pid, "--from-dir", self.src]
        args += ["--max-inflight-bytes", self.inflight]
        while True:
            assert self.starts < self.kills_wanted + 20, f"{self.pid}: too many restarts"
            proc = spawn_cli(*args, env=self.stream.env)
            self.starts += 1
            try:
                m = _wait_registered(proc)
                if m is not None:
                    assert int(m[2]) == self.starts, f"{self.pid}: incarnation {self.starts} got epoch {m[2]}"
                    self.resumed_at.append(cursor_position(json.loads(m[3])))
                if m is not None and self.kills < self.kills_wanted and self.resumed_at[-1] < self.files:
                    if self.rng.random() < 0.25:
                        delay = self.rng.uniform(0.0, self.early)
                    else:
                        delay = self.rng.uniform(0.0, self.window)
                        if not anyio.run(_wait_for_commit, self.stream.url, self.pid, self.starts, proc):
                            delay = 0.0  # it finished: let it be
                    try:
                        proc.wait(delay)
                    except subprocess.TimeoutExpired:
                        _kill(proc)
                        self.kills += 1
                        continue
                out, err = _finish(proc)
            finally:
                _reap(proc)
            assert proc.returncode == 0, f"{self.pid} incarnation {self.starts}: exit {proc.returncode}\n{out}\n{err}"
            return


async def _read_ranks(url: str, world: int, head: int) -> list[list[lakestream.RankBatch]]:
    out: list[list[lakestream.RankBatch]] = []
    for rank in range(world):
        async with lakestream.open_reader(url, rank, raw=True) as r:
            out.append([b async for b in r.steps(0, head + 1)])
    return out


async def _check_snapshots(url: str) -> int:
    """Every snapshot equals the replay of the log up to its version; the number of snapshots."""
    async with lakestream.open_store(url) as store:
        keys = await store.list(SNAPSHOT_PREFIX)
        snaps = {int(k.rsplit("/", 1)[1].removesuffix(".json")): await store.get(k) for k in keys}
        replay = State()
        for v in range(max(snaps, default=-1) + 1):
            replay.apply(v, await store.get(log_key(v)))
            if v in snaps:
                assert State.from_json(snaps[v]).to_json() == replay.to_json() == snaps[v], f"snapshot {v}"
        return len(snaps)


# (world size, global batch, samples per source, kills per producer, mid-stream kill window in seconds)
CRASH_CONFIG = {"file": (4, 8, (250, 301, 347, 398), 4, 0.05), "s3": (2, 8, (250, 301, 347), 4, 0.1)}


def test_exactly_once_under_sigkill(stream: Stream, tmp_path: Path) -> None:
    scheme = stream.url.split(":", 1)[0]
    world, batch, sizes, kills_each, window = CRASH_CONFIG[scheme]
    rng = random.Random(20240611)
    # Small snapshot interval: snapshots are written (and read back) while producers are killed.
    run_cli(
        "init", stream.url, "--world-size", world, "--global-batch", batch, "--snapshot-every", 16,
        env=stream.env, check=True,
    )  # fmt: skip

    sources: dict[str, dict[str, bytes]] = {}  # producer id -> {file name: bytes}
    drivers = []
    for k, n in enumerate(sizes):
        pid = f"prod-{k}"
        src = tmp_path / f"src-{k}"
        sources[pid] = make_source_dir(src, f"s{k}", n, rng)
        # Half the producers commit every TGB on its own (in-flight bound: 1 byte), half pipeline
        # a few TGBs (about 1 KB each) into one commit record.
        inflight = 1 if k % 2 else 4096
        driver_rng = random.Random(rng.random())
        drivers.append(Driver(stream, pid, src, len(sources[pid]), driver_rng, kills_each, window, inflight))

    t0 = time.monotonic()
    with ThreadPoolExecutor(len(drivers)) as pool:
        for f in [pool.submit(d.run) for d in drivers]:
            f.result()
    produce_s = time.monotonic() - t0

    state = anyio.run(lakestream.load_state, stream.url)
    kills = sum(d.kills for d in drivers)
    # A kill "mid-stream" hit an incarnation that had committed something and was not done yet.
    epochs_with_progress = {
        d.pid: sorted({s.epoch for s in state.steps if s.producer == d.pid and s.epoch < d.starts}) for d in drivers
    }
    mid = sum(len(v) for v in epochs_with_progress.values())
    print(
        f"\n{scheme}: {kills} SIGKILLs ({mid} after the killed incarnation had committed), "
        f"{sum(d.starts for d in drivers)} starts, {len(state.steps)} steps, produce phase {produce_s:.1f} s"
    )
    for d in drivers:
        print(
            f"  {d.pid}: {d.kills} kills, resumed at files {d.resumed_at}, "
            f"killed epochs with commits {epochs_with_progress[d.pid]}"
        )
    assert kills >= kills_each * len(drivers) // 2, "too few kills: the producers finished too early"
    assert mid >= len(drivers), "too few kills landed mid-stream"

    # The manifest: steps 0..head gap-free; each producer's epochs = its incarnations, its cursor at the end.
    head = state.head
    assert [s.step for s in state.steps] == list(range(head + 1))
    assert state.rejected == []
    for d in drivers:
        p = state.producers[d.pid]
        assert p.epoch == d.starts
        assert cursor_position(p.cursor) == len(sources[d.pid])

    t1 = time.monotonic()
    # Every rank, through the CLI: each source file in exactly one (step, rank), bytes equal.
    seen: dict[str, list[tuple[int, int]]] = defaultdict(list)
    got: dict[str, bytes] = {}
    for rank in range(world):
        out = tmp_path / f"out-{rank}"
        run_cli("read", stream.url, "--rank", rank, "--out", out, env=stream.env, check=True)
        steps = read_out_dir(out)
        assert sorted(steps) == list(range(head + 1)), f"rank {rank} did not get every step 0..{head}"
        for step, files in steps.items():
            for name, data in files.items():
                seen[name].append((step, rank))
                got[name] = data
    expected = {name: data for files in sources.values() for name, data in files.items()}
    dupes = {name: where for name, where in seen.items() if len(where) > 1}
    assert not dupes, f"{len(dupes)} files read more than once, e.g. {sorted(dupes.items())[:5]}"
    lost = sorted(set(expected) - set(got))
    assert not lost, f"{len(lost)} files lost, e.g. {lost[:10]}"
    assert not set(got) - set(expected), f"unexpected files {sorted(set(got) - set(expected))[:10]}"
    wrong = [name for name in expected if got[name] != expected[name]]
    assert not wrong, f"{len(wrong)} files with other bytes, e.g. {wrong[:10]}"
    for name, [(step, rank)] in seen.items():  # the fields of one sample travel together
        key = name.partition(".")[0]
        for other in (f"{key}.txt", f"{key}.bin"):
            assert seen[other] == [(step, rank)], f"{name} at {(step, rank)}, {other} at {seen[other]}"

    t2 = time.monotonic()
    # Every rank, through the Python reader: the same producer at every step on every rank, and
    # each producer's samples in source order, in full global batches but for the stream's last.
    per_rank = anyio.run(_read_ranks, stream.url, world, head)
    order: dict[str, list[str]] = defaultdict(list)
    consumed: dict[str, int] = Counter()
    owners = {d.pid.rsplit("-", 1)[1]: d.pid for d in drivers}
    for step in range(head + 1):
        entry = state.step(step)
        assert entry is not None
        batches = [per_rank[rank][step] for rank in range(world)]
        assert [b.step for b in batches] == [step] * world
        assert {b.producer for b in batches} == {entry.producer}, f"step {step}: ranks disagree on the producer"
        assert {b.version for b in batches} == {entry.version}
        n = sum(len(b) for b in batches)
        samples = [batches[i % world].samples[i // world] for i in range(n)]  # round-robin put order
        for sample in samples:  # key s<i>-… is of producer <prefix>-<i>
            owner = owners[sample["__key__"].split("-")[0][1:]]
            order[owner].append(sample["__key__"])
            consumed[owner] += len(sample) - 1
        if entry.packed is None:
            keys = [sample["__key__"] for sample in samples]
            assert {owners[k.split("-")[0][1:]] for k in keys} == {entry.producer}, (step, entry.producer, keys)
        for pid, cursor in entry.cursors():  # a step packing the leftovers: each producer's cursor after them
            assert cursor_position(cursor) == consumed[pid], f"step {step}: cursor {cursor} is not past its last file"
    for d in drivers:
        want = sorted({name.partition(".")[0] for name in sources[d.pid]})
        assert order[d.pid] == want, f"{d.pid}: samples out of order, lost or duplicated"
    # in full global batches but for the stream's last step
    assert [s.samples for s in state.steps[:-1]] == [batch] * head and 0 < state.steps[-1].samples <= batch

    snapshots = anyio.run(_check_snapshots, stream.url)
    assert snapshots >= 1

    t3 = time.monotonic()
    r = run_cli("verify", stream.url, env=stream.env)
    assert r.returncode == 0, describe(r)
    assert r.stdout.startswith("OK"), describe(r)
    print(
        f"  {snapshots} snapshots checked; read --out {t2 - t1:.1f} s, Python reader + snapshots {t3 - t2:.1f} s, "
        f"verify {time.monotonic() - t3:.1f} s"
    )


# -- fencing a zombie ---------------------------------------------------------------------------------


async def _wait_for_step(url: str, step: int) -> None:
    async with lakestream.open_reader(url, 0) as r:
        await r.wait_for_step(step, timeout=60)


async def _records(url: str, first: int, last: int) -> list[tuple[int, dict[str, Any]]]:
    async with lakestream.open_store(url) as store:
        return [(v, orjson.loads(await store.get(log_key(v)))) for v in range(first, last + 1)]


def test_zombie_producer_is_fenced(stream: Stream) -> None:
    url, env = stream.url, stream.env
    run_cli("init", url, "--world-size", 2, "--global-batch", 4, env=env, check=True)
    pid = "zombie"
    # Slowed down (CPU work per sample) so that it is mid-stream when stopped.
    first = spawn_cli(
        "-v", "produce", url, "--producer-id", pid, "--synthetic", 1_000_000, "--sample-size", 512, "--work-ms", 5,
        env=env,
    )  # fmt: skip
    try:
        m = _wait_registered(first)
        assert m is not None and m[2] == "1", "the first incarnation did not register with epoch 1"
        anyio.run(_wait_for_step, url, 2)  # epoch 1 has committed some steps
        first.send_signal(signal.SIGSTOP)
        before = anyio.run(lakestream.load_state, url)
        assert {s.epoch for s in before.steps if s.producer == pid} == {1}

        # A second incarnation registers, resumes at the committed cursor and commits some more.
        total = before.producers[pid].cursor + 40
        second = run_cli("produce", url, "--producer-id", pid, "--synthetic", total, "--sample-size", 512, env=env)
        assert second.returncode == 0 and f"producer {pid} epoch 2: resumed at " in second.stdout, describe(second)
        middle = anyio.run(lakestream.load_state, url)

        first.send_signal(signal.SIGCONT)
        out, err = _finish(first, timeout=60)
    finally:
        _reap(first)
    assert first.returncode != 0, f"the zombie exited {first.returncode}\n{out}\n{err}"
    assert "another process registered as producer 'zombie' (epoch 2) and fenced this one (epoch 1)" in err, err
    assert "lakestream produce: error:" in err and "Traceback" not in err, err
    print(f"\nzombie: exit {first.returncode}: {err.strip().splitlines()[-1]}")

    after = anyio.run(lakestream.load_state, url)
    assert after.version == middle.version, "the zombie wrote to the log after it woke up"
    records = anyio.run(_records, url, before.version + 1, after.version)
    registers = [(v, r) for v, r in records if r["kind"] == "register"]
    assert [(r["producer"], r["epoch"]) for _, r in registers] == [(pid, 2)], registers
    reg_version = registers[0][0]
    mine = [s for s in after.steps if s.producer == pid]
    older = [s for s in mine if s.version < reg_version]
    newer = [s for s in mine if s.version > reg_version]
    assert older and newer, "each incarnation committed something"
    assert all(s.epoch == 1 for s in older)
    assert all(s.epoch == 2 for s in newer), [(s.step, s.version, s.epoch) for s in newer]
    assert [s.seq for s in mine] == list(range(len(mine))), "sequence numbers are not gap-free"
    assert f"resumed at {older[-1].cursor}," in second.stdout, "the second incarnation resumed after epoch 1's commits"
    assert after.producers[pid].epoch == 2 and after.producers[pid].cursor == total

    # Exactly the samples 0..total-1, once each, in order: nothing the zombie had pending leaked.
    batches = anyio.run(_read_ranks, url, 2, after.head)
    keys = []
    for step in range(after.head + 1):
        b0, b1 = batches[0][step], batches[1][step]
        keys += [(b0, b1)[i % 2].samples[i // 2]["__key__"] for i in range(len(b0) + len(b1))]
    assert keys == [f"{pid}-{i:09d}" for i in range(total)]
    run_cli("verify", url, env=env, check=True)
