"""`lakestream dev-s3`: a local S3 server for trying s3:// streams, run as a real subprocess."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest
from cliutil import run_cli, spawn_cli, wait_until


def _start(data: Path) -> tuple[subprocess.Popen[str], dict[str, str]]:
    """Start `dev-s3 --dir data` and read the environment it prints, up to its ready line."""
    proc = spawn_cli("dev-s3", "--port", "0", "--dir", data)
    env: dict[str, str] = {}
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("export "):
            name, value = line.removeprefix("export ").strip().split("=", 1)
            env[name] = value
        elif line.startswith("# S3 at"):
            assert "bucket s3://lakestream-dev" in line, line
            return proc, env
    proc.kill()
    raise AssertionError(f"dev-s3 ended before it was ready: {proc.communicate()}")


def _weed_children(pid: int) -> list[int]:
    """The pids of `weed` processes whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
        except (OSError, ValueError):
            continue
        name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        if name == "weed" and int(rest[1]) == pid:
            found.append(int(entry.name))
    return found


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"


def test_dev_s3_serves_a_stream_keeps_it_in_dir_and_never_outlives_its_process(tmp_path: Path) -> None:
    data = tmp_path / "s3"
    proc, env = _start(data)
    try:
        assert env["AWS_ENDPOINT_URL"].startswith("http://127.0.0.1:")
        url = "s3://lakestream-dev/trial"
        run_cli("init", url, "--world-size", "2", "--global-batch", "4", env=env, check=True)
        run_cli("produce", url, "--producer-id", "p", "--synthetic", "10", env=env, check=True)
        weed = _weed_children(proc.pid)
        assert weed, "dev-s3 runs a weed server"
        proc.send_signal(signal.SIGINT)  # Ctrl-C: a clean stop, status 0
        proc.communicate(timeout=30)
        assert proc.returncode == 0
        wait_until(lambda: all(_gone(p) for p in weed), 15, "weed stopped after Ctrl-C")
    finally:
        proc.kill()
        proc.communicate()

    # The data outlives the server in --dir; a killed dev-s3 takes its server with it.
    proc, env = _start(data)
    try:
        status = run_cli("status", "s3://lakestream-dev/trial", env=env, check=True)
        assert "steps 0..2" in status.stdout, status.stdout
        weed = _weed_children(proc.pid)
        assert weed
        proc.kill()
        proc.communicate()
        wait_until(lambda: all(_gone(p) for p in weed), 15, "weed killed with its parent")
    finally:
        proc.kill()
        proc.communicate()


def test_a_server_whose_port_was_taken_before_it_bound_it_starts_again_on_fresh_ports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ports are chosen free and then bound by `weed`; another process may take one in between
    (parallel test workers' connections draw from the same range). The server exits at once
    ("address already in use") and is started again on fresh ports, not reported as broken."""
    from lakestream import _devs3

    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    chosen: list[list[int]] = []
    real = _devs3.free_ports

    def first_one_taken(n: int) -> list[int]:
        ports = real(n)
        if not chosen:
            ports[4] = taken.getsockname()[1]  # the filer's port, as in the failure seen
        chosen.append(ports)
        return ports

    monkeypatch.setattr(_devs3, "free_ports", first_one_taken)
    try:
        with _devs3.S3Server() as server:
            assert len(chosen) == 2 and server.endpoint_url == f"http://127.0.0.1:{chosen[1][6]}"
            url = server.new_bucket("s")
            assert url.startswith("s3://")
    finally:
        taken.close()
