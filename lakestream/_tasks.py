"""Task groups: background tasks owned by a long-lived object, and groups whose errors come out
as themselves (the documented error types), never wrapped in an ExceptionGroup."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import anyio.abc

__all__ = ["cancel_task_group", "enter_task_group", "first_error", "task_group"]


def first_error(group: BaseExceptionGroup) -> BaseException:
    """The first leaf error of a (nested) exception group, preferring an Exception."""
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for inner in e.exceptions:
                walk(inner)
        else:
            leaves.append(e)

    walk(group)
    return next((e for e in leaves if isinstance(e, Exception)), leaves[0] if leaves else group)


@asynccontextmanager
async def task_group() -> AsyncIterator[anyio.abc.TaskGroup]:
    """`anyio.create_task_group()`, raising the first child error itself.

    Callers catch `StoreUnavailable`, `CorruptData` … by type; an ExceptionGroup around them would
    slip past every such handler (and out of the public API).
    """
    try:
        async with anyio.create_task_group() as tg:
            yield tg
    except BaseExceptionGroup as group:
        raise first_error(group) from group


async def enter_task_group() -> anyio.abc.TaskGroup:
    """A task group entered by the calling task; end it with `cancel_task_group` in that task."""
    tg = anyio.create_task_group()
    await tg.__aenter__()
    return tg


async def cancel_task_group(tg: anyio.abc.TaskGroup | None) -> None:
    """Cancel every task of `tg` and wait for them; nothing if None."""
    if tg is not None:
        tg.cancel_scope.cancel()
        try:
            await tg.__aexit__(None, None, None)
        except BaseExceptionGroup as group:
            raise first_error(group) from group
