"""Elastic training under torchrun: examples/train_torch.py checkpointed at 2 ranks and crashed, the
stream reshaped to 1 rank from the checkpoint's next step with `lakestream reshape`, and the job
resumed at 1 rank from the 2-rank checkpoint reads every later sample exactly once, on file:// and
on a real S3 server (SeaweedFS)."""

from __future__ import annotations

import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest
import torch  # the 'torch' extra (scripts/setup.sh installs it): a missing torch fails, never skips
from cliutil import describe, run_cli

import lakestream
from lakestream.torch import StreamDataset

ROOT = Path(__file__).parent.parent
EXAMPLE = ROOT / "examples" / "train_torch.py"
STEPS, BATCH, EVERY, KILL_AT = 20, 16, 5, 13
NEXT = 10  # the newest checkpoint before the crash trained on step 9
PRODUCED = 15  # steps committed for 2 ranks before training; the resumed job's producer writes the rest
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
TORCHRUN_TIMEOUT = 150.0


@pytest.fixture(autouse=True)
def no_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(params=["file", "s3"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A stream URL not created yet: a local directory, or a fresh prefix on the S3 server (with
    the AWS_* variables set, which the subprocesses inherit)."""
    if request.param == "file":
        return f"file://{tmp_path}/stream"
    s3: str = request.getfixturevalue("s3_url")
    return s3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(nproc: int, url: str, ckpt: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`torchrun --nproc-per-node NPROC examples/train_torch.py train URL ...` to completion."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
        "--master-port", str(free_port()), str(EXAMPLE), "train", url, "--ckpt-dir", str(ckpt),
        "--steps", str(STEPS), "--global-batch", str(BATCH), "--checkpoint-every", str(EVERY), *args,
    ]  # fmt: skip
    # its own process group, so that a timeout stops all of it (torchrun stops its workers, and
    # rank 0's producer, when terminated)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, stdin=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    t0 = time.monotonic()
    try:
        out, err = proc.communicate(timeout=TORCHRUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        err += f"\n[test] timed out after {TORCHRUN_TIMEOUT} s"
    err += f"\n[test] {nproc} ranks, {' '.join(args)}: {time.monotonic() - t0:.1f} s"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def explain(r: subprocess.CompletedProcess[str], ckpt: Path) -> str:
    log = ckpt / "producer.log"
    producer = log.read_text(errors="replace") if log.exists() else ""
    return f"exit {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}\n--- producer.log\n{producer}"


def read_keys(path: Path) -> dict[tuple[int, int], list[str]]:
    """The example's --keys file: {(step, rank): keys in the order read}; a (step, rank) read twice fails."""
    out: dict[tuple[int, int], list[str]] = {}
    for line in path.read_text().splitlines():
        step, rank, *keys = line.split()
        where = (int(step), int(rank))
        assert where not in out, f"step {where[0]} read twice by rank {where[1]}"
        out[where] = keys
    return out


def produced(step: int) -> list[str]:
    """The keys of `step`: the example's producer puts samples s0, s1, … BATCH to a step, in order."""
    return [f"s{i:09d}" for i in range(step * BATCH, (step + 1) * BATCH)]


async def read_rank(url: str, rank: int, world: int | None, start: int, stop: int) -> dict[int, list[str]]:
    async with lakestream.open_reader(url, rank, world) as r:
        return {b.step: [s["__key__"] for s in b.samples] async for b in r.steps(start, stop)}


@pytest.mark.timeout(600)
def test_a_job_checkpointed_at_2_ranks_resumes_at_1_reading_every_later_sample_once(url: str, tmp_path: Path) -> None:
    t0 = time.monotonic()
    ckpt, killed_keys, resumed_keys = tmp_path / "ckpt", tmp_path / "killed-keys.txt", tmp_path / "resumed-keys.txt"
    run_cli("init", url, "--world-size", 2, "--global-batch", BATCH, check=True)
    r = subprocess.run(
        [sys.executable, str(EXAMPLE), "produce", url, "--samples", str(PRODUCED * BATCH)],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr

    # 2 ranks: checkpoints after steps 4 and 9, a crash when step 13 arrives
    r = torchrun(2, url, ckpt, "--no-produce", "--kill-at", str(KILL_AT), "--keys", str(killed_keys))
    assert r.returncode != 0 and re.search(r"exitcode\s*:\s*17\b", r.stderr), explain(r, ckpt)
    assert "rank 0 of 2: training from scratch, next step 0" in r.stdout, explain(r, ckpt)
    assert sorted(p.name for p in ckpt.glob("ckpt-*.pt")) == ["ckpt-000000004.pt", "ckpt-000000009.pt"]
    saved = torch.load(ckpt / "ckpt-000000009.pt", map_location="cpu", weights_only=True)
    assert saved["dataset"] == {"next_step": NEXT} and saved["step"] == NEXT - 1
    at2 = {
        step: [anyio.run(read_rank, url, rank, 2, step, step + 1)[step] for rank in (0, 1)] for step in range(PRODUCED)
    }
    killed = read_keys(killed_keys)
    assert sorted(killed) == [(step, rank) for step in range(KILL_AT) for rank in (0, 1)]
    for step in range(KILL_AT):
        assert [killed[step, 0], killed[step, 1]] == at2[step], f"step {step}"
        assert sorted(at2[step][0] + at2[step][1]) == produced(step), f"step {step}"
    t1 = time.monotonic()

    r = run_cli("reshape", url, "--world-size", 1, "--from-step", NEXT, check=True)
    assert f"steps from {NEXT} on are read as 1 ranks" in r.stdout, describe(r)
    state = anyio.run(lakestream.load_state, url)
    assert (state.world_at(NEXT - 1), state.world_at(NEXT), state.head) == (2, 1, PRODUCED - 1)
    # A 1-rank trainer resumed from an older checkpoint is stopped at the first 2-rank step, not fed
    # half of it; a 2-rank one is stopped at the reshape.
    with pytest.raises(lakestream.ConfigMismatch, match="read as 2 ranks"):
        next(iter(StreamDataset(url, rank=0, world_size=1, start=NEXT - 5)))
    with pytest.raises(lakestream.ConfigMismatch, match="reshaped"):
        next(iter(StreamDataset(url, rank=1, world_size=2, start=NEXT)))

    # 1 rank, from the 2-rank checkpoint; its producer commits steps 15..19, sealed for 1 rank
    r = torchrun(1, url, ckpt, "--resume", "--keys", str(resumed_keys))
    assert r.returncode == 0, explain(r, ckpt)
    assert f"rank 0 of 1: training resumed from ckpt-000000009.pt, next step {NEXT}" in r.stdout, explain(r, ckpt)
    resumed = read_keys(resumed_keys)
    assert list(resumed) == [(step, 0) for step in range(NEXT, STEPS)]  # in order, none skipped, none before NEXT
    for step in range(NEXT, STEPS):
        keys = resumed[step, 0]
        assert len(keys) == len(set(keys)) == BATCH, f"step {step}: {keys}"
        assert sorted(keys) == produced(step), f"step {step}"
        if step < PRODUCED:  # committed for 2 ranks: their slices, one after the other
            assert keys == at2[step][0] + at2[step][1], f"step {step}"
    every = [k for step in range(NEXT) for rank in (0, 1) for k in killed[step, rank]]
    every += [k for step in range(NEXT, STEPS) for k in resumed[step, 0]]
    assert sorted(every) == [k for step in range(STEPS) for k in produced(step)]  # each sample once
    losses = [float.fromhex(line.split()[1]) for line in (ckpt / "losses.txt").read_text().splitlines()]
    assert len(losses) == KILL_AT + STEPS - NEXT and all(math.isfinite(v) for v in losses)

    state = anyio.run(lakestream.load_state, url)
    assert state.head == STEPS - 1 and state.producers["features"].cursor == STEPS * BATCH
    stored = [len(state.step(step).ranks) for step in range(NEXT, STEPS)]  # type: ignore[union-attr]
    assert stored == [2] * (PRODUCED - NEXT) + [1] * (STEPS - PRODUCED)  # re-sliced on read, then sealed for 1
    assert [(c.id, c.step) for c in state.checkpoints] == [("step-9", 9), ("step-14", 14), ("step-19", 19)]
    r = run_cli("verify", url)
    assert r.returncode == 0, describe(r)
    print(
        f"elastic torchrun ({url.split(':')[0]}): 2 ranks killed {t1 - t0:.1f} s, 1 rank resumed {time.monotonic() - t1:.1f} s"
    )


async def write_steps(url: str, world: int, steps: int) -> None:
    await lakestream.create(url, world_size=world, global_batch=BATCH)
    async with lakestream.open_producer(url, "p", policy="eager") as p:
        for i in range(steps * BATCH):
            await p.put({"__key__": f"s{i:09d}", "x": b"x"}, cursor=i + 1)


@pytest.mark.parametrize(("world", "world2"), [(2, 1), (2, 3), (3, 2)])
def test_a_dataset_state_saved_by_w_ranks_loads_in_w2_ranks(tmp_path: Path, world: int, world2: int) -> None:
    """StreamDatasets of W ranks read steps 0..2 and save their state; after a reshape from step 3,
    W2 ranks load it and read steps 3..5: every sample of those steps once, spread within one."""
    url = f"file://{tmp_path}/stream"
    anyio.run(write_steps, url, world, 6)
    before = [StreamDataset(url, rank=r, world_size=world, stop=3) for r in range(world)]
    first = [{it["step"]: [s["__key__"] for s in it["samples"]] for it in ds} for ds in before]
    states = [ds.state_dict() for ds in before]
    assert states == [{"next_step": 3}] * world
    run_cli("reshape", url, "--world-size", world2, "--from-step", 3, check=True)
    after = []
    for r in range(world2):
        ds = StreamDataset(url, rank=r, world_size=world2, stop=6)
        ds.load_state_dict(states[0])
        after.append({it["step"]: [s["__key__"] for s in it["samples"]] for it in ds})
    for step in range(6):
        parts = [f[step] for f in first] if step < 3 else [a[step] for a in after]
        assert sorted(k for p in parts for k in p) == produced(step), f"step {step}"
        assert max(map(len, parts)) - min(map(len, parts)) <= 1, f"step {step}: {list(map(len, parts))}"
    assert all(sorted(a) == [3, 4, 5] for a in after)  # nothing before the saved step is read again
