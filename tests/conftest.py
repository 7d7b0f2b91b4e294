"""Shared fixtures. `s3_server` runs a real SeaweedFS S3 server for the session (see s3server.py), and
`azurite` a real Azure Blob Storage emulator (see azurite.py); with pytest-xdist (`-n` in pyproject.toml)
each worker is a session of its own, with servers of its own.

Nothing outlives the run: every process it starts carries LAKESTREAM_TEST_RUN in its environment, and
a reaper (reaper.py), started first and watching a pipe from the run, ends what is left of them and
unmounts what is left mounted once the run ends, is interrupted or is killed."""

from __future__ import annotations

import compileall
import importlib.util
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from azurite import Azurite, AzuriteNotFound, find_azurite
from hypothesis import HealthCheck, settings
from reaper import RUN_VAR
from s3server import S3Server, WeedNotFound, find_weed

REAPER = pytest.StashKey[subprocess.Popen[bytes]]()

# Hypothesis's per-example deadline (200 ms) and its too-slow check time the machine, not the code: with
# four workers on two cores, shared with other work, an example waits for a core. Every example still runs;
# pytest-timeout bounds a test that hangs.
settings.register_profile("suite", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("suite")


@pytest.hookimpl(trylast=True)  # after the tmp_path plugin's configure: the run's base temp dir is known
def pytest_configure(config: pytest.Config) -> None:
    """In every process of the run: let pytest keep its rewritten test modules in __pycache__ even where
    PYTHONDONTWRITEBYTECODE is set (each xdist worker rewrites every test module as it collects: about 10 s
    of CPU each, without its cache).

    In the run's first process (the xdist controller, or the only one), before any worker starts: compile
    the packages the tests import (a CLI subprocess reads the .pyc files whatever PYTHONDONTWRITEBYTECODE
    says, and starts in half the CPU), mark the environment every later process inherits, and start the
    reaper in a session of its own (a Ctrl-C at the terminal does not reach it), with the read end of a pipe
    only this process writes to.

    A run started in the background by a shell without job control (`nohup ./.ci/run &`) inherits
    SIGINT ignored, and every process it starts would too: the tests that stop a caller, a CLI
    command or a server with Ctrl-C's signal need it to act as it does at a terminal, so it is
    restored here, in every process of the run (its children then start with the default)."""
    sys.dont_write_bytecode = False
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if hasattr(config, "workerinput") or RUN_VAR in os.environ:
        return  # an xdist worker, or a run inside a run: the outer reaper covers it
    for package in ("lakestream", "lakestream_mount"):
        spec = importlib.util.find_spec(package)
        for directory in (spec and spec.submodule_search_locations) or ():
            compileall.compile_dir(directory, quiet=1)
    run = uuid.uuid4().hex
    os.environ[RUN_VAR] = run
    temp = str(config._tmp_path_factory.getbasetemp())  # type: ignore[attr-defined]  # xdist uses it too
    argv = [sys.executable, str(Path(__file__).with_name("reaper.py")), run, str(os.getpid()), temp]
    config.stash[REAPER] = subprocess.Popen(argv, stdin=subprocess.PIPE, start_new_session=True)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """`--dist loadgroup` (pyproject.toml): this suite's groups and order (see scheduling.py)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from scheduling import Scheduling

    return Scheduling(config, log)


def pytest_unconfigure(config: pytest.Config) -> None:
    """End this process's CLI fork server (cliutil.py); close the reaper's pipe and wait for it to have ended
    what the run left (nothing, normally)."""
    if "cliutil" in sys.modules:
        sys.modules["cliutil"].stop_fork_server()
    reaper = config.stash.get(REAPER, None)
    if reaper is not None:
        assert reaper.stdin is not None
        reaper.stdin.close()
        try:
            reaper.wait(60)
        except subprocess.TimeoutExpired:
            pass


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A SeaweedFS S3 server for the whole session: `.endpoint_url`, `.access_key`, `.secret_key`,
    `.new_bucket()` -> fresh `s3://BUCKET/PREFIX`, `.env()` -> AWS_* variables for subprocesses.
    Fails (never skips) without the `weed` binary: the S3 tests need the real server."""
    try:
        weed, missing = find_weed(), ""
    except WeedNotFound as e:
        weed, missing = "", str(e)
    if missing:
        pytest.fail(missing, pytrace=False)
    with S3Server(weed) as server:
        yield server


@pytest.fixture
def s3_url(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh, empty `s3://BUCKET/PREFIX`, with the AWS_* variables set so `open_store(url)` works."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return s3_server.new_stream()


@pytest.fixture(scope="session")
def azurite() -> Iterator[Azurite]:
    """An Azurite blob server for the whole session. Fails (never skips) without `azurite-blob`:
    the az:// tests need the real emulator."""
    try:
        exe, missing = find_azurite(), ""
    except AzuriteNotFound as e:
        exe, missing = "", str(e)
    if missing:
        pytest.fail(missing, pytrace=False)
    with Azurite(exe) as server:
        yield server


@pytest.fixture
def az_url(azurite: Azurite, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh, empty `az://CONTAINER/PREFIX`, with the AZURE_* variables set so `open_store(url)` works."""
    for name in [n for n in os.environ if n.startswith("AZURE_")]:
        monkeypatch.delenv(name)
    for name, value in azurite.env().items():
        monkeypatch.setenv(name, value)
    return azurite.new_stream()


@pytest.fixture(params=["file", "s3"])
def stream_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh stream URL, once on `file://` and once on the real SeaweedFS server."""
    return f"file://{tmp_path}/s" if request.param == "file" else str(request.getfixturevalue("s3_url"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that uses the S3 server `s3`, the Azure emulator `azure`, and the longest ones
    (scheduling.FIRST) `slow`."""
    from scheduling import is_slow

    for item in items:
        callspec = getattr(item, "callspec", None)
        uses_s3 = callspec is not None and callspec.params.get("stream_url") == "s3"
        if uses_s3 or "s3_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.s3)
        if "azurite" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.azure)
        if is_slow(item.nodeid):
            item.add_marker(pytest.mark.slow)
