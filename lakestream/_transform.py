"""The transform stage of `lakestream produce --map MODULE:FUNCTION`.

The function takes a sample dict and returns a sample dict, None (the sample is dropped and counted)
or a list of samples (one record into many). Outputs without `__key__` are named after their record:
`<key>` for a single sample, `<key>-<i>` for the i-th sample of a list (also when it kept the
record's own key, as a function that copies the record does), so keys stay unique.

`--workers K` runs the function in K worker processes; records are submitted in order and their
results consumed in order, with a bounded number in flight, so the output sequence (and the cursor
committed with each output) is the same as with the function run in the producer process.

Cursors stay exact with expansion. The source yields (record, cursor after it). The last output of a
record carries that source cursor, unchanged; an earlier output j (0-based) carries
`{"at": <source cursor before the record>, "skip": j + 1}`. A producer resuming at such a cursor
re-reads the record at `at`, applies the function again and skips the first `skip` outputs. The
function must therefore be deterministic: the same record gives the same outputs, in the same order.

A function that raises is fatal (`on_error="fail"`: `MapError`, naming the record's key and, when the
cursor names one, its source file) or, with `on_error="skip"`, the record is skipped and its key listed
in `MapStats.skipped`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import importlib
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MapError", "MapStats", "Transform", "is_sub_cursor", "load_function", "source_cursor", "transform"]

Sample = dict[str, Any]
MapFunction = Callable[[Sample], Any]


class MapError(ValueError):
    """The map function failed on a record (or returned something that is not a sample)."""


@dataclass
class MapStats:
    records: int = 0  # source records read (the re-read record of a resumed expansion included)
    outputs: int = 0  # samples yielded
    dropped: int = 0  # records the function mapped to None or []
    skipped: list[str] = field(default_factory=list)  # keys of the records whose function call failed
    seconds: float = 0.0  # spent in the function, summed over the worker processes


def load_function(spec: str) -> MapFunction:
    """The function named by `MODULE:FUNCTION` (the module found on sys.path or in the working directory)."""
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise ValueError(f"--map {spec!r}: expected MODULE:FUNCTION")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:  # the module is missing or fails to import: say it was --map's
        raise ValueError(f"--map {spec!r}: cannot import {module_name!r}: {e}") from e
    fn: Any = module
    for part in name.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ValueError(f"--map {spec!r}: module {module_name!r} has no {name!r}")
    if not callable(fn):
        raise ValueError(f"--map {spec!r}: {name!r} is not callable")
    return fn  # type: ignore[no-any-return]


def is_sub_cursor(cursor: Any) -> bool:
    """Whether `cursor` points inside an expanded record (`{"at": ..., "skip": n}`)."""
    return isinstance(cursor, dict) and set(cursor) == {"at", "skip"}


def source_cursor(cursor: Any, mapped: bool) -> Any:
    """The source cursor to open the source at for the committed `cursor`."""
    if not is_sub_cursor(cursor):
        return cursor
    if not mapped:
        raise ValueError(
            f"the committed cursor {cursor!r} points inside a record expanded by --map: run with the same --map"
        )
    return cursor["at"]


def _where(sample: Any, cursor: Any) -> str:
    key = sample.get("__key__") if isinstance(sample, dict) else None
    where = f"sample {key!r}"
    if isinstance(cursor, dict) and "shard" in cursor:
        where += f" of {cursor['shard']!r}"
    elif isinstance(cursor, dict) and "after" in cursor:
        where += f" (file {cursor['after']!r})"
    return where


def _outputs(result: Any, record: Sample, where: str) -> list[Sample]:
    """The samples `result` stands for, keyed after `record` where the function set no key."""
    key = record.get("__key__")
    if result is None:
        return []
    if isinstance(result, dict):
        out = dict(result)
        out.setdefault("__key__", key)
        return [out]
    if isinstance(result, list | tuple):
        outs = []
        for i, r in enumerate(result):
            if not isinstance(r, dict):
                raise MapError(f"--map returned a list holding a {type(r).__name__} for {where}, not a sample dict")
            o = dict(r)
            if o.get("__key__", key) == key:  # unset, or copied from the record with its fields
                o["__key__"] = f"{key}-{i}"
            outs.append(o)
        return outs
    raise MapError(f"--map returned a {type(result).__name__} for {where}: expected a dict, None or a list")


# -- worker processes --------------------------------------------------------------------------------

_worker_fn: MapFunction | None = None


def _init_worker(fn: str | MapFunction, parent: int) -> None:
    global _worker_fn
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    _worker_fn = load_function(fn) if isinstance(fn, str) else fn


def _exit_with_parent(parent: int) -> None:
    """End this worker once the producer process is gone (SIGKILL leaves the pool's pipes open)."""
    while os.getppid() == parent:
        time.sleep(0.2)
    os._exit(1)


def _call_in_worker(sample: Sample) -> tuple[Any, float]:
    """The function's result, and the seconds it took."""
    assert _worker_fn is not None
    started = time.perf_counter()
    return _worker_fn(sample), time.perf_counter() - started


def _results(
    records: Iterator[tuple[Sample, Any]],
    spec: str | MapFunction,
    workers: int,
    stats: MapStats,
    pools: list[concurrent.futures.ProcessPoolExecutor],
) -> Iterator[tuple[Sample, Any, Any, BaseException | None]]:
    """(record, cursor after it, result, exception) in source order; the function's time goes to `stats`."""
    if workers <= 0:
        fn = load_function(spec) if isinstance(spec, str) else spec
        clock = time.perf_counter
        for sample, cursor in records:
            started = clock()
            try:
                result = fn(sample)
            except Exception as e:
                stats.seconds += clock() - started
                yield sample, cursor, None, e
                continue
            stats.seconds += clock() - started
            yield sample, cursor, result, None
        return
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that runs threads
    with concurrent.futures.ProcessPoolExecutor(
        workers, mp_context=ctx, initializer=_init_worker, initargs=(spec, os.getpid())
    ) as pool:
        pools.append(pool)
        pending: collections.deque[tuple[Sample, Any, concurrent.futures.Future[Any]]] = collections.deque()
        limit = 4 * workers
        broken: tuple[Sample, Any] | None = None
        try:
            for sample, cursor in records:
                try:
                    fut = pool.submit(_call_in_worker, sample)
                except concurrent.futures.process.BrokenProcessPool:
                    broken = (sample, cursor)  # a worker died: the record it was mapping is pending (below)
                    break
                pending.append((sample, cursor, fut))
                while len(pending) >= limit:
                    yield _settle(*pending.popleft(), stats)
            while pending:
                yield _settle(*pending.popleft(), stats)
            if broken is not None:
                raise MapError(f"a --map worker process ended abruptly (killed, out of memory, or it exited) "
                               f"before {_where(*broken)} was given to it")  # fmt: skip
        finally:
            for *_, fut in pending:
                fut.cancel()


def _settle(
    sample: Sample, cursor: Any, fut: concurrent.futures.Future[Any], stats: MapStats
) -> tuple[Sample, Any, Any, BaseException | None]:
    try:
        result, seconds = fut.result()
        stats.seconds += seconds
        return sample, cursor, result, None
    except concurrent.futures.process.BrokenProcessPool:
        raise MapError(
            f"a --map worker process ended abruptly (killed, out of memory, or it exited) while mapping "
            f"{_where(sample, cursor)}"
        ) from None
    except Exception as e:
        return sample, cursor, None, e


# -- the stage ---------------------------------------------------------------------------------------


class Transform(Iterator[tuple[Sample, Any]]):
    """The (sample, cursor) pairs of the stage: an iterator that can also be aborted from another thread."""

    def __init__(self, outputs: Iterator[tuple[Sample, Any]], pools: list[concurrent.futures.ProcessPoolExecutor]):
        self._outputs = outputs
        self._pools = pools

    def __next__(self) -> tuple[Sample, Any]:
        return next(self._outputs)

    def close(self) -> None:
        """Stop, and stop the worker processes (waits for the calls they are running)."""
        close = getattr(self._outputs, "close", None)
        if close is not None:
            close()

    def abort(self) -> None:
        """Kill the worker processes now, from any thread: a call that hangs ends, and the thread
        waiting for it gets MapError. For stopping a run whose results are no longer wanted."""
        for pool in self._pools:
            # ProcessPoolExecutor has no public way to kill its workers before Python 3.14
            # (`kill_workers`); its `_processes` map has been stable since 3.8.
            processes = getattr(pool, "_processes", None) or {}
            for process in list(processes.values()):
                process.kill()


def transform(
    records: Iterator[tuple[Sample, Any]],
    spec: str | MapFunction,
    *,
    start: Any = None,
    workers: int = 0,
    on_error: str = "fail",
    stats: MapStats | None = None,
) -> Transform:
    """(sample, cursor) after mapping `records` (the source opened at `source_cursor(start, True)`).

    `spec` is `MODULE:FUNCTION` or the function itself (with `workers`, one the worker processes can
    unpickle: a module-level function, not a lambda or a closure)."""
    if on_error not in ("fail", "skip"):
        raise ValueError(f"--on-error {on_error!r}: expected fail or skip")
    pools: list[concurrent.futures.ProcessPoolExecutor] = []
    return Transform(_transformed(records, spec, start, workers, on_error, stats, pools), pools)


def _transformed(
    records: Iterator[tuple[Sample, Any]],
    spec: str | MapFunction,
    start: Any,
    workers: int,
    on_error: str,
    stats: MapStats | None,
    pools: list[concurrent.futures.ProcessPoolExecutor],
) -> Iterator[tuple[Sample, Any]]:
    st = stats if stats is not None else MapStats()
    before = source_cursor(start, True)
    skip = int(start["skip"]) if is_sub_cursor(start) else 0
    for record, after, result, error in _results(records, spec, workers, st, pools):
        st.records += 1
        where = _where(record, after)
        if error is not None:
            if on_error == "fail":
                raise MapError(f"--map failed on {where}: {type(error).__name__}: {error}") from error
            st.skipped.append(str(record.get("__key__")))
            outs: list[Sample] = []
        else:
            outs = _outputs(result, record, where)
            if not outs:
                st.dropped += 1
        if skip:
            if len(outs) <= skip:
                raise MapError(
                    f"--map gave {len(outs)} outputs for {where} on resuming, where it had given more than {skip}: "
                    "the function must be deterministic"
                )
            outs, first = outs[skip:], skip
            skip = 0
        else:
            first = 0
        for j, out in enumerate(outs, start=first):
            last = j == first + len(outs) - 1
            st.outputs += 1
            yield out, after if last else {"at": before, "skip": j + 1}
        before = after
