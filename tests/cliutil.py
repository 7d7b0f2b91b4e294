"""Helpers for tests that run the `lakestream` command in real subprocesses.

    result = run_cli("status", url, "--json")            # CompletedProcess, text output
    proc = spawn_cli("produce", url, "--producer-id", "a", "--from-dir", d)   # Popen
    files = make_source_dir(tmp / "src", "a", 100, random.Random(0))        # {name: bytes}
    steps = read_out_dir(tmp / "out")                     # {step: {name: bytes}}

`env` arguments are merged over `os.environ` (pass `s3_server.env()` for an S3 stream).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import clifork

__all__ = [
    "LAKESTREAM",
    "cli_env",
    "cursor_position",
    "head_step",
    "make_source_dir",
    "read_out_dir",
    "run_cli",
    "spawn_cli",
    "stop_fork_server",
    "wait_until",
]

#: The command line that runs the CLI of the interpreter running the tests.
LAKESTREAM = [sys.executable, "-m", "lakestream._cli"]

#: Whether `run_cli` starts a fresh interpreter for every command rather than forking one (clifork.py, which
#: needs Linux: pidfds and abstract Unix sockets).
FRESH = os.environ.get("LAKESTREAM_TEST_FRESH_CLI", "") not in ("", "0") or not hasattr(os, "pidfd_open")
_fork_server = clifork.Server()

T = TypeVar("T")


def cursor_position(cursor: Any) -> int:
    """How many source files a committed cursor has consumed: `--from-dir` cursors are
    `{"after": name, "files": n, "sha256": …}` (older ones a plain position), None is 0."""
    if isinstance(cursor, dict):
        return int(cursor["files"])
    return 0 if cursor is None else int(cursor)


def cli_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`os.environ` with `env` over it, and unbuffered Python output."""
    out = dict(os.environ)
    out.update(env or {})
    out["PYTHONUNBUFFERED"] = "1"
    return out


def run_cli(
    *args: Any,
    env: Mapping[str, str] | None = None,
    timeout: float = 120.0,
    check: bool | None = None,
    fresh: bool = FRESH,
) -> subprocess.CompletedProcess[str]:
    """Run `lakestream ARGS...` to completion; stdout and stderr captured as text.

    `check=True` asserts exit 0, `check=False` asserts a non-zero exit, None checks nothing. The command
    runs in a fork of a process that has imported the CLI (clifork.py), which behaves as a fresh
    `python -m lakestream._cli` at a fraction of the CPU; `fresh=True` (or LAKESTREAM_TEST_FRESH_CLI=1 for
    every call) starts a fresh interpreter.
    """
    if fresh:
        argv = [*LAKESTREAM, *map(str, args)]
        r = subprocess.run(
            argv, env=cli_env(env), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    else:
        r = _fork_server.run([str(a) for a in args], cli_env(env), timeout)
    if check is True:
        assert r.returncode == 0, describe(r)
    elif check is False:
        assert r.returncode != 0, describe(r)
    return r


def stop_fork_server() -> None:
    """End this process's CLI fork server, if it started one (conftest.py, as the session ends)."""
    _fork_server.close()


def describe(r: subprocess.CompletedProcess[str]) -> str:
    """A failure message showing a finished command's exit code and output."""
    cmd = " ".join(str(a) for a in r.args[len(LAKESTREAM) :]) if isinstance(r.args, list) else r.args
    return f"lakestream {cmd}: exit {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}"


def spawn_cli(
    *args: Any, env: Mapping[str, str] | None = None, fresh: bool = FRESH, **popen: Any
) -> subprocess.Popen[str]:
    """Start `lakestream ARGS...` (stdin /dev/null); stdout and stderr are text pipes unless overridden.

    As `run_cli`, in a fork of a process that has imported the CLI unless `fresh` (clifork.py): a `Popen`
    all the same, whose process can be signalled, polled and waited for."""
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.PIPE)
    if fresh:
        return subprocess.Popen(
            [*LAKESTREAM, *map(str, args)], env=cli_env(env), text=True, stdin=subprocess.DEVNULL, **popen
        )
    return _fork_server.popen([str(a) for a in args], cli_env(env), **popen)


def make_source_dir(
    directory: Path, prefix: str, n: int, rng: random.Random, *, max_bin: int = 200
) -> dict[str, bytes]:
    """A WebDataset-style directory of `n` samples with keys `<prefix>-<i:05d>`; its {file name: bytes}.

    Every sample has a `txt` and a `bin` field (random bytes, sometimes empty); some also a `json`.
    """
    directory.mkdir(parents=True, exist_ok=True)
    files: dict[str, bytes] = {}
    for i in range(n):
        key = f"{prefix}-{i:05d}"
        files[f"{key}.txt"] = f"sample {i} of {prefix}: {rng.random()}".encode()
        files[f"{key}.bin"] = rng.randbytes(rng.randrange(0, max_bin + 1))
        if i % 7 == 3:
            files[f"{key}.json"] = b'{"i": %d}' % i
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return files


def read_out_dir(out: Path) -> dict[int, dict[str, bytes]]:
    """What `lakestream read --out OUT` wrote: {step: {file name: bytes}}.

    Asserts the layout: only `<step:012d>` directories holding only files.
    """
    steps: dict[int, dict[str, bytes]] = {}
    for d in sorted(out.iterdir()):
        assert d.is_dir() and len(d.name) == 12 and d.name.isdigit(), f"unexpected entry {d} in {out}"
        files = {}
        for f in sorted(d.iterdir()):
            assert f.is_file(), f"unexpected entry {f}"
            files[f.name] = f.read_bytes()
        steps[int(d.name)] = files
    return steps


def head_step(url: str) -> int:
    """The stream's head step, read in this process: a poll that costs a file read, not a CLI start (which
    takes most of a second of CPU, and seconds on a busy machine, while the producer polled for runs on)."""
    import anyio

    import lakestream

    return anyio.run(lakestream.load_state, url).head


def wait_until(predicate: Callable[[], T], timeout: float = 30.0, what: str = "condition") -> T:
    """Poll `predicate` (with a short backoff) until it returns something truthy; return it."""
    deadline = time.monotonic() + timeout
    interval = 0.005
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout} s")
        time.sleep(interval)
        interval = min(interval * 2, 0.1)
