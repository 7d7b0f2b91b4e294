"""Object stores: `file://PATH` (or a plain path), `s3://BUCKET/PREFIX`, `memory://`."""

from __future__ import annotations

import os
from urllib.parse import urlparse

from ._base import ObjectStore
from ._file import FileStore
from ._memory import MemoryStore

__all__ = ["FileStore", "MemoryStore", "ObjectStore", "open_store", "split_url"]


def split_url(url: str | os.PathLike[str]) -> tuple[str, str]:
    """(scheme, rest) with plain paths taken as `file`."""
    url = os.fspath(url)
    parsed = urlparse(url)
    if parsed.scheme in ("", "file") or len(parsed.scheme) == 1:  # '' or a Windows drive letter
        path = parsed.path if parsed.scheme == "file" else url
        return "file", (parsed.netloc + path) if parsed.scheme == "file" else path
    return parsed.scheme, url


def open_store(url: str | os.PathLike[str], **options: object) -> ObjectStore:
    """A store for `url`. Use it as an async context manager (or call `aclose()`).

    Raises ValueError for an unknown scheme; S3 needs the `s3` extra (aiobotocore).
    With `LAKESTREAM_FAULTS` set in the environment (e.g. `ambiguous=0.02,fail=0.02,seed=1`),
    the store is wrapped in a FaultyStore that injects those faults: for crash and fault tests of
    whole processes.
    """
    store = _open_store(url, **options)
    spec = os.environ.get("LAKESTREAM_FAULTS")
    return _with_faults(store, spec) if spec else store


def _with_faults(store: ObjectStore, spec: str) -> ObjectStore:
    import random

    from ._faulty import FaultyStore

    try:
        kv = dict(item.split("=", 1) for item in spec.split(",") if item)
        faults = {"ambiguous_put": float(kv.pop("ambiguous", 0)), "fail_before": float(kv.pop("fail", 0))}
        seed = int(kv.pop("seed", 0)) or None
    except ValueError as e:
        raise ValueError(f"LAKESTREAM_FAULTS={spec!r}: expected ambiguous=P,fail=P,seed=N ({e})") from None
    if kv:
        raise ValueError(f"LAKESTREAM_FAULTS={spec!r}: unknown keys {sorted(kv)} (ambiguous, fail, seed)")
    return FaultyStore(store, rng=random.Random(seed), **faults)  # type: ignore[arg-type]


def _open_store(url: str | os.PathLike[str], **options: object) -> ObjectStore:
    scheme, rest = split_url(url)
    if scheme == "file":
        return FileStore(rest, **options)  # type: ignore[arg-type]
    if scheme == "memory":
        return MemoryStore(rest)
    if scheme == "s3":
        try:
            from ._s3 import S3Store
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("s3:// URLs need the 's3' extra: pip install 'lakestream[s3]'") from e
        return S3Store.from_url(rest, **options)
    raise ValueError(f"unsupported store URL {os.fspath(url)!r}: use file://, s3:// or memory://")
