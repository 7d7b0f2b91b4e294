"""`lakestream top`: the view computed from two manifest states (a pure function, on states real
producers wrote), its rendering, and `top --once --json` on live streams driven by real producer
processes."""

from __future__ import annotations

import io
import json
import re
import signal
import subprocess
import time
from pathlib import Path

import anyio
from cliutil import run_cli, spawn_cli, wait_until
from rich.console import Console

import lakestream
from lakestream._manifest import Manifest
from lakestream._top import render, view


async def _steps(url: str, producer: str, n: int, batch: int) -> None:
    """`n` steps by `producer`, one commit each."""
    async with lakestream.open_producer(url, producer) as p:
        for i in range(n):
            for j in range(batch):
                await p.put({"__key__": f"{producer}-{p.committed_seq + 1}-{i}-{j}", "v": b"x" * 100})
            await p.flush()


def test_view_of_two_states(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 's'}"

    async def build() -> tuple[lakestream.State, lakestream.State]:
        await lakestream.create(url, world_size=2, global_batch=4)
        await _steps(url, "a", 3, 4)
        await _steps(url, "b", 2, 4)
        before = await lakestream.load_state(url)
        await _steps(url, "a", 4, 4)
        await _steps(url, "b", 2, 4)
        await lakestream.checkpoint(url, "c1", 6)
        return before, await lakestream.load_state(url)

    before, after = anyio.run(build)
    now = time.time()
    v = view(before, after, 2.0, now, url)
    assert v["url"] == url and v["head_step"] == 10 and v["version"] == after.version
    assert v["steps_per_second"] == 3.0 and v["commits_per_second"] == 3.0  # 6 steps, 6 commits in 2 s
    assert (v["world_size"], v["global_batch"]) == (2, 4)
    a, b = v["producers"]
    assert (a["id"], b["id"]) == ("a", "b")
    assert (a["steps_per_second"], a["pace_seconds"], a["tgbs_per_commit"]) == (2.0, 0.5, 1.0)
    assert (b["steps_per_second"], b["pace_seconds"], b["tgbs_per_commit"]) == (1.0, 1.0, 1.0)
    assert a["tgbs"] == 7 and b["tgbs"] == 4
    assert a["active"] and b["active"] and v["active_producers"] == 2
    assert 0 <= a["last_commit_age_seconds"] < 60
    assert v["conflict_rate"] == 0.0  # one producer at a time: no race lost
    assert v["tgb"] == {"steps": 6, "samples": 4.0, "bytes": v["tgb"]["bytes"]} and v["tgb"]["bytes"] > 400
    assert v["watermark"] == 6 and v["last_checkpoint"] == {"id": "c1", "step": 6}
    assert v["steps_ahead"] == 4 and v["max_steps_ahead"] == 0 and v["backpressure"] is False
    assert v["gc"] == {"first_step": 0, "reclaimed_steps": 0, "retained_steps": 11}
    json.dumps(v)  # JSON-able as it is

    # The conflict rate is DAC's estimate: lost races of the latest commit of each producer that
    # committed in the interval, over those races plus those commits.
    after.producers["a"].lost = 2
    assert view(before, after, 2.0, now, url)["conflict_rate"] == 0.5
    # A producer idle for longer than the window is not active; nothing moved between equal states.
    later = view(after, after, 2.0, now + 120, url)
    assert later["active_producers"] == 0 and later["steps_per_second"] == 0.0
    assert later["conflict_rate"] is None and later["producers"][0]["pace_seconds"] is None
    assert later["tgb"]["steps"] == 11  # none new: the newest retained steps

    console = Console(file=io.StringIO(), width=150, record=True)
    console.print(render(v))
    text = console.export_text()
    for shown in ("head step", "10  3.00 steps/s", "2 active of 2", "conflict rate 0%", "watermark", "c1",
                  "4 steps ahead", "back-pressure", "0.50 s"):  # fmt: skip
        assert shown in text, (shown, text)
    assert v["jobs"] == [{"job": "main", "consumed": None, "lag": None, "mark_age_seconds": None}]
    assert "steps behind head" not in text  # `main` alone: no table of jobs

    # Jobs: each with the step its mark says it consumed last, how far behind the head, how old the mark is.
    after.jobs = ["eval"]
    v = view(before, after, 2.0, now, url, {"main": (9, now - 1.5), "eval": (4, now - 30)})
    assert v["jobs"] == [
        {"job": "main", "consumed": 9, "lag": 1, "mark_age_seconds": 1.5},
        {"job": "eval", "consumed": 4, "lag": 6, "mark_age_seconds": 30.0},
    ]
    assert view(before, after, 2.0, now, url, {"main": (9, now)})["jobs"][1]["consumed"] is None  # no mark yet
    v["jobs"][1]["job"] = "x[/y]\x1b[31m"  # shown as text, escaped, whatever the view holds
    console = Console(file=io.StringIO(), width=150, record=True)
    console.print(render(v))
    text = console.export_text()
    assert re.search(r"main[ │]+9[ │]+1[ │]+1\.5 s ago", text), text
    assert re.search(re.escape("x[/y]\\x1b[31m") + r"[ │]+4[ │]+6[ │]+30\.0 s ago", text), text
    assert "\x1b" not in text


def _top_json(url: str, interval: float = 1.5) -> dict:
    r = run_cli("top", url, "--once", "--json", "--interval", interval, check=True)
    assert r.stdout.count("\n") == 1, r.stdout
    return json.loads(r.stdout)


def _stop(*procs: subprocess.Popen[str]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    for p in procs:
        p.communicate(timeout=30)


def test_top_once_json_shows_the_producers_and_rates_of_a_live_stream(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 's'}"
    run_cli("init", url, "--world-size", "2", "--global-batch", "8", check=True)
    args = ("--synthetic", "100000", "--sample-size", "256", "--rate", "80")
    procs = [spawn_cli("produce", url, "--producer-id", pid, *args) for pid in ("p0", "p1")]
    try:
        wait_until(
            lambda: {"p0", "p1"} <= {k for k, p in anyio.run(lakestream.load_state, url).producers.items() if p.tgbs},
            30, "both producers committing",
        )  # fmt: skip
        v = _top_json(url)
        assert v["url"] == url
        assert v["active_producers"] == 2
        ids = {p["id"]: p for p in v["producers"]}
        assert set(ids) == {"p0", "p1"}
        for p in ids.values():
            assert p["active"] and p["steps_per_second"] > 0 and p["pace_seconds"] > 0, p
            assert p["last_commit_age_seconds"] < 30
        assert v["steps_per_second"] > 0 and v["head_step"] >= 2
        assert abs(v["steps_per_second"] - sum(p["steps_per_second"] for p in ids.values())) < 0.01
        assert v["conflict_rate"] is not None and 0 <= v["conflict_rate"] < 1
        assert v["tgb"]["samples"] == 8.0
        assert v["watermark"] == -1 and v["backpressure"] is False
    finally:
        _stop(*procs)


def test_top_shows_back_pressure_and_how_far_producers_run_ahead(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 's'}"
    run_cli("init", url, "--world-size", "1", "--global-batch", "4", "--max-steps-ahead", "3", check=True)
    proc = spawn_cli("produce", url, "--producer-id", "held", "--synthetic", "400")
    try:
        wait_until(lambda: anyio.run(lakestream.load_state, url).head == 2, 30, "three steps")
        v = _top_json(url, 0.5)
        assert v["backpressure"] is True and v["steps_ahead"] == 3 and v["max_steps_ahead"] == 3
        assert v["steps_per_second"] == 0.0 and v["head_step"] == 2
        run_cli("checkpoint", url, "--id", "c1", "--step", "1", check=True)
        wait_until(lambda: anyio.run(lakestream.load_state, url).head == 4, 30, "two more steps")
        v = _top_json(url, 0.5)
        assert v["watermark"] == 1 and v["steps_ahead"] == 3 and v["backpressure"] is True
        assert v["last_checkpoint"] == {"id": "c1", "step": 1}
        table = run_cli("top", url, "--once", "--interval", "0.2", check=True).stdout
        assert "producers held" in table and "held" in table and "checkpoint c1" in table, table
    finally:
        _stop(proc)


def test_progress_bars_on_a_terminal_only(tmp_path: Path) -> None:
    """`read` draws its bar on stderr when stderr is a terminal (a real pty here), and says nothing more
    than its summary line when it is a pipe."""
    import os
    import pty

    from cliutil import LAKESTREAM, cli_env

    url = f"file://{tmp_path / 's'}"
    run_cli("init", url, "--world-size", "1", "--global-batch", "4", check=True)
    run_cli("produce", url, "--producer-id", "a", "--synthetic", "20", "--sample-size", "64", check=True)
    master, slave = pty.openpty()
    proc = subprocess.Popen([*LAKESTREAM, "read", url, "--rank", "0"], stdout=subprocess.DEVNULL, stderr=slave,
                            stdin=subprocess.DEVNULL, env={**cli_env(), "TERM": "xterm", "COLUMNS": "100"})  # fmt: skip
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    assert proc.wait(timeout=60) == 0
    shown = b"".join(chunks).decode(errors="replace")
    assert "steps read" in shown and "5/5" in shown and "rank 0: 5 steps" in shown, shown
    piped = run_cli("read", url, "--rank", "0", check=True)
    assert piped.stderr == "rank 0: 5 steps, 0.0 MB\n", piped.stderr


def test_top_shows_names_from_the_store_as_text(tmp_path: Path) -> None:
    """A checkpoint id is whatever the trainer chose: rich markup in it (`x[/y]`) is shown as it is, not parsed
    (it crashed the table), and an escape sequence is shown escaped, never sent to the terminal."""
    url = f"file://{tmp_path / 's'}"
    run_cli("init", url, "--world-size", "1", "--global-batch", "2", check=True)
    run_cli("produce", url, "--producer-id", "p", "--synthetic", "4", check=True)
    for step, cid, shown in ((0, "x[/y]", "checkpoint x[/y]"), (1, "\x1b[31mred\x07", "checkpoint \\x1b[31mred\\x07")):
        anyio.run(lakestream.checkpoint, url, cid, step)
        r = run_cli("top", url, "--once", "--interval", "0.2", env={"COLUMNS": "200"})
        assert r.returncode == 0 and shown in r.stdout, (r.stdout, r.stderr)
        assert not any(c in r.stdout for c in "\x1b\x07"), r.stdout
        assert _top_json(url, 0.2)["last_checkpoint"] == {"id": cid, "step": step}

    anyio.run(lambda: lakestream.checkpoint(url, "e", 1, job="eval"))  # a second job, reading step 1
    anyio.run(lambda: Manifest(lakestream.open_store(url)).publish_consumed(1, time.time() - 10, "eval"))
    jobs = _top_json(url, 0.2)["jobs"]
    assert [(j["job"], j["consumed"], j["lag"]) for j in jobs] == [("main", None, None), ("eval", 1, 0)], jobs
    assert 10 <= jobs[1]["mark_age_seconds"] < 60, jobs
    r = run_cli("top", url, "--once", "--interval", "0.2", env={"COLUMNS": "200"})
    assert r.returncode == 0 and re.search(r"eval[ │]+1[ │]+0[ │]+1\d\.\d s ago", r.stdout), r.stdout
