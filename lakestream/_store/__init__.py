"""Object stores: `file://PATH` (or a plain path), `s3://BUCKET/PREFIX`, `az://CONTAINER/PREFIX`
(Azure Blob Storage, on obstore), `memory://`.

`s3://` has two clients: obstore (Rust's object_store, the default: it costs a third of the CPU
per PUT and GET, docs/benchmarks.md) and aiobotocore. `LAKESTREAM_S3_CLIENT=obstore|aiobotocore`
chooses one; both need the `s3` extra. obstore's calls run on threads of its own, which a fork
does not copy: a process forked from one that used obstore opens its `s3://` stores on aiobotocore.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from urllib.parse import urlparse

from .._errors import CorruptData
from ._base import Data, ObjectStore
from ._file import FileStore
from ._memory import MemoryStore

__all__ = [
    "S3_CLIENTS",
    "Data",
    "FileStore",
    "MemoryStore",
    "ObjectStore",
    "open_source_store",
    "open_store",
    "s3_client",
    "set_store_wrapper",
    "split_url",
]

S3_CLIENTS = ("obstore", "aiobotocore")  # the first is the default


def split_url(url: str | os.PathLike[str]) -> tuple[str, str]:
    """(scheme, rest) with plain paths taken as `file`."""
    url = os.fspath(url)
    parsed = urlparse(url)
    if parsed.scheme in ("", "file") or len(parsed.scheme) == 1:  # '' or a Windows drive letter
        path = parsed.path if parsed.scheme == "file" else url
        return "file", (parsed.netloc + path) if parsed.scheme == "file" else path
    return parsed.scheme, url


_wrapper: Callable[[ObjectStore], ObjectStore] | None = None


def set_store_wrapper(wrap: Callable[[ObjectStore], ObjectStore] | None) -> None:
    """Wrap every store `open_store` opens from now on (for `lakestream.testing` only)."""
    global _wrapper
    _wrapper = wrap


def open_store(url: str | os.PathLike[str], **options: object) -> ObjectStore:
    """A store for `url`. Use it as an async context manager (or call `aclose()`).

    Raises ValueError for an unknown scheme or `LAKESTREAM_S3_CLIENT`; S3 and Azure need the `s3`
    extra (obstore).
    """
    store = _open_store(url, **options)
    return _wrapper(store) if _wrapper is not None else store


def open_source_store(url: str, where: str) -> ObjectStore:
    """The store of a fork's source, from a URL the fork's log names (read from a store, so
    untrusted): CorruptData naming `where` if it is not one this library opens."""
    try:
        return open_store(url)
    except (ValueError, ImportError) as e:
        raise CorruptData(f"{where}: the fork's source cannot be opened: {e}") from None


def _open_store(url: str | os.PathLike[str], **options: object) -> ObjectStore:
    scheme, rest = split_url(url)
    if scheme == "file":
        return FileStore(rest, **options)  # type: ignore[arg-type]
    if scheme == "memory":
        return MemoryStore(rest)
    if scheme == "s3":
        client = s3_client()
        try:
            if client == "obstore":
                from ._obstore import ObstoreS3Store, usable

                if usable():
                    return ObstoreS3Store.from_url(rest, **options)
                client = "aiobotocore"  # forked from a process that used obstore: its threads are not here
            from ._s3 import S3Store
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(f"s3:// URLs need the 's3' extra ({client}): pip install 'lakestream[s3]'") from e
        return S3Store.from_url(rest, **options)
    if scheme == "az":
        try:
            from ._obstore import ObstoreAzureStore
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("az:// URLs need the 's3' extra (obstore): pip install 'lakestream[s3]'") from e
        return ObstoreAzureStore.from_url(rest, **options)
    raise ValueError(f"unsupported store URL {os.fspath(url)!r}: use file://, s3://, az:// or memory://")


def s3_client() -> str:
    """The S3 client `s3://` stores use: `LAKESTREAM_S3_CLIENT`, else obstore. ValueError if unknown."""
    name = os.environ.get("LAKESTREAM_S3_CLIENT", "").strip().lower() or S3_CLIENTS[0]
    if name not in S3_CLIENTS:
        raise ValueError(f"LAKESTREAM_S3_CLIENT={name!r}: expected one of {', '.join(S3_CLIENTS)}")
    return name
