"""Helpers for tests of `lakestream mount` run for real (a FUSE mount in a subprocess).

    m = MountProc(url, tmp / "mnt", tmp / "mount.log", "--ranks", "0").start().wait_ready()
    ...                                     # use m.mountpoint with plain file APIs
    m.stop()                                # lazy unmount, terminate/kill; asserts the process exited

`read_tree` is a top-level function so that `multiprocessing` (spawn) workers can run it; this
module imports nothing but the standard library, `cliutil` and the mount table reader, so
spawned workers start fast.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from cliutil import spawn_cli

from lakestream_mount._mounts import mounts_at

__all__ = ["MountProc", "PathDataset", "is_mounted", "read_tree", "step_name"]


def step_name(step: int) -> str:
    return f"{step:012d}"


def is_mounted(mountpoint: str | os.PathLike[str]) -> bool:
    """Whether something is mounted exactly at `mountpoint` (per /proc/self/mountinfo)."""
    return bool(mounts_at(os.fspath(mountpoint)))


class MountProc:
    """`lakestream mount URL MOUNTPOINT ARGS...` as a subprocess; stdout and stderr go to `log_path`."""

    def __init__(self, url: str, mountpoint: Path, log_path: Path, *args: Any) -> None:
        self.url = url
        self.mountpoint = Path(mountpoint)
        self.log_path = Path(log_path)
        self.args = [str(a) for a in args]
        self.proc: subprocess.Popen[str] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> MountProc:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = spawn_cli("mount", self.url, self.mountpoint, *self.args, stdout=log, stderr=subprocess.STDOUT)
        return self

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def status(self) -> dict[str, Any]:
        with open(self.mountpoint / "_status.json", "rb") as f:
            return json.loads(f.read())

    def wait_ready(self, timeout: float = 30.0) -> MountProc:
        """Wait until MOUNTPOINT/_status.json is readable (the mount serves); fail if the process dies."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"lakestream mount exited with {self.proc.returncode} before serving:\n{self.log()}"
                )
            try:
                self.status()
                return self
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"lakestream mount not serving within {timeout} s:\n{self.log()}")
            time.sleep(0.02)

    def wait_exit(self, timeout: float) -> int | None:
        """The exit code, or None if the process is still running after `timeout` seconds."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def unmount(self) -> None:
        """`fusermount3 -u -z` (lazy: never blocks on busy files); no error if not mounted."""
        if is_mounted(self.mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True, timeout=30)

    def stop(self, grace: float = 5.0) -> int:
        """Unmount, then terminate (and if need be kill) the process; assert it exited. Its exit code."""
        assert self.proc is not None
        self.unmount()
        rc = self.wait_exit(grace)
        if rc is None:
            self.proc.send_signal(signal.SIGTERM)
            rc = self.wait_exit(3.0)
        if rc is None:
            self.proc.kill()
            rc = self.wait_exit(10.0)
        assert rc is not None, f"lakestream mount (pid {self.proc.pid}) did not exit even after SIGKILL"
        assert not is_mounted(self.mountpoint), f"{self.mountpoint} is still mounted"
        return rc


def read_tree(mountpoint: str, ranks: list[int], nsteps: int) -> dict[tuple[int, int], dict[str, bytes]]:
    """Every file of every rank's steps 0..nsteps-1 under a mount, read with plain open().

    Looks each step directory up by name, so it waits for steps that are not committed yet.
    """
    out: dict[tuple[int, int], dict[str, bytes]] = {}
    for step in range(nsteps):
        for rank in ranks:
            d = os.path.join(mountpoint, f"rank-{rank}", step_name(step))
            files = {}
            for name in sorted(os.listdir(d)):
                with open(os.path.join(d, name), "rb") as f:
                    files[name] = f.read()
            out[rank, step] = files
    return out


class PathDataset:
    """A map-style dataset of mounted file paths; an item is (path, bytes read with open())."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[str, bytes]:
        with open(self.paths[i], "rb") as f:
            return self.paths[i], f.read()
