"""The producer fleet on Ray (`lakestream fleet`, `lakestream.ray.run_fleet`) on a real local Ray cluster:
every sample exactly once, an actor's process SIGKILLed and restarted, an S3 stream, a failing --map,
the summary's figures against the stream.

One cluster (`ray start --head --block`) serves the file; the first test runs before it starts and
covers the command starting a local cluster of its own."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from cliutil import describe, run_cli, spawn_cli, wait_until
from test_sources import make_wds, read_values

import lakestream
from lakestream._pipeline import SyntheticSource
from lakestream.ray import FleetReport, run_fleet

SHARDS, PER_SHARD = 6, 30  # 180 samples; with 3 producers, producer i takes shards i and i + 3
ALL_KEYS = {f"s{s:03d}-{i:04d}" for s in range(SHARDS) for i in range(PER_SHARD)}

SLOW_MODULE = """
import time

def fn(sample):
    time.sleep(0.1)
    return sample
"""

FAILING_MODULE = """
def fn(sample):
    if sample["__key__"] == "s004-0003":
        raise RuntimeError("cannot decode")
    return sample
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_cluster() -> tuple[subprocess.Popen[bytes], str, Path]:
    """`ray start --head --block` on free ports in a temporary directory: (process, address, its log)."""
    temp = tempfile.mkdtemp(prefix="lsray-", dir="/tmp")  # Ray's socket paths must stay short
    port = _free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    log_path = Path(temp) / "ray-start.log"
    ray = str(Path(sys.executable).with_name("ray"))
    argv = [ray, "start", "--head", "--block", "--port", port, "--node-ip-address", "127.0.0.1", "--num-cpus", 4,
            "--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", temp,
            "--ray-client-server-port", _free_port(), "--dashboard-agent-listen-port", _free_port()]  # fmt: skip
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [str(a) for a in argv], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    wait_until(lambda: "Ray runtime started" in log_path.read_text() or proc.poll() is not None, 90, "the Ray cluster")
    return proc, f"127.0.0.1:{port}", log_path


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """A local Ray cluster for the module (`ray start --head --block`, stopped by SIGTERM): its address.

    Its ports are free ones, so it does not collide with another cluster on the machine; token
    authentication is off (it listens on the loopback only, for the length of the module). Started
    again, up to twice, if a start fails: on a busy machine Ray's raylet gives up on its own agents
    after a few seconds ("Timed out waiting for file .../metrics_agent_port", "Failed to get node
    info ... Deadline Exceeded")."""
    proc, address, log_path = _start_cluster()
    for _ in range(2):
        if proc.poll() is not None:
            proc, address, log_path = _start_cluster()
    try:
        assert proc.poll() is None, log_path.read_text()
        yield address
    finally:
        proc.send_signal(signal.SIGTERM)  # `ray start --block` stops the cluster's processes
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def setup(tmp_path: Path) -> dict[str, Any]:
    """WebDataset shards, map modules on a PYTHONPATH, an initialised file:// stream of 2 ranks x 4."""
    make_wds(tmp_path / "wds", SHARDS, PER_SHARD)
    (tmp_path / "mod").mkdir()
    (tmp_path / "mod" / "slow.py").write_text(SLOW_MODULE)
    (tmp_path / "mod" / "failing.py").write_text(FAILING_MODULE)
    url = f"file://{tmp_path}/stream"
    run_cli("init", url, "--world-size", 2, "--global-batch", 4, check=True)
    return {"url": url, "spec": f"wds:{tmp_path}/wds/*.tar", "env": {"PYTHONPATH": str(tmp_path / "mod")}}


def fleet(*args: Any, env: dict[str, str] | None = None, check: bool | None = True) -> subprocess.CompletedProcess[str]:
    return run_cli("fleet", *args, env=env, timeout=240, check=check)


def summary(r: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(r.stdout.splitlines()[-1])
    return out


def verified(url: str) -> dict[str, Any]:
    """`lakestream verify --json`, asserted OK."""
    report: dict[str, Any] = json.loads(run_cli("verify", url, "--json", check=True).stdout)
    assert report["ok"] and not report["problems"], report
    return report


def status(url: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(run_cli("status", url, "--json", check=True).stdout)
    return out


def test_without_an_address_the_command_starts_a_local_cluster(setup: dict[str, Any]) -> None:
    """No --ray-address and no RAY_ADDRESS: a local cluster for the run. Every sample once, and the summary's
    figures are the stream's."""
    env = {**setup["env"], "RAY_ADDRESS": ""}
    r = fleet(setup["url"], "--source", setup["spec"], "--producers", 3, "--json", env=env)
    s = summary(r)
    assert set(read_values(setup["url"], 2)) == ALL_KEYS
    v = verified(setup["url"])
    assert (s["samples"], s["steps"], s["bytes"]) == (180, 45, v["bytes"]) and v["samples"] == 180, describe(r)
    assert s["ok"] and s["restarts"] == 0 and s["failed"] == {} and s["skipped"] == [], describe(r)
    assert sorted(status(setup["url"])["producers"]) == ["fleet-0", "fleet-1", "fleet-2"]


def head(url: str) -> int:
    """The stream's head step, read in this process (lighter than `lakestream status` polled)."""
    return anyio.run(lakestream.load_state, url).head


def _producer_actor_pids(marker: str) -> list[int]:
    """Processes running a producer actor's task (Ray titles them `ray::_ProducerActor.run`) with `marker` in
    their environment: this test's fleet only, whatever else runs on the machine."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if (
                entry.name.isdigit()
                and (entry / "cmdline").read_bytes().startswith(b"ray::_ProducerActor.run")
                and marker.encode() in (entry / "environ").read_bytes()
            ):
                pids.append(int(entry.name))
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return pids


def kill_an_actor_mid_run(proc: subprocess.Popen[str], url: str, after_step: int, marker: str) -> tuple[str, str]:
    """Once step `after_step` is committed, SIGKILL a producer actor's process of the running fleet `proc` (its
    actors have `marker` in their environment); the fleet's output once it has ended."""
    with proc:
        try:
            wait_until(lambda: head(url) >= after_step, timeout=120, what=f"step {after_step}")
            victims = wait_until(lambda: _producer_actor_pids(marker), timeout=30, what="a producer actor's process")
            victim = victims[0]
            assert proc.poll() is None, "the fleet ended before an actor could be killed"
            os.kill(victim, signal.SIGKILL)
            return proc.communicate(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()


def test_an_actor_killed_mid_run_is_restarted_and_every_sample_lands_once(
    setup: dict[str, Any], ray_address: str
) -> None:
    url = setup["url"]
    proc = spawn_cli("fleet", url, "--source", setup["spec"], "--producers", 3, "--map", "slow:fn", "--json",
                     "--ray-address", ray_address, env=setup["env"])  # fmt: skip
    out, err = kill_an_actor_mid_run(proc, url, 6, setup["env"]["PYTHONPATH"])
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{err}"
    s = json.loads(out.splitlines()[-1])
    assert s["restarts"] == 1 and s["ok"], s
    assert set(read_values(url, 2)) == ALL_KEYS  # read_values asserts every key once
    v = verified(url)
    assert (s["samples"], s["steps"], s["bytes"]) == (180, 45, v["bytes"]), s


def test_a_fleet_on_s3_with_worker_processes(tmp_path: Path, s3_url: str, ray_address: str) -> None:
    """AWS_* reach the actors; --workers-per-producer spawns the map workers inside the actors; --close
    closes the stream after its last step once every actor has finished."""
    make_wds(tmp_path / "wds", SHARDS, PER_SHARD)
    (tmp_path / "mod").mkdir()
    (tmp_path / "mod" / "failing.py").write_text(FAILING_MODULE)
    run_cli("init", s3_url, "--world-size", 2, "--global-batch", 4, check=True)
    r = fleet(s3_url, "--source", f"wds:{tmp_path}/wds/*.tar", "--producers", 2, "--name", "s3fleet",
              "--map", "failing:fn", "--on-error", "skip", "--workers-per-producer", 1, "--json", "--close",
              "--ray-address", ray_address, env={"PYTHONPATH": str(tmp_path / "mod")})  # fmt: skip
    s = summary(r)
    assert s["skipped"] == ["s004-0003"] and s["samples"] == 179 and s["producers"] == 2, describe(r)
    assert set(read_values(s3_url, 2)) == ALL_KEYS - {"s004-0003"}
    assert verified(s3_url)["samples"] == 179
    st = status(s3_url)
    assert sorted(st["producers"]) == ["s3fleet-0", "s3fleet-1"]
    assert s["closed_after"] == st["closed_after"] == st["head_step"] == 44, describe(r)  # 179 samples: 45 steps


def test_a_failing_map_fails_the_run_naming_the_key_and_a_rerun_resumes(
    setup: dict[str, Any], ray_address: str
) -> None:
    url, base = setup["url"], ["--source", setup["spec"], "--producers", 3, "--map", "failing:fn", "--close"]
    r = fleet(url, *base, "--ray-address", ray_address, env=setup["env"], check=False)
    assert r.returncode == 1, describe(r)
    assert status(url)["closed_after"] is None  # --close: not with a producer failed
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lakestream fleet: error: fleet-1 failed:"), describe(r)
    assert "'s004-0003'" in lines[0] and "train-004.tar" in lines[0] and "cannot decode" in lines[0], describe(r)
    before = verified(url)["samples"]
    assert 120 <= before < 180  # fleet-0 and fleet-2 finished, fleet-1 stopped at the key
    r = fleet(url, *base, "--on-error", "skip", "--json", "--ray-address", ray_address, env=setup["env"])
    s = summary(r)
    assert s["skipped"] == ["s004-0003"] and s["samples"] == 179 - before and s["ok"], describe(r)
    assert set(read_values(url, 2)) == ALL_KEYS - {"s004-0003"}
    assert verified(url)["samples"] == 179
    assert s["closed_after"] == status(url)["closed_after"] == status(url)["head_step"] == 44, describe(r)


def test_run_fleet_from_python(setup: dict[str, Any], ray_address: str) -> None:
    report = run_fleet(setup["url"], setup["spec"], 2, name="py", ray_address=ray_address)
    assert isinstance(report, FleetReport) and report.ok, report
    # 90 samples a producer: 22 global batches of 4 each, and the 2 + 2 left over packed into one more
    assert (report.producers, report.samples, report.steps, report.restarts) == (2, 180, 45, 0), report
    assert report.bytes == verified(setup["url"])["bytes"] and report.skipped == [], report
    assert set(read_values(setup["url"], 2)) == ALL_KEYS
    state = anyio.run(lakestream.load_state, setup["url"])
    assert all(s.samples == 4 for s in state.steps) and state.steps[-1].packed is not None


def test_a_fleet_under_drop_last_commits_whole_global_batches_only(tmp_path: Path, ray_address: str) -> None:
    make_wds(tmp_path / "wds", 2, 31)  # 31 samples a producer: 7 global batches of 4, 3 held back each
    url = f"file://{tmp_path}/stream"
    run_cli("init", url, "--world-size", 2, "--global-batch", 4, check=True)
    r = fleet(url, "--source", f"wds:{tmp_path}/wds/*.tar", "--producers", 2, "--drop-last", "--json",
              "--ray-address", ray_address)  # fmt: skip
    assert summary(r)["steps"] == 14, describe(r)
    state = anyio.run(lakestream.load_state, url)
    assert all(s.samples == 4 for s in state.steps) and status(url)["leftovers"] == {}


def test_a_damaged_source_fails_every_producer_with_its_reason(
    setup: dict[str, Any], tmp_path: Path, ray_address: str
) -> None:
    """A source that opens (its files are there) but cannot be read: each producer fails naming its file."""
    for i in range(2):
        (tmp_path / f"bad-{i}.tar").write_bytes(b"not a tar file\n" * 100)
    report = run_fleet(setup["url"], f"wds:{tmp_path}/bad-*.tar", 2, ray_address=ray_address)
    assert not report.ok and sorted(report.failed) == ["fleet-0", "fleet-1"], report
    assert all(f"bad-{i}.tar" in report.failed[f"fleet-{i}"] for i in range(2)), report
    assert report.reason().startswith("fleet-0 failed: ") and "bad-0.tar" in report.reason(), report
    assert report.samples == 0


def test_what_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(lakestream.StreamNotFound):
        run_fleet(f"file://{tmp_path}/none", "wds:x", 2)
    with pytest.raises(ValueError, match="--workers-per-producer and --on-error apply to --map"):
        run_fleet(f"file://{tmp_path}/none", "wds:x", 2, workers_per_producer=2)
    with pytest.raises(ValueError, match="expected at least 1"):
        run_fleet(f"file://{tmp_path}/none", "wds:x", 0)
    url = f"file://{tmp_path}/stream"
    anyio.run(lambda: lakestream.create(url, world_size=1, global_batch=2))
    r = run_cli("fleet", url, "--source", "wds:x", "--producers", 0, check=False)
    assert r.stderr.strip().splitlines() == ["lakestream fleet: error: --producers 0: expected at least 1"], describe(r)


def test_a_local_cluster_that_times_out_starting_is_started_again_then_fails_as_an_os_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ray gives a local raylet 30 s to register, which a busy machine can exceed: the start is tried again
    (after `ray.shutdown`), and after LOCAL_STARTS tries the run fails with an OSError, not a bare Exception.
    `ray.init` is replaced here: a real timeout cannot be made to happen on demand."""
    import ray

    import lakestream.ray as fleet_module

    calls: list[str] = []

    def init(fail: int) -> Any:
        def fake(**_: Any) -> None:
            calls.append("init")
            if calls.count("init") <= fail:
                raise Exception("The current node timed out during startup. This could happen because ...")

        return fake

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(ray, "init", init(fail=1))
    with fleet_module._connected(None, 1):
        assert calls == ["init", "shutdown", "init"]
    assert calls[-1] == "shutdown"  # the cluster it started is shut down on leaving
    calls.clear()
    monkeypatch.setattr(ray, "init", init(fail=99))
    did_not_start = r"a local Ray cluster did not start, 3 times: The current node timed out"
    with pytest.raises(OSError, match=did_not_start), fleet_module._connected(None, 1):
        pass
    assert calls == ["init", "shutdown"] * (fleet_module.LOCAL_STARTS - 1) + ["init"]
    calls.clear()
    monkeypatch.setattr(ray, "init", init(fail=99))
    # with an address given, the cluster is not this run's to start again
    with pytest.raises(Exception, match="timed out during startup"), fleet_module._connected("127.0.0.1:1", 1):
        pass
    assert calls == ["init"]


def test_a_bad_source_or_map_is_refused_before_ray_starts(setup: dict[str, Any], tmp_path: Path) -> None:
    """A source that does not open, one with fewer files than producers, and a --map that does not load are
    refused in one line, before the command reaches for Ray: it points at an address where a socket listens
    and never answers, and nothing ever connects to it (a command that reached for Ray would hang there)."""
    listener = socket.socket()
    listener.bind(("", 0))  # every interface: Ray dials the machine's own address for 127.0.0.1
    listener.listen()
    listener.setblocking(False)
    url, nowhere = setup["url"], ["--ray-address", f"127.0.0.1:{listener.getsockname()[1]}"]
    cases = [
        (["--source", f"wds:{tmp_path}/nothing-*.tar", "--producers", 2], f"wds:{tmp_path}/nothing-*.tar: no file matches"),
        (["--source", setup["spec"], "--producers", 8],
         f"--source '{setup['spec']}': 6 files for --producers 8: producers 6..7 would have nothing to read"),
        (["--source", f"dir:{tmp_path}/wds", "--producers", 2], "needs a wds:, parquet: or hf: source"),
        (["--source", setup["spec"], "--producers", 2, "--map", "slwo:fn"], "--map 'slwo:fn': cannot import 'slwo'"),
        (["--source", setup["spec"], "--producers", 2, "--map", "slow:fnn"], "--map 'slow:fnn': module 'slow' has no"),
    ]  # fmt: skip
    with listener:
        for args, message in cases:
            r = fleet(url, *args, *nowhere, env=setup["env"], check=False)
            assert r.returncode == 1 and r.stderr.strip().splitlines() == [r.stderr.strip()], describe(r)
            assert r.stderr.startswith("lakestream fleet: error: ") and message in r.stderr, describe(r)
            with pytest.raises(BlockingIOError):  # nothing connected to the address
                listener.accept()[0].close()
        with pytest.raises(FileNotFoundError, match="no file matches"):
            run_fleet(url, f"wds:{tmp_path}/nothing-*.tar", 2, ray_address=nowhere[1])
        with pytest.raises(BlockingIOError):
            listener.accept()[0].close()
    assert status(url)["producers"] == {}


def test_another_number_of_producers_is_refused_before_ray_starts(setup: dict[str, Any], ray_address: str) -> None:
    """Run again with another --producers, every producer would get another share of the source (and a new one a
    share already produced): refused, naming both numbers, before the cluster is even reached (the refused runs
    name an address where no cluster listens). The same number resumes, with nothing left to commit."""
    url, base = setup["url"], ["--source", setup["spec"]]
    fleet(url, *base, "--producers", 2, "--ray-address", ray_address, env=setup["env"])
    nowhere = f"127.0.0.1:{_free_port()}"
    for n, address in ((3, ray_address), (1, nowhere)):
        r = fleet(url, *base, "--producers", n, "--ray-address", address, env=setup["env"], check=False)
        assert r.returncode == 1, describe(r)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            f"lakestream fleet: error: {url}: fleet 'fleet' was started with --producers 2 (fleet-0, fleet-1), "
            f"not {n}: "
        ), describe(r)
        assert lines[0].endswith("; run it with --producers 2"), describe(r)
    assert sorted(status(url)["producers"]) == ["fleet-0", "fleet-1"]
    assert verified(url)["samples"] == 180
    s = summary(fleet(url, *base, "--producers", 2, "--json", "--ray-address", ray_address, env=setup["env"]))
    assert s["ok"] and (s["samples"], s["steps"]) == (0, 0), s


def test_fewer_producers_than_committed_without_recorded_shares_are_refused(
    setup: dict[str, Any], ray_address: str
) -> None:
    """A producer of the fleet whose cursor records no share (committed before cursors recorded it; here a
    synthetic source's) still tells that the fleet had more producers than its index."""
    url = setup["url"]
    anyio.run(lambda: lakestream.produce(url, "fleet-2", SyntheticSource(4, 16)))
    for n in (2, 1):
        with pytest.raises(
            lakestream.ConfigMismatch, match=rf"--producers 3 or more \(fleet-2 has committed samples\), not {n}:"
        ):
            run_fleet(url, setup["spec"], n, ray_address=ray_address)
    assert set(status(url)["producers"]) == {"fleet-2"}


def test_an_actor_dead_with_no_restart_left_fails_its_producer(setup: dict[str, Any], ray_address: str) -> None:
    """--max-restarts 0: the killed producer fails for good, the other one finishes its share."""
    url = setup["url"]
    base = ["--source", setup["spec"], "--producers", 2, "--map", "slow:fn", "--ray-address", ray_address]
    proc = spawn_cli("fleet", url, *base, "--max-restarts", 0, env=setup["env"])
    out, err = kill_an_actor_mid_run(proc, url, 2, setup["env"]["PYTHONPATH"])
    assert proc.returncode == 1, f"exit {proc.returncode}\n{out}\n{err}"
    reason = [line for line in err.splitlines() if line.startswith("lakestream fleet: error: ")]
    assert len(reason) == 1 and "its actor died for good (no restart allowed)" in reason[0], err
    v = verified(url)  # the other producer's whole share (its partial last batch held: the killed one never
    assert 90 <= v["samples"] + v["held"] < 180  # finished), and the part of the killed one's it committed
