"""Real processes at S3's latencies: 128 combining producers in 4 processes and 16 rank readers in 2
share one file:// stream at D = 10 steps/s for a minute, every process throttled to its share of
S3's per-prefix request rates. Training keeps up (rank 0 consumes >= 0.9·D between 10 s after the
start and the end of production), every sample is read exactly once, every rank reads the same
steps, and `verify` is OK. Every producer closes when production ends (leftovers, finish records,
the last one packing), and readers stop at the head as it is then.

The children are `tests/scale_children.py` (its docstring says what each runs and reports).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import lakestream

HERE = Path(__file__).resolve().parent
WORLD, BATCH, AHEAD = 16, 16, 32
PROCS, PER_PROC = 4, 32  # producer processes, producers in each
READERS = 2  # reader processes, WORLD // READERS ranks in each
D = 10.0  # TGBs (steps) per second, all producers together
DURATION = 60.0  # seconds of production
WARMUP = 10.0  # seconds after the start not counted in the consumption rate
# A fair share of S3's per-prefix rates (5,500 GET and 3,500 PUT per second) for each process.
GET_RATE, PUT_RATE = 900, 500


def spawn(mode: str, args: dict[str, Any], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, str(HERE / "scale_children.py"), mode, json.dumps(args)], stdout=out, stderr=out
        )


def publish(path: Path, text: str) -> None:
    """Write a file the children poll for whole or not at all (they read it once it exists)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def wait_all(procs: list[subprocess.Popen[bytes]], logs: list[Path], deadline: float) -> None:
    """Wait for every child until `deadline` (monotonic); a child that fails or hangs fails the test."""
    for proc, log in zip(procs, logs):
        try:
            rc = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rc = None
        if rc != 0:
            pytest.fail(f"{log.name}: {'hung' if rc is None else f'exit {rc}'}\n{log.read_text()[-3000:]}")


def wait_file(path: Path, procs: list[subprocess.Popen[bytes]], logs: list[Path], deadline: float) -> None:
    while not path.exists():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            pytest.fail(f"{path.name} not written\n" + "\n".join(f"{g.name}: {g.read_text()[-2000:]}" for g in logs))
        time.sleep(0.1)


@pytest.mark.timeout(300)
async def test_128_combining_producers_and_16_readers_at_s3_latencies_keep_up_exactly_once(tmp_path: Path) -> None:
    started = time.monotonic()
    url = f"file://{tmp_path}/s"
    await lakestream.create(url, world_size=WORLD, global_batch=BATCH, max_steps_ahead=AHEAD)
    go, stop = tmp_path / "go", tmp_path / "stop"
    readers, reader_logs = [], []
    for i in range(READERS):
        ranks = list(range(i, WORLD, READERS))
        spec = f"latency=s3,get_rate={GET_RATE},put_rate={PUT_RATE},seed={100 + i}"
        args = {"url": url, "ranks": ranks, "world": WORLD, "stop": str(stop), "faults": spec}
        args |= {"journal": str(tmp_path / f"journal{i}"), "report": str(tmp_path / f"read{i}.json")}
        reader_logs.append(tmp_path / f"read{i}.log")
        readers.append(spawn("read", args, reader_logs[-1]))
    producers, producer_logs = [], []
    for i in range(PROCS):
        spec = f"latency=s3,get_rate={GET_RATE},put_rate={PUT_RATE},seed={i + 1}"
        args = {"url": url, "proc": i, "producers": PER_PROC, "batch": BATCH, "period": PROCS * PER_PROC / D}
        args |= {"duration": DURATION, "go": str(go), "ready": str(tmp_path / f"ready{i}"), "faults": spec}
        args |= {"report": str(tmp_path / f"produce{i}.json")}
        producer_logs.append(tmp_path / f"produce{i}.log")
        producers.append(spawn("produce", args, producer_logs[-1]))
    children, logs = producers + readers, producer_logs + reader_logs
    try:
        for i in range(PROCS):  # every producer registered
            wait_file(tmp_path / f"ready{i}", children, logs, time.monotonic() + 60)
        registered = time.monotonic()
        t0 = time.time() + 0.5
        publish(go, repr(t0))
        wait_all(producers, producer_logs, time.monotonic() + DURATION + 120)  # 128 finish records take a while
        produced = time.monotonic()
        state = await lakestream.load_state(url)
        publish(stop, str(state.head))
        wait_all(readers, reader_logs, time.monotonic() + 30)
        caught_up = time.monotonic()
    finally:  # a failure leaves no child behind
        for p in children:
            if p.poll() is None:
                p.kill()
                p.wait()

    reports = [json.loads((tmp_path / f"produce{i}.json").read_text()) for i in range(PROCS)]
    put = {pid: r["put"] for rep in reports for pid, r in rep["producers"].items()}
    assert len(put) == PROCS * PER_PROC
    assert {pid: r["cursor"] for rep in reports for pid, r in rep["producers"].items()} == put
    read: dict[int, dict[int, list[str]]] = {}  # rank -> step -> keys
    t_read: dict[int, float] = {}  # step -> when rank 0 read it
    for i in range(READERS):
        for line in (tmp_path / f"journal{i}").read_text().splitlines():
            e = json.loads(line)
            assert e["step"] not in read.setdefault(e["rank"], {}), e  # each step once per rank
            read[e["rank"]][e["step"]] = e["keys"]
            if e["rank"] == 0:
                t_read[e["step"]] = e["t"]
    steps = list(range(state.first_step, state.head + 1))
    assert {rank: sorted(got) for rank, got in read.items()} == dict.fromkeys(range(WORLD), steps)
    keys = Counter(k for got in read.values() for ks in got.values() for k in ks)
    assert keys == Counter(f"{pid}-{i}" for pid, n in put.items() for i in range(n))
    assert all(len(read[0][s]) == 1 for s in steps[:-1])  # one sample per rank; only the last step short

    window = (t0 + WARMUP, t0 + DURATION)
    consumed = sum(window[0] <= t < window[1] for t in t_read.values()) / (window[1] - window[0])
    injected = Counter[str]()
    read_reports = [json.loads((tmp_path / f"read{i}.json").read_text()) for i in range(READERS)]
    for rep in [*reports, *read_reports]:
        injected.update(rep["injected"])
    figures = {
        "consumed_steps_per_s": round(consumed, 2), "steps": len(steps), "versions": state.version,
        "injected": dict(injected), "register_s": round(registered - started, 1),
        "produce_s": round(produced - registered, 1), "catch_up_s": round(caught_up - produced, 1),
        "cpu_s": [rep["cpu_s"] for rep in [*reports, *read_reports]],
        "calls": [rep["calls"] for rep in reports],
    }  # fmt: skip
    print(json.dumps(figures))
    assert consumed >= 0.9 * D, figures
    report = await lakestream.verify(url)
    assert report.ok, report.problems
