"""End-to-end benchmark: one image-classification training input pipeline, measured four ways.

    .venv/bin/python bench/e2e.py --plot-dir docs   # full run, ~10 minutes; PNGs docs/e2e_*.png
    .venv/bin/python bench/e2e.py --quick           # ~5 minutes: 640 samples, sweep 320,500,800 px
    .venv/bin/python bench/e2e.py --smoke           # ~a minute: a tiny dataset, (a) (b) (c) once

The workload. The benchmark writes a dataset of JPEG images (--size px wide, photo-like, ~85 KB at
500 px) as WebDataset tar shards to a SeaweedFS S3 server it starts. The transform is the standard
training one (bench/e2e_work.py: decode, random-resized crop to 224 with torchvision's parameters,
horizontal flip, uint8 CHW). A trainer is one process per rank (bench/e2e_trainer.py); per step it
waits for a batch (--batch samples as one uint8 tensor: the data stall), copies every byte of it
into a staging tensor and sleeps --step-ms (the accelerator).

The machine split. Trainers run under `taskset -c --trainer-cpus` (the GPU node; with the mount
and the DataLoader workers there too); the producers under --producer-cpus (the preprocessing
node; this process pins itself there); the S3 server and the broker under --store-cpus (remote
services; default: the producer CPUs). The store's CPU is not counted for either side, but where
it shares the producers' CPUs it slows them: SeaweedFS spends ~20 ms of CPU on a 2.35 MB PUT (MD5
over the body three times: S3 gateway, filer, volume), nats-server ~3 ms on the same publish.

The pipelines:
  ceiling   the trainer on one batch held in memory: the accelerator-only steps/s (run before and
            after the main pipelines; the faster run counts).
  (a)       co-located: torch DataLoader, --workers processes on the trainer CPUs, reading the
            shards from S3 (GetObject streamed through tarfile) and decoding there.
  (b)       Lakestream: one producer per producer CPU runs `lakestream.produce(url, id,
            "wds:DIR/*.tar", map=train_transform)` over its share of the shards (copied from S3 to
            its local disk before the run, not timed; no `wds:s3://` source) and commits decoded TGBs; the trainer
            reads through StreamDataset, and in a second run (a new stream, new producers) through
            `lakestream mount` + MountDataset.
  (c)       broker: the same producers publish the same decoded batches to NATS JetStream
            (`nats-server -js`, started here), one subject per rank, each acknowledged, with the
            source cursor kept in a JetStream key-value bucket and message ids for de-duplication;
            the trainer pulls its own subject, --prefetch messages ahead.
  (d)       Mosaic Streaming: the same decoded samples written offline as MDS shards to S3, read
            with StreamingDataset + DataLoader(--workers) in a virtual environment of its own.

Lakestream and the broker run live: the producers start as soon as every trainer is ready to read
(its imports done), so the stream is not ahead at the start. Where the producers' capacity
(probed before the run) is below the trainer's demand (sweep points with large images), (b) runs
with the stream prefilled instead (marked "ahead"), standing for enough producer nodes; the
trainer side is what is measured. A live run whose producers delivered fewer samples per second
than the trainer's demand is marked producer-bound, and the steps/s target does not apply to it.
Faults: a producer SIGKILLed when rank 0 has done a third of its steps and restarted
--restart-after seconds later in (b) and (c), with the producers paced at 1.5x the demand so the
kill lands while they produce; in (a) one DataLoader worker is SIGKILLed. A fault run also gives
how many steps were readable ahead of rank 0 at the kill (a Lakestream step from the timestamp of
the commit record naming it, a broker batch from the time JetStream stored it): what the trainer
has in hand while the producer is down. `--only faults` runs the fault runs alone. Every run
checks the keys the trainers saw against the dataset's: each exactly once.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import SeaweedS3, format_table, load_average, machine_description, removing, temp_dir
from e2e_work import expected_digests, s3_client, train_transform, write_shards

HERE = Path(__file__).resolve().parent
PY = sys.executable
MOSAIC_VENV = Path(os.environ.get("E2E_MOSAIC_VENV", "/tmp/lakestream-mosaic-venv"))
# Its dependencies that `import streaming` needs (its cloud clients are imported only when used);
# transformers for its DataLoader module, which the package's __init__ imports.
MOSAIC_PACKAGES = ["mosaicml-streaming==0.13.0", "boto3", "brotli", "numpy<2.2", "python-snappy", "tqdm", "xxhash",
                   "zstd", "catalogue", "transformers<5"]  # fmt: skip

TARGET_CPU_RATIO = 0.10
TARGET_CEILING = 0.95
TARGET_STALL_AHEAD_S = 0.001
TARGET_KILL_STALL_S = 0.1  # a producer SIGKILL: the trainer's p99 wait from the kill to restart + 5 s
TARGET_MOSAIC = 0.80
FAULT_PACE = 1.5


def log(msg: str) -> None:
    print(f"  {msg}", file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); nan for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))]


def ms(seconds: float) -> str:
    if seconds != seconds:
        return "-"
    return f"{seconds * 1000:.2f}" if seconds < 0.01 else f"{seconds * 1000:.1f}"


# -- results ------------------------------------------------------------------------------------


@dataclass
class Run:
    """One pipeline run: the trainers' results merged, the producers', and the key check."""

    name: str
    size: int
    trainers: list[dict[str, Any]]
    producers: list[dict[str, Any]] = field(default_factory=list)
    expected: int = 0
    missing: int = 0
    repeated: int = 0
    wrong: int = 0  # samples whose image bytes are not what the transform made of their record
    extra: dict[str, Any] = field(default_factory=dict)
    mode: str = "live"

    @property
    def steps(self) -> int:
        return min((t["steps"] for t in self.trainers), default=0)

    @property
    def steps_per_s(self) -> float:
        return min((t["steps_per_s"] for t in self.trainers), default=0.0)

    @property
    def samples_per_s(self) -> float:
        return sum(t["samples"] / t["run_s"] for t in self.trainers if t["run_s"] > 0)

    def stalls(self) -> list[float]:
        return [s for t in self.trainers for s in t["stalls"][1:]]  # step 0's wait is the time to first batch

    @property
    def ttfb(self) -> float:
        return max((t["ttfb_s"] for t in self.trainers), default=float("nan"))

    @property
    def data_cpu(self) -> float:
        return sum(t["data_cpu"] for t in self.trainers)  # the mount's CPU included (--also-pid)

    @property
    def cpu_per_step(self) -> float:
        n = sum(t["steps"] for t in self.trainers)
        return self.data_cpu / n if n else float("nan")

    @property
    def cpu_per_sample(self) -> float:
        n = sum(t["samples"] for t in self.trainers)
        return self.data_cpu / n if n else float("nan")

    def producer_cpu(self) -> tuple[float, float, float]:
        """(CPU s per sample in all, in the transform, the rest) over the producers' clean exits."""
        n = sum(p["transformed"] for p in self.producers)
        if not n:
            return (float("nan"),) * 3
        total = sum(p["cpu"] for p in self.producers) / n
        tr = sum(p["transform_cpu"] for p in self.producers) / n
        return total, tr, total - tr

    def producer_rate(self) -> float:
        """Samples per second the producers delivered once started (from the first sample transformed
        to their exit; clean exits only; nan without producers)."""
        if not self.producers:
            return float("nan")
        return sum(p["samples"] for p in self.producers) / max(
            p["seconds"] - p.get("first_s", 0.0) for p in self.producers
        )

    @property
    def error(self) -> str:
        return "; ".join(t["error"] for t in self.trainers if t["error"])

    def keys_ok(self) -> bool:
        return self.missing == 0 and self.repeated == 0 and self.wrong == 0

    def keys_text(self) -> str:
        """What the key and content checks found: `seen/expected, N repeated` (`, N wrong`)."""
        wrong = f", {self.wrong} wrong" if self.wrong else ""
        return f"{self.expected - self.missing}/{self.expected}, {self.repeated} repeated{wrong}"


def check_keys(run: Run, expected: set[str], digests: dict[str, int]) -> None:
    """Every expected key seen once, and every sample's image bytes the transform's (`digests`)."""
    seen: dict[str, int] = {}
    for t in run.trainers:
        for k in t["keys"]:
            seen[k] = seen.get(k, 0) + 1
        run.wrong += sum(digests.get(k) != d for k, d in zip(t["keys"], t.get("digests", [])))
    run.expected = len(expected)
    run.missing = len(expected - seen.keys())
    run.repeated = sum(c - 1 for c in seen.values() if c > 1) + len(seen.keys() - expected)


# -- the bench ----------------------------------------------------------------------------------


class Bench:
    def __init__(self, a: argparse.Namespace, root: Path, s3: SeaweedS3) -> None:
        self.a, self.root, self.s3 = a, root, s3
        self.bucket = s3.new_stream("x").removeprefix("s3://").split("/")[0]
        self.client = s3_client()
        self.data: dict[int, dict[str, Any]] = {}  # size -> shards, keys, local dirs
        self.nats_url = ""
        self.nats_proc: subprocess.Popen[bytes] | None = None
        self.procs: list[subprocess.Popen[bytes]] = []
        self.n = 0

    # -- setup

    def dataset(self, size: int) -> dict[str, Any]:
        """Shards of `size` px images, written locally, uploaded to S3, and split into the
        producers' shares (local copies, GET from S3)."""
        if size in self.data:
            return self.data[size]
        a = self.a
        t0 = time.perf_counter()
        local = self.root / f"wds-{size}"
        paths = write_shards(local, a.samples, size, a.per_shard)
        keys = []
        nbytes = 0
        for p in paths:
            body = p.read_bytes()
            nbytes += len(body)
            key = f"wds/{size}/{p.name}"
            self.client.put_object(Bucket=self.bucket, Key=key, Body=body)
            keys.append(key)
        shares = []
        for i in range(a.producers):
            d = self.root / f"share-{size}-{i}"
            d.mkdir()
            for key in keys[i :: a.producers]:
                (d / Path(key).name).write_bytes(self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read())
            shares.append(d)
        expected = {f"s{size}-{i:07d}" for i in range(a.samples)}
        jpeg = nbytes / a.samples
        log(f"dataset {size} px: {a.samples} samples in {len(paths)} shards, {jpeg / 1000:.0f} KB per JPEG "
            f"(with tar headers), {time.perf_counter() - t0:.1f} s")  # fmt: skip
        digests = expected_digests(paths)  # what each key's image must be, wherever it is read
        self.data[size] = {"keys": keys, "shares": shares, "expected": expected, "digests": digests, "jpeg_bytes": jpeg}
        return self.data[size]

    def steps_for(self, n_samples_per_producer: list[int]) -> int:
        gb = self.a.batch * self.a.ranks
        return sum(math.ceil(n / gb) for n in n_samples_per_producer)

    def producer_samples(self, size: int) -> list[int]:
        a = self.a
        counts = [0] * a.producers
        shards = len(self.dataset(size)["keys"])
        for s in range(shards):
            counts[s % a.producers] += min(a.per_shard, a.samples - s * a.per_shard)
        return counts

    # -- processes

    def trainer_cmd(self, mode: str, rank: int, steps: int, out: Path, *extra: str, step_ms: float | None = None,
                    python: str = PY) -> list[str]:  # fmt: skip
        a = self.a
        return ["taskset", "-c", a.trainer_cpus, python, str(HERE / "e2e_trainer.py"), mode, "--rank", str(rank),
                "--world", str(a.ranks), "--batch", str(a.batch), "--steps", str(steps),
                "--step-ms", str(a.step_ms if step_ms is None else step_ms), "--workers", str(a.workers),
                "--prefetch", str(a.prefetch), "--launched", repr(time.time()), "--out", str(out),
                *(["--per-sample"] if a.per_sample and mode in ("stream", "mount") else []), *extra]  # fmt: skip

    def producer_cmd(self, mode: str, target: str, i: int, size: int, out: Path, rate: float = 0.0) -> list[str]:
        share = self.dataset(size)["shares"][i]
        return ["taskset", "-c", self.a.producer_cpus, PY, str(HERE / "e2e_producer.py"), mode, target, "--id",
                f"p{i}", "--shards", str(share), "--ranks", str(self.a.ranks), "--batch", str(self.a.batch),
                "--rate", str(rate), "--progress", f"{out}.progress", "--out", str(out)]  # fmt: skip

    def spawn(self, cmd: list[str], logname: str) -> subprocess.Popen[bytes]:
        with open(self.root / f"{logname}.log", "ab") as f:
            p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs.append(p)
        return p

    def wait(self, p: subprocess.Popen[bytes], logname: str, timeout: float) -> None:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            raise RuntimeError(f"{logname} did not finish within {timeout:.0f} s:\n{self.tail(logname)}") from None
        if p.returncode not in (0, -signal.SIGKILL):
            raise RuntimeError(f"{logname} exited with {p.returncode}:\n{self.tail(logname)}")

    def tail(self, logname: str) -> str:
        try:
            return "\n".join((self.root / f"{logname}.log").read_text(errors="replace").splitlines()[-30:])
        except OSError:
            return ""

    def timeout(self, steps: int) -> float:
        return 120 + steps * self.a.step_ms / 1000 * 4

    # -- one run

    def run(self, name: str, size: int, mode: str, *, producers: str = "", target: str = "", fault: str = "",
            prefill: bool = False, step_ms: float | None = None, trainer_args: tuple[str, ...] = (),
            python: str = PY, steps: int | None = None) -> Run:  # fmt: skip
        """Start the producers (if any), then the trainers; inject the fault; collect and check."""
        a = self.a
        self.n += 1
        tag = f"{self.n:02d}-{name.replace(' ', '_').replace('(', '').replace(')', '')}"
        data = self.dataset(size)
        steps = steps or self.steps_for(self.producer_samples(size))
        pouts = [self.root / f"{tag}-producer-{i}.json" for i in range(a.producers)]
        pprocs = []
        killed_cpu = 0.0
        # In a fault run the producers are paced at FAULT_PACE x the trainers' demand (per producer), so
        # that the kill lands while they still produce rather than after they have finished.
        rate = FAULT_PACE * a.batch * a.ranks * 1000 / (a.step_ms + 1) / a.producers if fault == "producer" else 0.0

        def start_producers() -> list[subprocess.Popen[bytes]]:
            return [self.spawn(self.producer_cmd(producers, target, i, size, pouts[i], rate), f"{tag}-producer-{i}")
                    for i in range(a.producers)]  # fmt: skip

        if producers and prefill:
            pprocs = start_producers()
            for i, p in enumerate(pprocs):
                self.wait(p, f"{tag}-producer-{i}", 600)
        touts = [self.root / f"{tag}-trainer-{r}.json" for r in range(a.ranks)]
        progress = [self.root / f"{tag}-progress-{r}" for r in range(a.ranks)]
        from e2e_work import proc_cpu

        t_launch = time.time()
        tprocs = []
        for r in range(a.ranks):
            extra = [*trainer_args, "--progress", str(progress[r])]
            if mode == "colocated":
                share = self.root / f"{tag}-shards-{r}.json"
                share.write_text(json.dumps(data["keys"][r :: a.ranks]))
                extra += ["--bucket", self.bucket, "--shard-list", str(share)]
            elif target and "--source" not in extra:
                extra += ["--source", target]
            tprocs.append(self.spawn(self.trainer_cmd(mode, r, steps, touts[r], *extra, step_ms=step_ms, python=python),
                                     f"{tag}-trainer-{r}"))  # fmt: skip
        if producers and not prefill:  # live: the producers start when every trainer is ready to read
            while not all(p.exists() for p in progress) and all(t.poll() is None for t in tprocs):
                time.sleep(0.02)
            pprocs = start_producers()
        fault_info: dict[str, Any] = {}
        if fault:
            # A third of the run: rank 0 has done a third of its steps; or, in (b) and (c), producer 0 has
            # transformed two thirds of its share (a trainer slow to start must not let it finish first).
            share0 = self.producer_samples(size)[0]
            while tprocs[0].poll() is None:
                if _count(progress[0]) >= steps // 3:
                    break
                if fault == "producer" and _count(Path(f"{pouts[0]}.progress")) >= 2 * share0 // 3:
                    fault_info["early"] = True
                    break
                time.sleep(0.02)
            t_kill = time.time()
            if fault == "producer":
                victim = pprocs[0]
                if victim.poll() is None:
                    killed_cpu = proc_cpu(victim.pid)
                    victim.send_signal(signal.SIGKILL)
                    victim.wait()
                    fault_info["killed"] = t_kill
                    time.sleep(a.restart_after)
                    fault_info["restarted"] = time.time()
                    pprocs[0] = self.spawn(
                        self.producer_cmd(producers, target, 0, size, pouts[0], rate), f"{tag}-producer-0b"
                    )
                else:
                    fault_info["missed"] = "the producer had already finished"
            elif fault == "worker":
                from e2e_work import children

                workers = children(tprocs[0].pid)
                if workers:
                    os.kill(workers[0], signal.SIGKILL)
                    fault_info["killed"] = t_kill
                else:
                    fault_info["missed"] = "no DataLoader worker was running"
        try:
            for r, p in enumerate(tprocs):
                self.wait(p, f"{tag}-trainer-{r}", self.timeout(steps))
        except RuntimeError as e:
            logs = "".join(f"\n{tag}-producer-{i}: {self.tail(f'{tag}-producer-{i}')}" for i in range(len(pprocs)))
            raise RuntimeError(f"{e}{logs}") from None
        for i, p in enumerate(pprocs):
            self.wait(p, f"{tag}-producer-{i}", 300)
        trainers = [json.loads(o.read_text()) for o in touts]
        prods = [json.loads(line) for o in pouts if o.exists() for line in o.read_text().splitlines() if line]
        run = Run(name, size, trainers, prods, mode="ahead" if prefill else "live")
        run.extra.update(fault_info, killed_cpu=killed_cpu, launched=t_launch)
        if producers and not prefill:
            run.extra["readable"] = self.readable_times(producers, target)
        if mode != "ceiling":
            check_keys(run, data["expected"], data["digests"])
        if "killed" in fault_info and run.extra.get("readable"):
            ready, asked = lead_at(run, fault_info["killed"])
            run.extra["lead_at_kill"] = ready - asked
            later = [r for r in run.extra["readable"] if r > fault_info["killed"]]
            if later:  # what the lead had to cover: from the kill to the next step readable
                run.extra["no_new_step_s"] = min(later) - fault_info["killed"]
            asks = trainers[0]["asks"]  # the lead in seconds of training: steps at the median step time
            run.extra["lead_at_kill_s"] = (ready - asked) * pct([b - a for a, b in itertools.pairwise(asks)], 50)
            log(f"{name}: at the kill {ready} steps readable, {asked} asked for: the stream was "
                f"{ready - asked} steps ahead of rank 0")  # fmt: skip
        if a.trace_dir:
            a.trace_dir.mkdir(parents=True, exist_ok=True)
            t0 = trainers[0]
            (a.trace_dir / f"{tag}.json").write_text(json.dumps({
                "name": name, "extra": run.extra, "asks": t0["asks"], "stalls": t0["stalls"],
                "first": t_launch + t0["ttfb_s"], "producers": prods}))  # fmt: skip
        log(f"{name} ({size} px{', prefilled' if prefill else ''}{', fault: ' + fault if fault else ''}): "
            f"{run.steps} steps, {run.steps_per_s:.2f} steps/s, stall p50/p99 {ms(pct(run.stalls(), 50))}/"
            f"{ms(pct(run.stalls(), 99))} ms, data CPU {ms(run.cpu_per_step)} ms/step, first batch {run.ttfb:.2f} s"
            + (f", missing {run.missing}, repeated {run.repeated}" if mode != "ceiling" else "")
            + (f", error: {run.error}" if run.error else ""))  # fmt: skip
        return run

    def readable_times(self, producers: str, target: str) -> list[float]:
        """Wall times at which rank 0's steps became readable, in step order: a Lakestream step at the
        timestamp of the commit record naming its TGB, a broker batch when JetStream stored it."""
        if producers == "lakestream":
            bucket, _, prefix = target.removeprefix("s3://").partition("/")
            out: list[float] = []
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=bucket, Prefix=f"{prefix.rstrip('/')}/_lakestream/log/"
            )
            for key in sorted(o["Key"] for page in pages for o in page.get("Contents", [])):
                rec = json.loads(self.client.get_object(Bucket=bucket, Key=key)["Body"].read())
                if rec.get("kind") == "commit":
                    out += [float(rec["ts"])] * len(rec["tgbs"])
            return out
        return asyncio.run(self._nats_times())

    async def _nats_times(self) -> list[float]:
        import nats

        nc = await nats.connect(self.nats_url)
        try:
            js = nc.jetstream(timeout=30)
            info = await js.stream_info("E2E")
            out = []
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                m = await js.get_msg("E2E", seq)
                if m.subject == "e2e.rank.0" and m.time is not None:
                    out.append(m.time.timestamp())
            return out
        finally:
            await nc.close()

    # -- the pipelines

    def ceiling(self, size: int) -> Run:
        steps = self.steps_for(self.producer_samples(size))
        return self.run("ceiling", size, "ceiling", steps=steps)

    def colocated(self, size: int, fault: str = "") -> Run:
        return self.run("(a) co-located" + (" + worker kill" if fault else ""), size, "colocated", fault=fault)

    def new_stream(self) -> str:
        import anyio

        import lakestream

        url = self.s3.new_stream()
        anyio.run(lambda: lakestream.create(url, world_size=self.a.ranks, global_batch=self.a.batch * self.a.ranks))
        return url

    def lakestream(self, size: int, *, fault: str = "", prefill: bool = False) -> tuple[Run, str]:
        url = self.new_stream()
        name = "(b) Lakestream, StreamDataset" + (" + producer kill" if fault else "")
        return self.run(name, size, "stream", producers="lakestream", target=url, fault=fault, prefill=prefill), url

    def lakestream_mount(self, size: int) -> Run:
        from mount import Mount

        url = self.new_stream()
        from lakestream.testing import lakestream_command

        Mount.command = ["taskset", "-c", self.a.trainer_cpus, *lakestream_command(), "mount"]
        with Mount(url, self.root / "mnt", self.root / "mount.log", "--prefetch", str(self.a.prefetch)) as m:
            return self.run("(b) Lakestream, mount", size, "mount", producers="lakestream", target=url,
                            trainer_args=("--source", str(self.root / "mnt"), "--also-pid", str(m.pid)))  # fmt: skip

    def reread(self, url: str, size: int, name: str, step_ms: float) -> Run:
        """The trainer alone on a stream that is already whole (the stream ahead of the trainer)."""
        return self.run(name, size, "stream", target=url, step_ms=step_ms, prefill=True)

    # -- NATS

    def start_nats(self) -> None:
        from s3server import free_ports

        port, = free_ports(1)  # fmt: skip
        conf = self.root / "nats.conf"
        conf.write_text(f"port: {port}\nmax_payload: 8MB\njetstream {{ store_dir: {self.root / 'nats'} }}\n")
        with open(self.root / "nats.log", "wb") as out:
            self.nats_proc = subprocess.Popen(["taskset", "-c", self.a.store_cpus, "nats-server", "-c", str(conf)],
                                              stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)  # fmt: skip
        self.nats_url = f"nats://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while True:
            try:
                asyncio.run(self._nats_ping())
                return
            except Exception:
                if time.monotonic() > deadline or self.nats_proc.poll() is not None:
                    raise RuntimeError("nats-server did not start:\n" + (self.root / "nats.log").read_text()) from None
                time.sleep(0.1)

    async def _nats_ping(self) -> None:
        import nats

        nc = await nats.connect(self.nats_url, max_reconnect_attempts=0, connect_timeout=1)
        await nc.close()

    async def _nats_reset(self) -> None:
        """A fresh stream E2E (subjects e2e.rank.*, file storage, 2-minute de-duplication window) and
        a fresh key-value bucket for the producers' cursors."""
        import nats
        from nats.js.api import KeyValueConfig, StorageType, StreamConfig

        nc = await nats.connect(self.nats_url)
        js = nc.jetstream(timeout=30)
        for delete in (js.delete_stream("E2E"), js.delete_key_value("e2e-cursors")):
            try:
                await delete
            except Exception:
                pass
        await js.add_stream(StreamConfig(name="E2E", subjects=["e2e.rank.*"], storage=StorageType.FILE,
                                         duplicate_window=120.0, max_msg_size=8 << 20))  # fmt: skip
        await js.create_key_value(KeyValueConfig(bucket="e2e-cursors", storage=StorageType.FILE))
        await nc.close()

    def nats(self, size: int, fault: str = "") -> Run:
        asyncio.run(self._nats_reset())
        name = "(c) NATS JetStream" + (" + producer kill" if fault else "")
        return self.run(name, size, "nats", producers="nats", target=self.nats_url, fault=fault)

    # -- Mosaic Streaming

    def mosaic_python(self) -> str | None:
        """The Mosaic venv's python, creating the venv if need be (it reuses .venv's torch, PIL and
        botocore through a .pth file; its own numpy is the version mosaicml-streaming pins)."""
        py = MOSAIC_VENV / "bin" / "python"
        probe = [str(py), "-c", "import sys,types\nfor n in ('vision','text','multimodal'): "
                 "sys.modules['streaming.'+n]=types.ModuleType(n)\nimport streaming"]  # fmt: skip
        if py.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
            return str(py)
        log(f"creating the Mosaic Streaming venv at {MOSAIC_VENV} (a few minutes) ...")
        try:
            subprocess.run([shutil.which("python3") or "python3", "-m", "venv",
                            str(MOSAIC_VENV)], check=True)  # fmt: skip
            site = subprocess.run([str(py), "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                                  capture_output=True, text=True).stdout.strip()  # fmt: skip
            ours = subprocess.run([PY, "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                                  capture_output=True, text=True).stdout.strip()  # fmt: skip
            Path(site, "zz_lakestream_venv.pth").write_text(ours + "\n")
            pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
            subprocess.run([*pip, "--no-deps", MOSAIC_PACKAGES[0]], check=True)
            subprocess.run([*pip, *MOSAIC_PACKAGES[1:]], check=True)
        except (OSError, subprocess.CalledProcessError) as e:
            log(f"could not create the Mosaic venv: {e}")
            return None
        return str(py) if subprocess.run(probe, capture_output=True).returncode == 0 else None

    def mosaic(self, size: int, py: str, step_ms: float | None = None, remote: str = "") -> tuple[Run, str]:
        a = self.a
        if not remote:
            remote = f"s3://{self.bucket}/mds/{size}-{self.n}"
            t0 = time.perf_counter()
            cmd = ["taskset", "-c", a.producer_cpus, py, str(HERE / "e2e_mosaic.py"), remote,
                   *[str(d) for d in self.dataset(size)["shares"]]]  # fmt: skip
            subprocess.run(cmd, check=True, env={**os.environ, "S3_ENDPOINT_URL": self.s3.endpoint_url},
                           stdout=subprocess.DEVNULL)  # fmt: skip
            log(f"MDS shards written offline in {time.perf_counter() - t0:.1f} s")
        cache = self.root / f"mosaic-cache-{self.n}"
        os.environ["S3_ENDPOINT_URL"] = self.s3.endpoint_url
        os.environ["E2E_MOSAIC"] = "1"
        try:
            steps = math.ceil(a.samples / a.batch)
            name = "(d) Mosaic Streaming" + (" read path" if step_ms == 0 else "")
            run = self.run(name, size, "mosaic", target=remote, trainer_args=("--cache", str(cache)), python=py,
                           steps=steps, step_ms=step_ms, prefill=True)  # fmt: skip
        finally:
            del os.environ["E2E_MOSAIC"]
        return run, remote

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if self.nats_proc is not None and self.nats_proc.poll() is None:
            self.nats_proc.terminate()
            self.nats_proc.wait(10)


def _count(path: Path) -> int:
    """The count a trainer or a producer keeps in its progress file (0 before it exists)."""
    try:
        return int(path.read_bytes() or b"0")
    except (OSError, ValueError):
        return 0


def transform_probe(size: int, shares: list[Path], n: int = 24) -> float:
    """CPU seconds per sample of `train_transform` on this process's CPUs (the producer CPUs)."""
    from e2e_work import tar_samples

    with open(sorted(shares[0].glob("*.tar"))[0], "rb") as f:
        samples = [s for _, s in zip(range(n), tar_samples(f))]
    t0 = time.process_time()
    for s in samples:
        train_transform(s)
    return (time.process_time() - t0) / len(samples)


# -- the report -----------------------------------------------------------------------------------


def fault_window(run: Run) -> tuple[list[float], list[float]]:
    """The stalls that overlap the time from the kill to 5 s after the restart (a step asked for
    before the kill and waited for through it among them), and the others."""
    t = run.trainers[0]
    first = run.extra["launched"] + t["ttfb_s"]  # wall time of the first batch
    lo = run.extra.get("killed", math.inf) - first
    hi = run.extra.get("restarted", run.extra.get("killed", math.inf)) + 5 - first
    during, other = [], []
    for ask, stall in zip(t["asks"][1:], t["stalls"][1:]):
        (during if ask <= hi and ask + stall >= lo else other).append(stall)
    return during, other


def lead_at(run: Run, when: float) -> tuple[int, int]:
    """(steps readable, steps rank 0 had asked for) at wall time `when`: the stream's lead is their
    difference."""
    t = run.trainers[0]
    first = run.extra["launched"] + t["ttfb_s"]
    asked = 1 + sum(1 for ask in t["asks"][1:] if first + ask <= when)
    return sum(1 for r in run.extra.get("readable", []) if r <= when), asked


def pipeline_rows(runs: list[Run], ceiling: Run) -> list[list[str]]:
    rows = []
    for r in runs:
        total, tr, plane = r.producer_cpu()
        rows.append([
            r.name + (" (ahead)" if r.mode == "ahead" and "Mosaic" not in r.name else ""),
            f"{r.steps_per_s:.2f}", f"{r.steps_per_s / ceiling.steps_per_s:.3f}" if r.name != "ceiling" else "1",
            ms(pct(r.stalls(), 50)), ms(pct(r.stalls(), 99)), ms(r.cpu_per_step), f"{r.cpu_per_sample * 1e6:.0f}",
            f"{r.ttfb:.2f}",
            f"{total * 1000:.2f} = {tr * 1000:.2f} + {plane * 1000:.2f}" if total == total else "-",
            "-" if r.name == "ceiling" else r.keys_text(),
        ])  # fmt: skip
    return rows


def plot_sweep(sweep: list[dict[str, Any]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    x = [p["transform_ms"] for p in sweep]
    labels = [f"{p['size']} px" for p in sweep]
    ax1.plot(x, [p["a"] for p in sweep], "o-", label="(a) co-located DataLoader")
    ax1.plot(x, [p["b"] for p in sweep], "s-", label="(b) Lakestream, StreamDataset")
    ax1.axhline(1.0, color="grey", lw=0.8)
    ax1.axhline(TARGET_CEILING, color="grey", ls="--", lw=0.8, label="0.95 x ceiling")
    ax1.set_xlabel("transform CPU per sample (ms), by image width")
    ax1.set_ylabel("steps/s / accelerator-only ceiling")
    ax1.set_ylim(0, 1.1)
    ax2.plot(x, [p["a_cpu"] * 1000 for p in sweep], "o-", label="(a) co-located")
    ax2.plot(x, [p["b_cpu"] * 1000 for p in sweep], "s-", label="(b) Lakestream")
    ax2.set_xlabel("transform CPU per sample (ms), by image width")
    ax2.set_ylabel("trainer-node CPU on data (ms per step)")
    for ax in (ax1, ax2):
        for xi, lab in zip(x, labels):
            ax.annotate(lab, (xi, 0), textcoords="offset points", xytext=(0, 3), fontsize=7, ha="center",
                        xycoords=("data", "axes fraction"))  # fmt: skip
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle("decode-cost sweep: trainer 1 CPU, producers 1 CPU (measured)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_faults(runs: list[Run], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.6 * len(runs)), squeeze=False)
    for ax, r in zip(axes[:, 0], runs):
        t = r.trainers[0]
        ax.plot(t["asks"], [s * 1000 for s in t["stalls"]], ".", ms=3)
        first = r.extra["launched"] + t["ttfb_s"]
        for key, colour in (("killed", "red"), ("restarted", "green")):
            if key in r.extra:
                ax.axvline(r.extra[key] - first, color=colour, lw=1, label=key)
        ax.set_yscale("log")
        ax.set_ylabel("stall (ms)")
        ax.set_title(f"{r.name}: {r.steps} steps" + (f", stopped: {r.error[:60]}" if r.error else ""), fontsize=9)
        if "killed" in r.extra:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("seconds since the first batch")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def verdict(ok: bool | None) -> str:
    return "n/a    " if ok is None else ("MET    " if ok else "NOT MET")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="~3-4 minutes: fewer samples, sweep 320,500,800")
    ap.add_argument("--smoke", action="store_true", help="seconds: a tiny dataset, (a) (b) (c) once, no sweep")
    ap.add_argument("--trainer-cpus", default="0", help="taskset list for the trainers (default 0)")
    ap.add_argument("--producer-cpus", default="1", help="taskset list for the producers (default 1)")
    ap.add_argument("--store-cpus", help="taskset list for the S3 server and the broker (default: --producer-cpus)")
    ap.add_argument("--producers", type=int, help="producer processes (default: one per producer CPU)")
    ap.add_argument("--ranks", type=int, default=1, help="trainer processes (default 1)")
    ap.add_argument("--batch", type=int, help="samples per rank per step (default 16; smoke 8)")
    ap.add_argument("--step-ms", type=float, help="accelerator step (default 100; smoke 20)")
    ap.add_argument("--size", type=int, help="image width of the main runs (default 500; smoke 320)")
    ap.add_argument("--sweep", help="image widths of the sweep (default 320,500,800,1100; quick 320,500,800)")
    ap.add_argument("--samples", type=int, help="samples per dataset (default 3200; quick 640; smoke 48)")
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers for (a) and (d) (default 2)")
    ap.add_argument("--prefetch", type=int, default=4, help="batches read ahead, every pipeline (default 4)")
    ap.add_argument("--per-sample", action="store_true",
                    help="(b) reads per-sample items and stacks them (default: collate=True, one tensor a step)")  # fmt: skip
    ap.add_argument("--restart-after", type=float, default=3.0, help="seconds before a killed producer restarts")
    ap.add_argument(
        "--only",
        default="a,b,mount,c,d,faults,sweep",
        help="parts to run (comma list; `faults` alone: just the fault runs)",
    )
    ap.add_argument("--plot-dir", type=Path, help="write e2e_sweep.png and e2e_faults.png here")
    ap.add_argument("--trace-dir", type=Path, help="write each run's per-step asks, stalls and readable times here")
    ap.add_argument("--proj-accels", type=int, default=64, help="projection: accelerators (default 64)")
    ap.add_argument("--proj-per-node", type=int, default=8, help="projection: accelerators per node (default 8)")
    ap.add_argument(
        "--proj-rate", type=float, default=2500, help="projection: samples/s per accelerator (default 2500)"
    )
    ap.add_argument("--proj-cores", type=int, default=96, help="projection: CPU cores per node (default 96)")
    a = ap.parse_args()
    mode = "smoke" if a.smoke else "quick" if a.quick else "full"
    a.batch = a.batch or (8 if a.smoke else 16)
    a.step_ms = a.step_ms if a.step_ms is not None else (20.0 if a.smoke else 100.0)
    a.size = a.size or (320 if a.smoke else 500)
    a.samples = a.samples or {"smoke": 48, "quick": 640, "full": 3200}[mode]
    sweep = [
        int(s)
        for s in (a.sweep or {"smoke": "", "quick": "320,500,800", "full": "320,500,800,1100"}[mode]).split(",")
        if s
    ]
    only = set(a.only.split(","))
    if a.smoke:
        only -= {"d", "faults", "sweep"}
    avail = os.sched_getaffinity(0)
    a.store_cpus = a.store_cpus or a.producer_cpus
    if not all(set(_cpus(c)) <= avail for c in (a.trainer_cpus, a.producer_cpus, a.store_cpus)):
        everything = ",".join(map(str, sorted(avail)))
        print(f"CPUs {a.trainer_cpus} / {a.producer_cpus} / {a.store_cpus} are not all available here "
              f"({everything}): trainer, producers and store share them all, and the split is not measured",
              flush=True)  # fmt: skip
        a.trainer_cpus = a.producer_cpus = a.store_cpus = everything
    producer_cpus = sorted(avail & set(_cpus(a.producer_cpus)))
    store_cpus = set(_cpus(a.store_cpus))
    a.producers = a.producers or len(producer_cpus) or 1
    gb = a.batch * a.ranks
    a.per_shard = gb * (1 if a.smoke else 4)
    a.samples = math.ceil(a.samples / (a.per_shard * a.producers)) * a.per_shard * a.producers
    if not shutil.which("taskset"):
        print("taskset (util-linux) is needed", file=sys.stderr)
        return 2
    machine = machine_description()  # before this process pins itself (nproc would say 1)
    load0 = load_average()
    os.sched_setaffinity(0, store_cpus)  # SeaweedFS inherits it; NATS is started on them too (start_nats)
    t_start = time.perf_counter()
    print(f"end-to-end benchmark ({mode}): {a.samples} samples of {a.size} px JPEG, batch {a.batch} x {a.ranks} "
          f"rank(s), step {a.step_ms:g} ms, trainer CPUs {a.trainer_cpus}, producer CPUs {a.producer_cpus} "
          f"({a.producers} producer(s)), store CPUs {a.store_cpus}, DataLoader workers {a.workers}, prefetch {a.prefetch}", flush=True)  # fmt: skip
    if a.smoke:
        print("--smoke runs (a), (b) and (c) once; (d) Mosaic Streaming, the faults and the sweep run in --quick "
              "and full runs only", flush=True)  # fmt: skip
    root = temp_dir("lakestream-bench-e2e-")
    fuse = os.path.exists("/dev/fuse") and os.access("/dev/fuse", os.R_OK | os.W_OK)
    verdicts: list[tuple[str, bool | None]] = []
    with removing(root), SeaweedS3() as s3:
        os.sched_setaffinity(0, producer_cpus or avail)  # producers and everything else this process starts
        os.environ.update(s3.env())
        bench = Bench(a, root, s3)
        try:
            return report(a, bench, sweep, only, fuse, verdicts, machine, load0, t_start)
        finally:
            bench.close()
            from mount import _close_all_mounts

            _close_all_mounts()


def _cpus(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def report(a: argparse.Namespace, bench: Bench, sweep: list[int], only: set[str], fuse: bool,
           verdicts: list[tuple[str, bool | None]], machine: str, load0: str, t_start: float) -> int:  # fmt: skip
    size = a.size
    data = bench.dataset(size)
    ceiling = bench.ceiling(size)
    runs: list[Run] = []
    col = stream = ahead = mnt = nats = mos = None
    url = ""
    if "a" in only:
        col = bench.colocated(size)
        runs.append(col)
    if "b" in only:
        stream, url = bench.lakestream(size)
        runs.append(stream)
        ahead = bench.reread(url, size, "(b) Lakestream, StreamDataset", a.step_ms)
        runs.append(ahead)
    if "mount" in only and "b" in only:
        if fuse:
            mnt = bench.lakestream_mount(size)
            runs.append(mnt)
        else:
            print("(b) through the mount: skipped, /dev/fuse is not usable here")
    if "c" in only:
        if shutil.which("nats-server") is None:
            print("(c) NATS JetStream: skipped, nats-server is not installed (apt-get install nats-server)")
        else:
            bench.start_nats()
            nats = bench.nats(size)
            runs.append(nats)
    # The accelerator alone again: the faster of the two runs is the ceiling (a loaded machine oversleeps).
    again = bench.ceiling(size)
    ceiling = max(ceiling, again, key=lambda r: r.steps_per_s)
    runs.insert(0, ceiling)
    py = None
    remote = ""
    if "d" in only:
        py = bench.mosaic_python() if a.ranks == 1 else None
        if py is None:
            print("(d) Mosaic Streaming: skipped (" + ("one rank only" if a.ranks != 1 else "no venv") + ")")
        else:
            mos, remote = bench.mosaic(size, py)
            runs.append(mos)
    read_runs: list[Run] = []
    if url and py:
        read_runs = [bench.reread(url, size, "(b) Lakestream read path", 0.0), bench.mosaic(size, py, 0.0, remote)[0]]
    faults: list[Run] = []
    if "faults" in only:
        alone = not only & {"a", "b", "c"}  # `--only faults`: the fault runs of (a), (b) and (c) alone
        if col is not None or alone:
            faults.append(bench.colocated(size, fault="worker"))
        if stream is not None or alone:
            faults.append(bench.lakestream(size, fault="producer")[0])
        if (nats is not None or alone) and shutil.which("nats-server"):
            if not bench.nats_url:
                bench.start_nats()
            faults.append(bench.nats(size, fault="producer"))
    points: list[dict[str, Any]] = []
    if "sweep" in only and "a" in only and "b" in only:
        demand = a.batch * a.ranks * ceiling.steps_per_s
        for w in sweep:
            d = bench.dataset(w)
            probe = transform_probe(w, d["shares"])
            capacity = a.producers / (probe * 1.25)  # the data plane's own cost is ~a quarter on top (measured)
            prefill = capacity < demand * 1.1
            ra = col if w == size and col else bench.colocated(w)
            if w == size and stream and ahead:  # the live run if its producers kept up, else the prefilled one
                rb = stream if stream.producer_rate() >= demand else ahead
            else:
                rb = bench.lakestream(w, prefill=prefill)[0]
                if not prefill and rb.producer_rate() < demand:
                    log(f"{w} px: the producers delivered {rb.producer_rate():.0f} samples/s < {demand:.0f}; "
                        "again with the stream prefilled")  # fmt: skip
                    rb = bench.lakestream(w, prefill=True)[0]
            total, tr, _ = (rb if rb.producers else stream or rb).producer_cpu()  # a re-read has no producers
            points.append({"size": w, "jpeg_kb": d["jpeg_bytes"] / 1000, "transform_ms": tr * 1000, "cap": 1 / total,
                           "a": ra.steps_per_s / ceiling.steps_per_s, "b": rb.steps_per_s / ceiling.steps_per_s,
                           "a_cpu": ra.cpu_per_step, "b_cpu": rb.cpu_per_step, "b_p99": pct(rb.stalls(), 99),
                           "cpu_ratio": rb.cpu_per_sample / ra.cpu_per_sample,
                           "b_mode": rb.mode, "keys": rb.keys_ok() and ra.keys_ok()})  # fmt: skip

    print()
    print(f"machine: {machine}")
    print(f"load average (1 min) at start {load0}, at end {load_average()}; "
          f"command: {shlex.join(['.venv/bin/python', *[x for x in sys.argv]])}")  # fmt: skip
    print(f"JPEG {data['jpeg_bytes'] / 1000:.0f} KB per sample at {size} px; decoded sample 3x224x224 uint8 = "
          f"147 KiB; global batch {a.batch * a.ranks}")  # fmt: skip
    print()
    print(f"## Pipelines, {size} px, step {a.step_ms:g} ms")
    print()
    print(format_table(["pipeline", "steps/s", "/ ceiling", "stall p50 ms", "stall p99 ms", "trainer data CPU ms/step",
                        "trainer CPU µs/sample", "first batch s", "producer CPU ms/sample = transform + rest",
                        "keys seen once"], pipeline_rows(runs, ceiling)))  # fmt: skip
    print()
    print(
        "stall: from asking for a batch to holding it as one tensor, steps 1.. (step 0's is in 'first batch',"
        " timed from launching the pipeline's processes); (ahead): the stream was whole before the trainer started"
    )
    if read_runs:
        print()
        print("## Read path on the same preprocessed data (step 0 ms: as fast as the trainer can take it)")
        print()
        print(format_table(["pipeline", "samples/s", "trainer CPU µs/sample", "keys"],
                           [[r.name, f"{r.samples_per_s:.0f}", f"{r.cpu_per_sample * 1e6:.0f}",
                             r.keys_text()] for r in read_runs]))  # fmt: skip
    if faults:
        print()
        print("## Faults (at a third of the run)")
        print()
        rows = []
        for r in faults:
            during, other = fault_window(r)
            if "worker" in r.name:
                what = f"training stopped after {r.steps} steps: {r.error}" if r.error else "training went on"
            else:
                what = (f"producer SIGKILLed{' (at 2/3 of its share, before step 1/3)' if 'early' in r.extra else ''}, "
                        f"restarted {a.restart_after:g} s later; " if "killed" in r.extra
                        else r.extra.get("missed", "") + "; ") + ("training went on" if not r.error else r.error)  # fmt: skip
            lead, gap = r.extra.get("lead_at_kill"), r.extra.get("no_new_step_s")
            rows.append([r.name, what, f"{r.steps}",
                         "-" if lead is None else f"{lead} ({r.extra['lead_at_kill_s']:.2f} s)",
                         "-" if gap is None else f"{gap:.2f}",
                         f"{ms(pct(other, 50))} / {ms(pct(other, 99))}",
                         f"{ms(pct(during, 50))} / {ms(pct(during, 99))} / {ms(max(during, default=float('nan')))}",
                         f"{r.missing} missing, {r.repeated} repeated of {r.expected}"
                         + (f", {r.wrong} wrong" if r.wrong else "")])  # fmt: skip
        print(format_table(["pipeline", "what happened", "steps",
                            "steps readable ahead of rank 0 at the kill (s of training)",
                            "s from the kill to the next step readable", "stall p50 / p99 ms, outside",
                            "stall p50 / p99 / max ms, kill to restart + 5 s", "keys"], rows, "llrrrrrl"))  # fmt: skip
        print()
        print(
            "A kill costs the trainer a stall unless the lead at the kill (in seconds of training) is longer than "
            "the time to the next step readable (the restart delay plus the restarted producer's start-up)."
        )
    if points:
        print()
        print(f"## Decode-cost sweep (demand {a.batch * a.ranks * ceiling.steps_per_s:.0f} samples/s at the ceiling)")
        print()
        print(format_table(["width", "JPEG KB", "transform ms/sample", "producer capacity samples/s per core",
                            "(a) / ceiling", "(a) trainer CPU ms/step", "(b) / ceiling", "(b) trainer CPU ms/step",
                            "trainer CPU (b) / (a)", "(b) stall p99 ms", "(b) stream", "keys once"],
                           [[p["size"], f"{p['jpeg_kb']:.0f}", f"{p['transform_ms']:.2f}", f"{p['cap']:.0f}",
                             f"{p['a']:.3f}", ms(p["a_cpu"]), f"{p['b']:.3f}", ms(p["b_cpu"]), f"{p['cpu_ratio']:.3f}",
                             ms(p["b_p99"]),
                             p["b_mode"], "yes" if p["keys"] else "NO"] for p in points]))  # fmt: skip
    if stream is not None:
        print()
        projection(a, stream, col)

    # -- targets
    if col and stream:
        ratio = stream.cpu_per_sample / col.cpu_per_sample
        mratio = mnt.cpu_per_sample / col.cpu_per_sample if mnt else float("nan")
        swept = "".join(f", sweep {p['size']} px {p['cpu_ratio']:.3f}" for p in points)
        verdicts.append((f"trainer-side CPU per sample, Lakestream / co-located at {size} px: StreamDataset {ratio:.3f}"
                         + (f", mount {mratio:.3f}" if mnt else "") + swept + f" (target <= {TARGET_CPU_RATIO})",
                         ratio <= TARGET_CPU_RATIO and (mnt is None or mratio <= TARGET_CPU_RATIO)
                         and all(p["cpu_ratio"] <= TARGET_CPU_RATIO for p in points)))  # fmt: skip
    demand = a.batch * a.ranks * ceiling.steps_per_s
    if stream:
        bound = [r for r in (stream, mnt) if r and r.producer_rate() < demand]
        if bound:
            print("producer-bound (producers delivered less than the demand of "
                  f"{demand:.0f} samples/s, so the steps/s target does not apply): "
                  + ", ".join(f"{r.name} {r.producer_rate():.0f} samples/s" for r in bound))  # fmt: skip
        bs = [r for r in (stream, ahead, mnt) if r and r not in bound]
        fr = [
            f"{r.name}{' (ahead)' if r.mode == 'ahead' else ''} {r.steps_per_s / ceiling.steps_per_s:.3f}" for r in bs
        ]
        fr += [f"sweep {p['size']} px ({p['b_mode']}) {p['b']:.3f}" for p in points]
        ok = all(r.steps_per_s / ceiling.steps_per_s >= TARGET_CEILING for r in bs) and all(
            p["b"] >= TARGET_CEILING for p in points
        )
        verdicts.append(("Lakestream steps/s / ceiling: " + ", ".join(fr) + f" (target >= {TARGET_CEILING})", ok))
    if stream and nats:
        s99, n99 = pct(stream.stalls(), 99), pct(nats.stalls(), 99)
        verdicts.append((f"stall p99, Lakestream live {ms(s99)} ms vs broker {ms(n99)} ms (prefetch {a.prefetch}; target <=)",
                         s99 <= n99))  # fmt: skip
    if ahead:
        p99 = pct(ahead.stalls(), 99)
        verdicts.append((f"stall p99 with the stream ahead of the trainer {ms(p99)} ms (target <= 1 ms; the loop "
                         f"with a batch held in memory, no loader at all, had p99 {ms(pct(ceiling.stalls(), 99))} ms "
                         "in this run)",
                         p99 <= TARGET_STALL_AHEAD_S))  # fmt: skip
    for r in faults:
        if "producer" in r.name:
            verdicts.append((f"{r.name}: training went on: {not r.error and r.steps > 0}, {r.missing} samples lost, "
                             f"{r.repeated} repeated", (not r.error) and r.keys_ok() and "killed" in r.extra))  # fmt: skip
        if "producer kill" in r.name and "Lakestream" in r.name and (during := fault_window(r)[0]):
            broker = next((b for b in faults if "NATS" in b.name and "producer kill" in b.name), None)
            versus = "" if broker is None else (f"; broker {ms(pct(fault_window(broker)[0], 99))} ms, lead "
                                                f"{broker.extra.get('lead_at_kill')} steps")  # fmt: skip
            verdicts.append((f"{r.name}: stall p99 from the kill to restart + 5 s {ms(pct(during, 99))} ms, lead at "
                             f"the kill {r.extra.get('lead_at_kill')} steps{versus}; store CPUs {a.store_cpus} "
                             f"(target <= {TARGET_KILL_STALL_S * 1000:g} ms)", pct(during, 99) <= TARGET_KILL_STALL_S))  # fmt: skip
    if mos and ahead:  # both read a stream (MDS shards) that was whole before the trainer started
        lake = [f"{r.name}{' (ahead)' if r.mode == 'ahead' else ''} {r.ttfb:.2f} s" for r in (ahead, stream, mnt) if r]
        verdicts.append((f"first batch, Lakestream no later than Mosaic Streaming's {mos.ttfb:.2f} s (both prefilled): "
                         + ", ".join(lake), ahead.ttfb <= mos.ttfb))  # fmt: skip
    if len(read_runs) == 2:
        q = read_runs[0].samples_per_s / read_runs[1].samples_per_s
        verdicts.append((f"read path samples/s, Lakestream / Mosaic Streaming {q:.2f} (target >= {TARGET_MOSAIC})",
                         q >= TARGET_MOSAIC))  # fmt: skip
    bad_keys = [r.name for r in runs + faults if r.name != "ceiling" and "worker" not in r.name and not r.keys_ok()]
    print()
    for what, ok in verdicts:
        print(f"{verdict(ok)}  {what}")
    if bad_keys:
        print(f"keys not seen exactly once in: {', '.join(bad_keys)}")
    if a.plot_dir and (points or faults):
        a.plot_dir.mkdir(parents=True, exist_ok=True)
        made = []
        if points:
            made.append(plot_sweep(points, a.plot_dir / "e2e_sweep.png"))
        shown = [r for r in faults]
        if shown:
            made.append(plot_faults(shown, a.plot_dir / "e2e_faults.png"))
        print("plots: " + ", ".join(str(p) for p in made))
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    return 0


def projection(a: argparse.Namespace, b: Run, col: Run | None) -> None:
    """The paper-sized job from the measured per-sample costs: a projection, printed as such."""
    total, tr, plane = b.producer_cpu()
    A, G, rate, C = a.proj_accels, a.proj_per_node, a.proj_rate, a.proj_cores
    demand = A * rate
    prod_cores = demand * total
    nodes = math.ceil(prod_cores / C)
    lake_trainer = G * rate * b.cpu_per_sample
    col_trainer = G * rate * col.cpu_per_sample if col else float("nan")
    print("## Projection (computed from the figures above, not measured)")
    print()
    print(f"inputs: A = {A} accelerators, G = {G} per node, r = {rate:g} samples/s per accelerator, C = {C} cores "
          f"per node; measured here: producer CPU per sample c_p = {total * 1000:.2f} ms (transform "
          f"{tr * 1000:.2f} + data plane {plane * 1000:.2f}), trainer-side CPU per sample Lakestream "
          f"c_L = {b.cpu_per_sample * 1e6:.0f} µs" + (f", co-located c_a = {col.cpu_per_sample * 1e6:.0f} µs" if col else ""))  # fmt: skip
    print(f"producer cores = A r c_p = {prod_cores:.0f}; producer nodes = ceil(A r c_p / C) = {nodes}")
    print(f"trainer-node cores on data with Lakestream = G r c_L = {lake_trainer:.1f} of {C}"
          + (f"; co-located = G r c_a = {col_trainer:.0f} of {C}" + (" (more than the node has)" if col_trainer > C else "")
             if col else ""))  # fmt: skip


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
