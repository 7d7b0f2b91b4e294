"""Shared fixtures. `s3_server` runs a real SeaweedFS S3 server for the session (see s3server.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from s3server import S3Server, WeedNotFound, find_weed


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


@pytest.fixture(params=["file", "s3"])
def stream_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh stream URL, once on `file://` and once on the real SeaweedFS server."""
    return f"file://{tmp_path}/s" if request.param == "file" else str(request.getfixturevalue("s3_url"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that uses the S3 server `s3`."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        uses_s3 = callspec is not None and callspec.params.get("stream_url") == "s3"
        if uses_s3 or "s3_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.s3)
