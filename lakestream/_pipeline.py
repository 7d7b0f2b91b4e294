"""The producer pipeline: a source, an optional transform, a producer; what `lakestream produce` runs.

    report = await lakestream.produce(url, "enc-0", "wds:/data/train-{000..127}.tar",
                                      shard=(0, 8), map=decode_and_crop, workers=4)

The source is opened at the producer's committed cursor (through `source_cursor` when a record was
expanded by the transform), so running the same pipeline again after a crash continues exactly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio

from ._producer import Producer, ProducerStats
from ._sources import synthetic_source
from ._transform import MapFunction, MapStats, source_cursor, transform
from .sources import Source, open_source

__all__ = ["ProduceReport", "SyntheticSource", "produce"]


@dataclass(frozen=True, slots=True)
class SyntheticSource:
    """`n` synthetic samples of `size` bytes keyed `<prefix><i>`; the cursor is the count consumed."""

    n: int
    size: int
    prefix: str = "s"
    work_ms: float = 0.0

    def iterate(self, cursor: Any = None) -> Iterator[tuple[dict[str, Any], Any]]:
        if not isinstance(cursor, int | None) or isinstance(cursor, bool):
            raise ValueError(f"resuming at {cursor!r}, which is not a synthetic position")
        return synthetic_source(self.n, self.size, start=cursor or 0, prefix=self.prefix, work_ms=self.work_ms)


@dataclass
class ProduceReport:
    """What one run of `produce` did (this incarnation only)."""

    producer: str
    epoch: int
    resumed_at: Any
    seconds: float
    stats: ProducerStats
    held_back: int = 0  # samples of a partial last global batch kept back by drop_last
    map: MapStats | None = None  # with a transform: records read, outputs, dropped, skipped keys
    policy: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


async def produce(
    target: Any,
    producer_id: str,
    source: str | Source,
    *,
    shard: tuple[int, int] = (0, 1),
    key_column: str | None = None,
    split: str | None = None,
    epochs: int = 1,
    shuffle_seed: int | None = None,
    map: str | MapFunction | None = None,
    workers: int = 0,
    on_error: str = "fail",
    drop_last: bool = False,
    rate: float = 0.0,
    on_open: Callable[[Producer], None] | None = None,
    **options: Any,
) -> ProduceReport:
    """Produce every sample of `source` (a spec for `open_source`, or a Source) into the stream.

    `map`: a function (or `MODULE:FUNCTION`) from a sample to a sample, None (dropped) or a list of
    samples, run in `workers` processes when > 0, order preserved (see `lakestream._transform`);
    `on_error`: `"fail"` (MapError naming the record) or `"skip"` (counted in the report).
    `drop_last`: commit whole global batches only; the rest is left for a later run.
    `rate`: samples per second at most (0: as fast as possible). `on_open` is called with the
    producer once it is registered. Other options go to `open_producer`.
    """
    from . import open_producer  # the public entry point; imported here to keep the package import acyclic

    if on_error not in ("fail", "skip"):
        raise ValueError(f"on_error {on_error!r}: expected fail or skip")
    if map is None and (workers or on_error != "fail"):
        raise ValueError("--workers and --on-error apply to --map")
    if isinstance(source, str):
        source = open_source(
            source, shard=shard, key_column=key_column, split=split, epochs=epochs, shuffle_seed=shuffle_seed
        )
    t0 = time.perf_counter()
    mapped = MapStats() if map is not None else None
    async with open_producer(target, producer_id, **options) as p:
        if on_open is not None:
            on_open(p)
        start = p.cursor
        it = source.iterate(source_cursor(start, mapped=map is not None))
        if map is not None:
            it = transform(it, map, start=start, workers=workers, on_error=on_error, stats=mapped)
        held = await _feed(p, it, p.global_batch if drop_last else 1, rate, t0)
    return ProduceReport(producer_id, p.epoch, start, time.perf_counter() - t0, p.stats, held, mapped, p.policy_name)


async def _feed(p: Producer, it: Iterator[Any], batch: int, rate: float, t0: float) -> int:
    """Put every sample of `it`, `batch` at a time (1, or a global batch for drop_last). The samples held back."""
    held: list[tuple[Any, Any]] = []
    n = 0
    try:
        while (item := await anyio.to_thread.run_sync(next, it, None)) is not None:
            held.append(item)
            if len(held) < batch:
                continue
            for sample, cursor in held:
                await p.put(sample, cursor=cursor)
                n += 1
                if rate > 0 and (ahead := t0 + n / rate - time.perf_counter()) > 0:
                    await anyio.sleep(ahead)
            held = []
    finally:
        close = getattr(it, "close", None)  # stop a transform's worker processes with the pipeline
        if close is not None:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(close)
    return len(held)
