"""An in-memory store for unit and property tests. One process only."""

from __future__ import annotations

from collections.abc import Sequence

from .._errors import ObjectNotFound
from ._base import Data

__all__ = ["MemoryStore"]


class MemoryStore:
    def __init__(self, url: str = "memory://") -> None:
        self.url = url
        self.objects: dict[str, bytes] = {}

    async def get(self, key: str) -> bytes:
        try:
            return self.objects[key]
        except KeyError:
            raise ObjectNotFound(f"{self.url}: no object {key!r}") from None

    async def get_range(self, key: str, offset: int, length: int) -> bytes:
        return (await self.get(key))[offset : offset + length]

    async def put(self, key: str, data: Data) -> None:
        self.objects[key] = bytes(data)

    async def put_if_absent(self, key: str, data: Data) -> bool:
        if key in self.objects:
            return False
        self.objects[key] = bytes(data)
        return True

    async def list(self, prefix: str) -> list[str]:
        return sorted(k for k in self.objects if k.startswith(prefix))

    async def list_sizes(self, prefix: str) -> dict[str, int]:
        return {k: len(self.objects[k]) for k in await self.list(prefix)}

    async def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            self.objects.pop(key, None)

    async def aclose(self) -> None:
        pass

    async def __aenter__(self) -> MemoryStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
