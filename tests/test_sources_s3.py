"""`wds:s3://…` and `parquet:s3://…` sources on a real SeaweedFS: the same samples as from local files,
produced into file:// and s3:// streams, split with `--shard`, resumed after SIGKILL, refused when an
object was rewritten (its ETag), read through an outage, and permanent errors as typed one-line errors."""

from __future__ import annotations

import contextlib
import io
import random
import socket
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import botocore.session
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from botocore.config import Config
from cliutil import describe, run_cli, spawn_cli, wait_until
from netfault import OutageProxy
from test_sources import file_url, make_parquet, make_wds, read_values

import lakestream
from lakestream import sources
from lakestream.sources import open_source


def client() -> Any:
    """A botocore client for the server the AWS_* variables (set by `s3_url`) name."""
    config = Config(
        s3={"addressing_style": "path"},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    return botocore.session.get_session().create_client("s3", config=config)


def upload(local: Path, url: str) -> None:
    """Every file under `local` to `url`/<its relative path>."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    c = client()
    for p in sorted(local.rglob("*")):
        if p.is_file():
            c.put_object(Bucket=bucket, Key=f"{prefix}/{p.relative_to(local).as_posix()}", Body=p.read_bytes())


def init(url: str, world: int, batch: int) -> None:
    anyio.run(lambda: lakestream.create(url, world_size=world, global_batch=batch))


def state(url: str) -> Any:
    """The stream's state, read in process (quicker than `status` in a subprocess, for polling)."""
    return anyio.run(lakestream.load_state, url)


def verified(url: str) -> bool:
    """What `lakestream verify` checks (every step readable, every key once), run in process."""
    report = anyio.run(lakestream.verify, url)
    assert report.ok, report.to_dict()
    return True


def as_files(values: dict[str, dict[str, Any]]) -> dict[str, bytes]:
    return {f"{key}.{field}": data for key, sample in values.items() for field, data in sample.items()}


def samples(spec: str, **kw: Any) -> list[dict[str, Any]]:
    return [s for s, _ in open_source(spec, **kw).iterate()]


@pytest.fixture
def src(s3_url: str, tmp_path: Path) -> dict[str, Any]:
    """4 tar shards and 3 Parquet files, local and uploaded beside the stream `s3_url`."""
    root = s3_url.removesuffix("/stream") + "/src"
    files = make_wds(tmp_path / "local" / "wds", 4, 15)
    rows = make_parquet(tmp_path / "local" / "pq", 3, 20)
    upload(tmp_path / "local", root)
    return {"root": root, "local": tmp_path / "local", "files": files, "rows": rows, "stream": s3_url}


def test_s3_objects_give_exactly_the_local_samples_and_cursors_resume(src: dict[str, Any]) -> None:
    root, local = src["root"], src["local"]
    s3_spec = f"wds:{root}/wds/train-{{000..003}}.tar"
    assert samples(s3_spec) == samples(f"wds:{local}/wds/train-{{000..003}}.tar")
    assert samples(f"wds:{root}/wds/*.tar", shard=(1, 2)) == samples(f"wds:{local}/wds/*.tar", shard=(1, 2))
    assert samples(f"parquet:{root}/pq/", key_column="id") == samples(f"parquet:{local}/pq", key_column="id")
    assert samples(f"parquet:{root}/pq/part-01.parquet") == samples(f"parquet:{local}/pq/part-01.parquet")
    whole = list(open_source(s3_spec, shard=(0, 2)).iterate())
    assert whole[0][1]["shard"] == "train-000.tar" and whole[0][1]["files"] == 2
    for k in (0, 14, 15, 22):
        assert list(open_source(s3_spec, shard=(0, 2)).iterate(whole[k][1])) == whole[k + 1 :]
    with pytest.raises(FileNotFoundError, match="no object"):
        open_source(f"wds:{root}/wds/train-{{003..004}}.tar")
    with pytest.raises(FileNotFoundError, match=r"no \.parquet objects"):
        open_source(f"parquet:{root}/wds/")


def test_produce_shards_from_s3_into_a_file_and_an_s3_stream(src: dict[str, Any], tmp_path: Path) -> None:
    root = src["root"]
    local = file_url(tmp_path / "stream")
    for url in (local, src["stream"]):
        init(url, 2, 6)
    for i in range(2):
        run_cli("produce", local, "--producer-id", f"w{i}", "--source", f"wds:{root}/wds/train-{{000..003}}.tar",
                "--shard", f"{i}/2", check=True)  # fmt: skip
    run_cli("produce", src["stream"], "--producer-id", "q", "--source", f"parquet:{root}/pq/", "--key-column", "id",
            check=True)  # fmt: skip
    assert as_files(read_values(local, 2)) == src["files"]
    assert read_values(src["stream"], 2) == src["rows"]
    for url in (local, src["stream"]):
        assert verified(url)


def test_sigkill_then_rerun_commits_every_sample_once_and_a_rewritten_shard_is_refused(src: dict[str, Any]) -> None:
    url = src["stream"]
    init(url, 2, 2)
    command = ["produce", url, "--producer-id", "p", "--source", f"wds:{src['root']}/wds/*.tar"]
    proc = spawn_cli(*command, "--max-inflight-bytes", 1, "--rate", 12)
    try:  # killed in the second shard or later (15 samples a shard, 2 a step), well before the end (5 s)
        wait_until(lambda: state(url).head >= 8, timeout=30, what="9 committed steps")
    finally:
        proc.kill()
        proc.communicate()
    cursor = state(url).producers["p"].cursor
    assert cursor["index"] >= 1 and (cursor["index"], cursor["sample"]) != (3, 15), cursor
    r = run_cli(*command, check=True)
    assert "resumed at" in r.stdout and "samples into" in r.stdout, describe(r)
    assert len(read_values(url, 2)) == 60
    assert verified(url)

    head = state(url).head
    bucket, _, prefix = src["root"].removeprefix("s3://").partition("/")
    key = f"{prefix}/wds/train-003.tar"
    old = client().get_object(Bucket=bucket, Key=key)["Body"].read()
    shard = io.BytesIO()
    # as many bytes, other content: only the ETag tells
    with tarfile.open(fileobj=shard, mode="w") as tar, tarfile.open(fileobj=io.BytesIO(old)) as before:
        for member in before:
            data = before.extractfile(member)
            assert data is not None
            tar.addfile(member, io.BytesIO(bytes(reversed(data.read()))))
    assert len(shard.getvalue()) == len(old) and shard.getvalue() != old
    client().put_object(Bucket=bucket, Key=key, Body=shard.getvalue())
    r = run_cli(*command, check=False)
    assert "a file was rewritten (its size or ETag changed)" in r.stderr and "committed cursor" in r.stderr, describe(r)
    assert len(r.stderr.strip().splitlines()) == 1 and state(url).head == head, describe(r)


def test_an_object_rewritten_while_read_is_refused(src: dict[str, Any], tmp_path: Path) -> None:
    def big(seed: int) -> bytes:  # 1 MB in row groups of 100 kB: read a row group at a time
        rng = random.Random(seed)
        out = io.BytesIO()
        pq.write_table(pa.table({"blob": [rng.randbytes(50_000) for _ in range(20)]}), out, row_group_size=2)
        return out.getvalue()

    bucket, _, prefix = src["root"].removeprefix("s3://").partition("/")
    client().put_object(Bucket=bucket, Key=f"{prefix}/big/a.parquet", Body=big(0))
    it = open_source(f"parquet:{src['root']}/big/a.parquet").iterate()
    next(it)  # the footer and the first row group read
    client().put_object(Bucket=bucket, Key=f"{prefix}/big/a.parquet", Body=big(1))
    with pytest.raises(lakestream.ConfigMismatch, match=r"was rewritten \(its ETag changed\) while it was being read"):
        list(it)  # the next row groups: each a GET pinned to the listed ETag


def test_reads_go_on_through_an_outage(src: dict[str, Any], s3_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream cut mid-shard and refused connections are retried until the endpoint is back."""
    rng = random.Random(5)
    shard = io.BytesIO()
    with tarfile.open(fileobj=shard, mode="w") as tar:  # 16 MB: more than the socket buffers hold
        for i in range(40):
            info = tarfile.TarInfo(f"big-{i:03d}.bin")
            info.size = 400_000
            tar.addfile(info, io.BytesIO(rng.randbytes(info.size)))
    bucket, _, prefix = src["root"].removeprefix("s3://").partition("/")
    client().put_object(Bucket=bucket, Key=f"{prefix}/big/big.tar", Body=shard.getvalue())
    spec = f"wds:{src['root']}/big/*.tar"
    want = samples(spec)
    host, port = s3_server.endpoint_url.removeprefix("http://").rsplit(":", 1)
    with OutageProxy((host, int(port))) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
        source = open_source(spec)
        assert isinstance(source, sources.WdsSource) and source.remote is not None
        it = source.iterate()
        got = [next(it)[0]]
        # Cut the shard's streamed GET, and refuse new connections. The proxy's pipe is blocked sending
        # to us (we stopped reading), and a socket closed under a blocked send sends no reset: shut it first.
        for conn in list(proxy._conns):
            with contextlib.suppress(OSError):  # one its pipe closed meanwhile
                conn.shutdown(socket.SHUT_RDWR)
        proxy.down()
        restore = threading.Timer(1.5, proxy.up)
        restore.start()
        t0 = time.monotonic()
        got += [s for s, _ in it]
        waited = time.monotonic() - t0
        restore.join()
    assert waited >= 1.0  # it did wait for the endpoint
    assert got == want
    assert source.remote.requests > 2  # the one streamed GET, then failed attempts, then a GET resuming it


def test_permanent_errors_are_typed_one_line_errors(src: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(lakestream.BucketNotFound):
        open_source("wds:s3://no-such-bucket-here/x/*.tar")
    url = file_url(tmp_path / "stream")
    init(url, 1, 2)
    command = ["produce", url, "--producer-id", "p", "--source", f"parquet:{src['root']}/pq/"]
    r = run_cli(*command, env={"AWS_SECRET_ACCESS_KEY": "not-the-secret"}, check=False)
    assert "denied" in r.stderr and "AWS_SECRET_ACCESS_KEY" in r.stderr, describe(r)
    assert len(r.stderr.strip().splitlines()) == 1, describe(r)
    r = run_cli("produce", url, "--producer-id", "p", "--source", "wds:s3://no-such-bucket-here/*.tar", check=False)
    assert "bucket 'no-such-bucket-here'" in r.stderr and "does not exist" in r.stderr, describe(r)
