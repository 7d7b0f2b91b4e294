"""Background tasks owned by a long-lived object (a producer, a reader)."""

from __future__ import annotations

import anyio
import anyio.abc

__all__ = ["cancel_task_group", "enter_task_group"]


async def enter_task_group() -> anyio.abc.TaskGroup:
    """A task group entered by the calling task; end it with `cancel_task_group` in that task."""
    tg = anyio.create_task_group()
    await tg.__aenter__()
    return tg


async def cancel_task_group(tg: anyio.abc.TaskGroup | None) -> None:
    """Cancel every task of `tg` and wait for them; nothing if None."""
    if tg is not None:
        tg.cancel_scope.cancel()
        await tg.__aexit__(None, None, None)
