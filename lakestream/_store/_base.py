"""The one storage protocol every backend implements.

Keys are '/'-separated strings relative to the store's root (the stream prefix). Every object is
written whole and becomes visible atomically; `put_if_absent` is the only coordination primitive
the engine needs: exactly one of any number of concurrent writers of a key wins.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

__all__ = ["Data", "ObjectStore"]

Data = bytes | memoryview  # what a put takes: a segment is a view of pooled memory (_buffers.py)


@runtime_checkable
class ObjectStore(Protocol):
    """An object store rooted at one prefix. Async context manager; `aclose()` is idempotent."""

    url: str

    async def get(self, key: str) -> bytes:
        """The whole object. Raises ObjectNotFound."""

    async def get_range(self, key: str, offset: int, length: int) -> bytes:
        """`length` bytes from `offset` (fewer only at the end of the object). Raises ObjectNotFound.

        May return any bytes-like object that nothing else writes to (a writable one is the
        caller's: the file store reads large ranges into pooled memory, _buffers.py).
        """

    async def put(self, key: str, data: Data) -> None:
        """Create or replace the object atomically."""

    async def put_if_absent(self, key: str, data: Data) -> bool:
        """Create the object if no object has the key. False when another writer got there first
        (which may be an earlier, ambiguous attempt of this same caller)."""

    async def list(self, prefix: str) -> list[str]:
        """Every key starting with `prefix`, sorted."""

    async def list_sizes(self, prefix: str) -> dict[str, int]:
        """Every key starting with `prefix`, with its size in bytes."""

    async def delete(self, keys: Sequence[str]) -> None:
        """Delete the objects; missing ones are ignored."""

    async def aclose(self) -> None:
        """Release clients and connections."""

    async def __aenter__(self) -> ObjectStore: ...

    async def __aexit__(self, *exc: object) -> None: ...
