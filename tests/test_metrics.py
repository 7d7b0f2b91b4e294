"""Prometheus metrics, scraped over HTTP from real processes: `produce --metrics-port`, `mount
--metrics-port`, and a reader and a StreamDataset in this process behind `lakestream.metrics.serve`.
Every scrape is parsed with prometheus_client's own parser; the tests check that the named series
exist and move as the run goes."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import anyio
import pytest
from cliutil import cli_env, run_cli, spawn_cli, wait_until
from mountutil import MountProc, read_tree, step_name
from prometheus_client.parser import text_string_to_metric_families

import lakestream
import lakestream.metrics

MOUNT = os.path.exists("/dev/fuse") and os.access("/dev/fuse", os.R_OK | os.W_OK)

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> Series:
    """Every sample of http://127.0.0.1:PORT/metrics: {(name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: Series = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def value(series: Series, name: str, **labels: str) -> float | None:
    """The sample `name` whose labels include `labels` (None if there is none)."""
    want = set(labels.items())
    found = [v for (n, ls), v in series.items() if n == name and want <= set(ls)]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


def scrape_until(port: int, what: str, check: object, timeout: float = 30.0) -> Series:
    """Scrape until `check(series)` holds (the process may still be starting its server)."""

    def attempt() -> Series | None:
        try:
            series = scrape(port)
        except OSError:
            return None
        return series if check(series) else None  # type: ignore[operator]

    return wait_until(attempt, timeout, what)


def test_produce_serves_its_commits_pace_and_back_pressure(tmp_path: Path) -> None:
    """A producer held by back-pressure (max_steps_ahead 3, no checkpoint) shows its wait; a checkpoint
    lets it go on, and its commit counters move."""
    url = f"file://{tmp_path / 's'}"
    run_cli("init", url, "--world-size", "2", "--global-batch", "8", "--max-steps-ahead", "3", check=True)
    port = free_port()
    proc = spawn_cli("produce", url, "--producer-id", "p0", "--synthetic", "400", "--sample-size", "512",
                     "--metrics-port", port)  # fmt: skip
    try:
        labels = {"stream": url, "producer": "p0"}
        held = scrape_until(
            port, "back-pressure", lambda s: (value(s, "lakestream_producer_backpressure_wait_seconds_total", **labels)
                                              or 0) > 0.2,
        )  # fmt: skip
        assert value(held, "lakestream_producer_tgbs_total", **labels) == 3  # steps 0..2, then held
        assert value(held, "lakestream_producer_samples_total", **labels) == 24
        assert (value(held, "lakestream_producer_bytes_total", **labels) or 0) > 24 * 512
        assert (value(held, "lakestream_producer_upload_bytes_total", **labels) or 0) >= value(
            held, "lakestream_producer_bytes_total", **labels
        )
        assert value(held, "lakestream_producer_commit_latency_seconds_count", **labels) == 3
        assert 2 <= (value(held, "lakestream_producer_log_appends_total", **labels) or 0) <= 4  # register, commits
        assert value(held, "lakestream_producer_lost_races_total", **labels) == 0
        assert value(held, "lakestream_producer_pace_seconds", **labels) is not None
        assert value(held, "lakestream_producer_pace_multiplier", **labels) is not None
        assert value(held, "lakestream_manifest_head_step", stream=url) == 2
        assert value(held, "lakestream_manifest_steps_ahead", stream=url) == 3
        assert value(held, "lakestream_manifest_watermark_step", stream=url) == -1
        assert value(held, "process_cpu_seconds_total") is not None  # the process collector is served too

        run_cli("checkpoint", url, "--id", "c1", "--step", "2", check=True)
        moved = scrape_until(
            port, "commits after the checkpoint",
            lambda s: (value(s, "lakestream_producer_tgbs_total", **labels) or 0) >= 5,
        )  # fmt: skip
        assert value(moved, "lakestream_producer_commit_latency_seconds_count", **labels) >= 5
        assert value(moved, "lakestream_manifest_watermark_step", stream=url) == 2
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)


def test_a_reader_and_a_dataset_that_outrun_the_producer_record_their_stalls(tmp_path: Path) -> None:
    """A producer slower than the consumer (8 samples a step at 40 samples/s: a step every 0.2 s) makes the
    reader wait for most steps; the stall histogram shows it, per rank."""
    url = f"file://{tmp_path / 's'}"
    run_cli("init", url, "--world-size", "2", "--global-batch", "8", check=True)
    port = lakestream.metrics.serve(0)
    proc = spawn_cli("produce", url, "--producer-id", "slow", "--synthetic", "120", "--sample-size", "256",
                     "--rate", "40")  # fmt: skip

    async def read(rank: int, steps: int) -> Series:
        async with lakestream.open_reader(url, rank) as r:
            async for batch in r.steps(0, steps):
                assert len(batch) == 4
            return await anyio.to_thread.run_sync(scrape, port)  # while the reader is open

    try:
        series = anyio.run(read, 0, 6)
        rank0 = {"stream": url, "rank": "0"}
        count = value(series, "lakestream_reader_stall_seconds_count", **rank0)
        assert count == 6
        quick = value(series, "lakestream_reader_stall_seconds_bucket", le="0.05", **rank0)
        assert quick is not None and quick < count, "no stall over 50 ms although the producer is 0.2 s a step"
        assert (value(series, "lakestream_reader_stall_seconds_sum", **rank0) or 0) > 0.3
        assert (value(series, "lakestream_reader_bytes_fetched_total", **rank0) or 0) > 6 * 4 * 256
        assert value(series, "lakestream_reader_checksum_failures_total", **rank0) == 0
        assert value(series, "lakestream_reader_prefetch_depth", **rank0) is not None
        assert (value(series, "lakestream_manifest_head_step", stream=url) or 0) >= 5

        from lakestream.torch import StreamDataset

        ds = StreamDataset(url, rank=1, world_size=2, stop=12)
        got = [item["step"] for item in ds]
        assert got == list(range(12))
        rank1 = scrape(port)
        assert value(rank1, "lakestream_reader_stall_seconds_count", stream=url, rank="1") == 12
        assert value(rank1, "lakestream_reader_stall_seconds_count", **rank0) == 6  # rank 0's own, unchanged
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)


@pytest.mark.skipif(not MOUNT, reason="needs /dev/fuse")
def test_mount_serves_cache_fetches_and_waiting_lookups(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 's'}"
    run_cli("init", url, "--world-size", "2", "--global-batch", "8", check=True)
    run_cli("produce", url, "--producer-id", "a", "--synthetic", "24", "--sample-size", "300", check=True)
    port = free_port()
    m = MountProc(url, tmp_path / "mnt", tmp_path / "mount.log", "--prefetch", "0", "--metrics-port", port)
    m.start().wait_ready()
    try:
        tree = read_tree(str(m.mountpoint), [0, 1], 3)
        assert len(tree) == 6
        s = scrape(port)
        assert value(s, "lakestream_mount_cache_misses_total", stream=url, rank="0") == 3
        assert value(s, "lakestream_mount_cache_misses_total", stream=url, rank="1") == 3
        assert (value(s, "lakestream_mount_cache_hits_total", stream=url, rank="0") or 0) >= 1  # files after _meta
        assert value(s, "lakestream_mount_fetch_seconds_count", stream=url) == 6
        assert (value(s, "lakestream_mount_cache_bytes", stream=url) or 0) > 6 * 4 * 300
        assert value(s, "lakestream_mount_lookups_waiting", stream=url) == 0
        for op in ("lookup", "open", "read"):  # 6 step directories, and at least a file of each opened and read
            assert (value(s, "lakestream_mount_requests_total", stream=url, op=op) or 0) >= 6, op
        assert value(s, "lakestream_manifest_head_step", stream=url) == 2

        # A lookup of step 3 waits for its commit: the gauge shows it, then the wait histogram.
        waiter = threading.Thread(target=os.listdir, args=(m.mountpoint / "rank-0" / step_name(3),), daemon=True)
        waiter.start()
        scrape_until(port, "a waiting lookup", lambda s: value(s, "lakestream_mount_lookups_waiting", stream=url) == 1)
        run_cli("produce", url, "--producer-id", "b", "--synthetic", "8", "--sample-size", "300", check=True)
        waiter.join(timeout=30)
        assert not waiter.is_alive()
        after = scrape_until(
            port, "the wait observed", lambda s: value(s, "lakestream_mount_lookup_wait_seconds_count", stream=url)
        )
        assert value(after, "lakestream_mount_lookups_waiting", stream=url) == 0
        assert value(after, "lakestream_manifest_head_step", stream=url) == 3
        assert (value(after, "lakestream_mount_lookup_wait_seconds_sum", stream=url) or 0) > 0
    finally:
        m.stop()


def test_prometheus_client_is_imported_only_by_a_process_that_records(tmp_path: Path) -> None:
    """`import lakestream` and the command line leave prometheus_client (a quarter of a second of CPU)
    unimported; the first producer imports it and records, as if `lakestream.metrics` had been
    imported with `lakestream`."""
    url = f"file://{tmp_path / 's'}"
    code = (
        "import sys, anyio, lakestream, lakestream._cli\n"
        "assert 'prometheus_client' not in sys.modules, 'imported with lakestream'\n"
        "async def main():\n"
        "    await lakestream.create(URL, world_size=1, global_batch=4)\n"
        "    assert 'prometheus_client' not in sys.modules, 'imported by create'\n"
        "    async with lakestream.open_producer(URL, 'x') as p:\n"
        "        for i in range(8): await p.put({'v': b'x'})\n"
        "anyio.run(main)\n"
        "from prometheus_client import REGISTRY\n"
        "print(REGISTRY.get_sample_value('lakestream_producer_samples_total', {'stream': URL, 'producer': 'x'}))\n"
        "print(type(lakestream.metrics.serve).__name__)\n"
    ).replace("URL", repr(url))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=cli_env())
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["8.0", "function"], r.stdout


def test_without_prometheus_client_recording_is_off_and_serving_names_the_extra(tmp_path: Path) -> None:
    """The core runs without the extra (a producer and a reader work); --metrics-port fails in one line."""
    url = f"file://{tmp_path / 's'}"
    run_cli("init", url, "--world-size", "1", "--global-batch", "4", check=True)
    hide = "import sys; sys.modules['prometheus_client'] = None; "
    code = hide + (
        "import anyio, lakestream, lakestream.metrics as m\n"
        "assert not m.AVAILABLE and not m.enabled()\n"
        "async def main():\n"
        f"    async with lakestream.open_producer({url!r}, 'x') as p:\n"
        "        for i in range(8): await p.put({'v': b'x'})\n"
        f"    async with lakestream.open_reader({url!r}, 0) as r:\n"
        "        assert [len(b) async for b in r.steps(0, 2)] == [4, 4]\n"
        "anyio.run(main)\n"
        "try:\n    m.serve(0)\nexcept ImportError as e:\n    print('refused:', e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=cli_env())
    assert r.returncode == 0, r.stderr
    assert "refused:" in r.stdout and "'metrics' extra" in r.stdout, r.stdout
    cli = hide + "from lakestream._cli import main; sys.exit(main(sys.argv[1:]))"
    r = subprocess.run(
        [sys.executable, "-c", cli, "produce", url, "--producer-id", "y", "--synthetic", "4", "--metrics-port", "0"],
        capture_output=True, text=True, timeout=60, env=cli_env(),
    )  # fmt: skip
    assert r.returncode == 1
    assert r.stderr.strip().count("\n") == 0 and "'metrics' extra" in r.stderr, r.stderr


def test_a_taken_metrics_port_is_one_line_and_nothing_is_produced(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 's'}"
    run_cli("init", url, "--world-size", "1", "--global-batch", "4", check=True)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = run_cli("produce", url, "--producer-id", "z", "--synthetic", "4", "--metrics-port", port, check=False)
    assert f"cannot serve metrics on 127.0.0.1:{port}" in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
    assert "z" not in anyio.run(lakestream.load_state, url).producers


def test_every_metric_is_documented_and_the_dashboard_uses_only_served_ones() -> None:
    import json
    import re

    from prometheus_client import REGISTRY

    root = Path(__file__).resolve().parent.parent
    served = {}  # name as exposed (counters with _total) -> type
    for family in REGISTRY.collect():
        if family.name.startswith("lakestream_"):
            served[family.name + ("_total" if family.type == "counter" else "")] = family.type
    doc = (root / "docs" / "observability.md").read_text()
    documented = set(re.findall(r"^\| `(lakestream_[a-z_]+)`", doc, re.M))
    assert documented == set(served), (sorted(documented - set(served)), sorted(set(served) - documented))
    dashboard = json.loads((root / "docs" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {re.sub(r"_(bucket|count|sum)$", "", n) for e in exprs for n in re.findall(r"lakestream_[a-z_]+", e)}
    assert used <= set(served), sorted(used - set(served))
    assert len(used) >= 25  # most of what is served is on the dashboard


def test_fleet_serves_one_endpoint_per_actor(tmp_path: Path) -> None:
    """`fleet --metrics-port P`: actor i serves its producer's metrics at P + i while it runs. Ports seen free
    here can be taken by the time an actor binds them (Ray's own processes bind ports as they start): a run
    that fails only on that is run again, on other ports and a new stream, up to three times."""
    from test_sources import make_wds

    make_wds(tmp_path / "wds", 2, 40)
    (tmp_path / "mod").mkdir()
    (tmp_path / "mod" / "slow.py").write_text(
        "import time\n\ndef fn(sample):\n    time.sleep(0.1)\n    return sample\n"
    )
    for attempt in range(3):
        taken = _fleet_serves_one_endpoint_per_actor(tmp_path, f"file://{tmp_path / f's{attempt}'}")
        if not taken:
            return
    pytest.fail(f"three runs found a metrics port taken: {taken}")


def _fleet_serves_one_endpoint_per_actor(tmp_path: Path, url: str) -> str:
    """One run of the test above: '' if it passed, the fleet's error if a metrics port was taken."""
    run_cli("init", url, "--world-size", "2", "--global-batch", "4", check=True)
    port = free_port()
    while port + 1 > 65535 or not _free(port + 1):
        port = free_port()
    proc = spawn_cli("fleet", url, "--source", f"wds:{tmp_path}/wds/*.tar", "--producers", "2", "--map", "slow:fn",
                     "--metrics-port", port, env={"PYTHONPATH": str(tmp_path / "mod")})  # fmt: skip
    # Both endpoints are scraped in one loop: an actor serves only while it runs, and one may be
    # done before the other (on a busy machine the wait for the first is long).
    seen: dict[int, Series] = {}

    def both() -> bool:
        for i in {0, 1} - seen.keys():
            labels = {"stream": url, "producer": f"fleet-{i}"}
            with contextlib.suppress(OSError):
                if (value(series := scrape(port + i), "lakestream_producer_tgbs_total", **labels) or 0) >= 1:
                    seen[i] = series
        return len(seen) == 2

    try:
        # (a fleet that ends first, failed or done, is told with its output below)
        wait_until(lambda: both() or proc.poll() is not None, 240, "both actors' metrics")
        if len(seen) < 2:
            out, err = proc.communicate()
            if proc.returncode != 0 and "Address already in use" in err:
                return err
            raise AssertionError(f"the fleet ended (exit {proc.returncode}) before both actors served: {out}{err}")
        for i, s in seen.items():
            labels = {"stream": url, "producer": f"fleet-{i}"}
            assert (value(s, "lakestream_transform_records_total", **labels) or 0) >= 4
            assert (value(s, "lakestream_transform_seconds_total", **labels) or 0) > 0
            other = {"stream": url, "producer": f"fleet-{1 - i}"}
            assert value(s, "lakestream_producer_tgbs_total", **other) is None  # each actor serves its own
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        assert "fleet of 2: 80 samples" in out, out
        return ""
    finally:
        if proc.poll() is None:
            proc.kill()
        if proc.stdout is not None and not proc.stdout.closed:
            proc.communicate()  # and its pipes closed


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_a_slice_that_fails_its_checksum_is_counted(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 's'}"
    port = lakestream.metrics.serve(0)

    async def run() -> None:
        await lakestream.create(url, world_size=2, global_batch=4)
        async with lakestream.open_producer(url, "p") as p:
            for i in range(4):
                await p.put({"__key__": f"k{i}", "v": b"payload %d" % i})
        segment = next((tmp_path / "s" / "segments").rglob("*.tgb"))
        data = bytearray(segment.read_bytes())
        data[-1] ^= 0xFF  # the last byte: rank 1's slice
        segment.write_bytes(bytes(data))
        async with lakestream.open_reader(url, 1) as r:
            with pytest.raises(lakestream.CorruptData, match="checksum mismatch"):
                await r.read_step(0)
        async with lakestream.open_reader(url, 0) as r:
            assert len(await r.read_step(0)) == 2

    anyio.run(run)
    s = scrape(port)
    assert value(s, "lakestream_reader_checksum_failures_total", stream=url, rank="1") == 1
    assert value(s, "lakestream_reader_checksum_failures_total", stream=url, rank="0") == 0
