"""The benchmarks still run: each bench's `--smoke` mode (every part of it, for a moment) as a real
subprocess, as a user runs it, so that a refactor cannot break a bench silently. The figures are
not judged here (docs/benchmarks.md holds real runs); that the bench printed them is."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MOUNT = os.path.exists("/dev/fuse") and os.access("/dev/fuse", os.R_OK | os.W_OK)


def run_bench(name: str, *args: str, timeout: float = 150.0) -> str:
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / name), "--smoke", *args],
        cwd=REPO, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"bench/{name} --smoke exited {proc.returncode}:\n{out[-4000:]}"
    assert "Traceback" not in out, out[-4000:]
    return out


def test_commit_bench_smoke() -> None:
    out = run_bench("commit.py")  # exits 1 if any run failed
    for part in ("## 1. Emulated S3", "## 2. Manifest size", "## 3. SeaweedFS"):
        assert part in out, part
    for policy in ("dac", "eager", "backoff", "interval"):  # a row of figures per policy
        assert re.search(rf"^\| {policy} +\| +2 \| +4 \| +\d+\.\d", out, re.M), (policy, out[-3000:])
    assert re.search(r"^\| 1,000 versions \| +2 \| +\d+\.\d", out, re.M), out[-3000:]
    assert re.search(r"^\| dac +\| 2 \| +4 \| +\d+\.\d", out.split("## 3. SeaweedFS")[1], re.M), out[-3000:]


def test_s3client_bench_smoke() -> None:
    out = run_bench("s3client.py")
    for size in ("2.35 MB", "4 KiB"):
        for op in ("PUT", "GET"):  # CPU per call of each client, their ratio, and throughput
            row = rf"^\| {size} +\| {op} +\|( +[\d,]+ \|){{2}} +\d+\.\d\d \|( +[\d,]+\.\d \|){{2}}$"
            assert re.search(row, out, re.M), (size, op, out[-3000:])
    assert re.search(r"^cheaper in CPU on every row: (obstore|aiobotocore|neither \(mixed\))$", out, re.M), out[-3000:]


def test_ingest_bench_smoke() -> None:
    out = run_bench("ingest.py", timeout=300.0)  # the floor section starts a second SeaweedFS server and a mount
    for store in ("file://", "SeaweedFS"):
        for producers in (1, 2):  # a row of figures per store and producer count
            assert re.search(rf"^\| {store} +\| +{producers} \| +4 KiB \| +\d+ \(256 KiB\)", out, re.M), (store, out)
    assert "read amplification <= 1.02 on every store: met" in out, out[-3000:]
    # The floor section: CPU per sample of each path, its floor's and their ratio, then one line per target.
    floor = out.split("## Against the object-store floor", 1)[1]
    rows = [("producer", "write + fsync"), ("StreamDataset", "read"), ("Reader.steps", "plain")]
    rows += [("producer", "obstore put"), ("StreamDataset", "obstore get")]
    if MOUNT:
        rows += [("MountDataset", "read"), ("MountDataset", "obstore get")]
    for path, kind in rows:
        row = rf"^\| (file://|SeaweedFS) +\| +{path}\S* .*/ {re.escape(kind)}.* \| +[\d,+= ]+ \| +[\d,]+ \| +\d+\.\d\d \|$"
        assert re.search(row, floor, re.M), (path, kind, floor[-3000:])
    targets = ["producer / PUT floor", "StreamDataset / GET floor", "file:// Reader / plain read MB/s"]
    if MOUNT:
        targets.append("MountDataset \\+ daemon / GET floor")
    for target in targets:
        assert re.search(rf"^target {target}.* [<>]= [\d.]+x: (met|NOT met) \(\d+\.\d\dx\)$", floor, re.M), target


def test_ingest_codec_bench_smoke() -> None:
    out = run_bench("ingest.py", "--codec")
    for name in ("zlib.crc32", "crc32c", "xxh3-64"):
        assert re.search(rf"^\| 2\.2 MiB +\| +{name} \| +[\d.]+ \| +[\d.]+ \|$", out, re.M), (name, out[-3000:])
    for buffer in ("0 bytes past the source", "16 bytes past the source", "pool.take(n, src)"):
        assert re.search(rf"^\| {re.escape(buffer)} +\| +\d+ \| +[\d.]+ \|$", out, re.M), (buffer, out[-3000:])
    for collate in (True, False):
        assert re.search(rf"^\| collate={collate} +\| +128 \| +\d+ \| +\d+ \|$", out, re.M), (collate, out[-3000:])


@pytest.mark.skipif(not MOUNT, reason="needs /dev/fuse")
def test_mount_bench_smoke() -> None:
    out = run_bench("mount.py")
    assert re.search(r"cold read .*GB/s", out), out[-3000:]
    assert re.search(r"4 KiB open\+read\+close p50 / p99, cold .* µs", out), out[-3000:]
    assert re.search(r"^(MET|NOT MET) +commit -> first byte p50 [\d.]+ ms", out, re.M), out[-3000:]
    # part 5: a request's CPU, the mount's against an empty pyfuse3 filesystem's, and a collated step's requests
    assert re.search(r"^\| FUSE request .*\| +\d+ µs \| +\d+ µs \| +[\d.]+ \|", out, re.M), out[-3000:]
    step = re.search(r"^\| MountDataset\(collate\) step.*requests \((.*)\) +\| +([\d.]+) \|", out, re.M)
    assert step is not None, out[-3000:]
    ops = dict(op.split() for op in step[1].split(", "))
    assert float(ops["read"]) >= 1 and float(ops["open"]) >= 1 and float(step[2]) > 0, step[0]


def test_e2e_bench_smoke() -> None:
    out = run_bench("e2e.py", timeout=400.0)  # needs nats-server (scripts/setup.sh installs it)
    pipelines = ["ceiling", r"\(a\) co-located", r"\(b\) Lakestream, StreamDataset", r"\(c\) NATS JetStream"]
    if MOUNT:
        pipelines.append(r"\(b\) Lakestream, mount")
    for name in pipelines:  # a row of figures per pipeline: steps/s, ratio to the ceiling, stall p50 and p99
        assert re.search(rf"^\| {name} +\| +\d+\.\d\d \| +[\d.]+ \| +[\d.]+ \| +[\d.]+ \|", out, re.M), (
            name,
            out[-4000:],
        )
    for name in pipelines[1:]:  # every sample of the dataset reached the trainer exactly once
        assert re.search(rf"^\| {name} .*\| +48/48, 0 repeated \|$", out, re.M), (name, out[-4000:])
    assert "trainer-side CPU per sample, Lakestream / co-located" in out, out[-3000:]
    assert "## Projection (computed from the figures above, not measured)" in out, out[-3000:]


def test_sources_bench_smoke() -> None:
    out = run_bench("sources.py", timeout=280)  # every run must read or commit every sample, or it exits 1
    for kind in ("wds", "parquet", "hf"):  # a row per kind: library, source, put loop, produce
        assert re.search(rf"^\| {kind} +\|( +\d+ / \d+ \|){{4}}$", out, re.M), (kind, out[-3000:])
        for workers in (0, 1):  # with the map, beside the library read + the same map
            assert re.search(rf"^\| {kind} +\| +{workers} \| +\d+ \| +\d+ \| +\d+\.\d\d ", out, re.M), (kind, workers)
        assert re.search(rf"^target {kind}: the source adds [+-]\d+\.\d%", out, re.M), (kind, out[-3000:])
    for fleet_map in ("none", "decode_map"):  # a fleet of 2 actors, without and with the map
        assert re.search(rf"^\| {fleet_map} +\| +\d+ \| +2 \| +\d+\.\d \| +\d+ \|", out, re.M), (fleet_map, out[-3000:])
    assert re.search(r"^plot: \S+sources_throughput\.png$", out, re.M), out[-3000:]


def test_metrics_bench_smoke() -> None:
    out = run_bench("metrics.py")
    for store in ("file://", "memory"):  # a row per store and path: off, on, the cost
        for path in ("ingest", "read"):
            row = rf"^\| {store} +\| {path} \(\w+/s\) +\| +[\d,]+ \| +[\d,]+ \| +[+-]\d+\.\d% \| +\d+% \|"
            assert re.search(row, out, re.M), (store, path, out[-3000:])
    assert re.search(r"^\| committed \(per TGB\) +\| +\d+\.\d\d \|$", out, re.M), out[-3000:]
    assert re.search(r"^recording per TGB: [\d.]+ µs", out, re.M), out[-3000:]
    assert re.search(r"^target metrics cost < 3% .*, per-call estimate: (met|NOT met) \(", out, re.M), out[-3000:]
    assert re.search(r"^target metrics cost < 3% .*, A/B medians: (met|inconclusive|NOT met)", out, re.M), out[-3000:]


def test_elastic_bench_smoke() -> None:
    out = run_bench("elastic.py")  # exits 1 if a re-sliced read lost or repeated a sample, or miscounted
    # A world size that divides the stored one reads whole slices: exactly the stored bytes, 8 slices of 8.
    assert re.search(r"^\| 8→4 +\|.*\| +8\.0 / 8 \| +1\.00 \| +1\.000 \| = 1\.00 +\| met +\|$", out, re.M), out[-3000:]
    for case in ("8→6", "8→7"):  # some slices are fetched by two new ranks: above 1, within the bound
        row = re.search(rf"^\| {case} +\|.*\| +(\d+\.\d\d) \| +\d\.\d+ \| <= 2\.00 \| met +\|$", out, re.M)
        assert row and 1.0 < float(row[1]) <= 2.0, (case, out[-3000:])
    assert re.search(r"^\| 4→8 +\|.*\| +8\.0 / 4 \| +2\.00 \| +2\.000 \|", out, re.M), out[-3000:]
    for case in ("8→4", "8→6", "8→7", "4→8"):  # samples/s and MB/s of both reads, and their ratio
        assert re.search(rf"^\| {case} +\|( +[\d,]+ \|){{4}} +\d+\.\d\d \| +[\d.]+\.\.[\d.]+ \|$", out, re.M), case
    assert re.search(r"^target read amplification 8→4 = 1\.00: met \(1\.00\)$", out, re.M), out[-3000:]


def test_scale_bench_smoke() -> None:
    out = run_bench("scale.py", "--json")  # the library's own producers and readers on simulated time
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(rows) == 1, out[-3000:]
    row = rows[0]
    for column in (
        "producers", "steps_per_s_demand", "readers", "consumed_steps_per_s", "visible_p50_s", "visible_p99_s",
        "requests_per_tgb", "log_gets_per_s", "log_puts_per_s", "rate_503", "max_lead_steps", "jain",
        "checkpoint_block_p99_ms", "committed_fraction",
    ):  # fmt: skip
        assert column in row, (column, row)
    assert (row["producers"], row["steps_per_s_demand"], row["readers"]) == (4, 4, 2)
    assert not row["truncated"] and row["simulated_s"] == 8.0, row  # 8 simulated seconds, in seconds of CPU
    assert row["consumed_steps_per_s"] > 0 and row["committed_fraction"] > 0.5, row
    assert row["checkpoints"] > 0 and not row["checkpoint_errors"] and row["checkpoint_block_p99_ms"] is not None, row
    assert row["checkpoints_retained"] > 0, row  # recorded in the background, yet recorded
    assert 0 < row["visible_p50_s"] <= row["visible_p99_s"] < 10, row
    assert row["requests_per_tgb"] > 2 and row["log_gets_per_s"] > 0 and row["log_puts_per_s"] > 0, row


def test_tail_bench_smoke() -> None:
    out = run_bench("tail.py")  # the mount's follower and a Reader at the tail, on simulated time
    for store in ("local", "S3"):
        for who in ("mount", "Reader"):
            row = re.search(
                rf"^\| steady +\| {store} +\| {who} +\| +(\d+\.\d\d) \| +([\d.]+) \| +([\d.]+) \| +([\d.]+) \|$",
                out,
                re.M,
            )
            assert row, (store, who, out[-3000:])
            reads, p50, p90, top = map(float, row.groups())
            assert 1.0 <= reads < 10 and 0 < p50 <= p90 <= top, row.group(0)
