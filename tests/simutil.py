"""Running real code on a simulated store and clock, as bench/scale.py does."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest

import lakestream
from lakestream.testing import SimulatedS3


def simulate(monkeypatch: pytest.MonkeyPatch, main: Callable[[], Awaitable[None]]) -> None:
    """Run `main` on trio's mock clock (time passes only in sleeps; work sent to a thread runs
    inline, taking no simulated time), as bench/scale.py does."""
    pytest.importorskip("trio")
    from trio.testing import MockClock

    async def inline(func: Callable[..., Any], *args: Any, **_: Any) -> Any:
        await anyio.lowlevel.checkpoint()
        return func(*args)

    monkeypatch.setattr(anyio.to_thread, "run_sync", inline)
    # Trio orders each batch of runnable tasks at random, from a generator of its own whose state
    # is whatever the tests run before in this process left (hypothesis reseeds it): seeded here,
    # a simulation takes the same course wherever it runs, and what it asserts holds or fails
    # every time, not in one schedule of many.
    import trio._core._run

    trio._core._run._r.seed(0)
    anyio.run(main, backend="trio", backend_options={"clock": MockClock(autojump_threshold=0)})


async def commit_one_a_step(bucket: SimulatedS3, pause: Callable[[int], float]) -> None:
    """A producer committing one sample (one step of world size 1) at a time, `pause(i)` apart."""
    now = anyio.current_time
    async with lakestream.open_producer(bucket.client("producer"), "p", clock=now, wall=lambda: 1e9 + now()) as p:
        for i in range(10_000):
            await p.put({"__key__": f"s{i}", "txt": "x"}, cursor=i + 1)
            await p.flush()
            await anyio.sleep(pause(i))
