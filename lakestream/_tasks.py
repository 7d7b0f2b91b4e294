"""Task groups: background tasks owned by a long-lived object, and groups whose errors come out
as themselves (the documented error types), never wrapped in an ExceptionGroup; and where
blocking work runs (`run_sync`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TypeVar, TypeVarTuple

import anyio
import anyio.abc
import anyio.to_thread

__all__ = [
    "INLINE_BYTES",
    "INLINE_ITEMS",
    "cancel_task_group",
    "enter_task_group",
    "event_class",
    "first_error",
    "run_sync",
    "task_group",
]

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

# CPU work over at most this many bytes and items (a checksum, a copy, a parse of a slice's index)
# runs on the event loop; more goes to a worker thread. A thread hop costs about 0.5 ms of CPU on
# a VM (the worker and then the loop woken, each a context switch, often an IPI to an idle vCPU),
# which is what xxh3, a copy and a parse of a 4 MiB, 128-sample slice take; larger work would hold
# the loop, and every task on it, longer than a millisecond (docs/benchmarks.md, "Thread hops").
INLINE_BYTES = 4 << 20
INLINE_ITEMS = 128


async def run_sync(fn: Callable[[*Ts], T], *args: *Ts, nbytes: int, items: int = 0) -> T:
    """`fn(*args)`: here, on the event loop, if it works over at most INLINE_BYTES bytes and
    INLINE_ITEMS items; else in a worker thread (`anyio.to_thread.run_sync`)."""
    if nbytes <= INLINE_BYTES and items <= INLINE_ITEMS:
        return fn(*args)
    return await anyio.to_thread.run_sync(fn, *args)


def event_class() -> Callable[[], anyio.Event]:
    """What makes an anyio Event on the running event loop, without asking which loop that is:
    `anyio.Event()` asks sniffio each time (about 5 µs; a reader makes two a step)."""
    return type(anyio.Event())


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
