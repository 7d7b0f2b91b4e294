"""The throwaway Azure Blob Storage server the `az://` tests use: Azurite's blob service (Microsoft's
emulator, from the npm registry; `scripts/setup.sh` installs it under `.venv/azurite`), one process
per test session on a free port, with its data in a temporary directory.

Azurite serves the well-known development account (`devstoreaccount1` and its published key); a
container is created here with one Create Container request signed with that key (Shared Key), as
the library has no call that creates one (a stream lives in a container its operator made).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from email.utils import formatdate
from pathlib import Path

from lakestream.testing import free_ports

ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
API_VERSION = "2021-08-06"


class AzuriteNotFound(RuntimeError):
    pass


def find_azurite() -> str:
    """`azurite-blob` from `.venv/azurite` (next to the interpreter's virtualenv), else on PATH."""
    here = Path(sys.executable).parent.parent / "azurite" / "node_modules" / ".bin" / "azurite-blob"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which("azurite-blob")
    if found:
        return found
    raise AzuriteNotFound(
        "Azurite's `azurite-blob` was not found in .venv/azurite or on PATH; the az:// tests need the real "
        "emulator: bash scripts/setup.sh (npm install --prefix .venv/azurite azurite)"
    )


def _die_with_parent() -> None:
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Azurite:
    """One `azurite-blob` process: `.endpoint_url`, `.env()`, `.new_container()`, `.new_stream()`."""

    def __init__(self, exe: str | None = None) -> None:
        self.exe = exe or find_azurite()
        self.dir = Path(tempfile.mkdtemp(prefix="lakestream-azurite-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.endpoint_url = ""
        self._container: str | None = None

    def __enter__(self) -> Azurite:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 60.0) -> Azurite:
        for attempt in range(3):  # a free port taken by another process before Azurite bound it
            (port,) = free_ports(1)
            self.endpoint_url = f"http://127.0.0.1:{port}/{ACCOUNT}"
            args = [self.exe, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", str(self.dir),
                    "--silent", "--skipApiVersionCheck", "--disableTelemetry"]  # fmt: skip
            with open(self.dir / "azurite.log", "ab") as log:
                self.proc = subprocess.Popen(
                    args, cwd=self.dir, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    preexec_fn=_die_with_parent,
                )  # fmt: skip
            deadline = time.monotonic() + timeout
            while self.proc.poll() is None and time.monotonic() < deadline:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    return self
                except OSError:
                    time.sleep(0.05)
            self.stop(keep_dir=True)
            if attempt == 2 or time.monotonic() >= deadline:
                break
        log_text = (self.dir / "azurite.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"Azurite did not start: {log_text}")

    def stop(self, *, keep_dir: bool = False) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if not keep_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def env(self) -> dict[str, str]:
        """The AZURE_* variables that point a client (or a subprocess) at this server."""
        return {
            "AZURE_STORAGE_ACCOUNT_NAME": ACCOUNT,
            "AZURE_STORAGE_ACCOUNT_KEY": KEY,
            "AZURE_STORAGE_ENDPOINT": self.endpoint_url,
        }

    def create_container(self, name: str) -> None:
        """Create Container, signed with the account key (Shared Key)."""
        date = formatdate(usegmt=True)
        headers = f"x-ms-date:{date}\nx-ms-version:{API_VERSION}"
        # VERB, then 11 standard headers (all empty here but Content-Length, which is empty when 0)
        to_sign = "\n".join(["PUT", *[""] * 11, headers, f"/{ACCOUNT}/{ACCOUNT}/{name}\nrestype:container"])
        mac = hmac.new(base64.b64decode(KEY), to_sign.encode(), hashlib.sha256).digest()
        request = urllib.request.Request(
            f"{self.endpoint_url}/{name}?restype=container",
            method="PUT",
            headers={
                "x-ms-date": date,
                "x-ms-version": API_VERSION,
                "Authorization": f"SharedKey {ACCOUNT}:{base64.b64encode(mac).decode()}",
                "Content-Length": "0",
            },
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 201, response.status

    def new_container(self) -> str:
        name = f"lakestream-{uuid.uuid4().hex[:16]}"
        self.create_container(name)
        return name

    def new_stream(self) -> str:
        """`az://CONTAINER/NAME` for a new stream, all in one container made on first use."""
        if self._container is None:
            self._container = self.new_container()
        return f"az://{self._container}/stream-{uuid.uuid4().hex[:8]}"
