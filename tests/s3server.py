"""The throwaway SeaweedFS S3 server the tests use: `lakestream.testing.S3Server` (`weed server`
on free loopback ports), imported here under the name the fixtures and helpers use."""

from __future__ import annotations

from lakestream.testing import S3Server, WeedNotFound, find_weed, free_ports

__all__ = ["S3Server", "WeedNotFound", "find_weed", "free_ports"]
