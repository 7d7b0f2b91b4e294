"""A fork server for `run_cli` (cliutil.py): `python clifork.py ADDRESS`, one per test process.

Starting `python -m lakestream._cli` costs about half a second of CPU, most of it importing the package;
the suite starts the CLI over a thousand times. This server imports `lakestream._cli` once, while it is
single-threaded and has done nothing else, then forks a child per request that runs the CLI as `python -m
lakestream._cli ARGS` would: the caller's environment (PYTHONPATH applied to `sys.path`), working
directory, argv, stdin /dev/null, stdout and stderr on the caller's pipes, the interpreter's own exit path
(flush, atexit, threads joined) and its exit status or signal. A request whose environment changes what an
interpreter reads as it starts (other PYTHON* variables, the locale) is run by the caller in a fresh process
instead (`Server.run`).

`Server.popen` starts such a child as `subprocess.Popen` would (stdin /dev/null, stdout and stderr as
given) and returns a `Popen` of it (`ForkedPopen`): the same pipes, `poll`, `wait`, `communicate` and
signals, its exit status told by the server, which is its parent.

Protocol, on an abstract Unix socket, one connection per request: the client sends a 4-byte length and a
JSON request {argv, env, cwd} with the child's stdin, stdout and stderr attached; the server answers
"PID\n" once the child runs, then "STATUS\n" (as `Popen.returncode`: -N for signal N) when it ends.
The server ends when its stdin (a pipe from the test process) closes. Standard library only, so that the
server's one import of note is the CLI's.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import socket
import struct
import subprocess
import sys
import time
import types
from collections.abc import Mapping
from typing import Any

#: Environment variables an interpreter or a library reads once, as it starts or is imported: a request that
#: changes one of them (PYTHONPATH and PYTHONUNBUFFERED aside, see `_child`) runs in a fresh process.
#: PYTHONBREAKPOINT is read at each `breakpoint()`, not at start; `ray.init` sets it in the process
#: that calls it, which made every later command of a fleet test's worker run fresh.
STARTUP_PREFIXES = ("PYTHON", "LC_", "LANG", "OPENBLAS", "OMP_", "NPY_", "MKL_")
NOT_STARTUP = ("PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONBREAKPOINT")
MODULE = "lakestream._cli"
#: Imported by the server too: what most commands import as they run (asyncio, the S3 clients; importing
#: these starts no thread, and obstore starts its threads on first use only).
PRELOAD = [
    "asyncio",
    "ssl",
    "anyio._backends._asyncio",
    "botocore.session",
    "lakestream._store._obstore",
    "lakestream._store._s3",
]


def startup_vars(env: Mapping[str, str]) -> dict[str, str]:
    """The part of `env` a fork of the server cannot apply."""
    return {k: v for k, v in env.items() if k.startswith(STARTUP_PREFIXES) and k not in NOT_STARTUP}


def _search_path(pythonpath: str | None) -> list[str]:
    """The `sys.path` entries an interpreter makes of PYTHONPATH."""
    return [os.path.abspath(p) for p in (pythonpath or "").split(os.pathsep) if p]


# --- the server ---------------------------------------------------------------------------------------------


def _serve(address: str) -> dict[str, Any]:
    """Answer requests until stdin closes (then exit); in a forked child, return its request."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(0, selectors.EVENT_READ, "stdin")
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, connection)
    while True:
        for key, _ in sel.select():
            if key.data == "stdin":
                if not os.read(0, 4096):
                    sys.exit(0)
            elif key.data == "accept":
                conn, _ = listener.accept()
                conn.setblocking(True)
                try:
                    request, fds = _receive(conn)
                except EOFError:  # a probe (Server._start), or a caller gone
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    listener.close()
                    for pidfd, (_, other) in children.items():
                        os.close(pidfd)
                        other.close()
                    conn.close()
                    request["fds"] = fds
                    return request
                for fd in fds:
                    os.close(fd)
                pidfd = os.pidfd_open(pid)
                children[pidfd] = (pid, conn)
                sel.register(pidfd, selectors.EVENT_READ, "child")
                conn.sendall(b"%d\n" % pid)
            else:
                pidfd = key.fd
                pid, conn = children.pop(pidfd)
                sel.unregister(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                try:
                    conn.sendall(b"%d\n" % os.waitstatus_to_exitcode(status))
                except OSError:
                    pass  # the caller left (interrupted)
                conn.close()


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    if not data:
        raise EOFError("no request")
    while len(data) < 4 or len(data) < 4 + struct.unpack("<I", data[:4])[0]:
        more = conn.recv(1 << 16)
        if not more:
            raise EOFError("request cut short")
        data += more
    return json.loads(data[4:]), fds


def _child(request: dict[str, Any]) -> None:
    """Make this fork of the server the process `python -m lakestream._cli ARGS` would have been."""
    fds = request["fds"]
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    os.chdir(request["cwd"])
    base = _search_path(os.environ.get("PYTHONPATH"))
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[:] = [
        os.getcwd(),  # `-m` puts the working directory first
        *_search_path(os.environ.get("PYTHONPATH")),
        *(p for p in sys.path[1:] if p not in base),
    ]
    import importlib

    importlib.invalidate_caches()
    import multiprocessing.process

    multiprocessing.process.ORIGINAL_DIR = os.getcwd()  # what it read at import, in a fresh process
    multiprocessing.process.current_process().authkey = os.urandom(32)
    sys.argv = ["-m", *request["argv"]]
    sys.orig_argv = [sys.executable, "-m", MODULE, *request["argv"]]
    main = types.ModuleType("__main__")  # a fresh namespace, not this script's
    sys.modules["__main__"] = main


# --- the client ---------------------------------------------------------------------------------------------


class Server:
    """This process's fork server, started on first use, ended when this process ends (`close`, or the
    kernel closing its stdin)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._address = ""
        self._startup: dict[str, str] = {}

    def _start(self) -> None:
        self._address = f"\0lakestream-cli-{os.getpid()}-{time.monotonic_ns()}"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self._startup = startup_vars(env)
        self._proc = subprocess.Popen(
            [sys.executable, __file__, self._address[1:]],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        atexit.register(self.close)
        deadline = time.monotonic() + 120
        while True:
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                    probe.connect(self._address)  # an empty request, which the server drops
                return
            except (ConnectionRefusedError, FileNotFoundError):
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the CLI fork server did not start (exit {self._proc.poll()})") from None
                time.sleep(0.02)

    def close(self) -> None:
        """End the server and wait for it (so that its children's CPU time counts as this process's)."""
        if self._proc is not None and self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def run(self, argv: list[str], env: dict[str, str], timeout: float | None) -> subprocess.CompletedProcess[str]:
        """`subprocess.run([*LAKESTREAM, *argv], env=env, capture_output=True, text=True, timeout=timeout,
        stdin=DEVNULL)`, in a fork of the server where that gives the same process."""
        cmd = [sys.executable, "-m", MODULE, *argv]
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        if startup_vars(env) != self._startup:
            return subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
            )
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        devnull = os.open(os.devnull, os.O_RDONLY)
        try:
            conn = self._request(argv, env, os.getcwd(), [devnull, out_w, err_w])
        finally:
            for fd in (devnull, out_w, err_w):
                os.close(fd)
        return _collect(cmd, conn, out_r, err_r, timeout)

    def popen(self, argv: list[str], env: dict[str, str], **popen: Any) -> subprocess.Popen[str]:
        """`subprocess.Popen([*LAKESTREAM, *argv], env=env, stdin=DEVNULL, text=True, **popen)`, its process a fork
        of the server where that gives the same process: `popen` may name `stdout` and `stderr` only."""
        cmd = [sys.executable, "-m", MODULE, *argv]
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        if startup_vars(env) != self._startup or set(popen) - {"stdout", "stderr"}:
            return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, text=True, **popen)
        return ForkedPopen(self, cmd, env=env, stdin=subprocess.DEVNULL, text=True, **popen)

    def _request(self, argv: list[str], env: dict[str, str], cwd: str, fds: list[int]) -> socket.socket:
        """Ask for a child running `argv` on `fds` (its stdin, stdout, stderr): the connection its answers come on."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self._address)
            payload = json.dumps({"argv": argv, "env": env, "cwd": cwd}).encode()
            socket.send_fds(conn, [struct.pack("<I", len(payload)) + payload], fds)
        except BaseException:
            conn.close()
            raise
        return conn


class ForkedPopen(subprocess.Popen[str]):
    """A `Popen` whose process the server forks instead of this process starting it (`Server.popen`).

    Only how the child starts and how its exit status is learnt differ: `_execute_child` sends the request
    with the child's ends of the pipes `Popen` made, and the status the server reads with `waitpid` (it is the
    parent) comes back on the request's connection, where `_try_wait` reads it."""

    def __init__(self, server: Server, cmd: list[str], **popen: Any) -> None:
        self._server = server
        self._answers: list[bytes] = []
        self._conn: socket.socket | None = None
        super().__init__(cmd, **popen)

    def _execute_child(self, args: Any, executable: Any, preexec_fn: Any, close_fds: Any, pass_fds: Any, cwd: Any,
                       env: Any, startupinfo: Any, creationflags: Any, shell: Any, p2cread: int, p2cwrite: int,
                       c2pread: int, c2pwrite: int, errread: int, errwrite: int, *rest: Any) -> None:  # fmt: skip
        try:
            fds = [p2cread, c2pwrite if c2pwrite != -1 else 1, errwrite if errwrite != -1 else 2]
            self._conn = self._server._request(args[3:], env, os.fspath(cwd or os.getcwd()), fds)
            self.pid = _answers(self._answers, self._conn)[0]
            self._child_created = True
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    def _try_wait(self, wait_flags: int) -> tuple[int, int]:
        """(pid, wait status) once the server has told the exit status, else (0, 0) under WNOHANG."""
        if self._conn is None:
            return 0, 0
        self._conn.setblocking(not wait_flags & os.WNOHANG)
        try:
            code = _answers(self._answers, self._conn, 2)[1]
        except BlockingIOError:
            return 0, 0
        self._conn.close()
        self._conn = None
        return self.pid, (code & 0xFF) << 8 if code >= 0 else -code

    def _internal_poll(self, _deadstate: int | None = None, **_: Any) -> int | None:
        """As `Popen._internal_poll`, by `_try_wait` rather than `waitpid` (the child is not this process's)."""
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                if self.returncode is None:
                    pid, status = self._try_wait(os.WNOHANG)
                    if pid == self.pid:
                        self._handle_exitstatus(status)
            except (OSError, RuntimeError):  # the server gone: the status cannot be known
                if _deadstate is None:
                    raise
                self.returncode = _deadstate  # (as the object is collected)
            finally:
                self._waitpid_lock.release()
        return self.returncode


def _collect(
    cmd: list[str], conn: socket.socket, out_r: int, err_r: int, timeout: float | None
) -> subprocess.CompletedProcess[str]:
    """Read the child's output to its end, then its exit status, as `subprocess.run` does: on timeout the
    child is killed and `TimeoutExpired` raised once it has ended."""
    deadline = None if timeout is None else time.monotonic() + timeout
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: [], conn.fileno(): []}
    try:
        with selectors.DefaultSelector() as sel:
            for fd in chunks:
                sel.register(fd, selectors.EVENT_READ)
            while out_r in sel.get_map() or err_r in sel.get_map():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    answers = _answers(chunks[conn.fileno()], conn)
                    if len(answers) == 1:  # not reaped yet: the server reports the status after it
                        os.kill(answers[0], 9)
                        _answers(chunks[conn.fileno()], conn, 2)
                    out, err = (_text(b"".join(chunks[fd])) for fd in (out_r, err_r))
                    raise subprocess.TimeoutExpired(cmd, timeout or 0.0, out, err)
                for key, _ in sel.select(left):
                    data = os.read(key.fd, 1 << 16)
                    if data:
                        chunks[key.fd].append(data)
                    else:
                        sel.unregister(key.fd)
        answers = _answers(chunks[conn.fileno()], conn, 2)  # no deadline here: `subprocess.run` waits too
    finally:
        conn.close()
        os.close(out_r)
        os.close(err_r)
    out, err = (_text(b"".join(chunks[fd])) for fd in (out_r, err_r))
    return subprocess.CompletedProcess(cmd, answers[1], out, err)


def _answers(chunks: list[bytes], conn: socket.socket, wait_for: int = 1) -> list[int]:
    """The server's answers so far (pid, then status), reading `conn` until there are `wait_for` of them."""
    while True:
        answers = b"".join(chunks).split(b"\n")[:-1]
        if len(answers) >= wait_for:
            return [int(a) for a in answers]
        data = conn.recv(4096)
        if not data:
            raise RuntimeError(f"the CLI fork server ended with a child running (answers {answers})")
        chunks.append(data)


def _text(data: bytes) -> str:
    """As `subprocess` decodes captured output in text mode."""
    import locale

    return data.decode(locale.getencoding()).replace("\r\n", "\n").replace("\r", "\n")


if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # as `python -m` has it, not this script's directory
    import importlib

    importlib.import_module(MODULE)  # and all it imports; then forgotten, as `-m` runs it as __main__ only
    del sys.modules[MODULE]
    package, _, name = MODULE.rpartition(".")
    delattr(sys.modules[package], name)
    for module in PRELOAD:
        importlib.import_module(module)
    import gc

    gc.freeze()  # out of the collector's sight: a child's collections and exit neither walk nor copy them
    _child(_serve("\0" + sys.argv[1]))
    import runpy

    runpy._run_module_as_main(MODULE)  # type: ignore[attr-defined]  # what `python -m` calls
