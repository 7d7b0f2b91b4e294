"""Shared fixtures. `s3_server` runs a real SeaweedFS S3 server for the session (see s3server.py)."""

from __future__ import annotations

from collections.abc import Iterator

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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that uses the S3 server `s3`."""
    for item in items:
        if "s3_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.s3)
