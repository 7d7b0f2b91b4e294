"""`run_cli` runs the CLI in a fork of a server that has imported it (clifork.py): the fork must behave as
the fresh `python -m lakestream._cli` it stands for, which every test of the command line relies on."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import clifork
import cliutil
import pytest
from cliutil import describe, run_cli

pytestmark = pytest.mark.skipif(cliutil.FRESH, reason="run_cli starts fresh interpreters here")

MAP_MODULE = """
import os

def fn(sample):
    return {**sample, "env": os.environ["MAP_ENV"].encode()}
"""


def same(*args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `lakestream ARGS` forked and fresh; assert the same exit status, stdout and stderr."""
    forked = run_cli(*args, env=env)
    fresh = run_cli(*args, env=env, fresh=True)
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr), (
        f"forked: {describe(forked)}\nfresh: {describe(fresh)}"
    )
    return forked


def test_a_forked_command_has_the_exit_status_and_output_of_a_fresh_one(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/s"
    assert same("--version").stdout.startswith("lakestream ")
    assert same("--help", env={"COLUMNS": "60"}).returncode == 0  # argparse wraps at $COLUMNS, read as it runs
    assert same("status", url).returncode == 1  # no stream: one line on stderr
    assert same("init", url, "--world-size", "two").returncode == 2  # a usage error, from argparse
    run_cli("init", url, "--world-size", "1", "--global-batch", "2", check=True)
    run_cli("produce", url, "--producer-id", "p", "--synthetic", "6", check=True)
    assert same("status", url, "--json").returncode == 0
    assert same("read", url, "--rank", "0", "--to-step", "2", "--json").stdout.count("\n") == 4  # 3 steps, summary
    r = same("status", "s3://bucket/s", env={"LAKESTREAM_S3_CLIENT": "nosuch"})  # read from the environment
    assert r.returncode == 1 and "LAKESTREAM_S3_CLIENT='nosuch'" in r.stderr, describe(r)


def test_a_variable_read_as_the_command_runs_is_applied_in_the_fork_and_one_read_at_start_is_not() -> None:
    """PYTHONBREAKPOINT is read at each `breakpoint()` (and `ray.init` sets it in its process, so a fleet
    test left it set for the rest of its worker): a fork applies it. PYTHONHASHSEED and the locale are
    read as the interpreter starts: a request that changes them runs fresh."""
    env = {"PYTHONBREAKPOINT": "ray.util.rpdb.set_trace", "PYTHONHASHSEED": "7", "LC_ALL": "C.UTF-8", "COLUMNS": "60"}
    assert clifork.startup_vars(env) == {"PYTHONHASHSEED": "7", "LC_ALL": "C.UTF-8"}
    assert same("--help", env={"PYTHONBREAKPOINT": "0"}).returncode == 0


def test_a_forked_command_imports_from_its_own_pythonpath_and_sees_its_environment(tmp_path: Path) -> None:
    (tmp_path / "mod").mkdir()
    (tmp_path / "mod" / "envmap.py").write_text(MAP_MODULE)
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path / "mod"), os.environ.get("PYTHONPATH", "")]), "MAP_ENV": "x"}
    for name, fresh in (("forked", False), ("fresh", True)):
        url = f"file://{tmp_path}/{name}"
        run_cli("init", url, "--world-size", "1", "--global-batch", "2", check=True, fresh=fresh)
        run_cli("produce", url, "--producer-id", "p", "--synthetic", "4", "--map", "envmap:fn",
                env=env, check=True, fresh=fresh)  # fmt: skip
        out = run_cli("read", url, "--rank", "0", "--to-step", "1", "--out", tmp_path / f"{name}-out", check=True)
        assert out.returncode == 0
    forked, fresh = (cliutil.read_out_dir(tmp_path / f"{name}-out") for name in ("forked", "fresh"))
    assert forked == fresh and [data for name, data in forked[0].items() if name.endswith(".env")] == [b"x", b"x"]
    r = run_cli("produce", f"file://{tmp_path}/forked", "--producer-id", "q", "--synthetic", "4", "--map", "envmap:fn")
    assert r.returncode == 1 and "envmap" in r.stderr, describe(r)  # not on this command's path


def test_a_forked_command_past_its_timeout_is_killed(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/s"
    run_cli("init", url, "--world-size", "1", "--global-batch", "2", check=True)
    with pytest.raises(subprocess.TimeoutExpired):
        run_cli("read", url, "--rank", "0", "--to-step", "0", timeout=3)  # waits for a step nobody produces
    server = cliutil._fork_server._proc
    assert server is not None and server.poll() is None
    children = Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split()
    assert children == [], f"the killed command is still running: {children}"
    assert same("status", url).returncode == 0  # and the server serves the next command


def test_a_spawned_command_is_a_popen_of_a_fork_that_can_be_polled_signalled_and_waited_for(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/s"
    run_cli("init", url, "--world-size", "1", "--global-batch", "2", check=True)
    # A server of this test's own, started in this environment: every request forks (the shared one may have
    # started under variables an earlier test set, and then runs requests fresh, as it should).
    own = clifork.Server()
    env = cliutil.cli_env()

    def spawn(*argv: str, fresh: bool = False, **popen: object) -> subprocess.Popen[str]:
        popen.setdefault("stdout", subprocess.PIPE)
        popen.setdefault("stderr", subprocess.PIPE)
        return cliutil.spawn_cli(*argv, fresh=True, **popen) if fresh else own.popen(list(argv), env, **popen)

    reader = spawn("status", url)  # starts the server
    reader.communicate(timeout=60)
    server = own._proc
    for fresh in (False, True):
        reader = spawn("read", url, "--rank", "0", "--to-step", "0", fresh=fresh)  # waits for step 0
        try:
            assert isinstance(reader, clifork.ForkedPopen) != fresh
            assert reader.stderr is not None
            assert "as they are committed" in reader.stderr.readline()  # said before it waits
            assert reader.poll() is None
            with pytest.raises(subprocess.TimeoutExpired):
                reader.wait(0.2)
            parent = Path(f"/proc/{reader.pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
            assert int(parent) == (os.getpid() if fresh else server.pid)  # type: ignore[union-attr]
            reader.send_signal(signal.SIGKILL)
            assert reader.wait(30) == -signal.SIGKILL and reader.poll() == -signal.SIGKILL
        finally:
            reader.kill()
            reader.communicate()
    out = tmp_path / "log"
    with open(out, "w") as log:  # stdout into a file, stderr with it, as the mount helper has them
        r = spawn("status", url, "--json", stdout=log, stderr=subprocess.STDOUT)
        assert isinstance(r, clifork.ForkedPopen)
        assert r.wait(60) == 0 and r.stdout is None
    assert '"head_step"' in out.read_text()
    bad = spawn("status", f"file://{tmp_path}/none")
    stdout, stderr = bad.communicate(timeout=60)
    own.close()
    assert isinstance(bad, clifork.ForkedPopen)
    fresh_bad = run_cli("status", f"file://{tmp_path}/none", fresh=True)
    assert (bad.returncode, stdout, stderr) == (fresh_bad.returncode, fresh_bad.stdout, fresh_bad.stderr)
