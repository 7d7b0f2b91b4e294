"""What runs inside the harness's child processes: `python tests/torture.py MODE ARGS…`.

* `cli ARGS…`: the `lakestream` command (producers, the mount daemon, gc, rewind, init, verify);
* `pyreader --url URL --rank R --start S …`: rank R's steps from S on through `open_reader`;
* `mntreader --mnt DIR --rank R --start S …`: the same through the FUSE mount with plain `open()`.

Readers journal every step they consume (one JSON line per step, appended with one write(2), so a
SIGKILL never leaves half a line behind a whole one) and every event (start, StepUnavailable, an
error). Every child injects the store faults the harness gave it in its environment:
LAKESTREAM_FAULTS (`lakestream.testing.inject_faults`), counted one line per fault in
TORTURE_FAULT_LOG, plus request timeouts from TORTURE_TIMEOUTS=probability:seconds:seed.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import random
import sys
import time
import traceback
from collections import Counter, defaultdict
from typing import Any

CHILD_MODES = ("cli", "pyreader", "mntreader")


def digest(data: bytes) -> str:
    """The short hash the journals and the checker compare bytes by."""
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def sample_fields(sample: dict[str, bytes]) -> list[list[Any]]:
    """A raw sample as the journals record it: sorted [field, digest, length] of every field."""
    return sorted([f, digest(v), len(v)] for f, v in sample.items() if f != "__key__")


# -- store faults ----------------------------------------------------------------------------------


class LoggedCounter(Counter):  # type: ignore[type-arg]
    """FaultyStore.injected that also appends every injection to a file (survives SIGKILL)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def __setitem__(self, key: str, value: int) -> None:
        super().__setitem__(key, value)
        os.write(self._fd, f"{key}\n".encode())


def timeout_hook(store: Any, probability: float, seconds: float, rng: random.Random) -> Any:
    """A FaultyStore hook: with `probability`, hang for `seconds`, then fail (a request timeout)."""

    async def hook(op: str, key: str) -> None:
        if probability and rng.random() < probability:
            import anyio

            from lakestream import StoreUnavailable

            store.injected[f"{op}:timeout"] += 1
            await anyio.sleep(seconds)
            raise StoreUnavailable(f"{store.url}: injected timeout of {op} {key!r} after {seconds:g}s")

    return hook


def install_faults() -> None:
    """In a child: inject the faults of LAKESTREAM_FAULTS into every store it opens
    (`lakestream.testing.inject_faults`), count them in TORTURE_FAULT_LOG and add the timeouts of
    TORTURE_TIMEOUTS=probability:seconds:seed."""
    spec = os.environ.get("LAKESTREAM_FAULTS")
    if not spec:
        return
    from lakestream.testing import FaultyStore, inject_faults

    log_path = os.environ.get("TORTURE_FAULT_LOG")
    timeouts = os.environ.get("TORTURE_TIMEOUTS")

    def configure(faulty: FaultyStore) -> None:
        if log_path:
            faulty.injected = LoggedCounter(log_path)
        if timeouts:
            p, s, seed = timeouts.split(":")
            faulty.hook = timeout_hook(faulty, float(p), float(s), random.Random(int(seed)))

    inject_faults(spec, configure)


# -- the journal -----------------------------------------------------------------------------------


class Journal:
    """One JSON line per consumed step or event, appended with one write(2) each."""

    def __init__(self, path: str, slot: str, inc: int) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.slot, self.inc = slot, inc

    def write(self, record: dict[str, Any]) -> None:
        record = {"t": time.time(), "slot": self.slot, "inc": self.inc, **record}
        os.write(self.fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())

    def event(self, event: str, **kw: Any) -> None:
        self.write({"event": event, "pid": os.getpid(), **kw})


def _reader_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url")
    ap.add_argument("--mnt")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--start", type=int, required=True)
    ap.add_argument("--journal", required=True)
    ap.add_argument("--slot", required=True)
    ap.add_argument("--inc", type=int, required=True)
    return ap.parse_args(argv)


# -- the Python reader -----------------------------------------------------------------------------


def pyreader(argv: list[str]) -> int:
    """Read rank `--rank`'s steps from `--start` on with `open_reader`, journaling each one.
    Exit 3 on StepUnavailable (a rewind discarded a step it read), 1 on any other error."""
    import anyio

    import lakestream

    a = _reader_args(argv)
    j = Journal(a.journal, a.slot, a.inc)
    j.event("start", step=a.start)
    at = a.start

    async def run() -> None:
        nonlocal at
        async with lakestream.open_store(a.url) as store, lakestream.open_reader(store, a.rank, raw=True) as r:
            async for b in r.steps(a.start):
                samples = [[s["__key__"], sample_fields(s)] for s in b.samples]
                j.write({"step": b.step, "version": b.version, "producer": b.producer, "rank": a.rank,
                         "samples": samples})  # fmt: skip
                at = b.step + 1

    try:
        anyio.run(run)
    except lakestream.StepUnavailable as e:
        j.event("unavailable", step=at, error=str(e))
        print(f"pyreader: StepUnavailable at step {at}: {e}", file=sys.stderr)
        return 3
    except Exception as e:
        j.event("error", step=at, error=f"{type(e).__name__}: {e}")
        traceback.print_exc()
        return 1
    return 0


# -- the mount reader ------------------------------------------------------------------------------


def mount_instance(mnt: str) -> tuple[int | None, dict[str, Any] | None]:
    """(mount instance id: the mtime every file of a mount carries, _status.json), or (None, None)."""
    path = os.path.join(mnt, "_status.json")
    try:
        mtime = os.stat(path).st_mtime_ns
        with open(path, "rb") as f:
            return mtime, json.loads(f.read())
    except (OSError, ValueError):
        return None, None


def mntreader(argv: list[str]) -> int:
    """Read rank `--rank`'s steps from `--start` on through the mount with plain os/open calls.

    An error is retried; it is journaled as an error only if the mount was up, the same instance,
    before and after it (a SIGKILLed mount daemon is the harness's doing, not a reader failure),
    and the step is retained and committed. Exit 4 once the step it waits for is reclaimed.
    """
    a = _reader_args(argv)
    j = Journal(a.journal, a.slot, a.inc)
    j.event("start", step=a.start)
    step = a.start
    failures: Counter[int] = Counter()
    while True:
        inst, _status = mount_instance(a.mnt)
        if inst is None:
            time.sleep(0.05)
            continue
        d = os.path.join(a.mnt, f"rank-{a.rank}", f"{step:012d}")
        try:
            names = sorted(os.listdir(d))
            with open(os.path.join(d, "_meta.json"), "rb") as f:
                meta = json.loads(f.read())
            data: dict[str, bytes] = {}
            for name in names:
                if name != "_meta.json":
                    with open(os.path.join(d, name), "rb") as f:
                        data[name] = f.read()
            with open(os.path.join(d, "_meta.json"), "rb") as f:
                meta2 = json.loads(f.read())
        except OSError as e:
            inst2, status2 = mount_instance(a.mnt)
            if inst2 is None or inst2 != inst:
                time.sleep(0.05)  # the mount went away (killed daemon): wait for the next one
                continue
            assert status2 is not None
            if e.errno == errno.ENOENT and step > status2["head_step"]:
                continue  # the lookup's wait for the step ran out: look again
            if e.errno == errno.ENOENT and step < status2["first_step"]:
                j.event("reclaimed", step=step, error=str(e), first_step=status2["first_step"])
                return 4
            failures[step] += 1
            if failures[step] == 3:  # not a race with the status (head, first step) we looked at
                j.event("error", step=step, errno=e.errno, error=str(e), status={
                    k: status2.get(k) for k in ("head_step", "first_step", "version")})  # fmt: skip
            time.sleep(0.1)
            continue
        problem = None
        if meta != meta2:
            problem = f"_meta.json changed during the read: version {meta.get('version')} -> {meta2.get('version')}"
        elif meta["step"] != step or meta["rank"] != a.rank:
            problem = f"_meta.json is for step {meta['step']} rank {meta['rank']}"
        elif set(data) != set(meta["files"]) or any(len(data[n]) != meta["files"][n] for n in data):
            problem = f"files {sorted(data)} do not match _meta.json {meta['files']}"
        if problem is not None:
            failures[step] += 1
            if failures[step] == 3:
                j.event("error", step=step, error=problem)
            time.sleep(0.1)
            continue
        fields: dict[str, list[list[Any]]] = defaultdict(list)
        for name, b in data.items():
            key, _, fld = name.partition(".")
            fields[key].append([fld, digest(b), len(b)])
        samples = [[k, sorted(fields[k])] for k in meta["keys"]]
        j.write({
            "step": step, "version": meta["version"], "producer": meta["producer"], "rank": a.rank,
            "epoch": meta["epoch"], "seq": meta["seq"], "segment": meta["segment"], "samples": samples,
        })  # fmt: skip
        step += 1


def child_main(argv: list[str]) -> int:
    """`torture.py MODE ARGS…` in a child process, with the faults of its environment."""
    mode, rest = argv[0], argv[1:]
    install_faults()
    if mode == "cli":
        from lakestream.testing import run_command

        return run_command(rest)
    if mode == "pyreader":
        return pyreader(rest)
    if mode == "mntreader":
        return mntreader(rest)
    raise SystemExit(f"unknown child mode {mode!r}")
