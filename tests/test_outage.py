"""A store that goes away (refused connections, cut streams) for longer than the S3 client's own
retries never stops a producer or a reader: they back off, continue when it returns, and the
stream holds every sample exactly once."""

from __future__ import annotations

import time
from urllib.parse import urlsplit

import pytest
from cliutil import spawn_cli
from netfault import OutageProxy
from s3server import S3Server

import lakestream

SAMPLES, WORLD, BATCH = 400, 2, 8


@pytest.mark.s3
async def test_a_store_outage_longer_than_the_retry_timeout_stops_no_producer_or_reader(
    s3_server: S3Server, s3_url: str
) -> None:
    await lakestream.create(s3_url, world_size=WORLD, global_batch=BATCH)
    up = urlsplit(s3_server.endpoint_url)
    with OutageProxy((up.hostname or "127.0.0.1", up.port or 80)) as proxy:
        env = {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.url, "AWS_ENDPOINT_URL_S3": proxy.url}
        producer = spawn_cli(
            "produce", s3_url, "--producer-id", "p", "--synthetic", SAMPLES, "--sample-size", 2048, "--rate", 60,
            env=env,
        )  # fmt: skip
        last = SAMPLES // BATCH - 1
        reader = spawn_cli("read", s3_url, "--rank", 1, "--from-step", 0, "--to-step", last, env=env)
        try:
            time.sleep(2.0)
            proxy.down()
            time.sleep(14.0)  # past the store's 10 s of retries: a one-shot call would have failed
            assert producer.poll() is None and reader.poll() is None, "a process gave up during the outage"
            proxy.up()
            _, err = producer.communicate(timeout=120)
            out_r, err_r = reader.communicate(timeout=60)
        finally:
            for proc in (producer, reader):
                proc.kill()
                proc.communicate()
    assert producer.returncode == 0, f"producer: {err}"
    assert "still retrying" in err and "still retrying" in err_r, (err, err_r)
    assert reader.returncode == 0, f"reader: {err_r}"
    assert sum(line.startswith("step ") for line in out_r.splitlines()) == last + 1, out_r
    report = await lakestream.verify(s3_url)
    assert report.ok and report.samples == SAMPLES, report.problems
