"""The transform stage (`produce --map MODULE:FUNCTION`, `--workers`, `--on-error`): dropping and expanding
samples, the same stream with worker processes, exact cursors across SIGKILL, and failing functions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest
from cliutil import describe, head_step, run_cli, spawn_cli, wait_until
from test_sources import make_wds

import lakestream
from lakestream._transform import MapError, is_sub_cursor, source_cursor, transform
from lakestream.sources import open_source

MAP_MODULE = """
import os
import time

def fn(sample):
    key = sample["__key__"]
    i = int(key.rsplit("-", 1)[1])
    if key == os.environ.get("MAP_FAIL_KEY"):
        raise RuntimeError("cannot decode")
    if key == os.environ.get("MAP_HANG_KEY"):
        while True:
            time.sleep(1)
    if key == os.environ.get("MAP_EXIT_KEY"):
        os._exit(3)
    if i % 2:
        return None  # odd samples are dropped
    if i % 4 == 0:  # one record into three; the copies keep the record's key, renamed <key>-<j>
        return [{**sample, "part": str(j).encode()} for j in range(3)]
    return {**sample, "txt": sample["txt"].upper()}
"""


def expected_keys(shards: int, per_shard: int) -> list[str]:
    keys = []
    for s in range(shards):
        for i in range(per_shard):
            key = f"s{s:03d}-{i:04d}"
            if i % 4 == 0:
                keys += [f"{key}-{j}" for j in range(3)]
            elif i % 2 == 0:
                keys.append(key)
    return keys


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    (tmp_path / "mod").mkdir()
    (tmp_path / "mod" / "mymap.py").write_text(MAP_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path / "mod"))
    make_wds(tmp_path / "wds", 3, 20)
    return {
        "env": {"PYTHONPATH": str(tmp_path / "mod")},
        "source": ["--source", f"wds:{tmp_path}/wds/*.tar", "--map", "mymap:fn"],
        "spec": f"wds:{tmp_path}/wds/*.tar",
    }


def stream_keys(url: str) -> list[str]:
    """Every committed sample's key in step order (world size 1)."""

    async def main() -> list[str]:
        keys: list[str] = []
        async with lakestream.open_reader(url, 0) as r:
            async for batch in r.steps(r.state.first_step, r.state.head + 1):
                keys += [s["__key__"] for s in batch.samples]
        return keys

    return anyio.run(main)


def status(url: str) -> dict[str, Any]:
    return json.loads(run_cli("status", url, "--json", check=True).stdout)


def test_every_cursor_resumes_with_exactly_the_rest(setup: dict[str, Any]) -> None:
    """In process: resuming at the cursor of output j (plain or {"at", "skip"}) yields exactly outputs j+1..."""
    src = open_source(setup["spec"])
    full = list(transform(src.iterate(None), "mymap:fn"))
    assert [s["__key__"] for s, _ in full] == expected_keys(3, 20)
    assert any(is_sub_cursor(c) for _, c in full) and not is_sub_cursor(full[-1][1])
    for j, (_, cursor) in enumerate(full):
        rest = list(transform(src.iterate(source_cursor(cursor, True)), "mymap:fn", start=cursor))
        assert [s["__key__"] for s, _ in rest] == [s["__key__"] for s, _ in full[j + 1 :]], (j, cursor)
    with pytest.raises(ValueError, match="inside a record expanded by --map"):
        source_cursor(full[0][1], False)
    s0, _ = full[0]
    assert s0["part"] == b"0" and full[3][0]["txt"] == b"CAPTION 0 2"


def test_workers_give_the_same_stream_and_stats(tmp_path: Path, setup: dict[str, Any]) -> None:
    streams = []
    for workers in (0, 2):
        url = f"file://{tmp_path}/stream{workers}"
        run_cli("init", url, "--world-size", 1, "--global-batch", 4, check=True)
        r = run_cli("produce", url, "--producer-id", "p", *setup["source"], "--workers", workers, "--stats-json",
                    env=setup["env"], check=True)  # fmt: skip
        figures = json.loads(r.stdout.splitlines()[0])
        assert figures["map"] == {"records": 60, "outputs": 60, "dropped": 30, "skipped": []}, describe(r)
        streams.append(stream_keys(url))
        run_cli("verify", url, check=True)
    assert streams[0] == streams[1] == expected_keys(3, 20)


def test_sigkill_mid_expansion_then_rerun_commits_every_output_once(tmp_path: Path, setup: dict[str, Any]) -> None:
    url = f"file://{tmp_path}/stream"
    run_cli("init", url, "--world-size", 1, "--global-batch", 2, check=True)
    command = ["produce", url, "--producer-id", "p", *setup["source"], "--workers", 2,
               "--max-inflight-bytes", 1, "--rate", 60]  # fmt: skip
    proc = spawn_cli(*command, env=setup["env"])
    try:
        wait_until(lambda: head_step(url) >= 12, timeout=20, what="13 committed steps")
    finally:
        proc.kill()
        proc.communicate()
    cursor = status(url)["producers"]["p"]["cursor"]
    assert cursor is not None, cursor
    run_cli(*command[:-2], env=setup["env"], check=True)
    assert stream_keys(url) == expected_keys(3, 20)
    run_cli("verify", url, check=True)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_failing_function_fails_naming_the_key_or_is_skipped(
    tmp_path: Path, setup: dict[str, Any], workers: int
) -> None:
    env = {**setup["env"], "MAP_FAIL_KEY": "s001-0006"}
    url = f"file://{tmp_path}/stream"
    run_cli("init", url, "--world-size", 1, "--global-batch", 4, check=True)
    base = ["produce", url, "--producer-id", "p", *setup["source"], "--workers", workers]
    r = run_cli(*base, env=env, check=False)
    assert r.returncode == 1, describe(r)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "'s001-0006'" in lines[0] and "train-001.tar" in lines[0], describe(r)
    assert "cannot decode" in lines[0], describe(r)
    r = run_cli(*base, "--on-error", "skip", "--stats-json", env=env, check=True)
    figures = json.loads(r.stdout.splitlines()[0])
    assert figures["map"]["skipped"] == ["s001-0006"] and figures["map"]["dropped"] > 0, describe(r)
    assert stream_keys(url) == [k for k in expected_keys(3, 20) if k != "s001-0006"]
    run_cli("verify", url, check=True)


def test_ctrl_c_stops_a_producer_whose_function_hangs_in_a_worker(tmp_path: Path, setup: dict[str, Any]) -> None:
    import signal
    import time

    url = f"file://{tmp_path}/stream"
    run_cli("init", url, "--world-size", 1, "--global-batch", 2, check=True)
    env = {**setup["env"], "MAP_HANG_KEY": "s000-0006"}
    proc = spawn_cli("produce", url, "--producer-id", "p", *setup["source"], "--workers", 1, env=env)
    try:
        wait_until(lambda: head_step(url) >= 1, timeout=30, what="the steps before the hung record")
        time.sleep(0.5)  # the worker is in the function by now
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=15)
        assert proc.returncode == 130 and time.monotonic() - started < 10, err
        assert "interrupted; committed through" in err and "Traceback" not in err, err
    finally:
        proc.kill()
        proc.communicate()
    # What was committed stays; a rerun without the hang finishes exactly.
    run_cli("produce", url, "--producer-id", "p", *setup["source"], "--workers", 1, env=setup["env"], check=True)
    assert stream_keys(url) == expected_keys(3, 20)


def test_a_worker_process_that_exits_is_named_with_its_record(tmp_path: Path, setup: dict[str, Any]) -> None:
    url = f"file://{tmp_path}/stream"
    run_cli("init", url, "--world-size", 1, "--global-batch", 4, check=True)
    env = {**setup["env"], "MAP_EXIT_KEY": "s001-0002"}
    r = run_cli("produce", url, "--producer-id", "p", *setup["source"], "--workers", 2, env=env, check=False)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, describe(r)
    assert "worker process ended abruptly" in lines[0] and "'s001-0002'" in lines[0], describe(r)
    assert "internal error" not in lines[0] and "BrokenProcessPool" not in lines[0], describe(r)


def test_a_worker_that_exits_before_the_next_record_is_submitted_is_named_with_its_record(
    setup: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool breaks while the source is slow to give the next record: submitting it raises
    BrokenProcessPool, which must not escape; the record the worker was mapping is named."""
    import time

    from lakestream._transform import MapError

    monkeypatch.setenv("MAP_EXIT_KEY", "s000-0001")
    monkeypatch.setenv("PYTHONPATH", setup["env"]["PYTHONPATH"])

    def slow(records: Any) -> Any:
        for i, item in enumerate(records):
            if i == 2:
                time.sleep(3)  # the worker has exited by now: the pool is broken
            yield item

    src = open_source(setup["spec"])
    with pytest.raises(MapError, match=r"ended abruptly .* while mapping sample 's000-0001'"):
        list(transform(slow(src.iterate(None)), "mymap:fn", workers=1))


def test_map_options_are_checked(tmp_path: Path, setup: dict[str, Any]) -> None:
    url = f"file://{tmp_path}/stream"
    run_cli("init", url, "--world-size", 1, "--global-batch", 4, check=True)
    r = run_cli("produce", url, "--producer-id", "p", "--synthetic", 4, "--workers", 2, check=False)
    assert "--workers and --on-error apply to --map" in r.stderr, describe(r)
    r = run_cli("produce", url, "--producer-id", "p", "--synthetic", 4, "--map", "nomodule", check=False)
    assert "expected MODULE:FUNCTION" in r.stderr, describe(r)
    with pytest.raises(MapError, match="expected a dict, None or a list"):
        list(transform(iter([({"__key__": "k"}, 1)]), f"{__name__}:returns_a_string"))


def returns_a_string(sample: dict[str, Any]) -> str:
    return "nope"


@pytest.mark.parametrize("workers", [0, 2])
def test_the_python_pipeline_takes_the_function_itself(tmp_path: Path, setup: dict[str, Any], workers: int) -> None:
    import mymap  # the fixture put it on sys.path; spawned workers unpickle it by name

    url = f"file://{tmp_path}/stream"
    anyio.run(lambda: lakestream.create(url, world_size=1, global_batch=4))
    report = anyio.run(lambda: lakestream.produce(url, "p", setup["spec"], map=mymap.fn, workers=workers))
    assert stream_keys(url) == expected_keys(3, 20)
    assert report.map is not None and report.map.records == 60 and report.map.dropped == 30
    assert report.stats.samples == report.map.outputs == len(expected_keys(3, 20))
    again = anyio.run(lambda: lakestream.produce(url, "p", setup["spec"], map=mymap.fn, workers=workers))
    assert again.stats.samples == 0 and stream_keys(url) == expected_keys(3, 20)  # resumed at the end
