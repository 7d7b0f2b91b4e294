"""Commit-policy benchmark: DAC against eager, exponential backoff and fixed-interval group commit.

    .venv/bin/python bench/commit.py            # full run, about 15 minutes
    .venv/bin/python bench/commit.py --quick    # under two minutes: fewer N, shorter windows
    .venv/bin/python bench/commit.py --smoke    # seconds: every part, tiny; exits 1 if a run fails

Every producer offers the same open-loop load: RATE TGBs per second (global_batch=1, world_size=1,
so one `put` of a ~1 KiB sample seals one TGB), arrivals paced at fixed intervals from a random
per-producer phase. All four policies run side by side, each on a fresh stream.

1. Emulated S3. N producers as coroutines in one process (one child process per run, so a run
   that livelocks is killed at a hard timeout and cannot disturb the next) over
   `FaultyStore(MemoryStore(), latency=S3_LIKE, write_rate=3500)` (conditional PUT ~25 ms p50,
   GET ~10 ms p50, 3,500 writes/s per prefix before 503 SlowDown). All producers register first
   (not measured); then arrivals start, a warm-up passes, and figures are taken over the measured
   window only, from snapshots of every producer's `ProducerStats` and of `FaultyStore.calls` at
   the window's start and end (the final flush is never measured: producers are abandoned with
   `aclose()` at the window's end):
   - committed TGB/s: TGBs whose commit landed inside the window; "frac" = that / offered load;
   - req/TGB: every store request in the window (segment PUTs, log GETs, conditional PUTs,
     snapshots) / TGBs committed in it; "log req/TGB" counts only the manifest's own requests;
   - conflicts: lost conditional PUTs of log versions / all of them in the window, counted as
     they answer (`ProducerStats.conflicts` is only added to when a whole append returns);
   - p50/p99 ready-to-visible: seconds from sealed to committed of the TGBs committed in the
     window (the ones still waiting at its end are not in it: see "backlog" and "oldest");
   - Jain's index over the producers' committed TGBs in the window;
   - backlog: TGBs put but not yet committed, at the window's start -> end (its growth is the
     offered load the policy did not carry); oldest: the age of the oldest one at the end;
   - loop lag (p50/p99 oversleep of a 50 ms timer) and CPU (process CPU seconds / wall seconds,
     in cores): the emulation's own limits on this machine. A run whose lag p50 exceeds 10 ms (the
     emulated GET median) is flagged CPU-STARVED: its figures measure the machine, not the policy.
2. Manifest size: DAC at N_BIG producers on an empty stream and on one pre-populated with 100,000
   versions (64 old producers' register and commit records, written straight into the
   MemoryStore, and a snapshot of the state at the tail so producers load quickly).
3. Real SeaweedFS: N producer processes (`lakestream produce --synthetic ... --rate RATE
   --commit-policy P --stats-json`) per policy, each offering RATE samples/s for a fixed number
   of samples; figures from their JSON lines: TGB/s is the sum of each process's committed TGBs
   over its own run time (registration and the final flush included, so a policy that falls
   behind stretches its run and shows a lower fraction), requests/TGB from the summed `requests`.
   A run is bounded by a grace period; processes still running then are killed, and their
   committed TGBs are read from the manifest instead (their requests are then unknown).

Targets (emulated, at 64 producers): DAC commits >= 95 % of the offered load; DAC requests per
committed TGB <= 1/3 of eager's; DAC p99 ready-to-visible <= 1/2 of backoff's; DAC throughput with
100k versions within 10 % of an empty stream's; Jain's index >= 0.9.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO, SeaweedS3, WeedNotFound, format_table, load_average, machine_description

RATE = 2.0  # TGBs offered per second by each producer (one ~1 KiB sample each)
SAMPLE_BYTES = 1024
N_BIG = 16  # producers for the manifest-size comparison
PREPOPULATE = 100_000  # versions in the "big" manifest
POLICIES = ["dac", "eager", "backoff", "interval"]

# Emulated runs: N -> (warm-up s, measured s). DAC paces each producer to about one commit per
# N·L/ρ seconds (10-15 s at N=64, longer at 256, where it also needs tens of seconds to find N), so
# the warm-up and the window grow with N; every policy gets the same times at a given N.
FULL = {
    "emulated": {1: (3.0, 10.0), 4: (3.0, 10.0), 16: (5.0, 15.0), 64: (10.0, 30.0), 256: (30.0, 30.0)},
    "s3_n": [1, 4, 16],
    "s3_policies": POLICIES,
    "s3_seconds": 12.0,
    "s3_grace": 25.0,
}
QUICK = {
    "emulated": {1: (1.0, 2.0), 16: (1.5, 3.0), 64: (2.0, 5.0)},
    "s3_n": [1, 4],
    "s3_policies": ["dac", "eager"],
    "s3_seconds": 4.0,
    "s3_grace": 10.0,
}
# --smoke: every part and every policy, for a moment each, so a test can tell the bench still runs.
SMOKE = {
    "emulated": {2: (0.2, 0.5)},
    "n_big": 2,
    "prepopulate": 1_000,
    "s3_n": [2],
    "s3_policies": ["dac"],
    "s3_seconds": 1.0,
    "s3_grace": 20.0,
}
TARGET_N = 64
# A run whose event loop oversleeps a 50 ms timer by more than the emulated GET median (10 ms) half
# of the time is not emulating S3 any more: the machine, not the store, sets its latencies.
STARVED_LAG = 0.010


# ==============================================================================================
# The emulated run (a child process: `commit.py --worker JSON`)
# ==============================================================================================


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def jain(xs: list[float]) -> float:
    if not xs:
        return float("nan")
    sq = sum(x * x for x in xs)
    return (sum(xs) ** 2) / (len(xs) * sq) if sq > 0 else float("nan")


async def _prepopulate(inner: Any, versions: int, old_producers: int = 64) -> dict[str, Any]:
    """Write versions 1..`versions` of a plausible log (register, then one-TGB commits round-robin)
    straight into `inner`, and a snapshot of the state at the tail (hint included)."""
    import orjson

    from lakestream.testing import write_synthetic_log

    t0 = time.perf_counter()
    state = await write_synthetic_log(inner, versions, producers=old_producers)
    t1 = time.perf_counter()
    snap = state.to_json()
    t2 = time.perf_counter()
    state.copy()
    copy_s = time.perf_counter() - t2
    assert orjson.loads(snap)["version"] == versions
    return {
        "versions": state.version,
        "steps": len(state.steps),
        "build_s": t1 - t0,
        "snapshot_bytes": len(snap),
        "to_json_s": t2 - t1,
        "copy_s": copy_s,
    }


def make_policy(name: str, rng: random.Random) -> Any:
    """A fresh commit policy object by name, seeded where the policy is randomised."""
    import lakestream

    if name == "dac":
        return lakestream.DacPolicy(rng=rng)
    if name == "backoff":
        return lakestream.BackoffPolicy(rng=rng)
    return {"eager": lakestream.EagerPolicy, "interval": lakestream.IntervalPolicy}[name]()


def active_producers(p: Any, policy: Any) -> int:
    """The producers `p`'s policy counts as active: those with a commit record in its activity
    window (p included), from p's view of the manifest (what the producer computes for itself)."""
    since = time.time() - policy.activity_window
    return 1 + sum(1 for pid, ps in p.manifest.state.producers.items() if pid != p.id and ps.last_ts >= since)


class _RaceCounter:
    """Delegates to a store, counting the outcomes of conditional PUTs of manifest log versions as
    they happen (ProducerStats.conflicts is only updated when a whole append returns, so during a
    livelock it lags far behind)."""

    def __init__(self, inner: Any, log_prefix: str) -> None:
        self.inner = inner
        self.url = inner.url
        self._prefix = log_prefix
        self.won = 0
        self.lost = 0

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        ok = await self.inner.put_if_absent(key, data)
        if key.startswith(self._prefix):
            if ok:
                self.won += 1
            else:
                self.lost += 1
        return ok

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@dataclass
class _Track:
    """What the benchmark knows of one producer beside its ProducerStats."""

    put_times: list[float] = field(default_factory=list)  # monotonic time of each put (= seal)
    error: str = ""


def _snapshot(
    producers: list[Any], tracks: list[_Track], store: Any, races: _RaceCounter, now: float
) -> dict[str, Any]:
    per = []
    for p, tr in zip(producers, tracks):
        s = p.stats
        committed = s.tgbs_committed
        oldest = now - tr.put_times[committed] if committed < len(tr.put_times) else 0.0
        per.append(
            {
                "tgbs": committed,
                "commits": s.commits,
                "conflicts": s.conflicts,
                "attempts": s.commit_attempts,
                "rtv": len(s.ready_to_visible),
                "log_requests": p.manifest.requests,
                "puts": len(tr.put_times),
                "oldest": oldest,
            }
        )
    return {
        "t": now,
        "per": per,
        "calls": dict(store.calls),
        "won": races.won,
        "lost": races.lost,
        "injected": dict(store.injected),
        "cpu": time.process_time(),
    }


async def emulate(cfg: dict[str, Any]) -> dict[str, Any]:
    import anyio

    import lakestream
    from lakestream import Producer
    from lakestream.testing import LOG_PREFIX, S3_LIKE, SNAPSHOT_PREFIX, FaultyStore

    policy: str = cfg["policy"]
    n: int = cfg["n"]
    rate: float = cfg["rate"]
    warmup: float = cfg["warmup"]
    window: float = cfg["window"]
    seed: int = cfg.get("seed", 1)
    rng = random.Random(seed)

    inner = lakestream.open_store(f"memory://{policy}-{n}")
    await lakestream.create(inner, world_size=1, global_batch=1)
    prepop = await _prepopulate(inner, cfg["prepopulate"]) if cfg.get("prepopulate") else None
    store = FaultyStore(inner, latency=S3_LIKE, write_rate=3500, rng=random.Random(seed))
    races = _RaceCounter(store, LOG_PREFIX)
    payload = os.urandom(SAMPLE_BYTES)

    producers: list[Any] = []
    policies: list[Any] = []  # each producer's policy object, for the diagnostics
    tracks: list[_Track] = []
    for k in range(n):
        prng = random.Random(seed * 100_003 + k)
        policies.append(make_policy(policy, prng))
        producers.append(Producer(races, f"p{k:03d}", policy=policies[-1]))
        tracks.append(_Track())
    phases = [rng.uniform(0, 1 / rate) for _ in range(n)]

    registered = 0
    all_registered = anyio.Event()
    start = anyio.Event()
    stop = anyio.Event()
    t_start = 0.0
    reg_sem = anyio.Semaphore(8)  # registration is setup, not measured: keep its races small
    t_setup0 = time.monotonic()

    async def one(k: int) -> None:
        nonlocal registered
        p, tr = producers[k], tracks[k]
        async with reg_sem:
            await p.__aenter__()
        try:
            registered += 1
            if registered == n:
                all_registered.set()
            await start.wait()
            i = 0
            while not stop.is_set():
                due = t_start + phases[k] + i / rate
                wait = due - time.monotonic()
                if wait > 0:
                    with anyio.move_on_after(wait):
                        await stop.wait()
                    if stop.is_set():
                        break
                tr.put_times.append(time.monotonic())
                await p.put({"__key__": f"p{k:03d}-{i:07d}", "bin": payload}, cursor=i + 1)
                i += 1
            await stop.wait()
        except Exception as e:  # a failed producer keeps its figures; the run goes on
            tr.error = f"{type(e).__name__}: {e}"[:300]
            await stop.wait()
        finally:
            await p.aclose()  # abandon: the final flush is not part of the measurement

    lags: list[tuple[float, float]] = []

    async def monitor() -> None:
        while not stop.is_set():
            t = time.monotonic()
            await anyio.sleep(0.05)
            lags.append((t, time.monotonic() - t - 0.05))

    trace: list[list[float]] = []  # once a second: t, TGBs committed, lost races, mean N^, L, m

    async def tracer() -> None:
        t0 = time.monotonic()
        while not stop.is_set():
            await anyio.sleep(1.0)
            lat = [x.latency for x in policies if hasattr(x, "latency")]
            mult = [x.multiplier for x in policies if hasattr(x, "multiplier")]
            trace.append(
                [
                    round(time.monotonic() - t0, 2),
                    sum(p.stats.tgbs_committed for p in producers),
                    races.lost,
                    round(statistics.mean(active_producers(p, pol) for p, pol in zip(producers, policies)), 1),
                    round(statistics.mean(lat), 4) if lat else 0.0,
                    round(statistics.mean(mult), 3) if mult else 0.0,
                ]
            )

    snaps: dict[str, Any] = {}
    snapshots_before = 0
    async with anyio.create_task_group() as tg:
        for k in range(n):
            tg.start_soon(one, k)
        await all_registered.wait()
        setup_s = time.monotonic() - t_setup0
        tg.start_soon(monitor)
        tg.start_soon(tracer)
        t_start = time.monotonic() + 0.05
        start.set()
        await anyio.sleep(t_start + warmup - time.monotonic())
        snapshots_before = len(await inner.list(SNAPSHOT_PREFIX))
        snaps["a"] = _snapshot(producers, tracks, store, races, time.monotonic())
        await anyio.sleep(t_start + warmup + window - time.monotonic())
        snaps["b"] = _snapshot(producers, tracks, store, races, time.monotonic())
        snapshots_after = len(await inner.list(SNAPSHOT_PREFIX))
        diag = []
        for p, pol in zip(producers, policies):  # the controller's own view at the window's end
            active = active_producers(p, pol)
            diag.append(
                {
                    "latency": getattr(pol, "latency", None),
                    "multiplier": getattr(pol, "multiplier", None),
                    "active": active,
                    "interval": pol.interval(active) if hasattr(pol, "interval") and callable(pol.interval) else None,
                }
            )
        stop.set()

    a, b = snaps["a"], snaps["b"]
    span = b["t"] - a["t"]
    rtv: list[float] = []
    for p, pa, pb in zip(producers, a["per"], b["per"]):
        rtv.extend(p.stats.ready_to_visible[pa["rtv"] : pb["rtv"]])
    d = lambda key: sum(pb[key] - pa[key] for pa, pb in zip(a["per"], b["per"]))  # noqa: E731
    committed = d("tgbs")
    calls = Counter(b["calls"])
    calls.subtract(a["calls"])
    injected = Counter(b["injected"])
    injected.subtract(a["injected"])
    per_committed = [pb["tgbs"] - pa["tgbs"] for pa, pb in zip(a["per"], b["per"])]
    lag_w = [lag for t, lag in lags if a["t"] <= t <= b["t"]]
    errors = Counter(tr.error.split(":")[0] for tr in tracks if tr.error)
    lat = [x["latency"] for x in diag if x["latency"] is not None]
    mult = [x["multiplier"] for x in diag if x["multiplier"] is not None]
    ivl = [x["interval"] for x in diag if x["interval"] is not None]
    return {
        "part": "emulated",
        **{k: cfg[k] for k in ("policy", "n", "rate", "warmup", "window")},
        "prepopulate": prepop,
        "setup_s": setup_s,
        "span": span,
        "offered": n * rate * span,
        "puts": d("puts"),
        "committed": committed,
        "tgb_per_s": committed / span,
        "frac": committed / (n * rate * span),
        "commits": d("commits"),
        "conflicts": d("conflicts"),
        "attempts": d("attempts"),
        "won": b["won"] - a["won"],
        "lost": b["lost"] - a["lost"],
        "requests": sum(calls.values()),
        "requests_by_op": {k: v for k, v in calls.items() if v},
        "log_requests": d("log_requests"),
        "throttled": sum(v for k, v in injected.items() if k.endswith(":throttled")),
        "rtv_p50": _pct(rtv, 0.50),
        "rtv_p99": _pct(rtv, 0.99),
        "rtv_max": max(rtv) if rtv else float("nan"),
        "jain": jain([float(x) for x in per_committed]),
        "backlog": sum(pb["puts"] - pb["tgbs"] for pb in b["per"]),
        "backlog_start": sum(pa["puts"] - pa["tgbs"] for pa in a["per"]),
        "oldest": max((pb["oldest"] for pb in b["per"]), default=0.0),
        "lag_p50": _pct(lag_w, 0.5),
        "lag_p99": _pct(lag_w, 0.99),
        "lag_max": max(lag_w) if lag_w else float("nan"),
        "cpu": (b["cpu"] - a["cpu"]) / span,
        "errors": dict(errors),
        "snapshots_in_window": snapshots_after - snapshots_before,
        "dac_latency": statistics.mean(lat) if lat else None,
        "dac_multiplier": statistics.mean(mult) if mult else None,
        "dac_interval": statistics.mean(ivl) if ivl else None,
        "active_estimate": statistics.mean(x["active"] for x in diag),
        "trace": trace,
    }


def worker_main(cfg_json: str) -> int:
    import anyio

    result = anyio.run(emulate, json.loads(cfg_json))
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)  # leave at once: worker threads and the loop have nothing left to do


def run_emulated(cfg: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One emulated configuration in a child process, killed after `timeout` seconds."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(cfg)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {**cfg, "part": "emulated", "failed": f"killed after {timeout:.0f} s", "wall": time.perf_counter() - t0}
    for line in out.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT ") :])
            r["wall"] = time.perf_counter() - t0
            return r
    tail = "\n".join(err.strip().splitlines()[-5:])
    return {**cfg, "part": "emulated", "failed": f"exit {proc.returncode}: {tail}", "wall": time.perf_counter() - t0}


# ==============================================================================================
# Real SeaweedFS: producer processes through the CLI
# ==============================================================================================


def run_s3(s3: SeaweedS3, bucket: str, policy: str, n: int, samples: int, grace: float) -> dict[str, Any]:
    """One SeaweedFS run on a fresh stream under `bucket` (one bucket for all runs: SeaweedFS grows
    a set of volumes per bucket, and after about ten buckets a server started with -volume.max=0
    answers PutObject with InternalError)."""
    import anyio

    import lakestream
    from lakestream.testing import lakestream_command

    env = {**os.environ, **s3.env()}
    cli = lakestream_command()
    for attempt in range(3):
        url = f"{bucket}/{policy}-{n}-{uuid.uuid4().hex[:8]}"
        init = subprocess.run(
            [*cli, "init", url, "--world-size", "1", "--global-batch", "1"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if init.returncode == 0:
            break
        print(
            f"  lakestream init failed (attempt {attempt + 1}): {init.stderr.strip()[-300:]}",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(2)
    else:
        raise RuntimeError(f"lakestream init failed 3 times: {init.stderr.strip()[-300:]}")
    procs = []
    t0 = time.perf_counter()
    for k in range(n):
        cmd = [
            *cli, "produce", url, "--producer-id", f"p{k:02d}", "--synthetic", str(samples),
            "--sample-size", str(SAMPLE_BYTES), "--rate", str(RATE), "--commit-policy", policy, "--stats-json",
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
            )
        )
    deadline = t0 + samples / RATE + grace
    figures: list[dict[str, Any] | None] = []
    killed = 0
    errors = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            figures.append(None)
            killed += 1
            continue
        fig = None
        for line in out.splitlines():
            if line.startswith("{"):
                fig = json.loads(line)
        if fig is None:
            errors.append(f"exit {proc.returncode}: {err.strip().splitlines()[-1:]}")
        figures.append(fig)
    wall = time.perf_counter() - t0

    async def manifest_tgbs() -> dict[str, int]:
        async with lakestream.open_store(url, **s3.store_options()) as store:
            state = await lakestream.load_state(store)
        return {pid: p.tgbs for pid, p in state.producers.items()}

    by_manifest = anyio.run(manifest_tgbs)
    rates, tgbs, rtv = [], 0, []
    requests = conflicts = attempts = commits = 0
    requests_known = True
    for k, fig in enumerate(figures):
        if fig is None:  # killed or failed: its committed TGBs from the manifest, over the whole wall
            got = by_manifest.get(f"p{k:02d}", 0)
            tgbs += got
            rates.append(got / wall)
            requests_known = False
            continue
        tgbs += fig["tgbs"]
        rates.append(fig["tgbs"] / fig["seconds"])
        rtv.extend(fig["ready_to_visible"])
        requests += fig["requests"] or 0
        conflicts += fig["conflicts"]
        attempts += fig["commit_attempts"]
        commits += fig["commits"]
    done = [f for f in figures if f is not None]
    return {
        "part": "s3",
        "policy": policy,
        "n": n,
        "samples": samples,
        "offered_tgb_per_s": n * RATE,
        "tgb_per_s": sum(rates),
        "frac": sum(rates) / (n * RATE),
        "tgbs": tgbs,
        "finished": len(done),
        "killed": killed,
        "errors": errors,
        "commits": commits,
        "conflicts": conflicts,
        "attempts": attempts,
        "requests": requests,
        "req_per_tgb": (requests / sum(f["tgbs"] for f in done))
        if done and sum(f["tgbs"] for f in done)
        else float("nan"),
        "requests_complete": requests_known,
        "rtv_p50": _pct(rtv, 0.5),
        "rtv_p99": _pct(rtv, 0.99),
        "jain": jain(rates),
        "seconds_max": max((f["seconds"] for f in done), default=float("nan")),
        "wall": wall,
    }


# ==============================================================================================
# Tables, targets, plots
# ==============================================================================================


def _f(x: Any, fmt: str = ".2f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return format(x, fmt)


def emulated_table(results: list[dict[str, Any]]) -> str:
    headers = [
        "policy", "N", "offered/s", "TGB/s", "frac", "commits", "req/TGB", "log req/TGB", "conflicts",
        "p50 s", "p99 s", "Jain", "backlog", "oldest s", "lag ms", "CPU", "notes",
    ]  # fmt: skip
    rows = []
    for r in results:
        if "failed" in r:
            rows.append([r["policy"], r["n"], _f(r["n"] * r["rate"], ".0f"), *["–"] * 13, r["failed"][:60]])
            continue
        c = r["committed"]
        notes = []
        if r["lag_p50"] > STARVED_LAG:
            notes.append("CPU-STARVED (emulated latencies not held)")
        if r["throttled"]:
            notes.append(f"{r['throttled']} x 503")
        if r["errors"]:
            notes.append("failed: " + ", ".join(f"{v} {k}" for k, v in r["errors"].items()))
        if r["snapshots_in_window"]:
            notes.append(f"{r['snapshots_in_window']} snapshot(s)")
        if r["policy"] == "dac" and r.get("dac_latency") is not None:
            notes.append(f"L={r['dac_latency'] * 1000:.0f}ms m={r['dac_multiplier']:.2f} N^={r['active_estimate']:.0f}")
        rows.append(
            [
                r["policy"], r["n"], _f(r["n"] * r["rate"], ".0f"), _f(r["tgb_per_s"], ".1f"), _f(r["frac"]),
                r["won"], _f(r["requests"] / c if c else float("nan"), ".1f"),
                _f(r["log_requests"] / c if c else float("nan"), ".1f"),
                _f(r["lost"] / (r["won"] + r["lost"]) if r["won"] + r["lost"] else 0.0), _f(r["rtv_p50"]), _f(r["rtv_p99"]),
                _f(r["jain"], ".3f"), f"{r['backlog_start']}→{r['backlog']}", _f(r["oldest"], ".1f"),
                f"{r['lag_p50'] * 1000:.0f}/{r['lag_p99'] * 1000:.0f}",
                _f(r["cpu"], ".2f"), "; ".join(notes),
            ]
        )  # fmt: skip
    return format_table(headers, rows, "lrrrrrrrrrrrrrrrl")


def manifest_table(results: list[dict[str, Any]]) -> str:
    headers = ["stream", "N", "TGB/s", "frac", "req/TGB", "conflicts", "p50 s", "p99 s", "Jain", "setup s", "notes"]
    rows = []
    for r in results:
        pre = r.get("prepopulate")
        label = f"{pre['versions'] if isinstance(pre, dict) else pre:,} versions" if pre else "empty"
        if "failed" in r:
            rows.append([label, r["n"], *["–"] * 8, r["failed"][:60]])
            continue
        c = r["committed"]
        note = ""
        if r.get("prepopulate"):
            pp = r["prepopulate"]
            note = (
                f"snapshot {pp['snapshot_bytes'] / 1e6:.1f} MB, to_json {pp['to_json_s']:.2f} s, "
                f"copy {pp['copy_s'] * 1000:.0f} ms; {r['snapshots_in_window']} snapshot(s) in window"
            )
        rows.append(
            [
                label, r["n"], _f(r["tgb_per_s"], ".1f"), _f(r["frac"]), _f(r["requests"] / c if c else float("nan"), ".1f"),
                _f(r["lost"] / (r["won"] + r["lost"]) if r["won"] + r["lost"] else 0.0), _f(r["rtv_p50"]), _f(r["rtv_p99"]),
                _f(r["jain"], ".3f"), _f(r["setup_s"], ".1f"), note,
            ]
        )  # fmt: skip
    return format_table(headers, rows, "lrrrrrrrrrl")


def s3_table(results: list[dict[str, Any]]) -> str:
    headers = [
        "policy",
        "N",
        "offered/s",
        "TGB/s",
        "frac",
        "commits",
        "req/TGB",
        "conflicts",
        "p50 s",
        "p99 s",
        "Jain",
        "run s",
        "notes",
    ]
    rows = []
    for r in results:
        notes = []
        if r["killed"]:
            notes.append(
                f"{r['killed']}/{r['n']} killed at the bound (TGBs from the manifest, requests of finished ones only)"
            )
        if r["errors"]:
            notes.append("; ".join(r["errors"])[:80])
        rows.append(
            [
                r["policy"], r["n"], _f(r["offered_tgb_per_s"], ".0f"), _f(r["tgb_per_s"], ".1f"), _f(r["frac"]),
                r["commits"], _f(r["req_per_tgb"], ".1f"),
                _f(r["conflicts"] / r["attempts"] if r["attempts"] else 0.0), _f(r["rtv_p50"]), _f(r["rtv_p99"]),
                _f(r["jain"], ".3f"), _f(r["wall"], ".1f"), "; ".join(notes),
            ]
        )  # fmt: skip
    return format_table(headers, rows, "lrrrrrrrrrrrl")


def targets(emulated: list[dict[str, Any]], manifest: list[dict[str, Any]]) -> list[tuple[str, str, bool | None]]:
    at = {r["policy"]: r for r in emulated if r["n"] == TARGET_N and "failed" not in r}
    out: list[tuple[str, str, bool | None]] = []
    dac = at.get("dac")

    def rpt(r: dict[str, Any] | None) -> float:
        return r["requests"] / r["committed"] if r and r["committed"] else float("nan")

    if dac is None:
        return [("DAC at 64 producers", "not measured", None)]
    out.append(("DAC commits >= 95 % of offered load", f"{dac['frac'] * 100:.1f} %", dac["frac"] >= 0.95))
    eager = at.get("eager")
    if eager:
        ratio = rpt(dac) / rpt(eager)
        out.append(
            (
                "DAC requests/TGB <= 1/3 of eager's",
                f"{rpt(dac):.1f} vs {rpt(eager):.1f} (ratio {ratio:.2f})",
                ratio <= 1 / 3,
            )
        )
    backoff = at.get("backoff")
    if backoff:
        ratio = dac["rtv_p99"] / backoff["rtv_p99"]
        out.append(
            (
                "DAC p99 ready-to-visible <= 1/2 of backoff's",
                f"{dac['rtv_p99']:.2f} s vs {backoff['rtv_p99']:.2f} s (ratio {ratio:.2f}; backoff backlog "
                f"{backoff['backlog']} TGBs, oldest {backoff['oldest']:.1f} s)",
                ratio <= 0.5,
            )
        )
    empty = [r for r in manifest if not r.get("prepopulate") and "failed" not in r]
    big = [r for r in manifest if r.get("prepopulate") and "failed" not in r]
    if empty and big:
        ratio = big[0]["tgb_per_s"] / empty[0]["tgb_per_s"]
        out.append(
            (
                f"DAC throughput with 100k versions within 10 % of empty (N={N_BIG})",
                f"{big[0]['tgb_per_s']:.1f} vs {empty[0]['tgb_per_s']:.1f} TGB/s ({(ratio - 1) * 100:+.1f} %)",
                abs(ratio - 1) <= 0.10,
            )
        )
    out.append(("DAC Jain's index >= 0.9", f"{dac['jain']:.3f}", dac["jain"] >= 0.9))
    return out


def plots(emulated: list[dict[str, Any]], s3: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    colours = {"dac": "tab:blue", "eager": "tab:red", "backoff": "tab:orange", "interval": "tab:green"}

    def series(results: list[dict[str, Any]], policy: str, y: Any) -> tuple[list[int], list[float]]:
        pts = sorted((r["n"], y(r)) for r in results if r["policy"] == policy and "failed" not in r)
        return [p[0] for p in pts], [p[1] for p in pts]

    specs = [
        ("commit_fraction.png", "committed / offered load", lambda r: r["frac"], lambda r: r["frac"], False),
        (
            "commit_requests.png",
            "store requests per committed TGB",
            lambda r: r["requests"] / r["committed"] if r["committed"] else float("nan"),
            lambda r: r["req_per_tgb"],
            True,
        ),
        ("commit_p99.png", "p99 ready-to-visible (s)", lambda r: r["rtv_p99"], lambda r: r["rtv_p99"], True),
    ]
    paths = []
    for name, ylabel, y_emu, y_s3, logy in specs:
        fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
        for policy in POLICIES:
            xs, ys = series(emulated, policy, y_emu)
            if xs:
                ax.plot(xs, ys, "o-", color=colours[policy], label=f"{policy} (emulated S3)")
            xs, ys = series(s3, policy, y_s3)
            if xs:
                ax.plot(xs, ys, "s--", color=colours[policy], alpha=0.6, label=f"{policy} (SeaweedFS)")
        ax.set_xscale("log", base=2)
        ns = sorted({r["n"] for r in emulated + s3})
        ax.set_xticks(ns)
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        if logy:
            ax.set_yscale("log")
        if name == "commit_fraction.png":
            ax.axhline(0.95, color="grey", linestyle=":", linewidth=1)
            ax.set_ylim(0, 1.05)
        ax.set_xlabel(f"producers N (each offering {RATE:g} TGB/s)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


# ==============================================================================================
# main
# ==============================================================================================


def _git_state() -> str:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    head = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    dirty = git("status", "--porcelain", "--", "lakestream")
    files = [line[3:] for line in dirty.splitlines() if line.strip()]
    return f"commit {head}" + (f" + uncommitted changes in {', '.join(files)}" if files else " (clean)")


def _times(mode: dict[str, Any], n: int, a: argparse.Namespace) -> tuple[float, float]:
    table = mode["emulated"]
    w, m = table.get(n) or table[min(table, key=lambda k: abs(k - n))]
    return (a.warmup if a.warmup is not None else w, a.window if a.window is not None else m)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--quick", action="store_true", help="N in {1, 16, 64}, short windows, a small SeaweedFS part (< 2 min)"
    )
    ap.add_argument("--smoke", action="store_true", help="every part, tiny (seconds); exit 1 if any run failed")
    ap.add_argument(
        "--parts", nargs="+", choices=["emulated", "manifest", "s3"], default=["emulated", "manifest", "s3"]
    )
    ap.add_argument("--policies", nargs="+", choices=POLICIES, default=POLICIES, help="emulated policies")
    ap.add_argument("--producers", nargs="+", type=int, help="emulated N (default: by mode)")
    ap.add_argument("--warmup", type=float, help="emulated warm-up seconds (default: by N)")
    ap.add_argument("--window", type=float, help="emulated measured seconds (default: by N)")
    ap.add_argument("--s3-producers", nargs="+", type=int, help="SeaweedFS N (default: by mode)")
    ap.add_argument("--s3-policies", nargs="+", choices=POLICIES, help="SeaweedFS policies (default: by mode)")
    ap.add_argument("--jobs", type=int, help="emulated runs at a time (default: 1; --quick: 2, a smoke test)")
    ap.add_argument("--plots", choices=["auto", "yes", "no"], default="auto", help="auto: only in a full run")
    ap.add_argument("--json", metavar="PATH", help="also write every result as JSON here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return worker_main(a.worker)

    mode = dict(SMOKE if a.smoke else QUICK if a.quick else FULL)
    n_big, prepopulate = mode.get("n_big", N_BIG), mode.get("prepopulate", PREPOPULATE)
    label = "--smoke" if a.smoke else "--quick" if a.quick else "(full)"
    short = a.quick or a.smoke
    if a.s3_producers:
        mode["s3_n"] = a.s3_producers
    if a.s3_policies:
        mode["s3_policies"] = a.s3_policies
    ns = a.producers or list(mode["emulated"])
    t_all = time.perf_counter()
    print(f"# bench/commit.py {label}: {shlex.join(sys.argv)}")
    print(f"machine: {machine_description()}")
    print(f"load average at start: {load_average()}")
    print(f"lakestream: {_git_state()}")
    print(
        f"each producer offers {RATE:g} TGB/s (global_batch=1, world_size=1, {SAMPLE_BYTES} B samples), "
        "arrivals paced from a random phase; emulated warm-up + measured seconds by N: "
        + ", ".join(f"N={n}: {_times(mode, n, a)[0]:g}+{_times(mode, n, a)[1]:g}" for n in ns)
        + "\n",
        flush=True,
    )
    emulated: list[dict[str, Any]] = []
    manifest: list[dict[str, Any]] = []
    s3: list[dict[str, Any]] = []
    s3_failed: list[str] = []

    def save() -> None:
        if a.json:
            Path(a.json).write_text(json.dumps(emulated + manifest + s3, indent=1))

    def bound(n: int, warmup: float, window: float) -> float:
        return 60.0 + warmup + window + n * 0.25  # registration of 256 producers takes ~12 s

    if "emulated" in a.parts:
        jobs = a.jobs or (2 if short else 1)
        print(
            "## 1. Emulated S3 (FaultyStore(MemoryStore(), latency=S3_LIKE, write_rate=3500))"
            + (f": {jobs} runs at a time, so CPU figures are shared" if jobs > 1 else ""),
            flush=True,
        )
        cfgs = []
        for n in ns:
            warmup, window = _times(mode, n, a)
            for policy in a.policies:
                cfgs.append({"policy": policy, "n": n, "rate": RATE, "warmup": warmup, "window": window, "seed": 1})

        def one(cfg: dict[str, Any]) -> dict[str, Any]:
            r = run_emulated(cfg, bound(cfg["n"], cfg["warmup"], cfg["window"]))
            print(
                f"  {cfg['policy']:8s} N={cfg['n']:3d}: "
                + (r["failed"] if "failed" in r else f"{r['tgb_per_s']:.1f} TGB/s ({r['frac'] * 100:.0f} %)")
                + f"  [{r['wall']:.1f} s]",
                file=sys.stderr,
                flush=True,
            )
            return r

        with ThreadPoolExecutor(jobs) as pool:
            emulated = list(pool.map(one, cfgs))
        save()
        print(emulated_table(emulated) + "\n", flush=True)

    if "manifest" in a.parts:
        warmup, window = _times(mode, n_big, a)
        print(
            f"## 2. Manifest size: DAC, N={n_big}, empty vs {prepopulate:,} versions (same emulation, "
            f"{warmup:g} s warm-up + {window:g} s measured)",
            flush=True,
        )

        def big(pre: int) -> dict[str, Any]:
            cfg = {
                "policy": "dac",
                "n": n_big,
                "rate": RATE,
                "warmup": warmup,
                "window": window,
                "seed": 2,
                "prepopulate": pre,
            }
            r = run_emulated(cfg, bound(n_big, warmup, window) + 90)
            print(
                f"  prepopulate={pre}: "
                + (r.get("failed") or f"{r['tgb_per_s']:.1f} TGB/s")
                + f"  [{r['wall']:.1f} s]",
                file=sys.stderr,
                flush=True,
            )
            return r

        with ThreadPoolExecutor(a.jobs or (2 if short else 1)) as pool:
            manifest = list(pool.map(big, (0, prepopulate)))
        save()
        print(manifest_table(manifest) + "\n", flush=True)

    if "s3" in a.parts:
        samples = int(mode["s3_seconds"] * RATE)
        print(
            f"## 3. SeaweedFS: producer processes, {samples} samples each at {RATE:g}/s "
            f"({mode['s3_seconds']:g} s offered), bound {mode['s3_grace']:g} s past that; "
            f"policies {', '.join(mode['s3_policies'])}",
            flush=True,
        )
        try:
            with SeaweedS3() as server:
                bucket = server.new_bucket("")
                for n in mode["s3_n"]:
                    for policy in mode["s3_policies"]:
                        try:
                            r = run_s3(server, bucket, policy, n, samples, mode["s3_grace"])
                        except Exception as e:  # one broken run must not lose the others
                            print(f"  {policy:8s} N={n:3d}: failed: {e}", file=sys.stderr, flush=True)
                            s3_failed.append(f"{policy} N={n}: {type(e).__name__}: {e}"[:400])
                            continue
                        print(
                            f"  {policy:8s} N={n:3d}: {r['tgb_per_s']:.1f} TGB/s  [{r['wall']:.1f} s]",
                            file=sys.stderr,
                            flush=True,
                        )
                        s3.append(r)
                        save()
        except WeedNotFound as e:
            print(f"skipped: {e}")
        if s3:
            print(s3_table(s3) + "\n", flush=True)
        for line in s3_failed:
            print(f"- failed: {line}")

    if emulated:
        print(f"## Targets (emulated, N={TARGET_N})")
        if short:
            print(f"({label}: the windows are shorter than one DAC period at N=64; only the full run judges these)")
        for what, measured, ok in targets(emulated, manifest):
            verdict = "n/a" if ok is None else ("MET" if ok else "MISSED")
            print(f"- {what}: {measured} — {verdict}")
        print()

    want_plots = a.plots == "yes" or (a.plots == "auto" and not short)
    if want_plots and emulated:
        for path in plots(emulated, s3, REPO / "docs"):
            print(f"plot: {path.relative_to(REPO)}")
    print(f"load average at end: {load_average()}")
    print(f"total time: {time.perf_counter() - t_all:.0f} s")
    save()
    failed = [r for r in emulated + manifest if "failed" in r] + [r for r in s3 if r["errors"] or r["killed"]]
    if a.smoke and (failed or s3_failed):
        print(f"--smoke: {len(failed) + len(s3_failed)} run(s) failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
