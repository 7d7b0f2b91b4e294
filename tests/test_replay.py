"""Replay without bad steps: `lakestream rewind --to-checkpoint C --skip-steps A-B[,...]`.

The steps after the checkpoint become the next steps again, referenced rather than produced again,
but the skipped ones, whose samples are recorded as skipped (`status`, `verify`); producers go on
where they were, even one killed while the replay lands. (The state machine's part: test_state.py;
the API's, with GC: test_lifecycle.py.)
"""

from __future__ import annotations

import random
import signal
from pathlib import Path

import orjson
from cliutil import describe, make_source_dir, run_cli, spawn_cli, wait_until

import lakestream

WORLD, BATCH = 2, 4


async def keys_by_step(url: str) -> dict[int, list[str]]:
    state = await lakestream.load_state(url)
    out: dict[int, list[str]] = {}
    async with lakestream.open_reader(url, None) as r:
        for s in state.steps:
            out[s.step] = sorted({f.key for rank in range(WORLD) for f in (await r.fetch_raw(s, rank)).files})
    return out


def status(url: str) -> dict:
    return orjson.loads(run_cli("status", url, "--json", check=True).stdout)


async def test_skip_steps_on_the_command_line(stream_url: str, tmp_path: Path) -> None:
    url = stream_url
    make_source_dir(tmp_path / "src", "a", 10 * BATCH, random.Random(1))
    run_cli("init", url, "--world-size", WORLD, "--global-batch", BATCH, check=True)
    run_cli("produce", url, "--producer-id", "a", "--from-dir", tmp_path / "src", check=True)  # steps 0..9
    run_cli("checkpoint", url, "--id", "c", "--step", 3, check=True)
    before = await keys_by_step(url)
    for bad, why in [("6-5", "rising and disjoint"), ("5-6,6", "rising and disjoint"), ("x", "")]:
        r = run_cli("rewind", url, "--to-checkpoint", "c", "--skip-steps", bad, check=False)
        assert r.returncode == 2 and "--skip-steps" in r.stderr and why in r.stderr, describe(r)
    for bad, why in [("2", "after step 3"), ("8-12", "the head is step 9")]:
        r = run_cli("rewind", url, "--to-checkpoint", "c", "--skip-steps", bad, check=False)
        lines = r.stderr.strip().splitlines()
        assert r.returncode != 0 and len(lines) == 1 and why in lines[0], describe(r)
    assert status(url)["head_step"] == 9  # nothing happened
    r = run_cli("rewind", url, "--to-checkpoint", "c", "--skip-steps", "5-6,8", check=True)
    assert r.stdout.strip() == (
        f"replayed {url}: the steps after the rewind are now up to step 6, without steps 5-6,8 (3 TGBs, their "
        "samples recorded as skipped: `lakestream status`); producers continue where they were"
    )
    after = await keys_by_step(url)
    assert [after[s] for s in range(7)] == [before[n] for n in (0, 1, 2, 3, 4, 7, 9)]
    d = status(url)
    assert [(k["after_step"], k["was_step"], k["samples"]) for k in d["skipped"]] == [(4, 5, 4), (4, 6, 4), (5, 8, 4)]
    text = run_cli("status", url, check=True).stdout
    assert "skipped by a replay: 3 TGBs, 12 samples" in text and "after step 4: was step 5 (a seq 5, 4 samples)" in text
    r = run_cli("verify", url, check=True)
    assert "40 samples" not in r.stdout and "28 samples (12 skipped by a replay)" in r.stdout, describe(r)


async def test_a_producer_killed_while_a_replay_lands_goes_on_exactly_once(stream_url: str, tmp_path: Path) -> None:
    """A producer is at work when the replay lands (it is not fenced: it goes on), is SIGKILLed,
    and run again: every source sample is in one step or skipped, once, and verify is clean."""
    url = stream_url
    n = 40 * BATCH
    make_source_dir(tmp_path / "src", "a", n, random.Random(2))
    run_cli("init", url, "--world-size", WORLD, "--global-batch", BATCH, check=True)
    producer = spawn_cli("produce", url, "--producer-id", "a", "--from-dir", tmp_path / "src", "--rate", 8)
    try:
        wait_until(lambda: status(url)["head_step"] >= 6, timeout=60, what="steps 0..6")
        run_cli("checkpoint", url, "--id", "c", "--step", 2, check=True)
        run_cli("rewind", url, "--to-checkpoint", "c", "--skip-steps", "4,6", check=True)
        head = status(url)["head_step"]
        wait_until(lambda: status(url)["head_step"] >= head + 2, timeout=60, what="commits after the replay")
        assert producer.poll() is None, producer.communicate()  # not fenced: it went on
        producer.send_signal(signal.SIGKILL)
        producer.wait(timeout=30)
    finally:
        producer.kill()
        producer.communicate()
    skipped = status(url)["skipped"]
    assert [k["was_step"] for k in skipped] == [4, 6]
    run_cli("produce", url, "--producer-id", "a", "--from-dir", tmp_path / "src", check=True)
    state = await lakestream.load_state(url)
    async with lakestream.open_reader(url, None) as r:
        skipped_keys = [
            f.key for k in state.skipped for rank in range(WORLD) for f in (await r.fetch_raw(k.step, rank)).files
        ]
    keys = [k for ks in (await keys_by_step(url)).values() for k in ks] + sorted(set(skipped_keys))
    assert sorted(keys) == [f"a-{i:05d}" for i in range(n)]
    assert len(set(skipped_keys)) == 2 * BATCH
    r = run_cli("verify", url, check=True)
    assert f"({2 * BATCH} skipped by a replay)" in r.stdout, describe(r)
