"""PyTorch integration: a stream (or a mounted stream) as an `IterableDataset`, and the checkpoint hook.

    from lakestream.torch import StreamDataset, checkpoint_hook

    ds = StreamDataset(url, stop=steps)                # rank from torch.distributed / torchrun env
    ds.load_state_dict(saved["dataset"])               # resume: {"next_step": n}
    hook = checkpoint_hook(url)                        # rank 0 records, other ranks: no-op
    for item in DataLoader(ds, batch_size=None):       # one item per step
        step, samples = item["step"], item["samples"]  # this rank's samples of the global batch
        ...
        if time_to_checkpoint:
            save_atomically({"model": ..., "optimizer": ..., "dataset": ds.state_dict()})
            hook(step)                                 # after the trainer's checkpoint is durable

An item is `{"step": int, "samples": [sample, ...]}`; a sample is a dict with `__key__` and its
fields as put, except that numpy arrays become torch tensors (`torch.from_numpy`; arrays of a dtype
torch has no tensor type for stay numpy arrays). `stop` (exclusive) ends the iteration; without it
the dataset follows the stream, waiting for steps not committed yet, and ends after the last step
of a closed stream (`lakestream close`).

With `collate=True` an item is the step's samples as columns: `{"step": int, "keys": [key, ...],
field: tensor or list, ...}`. A field that is a numpy array of one dtype and shape in every sample
of the rank slice is one tensor of shape `(n, *shape)`, in sample order; any other field a list of
each sample's value (arrays as tensors; None where a sample has no such field). StreamDataset's
tensors are views of one copy of the fetched slice (the producer stored such a field as one block);
MountDataset reads such a field's `_batch/<field>.npy` (one open and one read) into one buffer that
the tensor is a view of, and other `.npy` fields' files straight into one tensor. A field named `step` or `keys`
cannot be collated (ValueError).

`state_dict()` is `{"next_step": n}`, the step after the last one yielded; each new iterator starts
at `state_dict()["next_step"]` (the `start` option at first), so iterating again continues the
stream, and `load_state_dict()` sets where the next iterator starts. Once an iteration with
`stop=None` ended at the end of a closed stream, the state says the stream is done:
`{"next_step": n, "done": True}`; an iterator of a dataset in that state (or resumed from it)
yields nothing. To read on after a `lakestream reopen`, load `{"next_step": n}`.

DataLoader workers (`num_workers=W > 0`): the steps are sharded across workers so that
DataLoader's round-robin over workers yields them in order: worker w reads steps n+w, n+w+W, …
(n: `next_step` when the DataLoader iterator was created). Each worker iterates a copy of the
dataset, whose `state_dict()` there is that worker's own position, `{"next_step": m, "worker": w,
"num_workers": W}` (m: the next step of its share). The dataset in the training process does not
advance, so once workers have read it its `state_dict()` raises RuntimeError. Save instead:

- with torchdata's `StatefulDataLoader(ds, batch_size=None, num_workers=W)` (the `torch` extra
  installs torchdata): `loader.state_dict()`, which holds every worker's state as of the last item
  the loader yielded. `loader.load_state_dict(saved)` on a new loader with the same `num_workers`
  restarts each worker at its own next step and the round robin at the worker whose step comes
  next: the steps after the last one yielded, in order, none twice;
- with torch's DataLoader: `{"next_step": item["step"] + 1}` of the last item trained on, restored
  with `ds.load_state_dict` before the DataLoader iterator is created.

`persistent_workers=True` is not supported: a second epoch would skip the steps the workers had
read ahead of the loop.

This is the only module of the package that imports torch; `import lakestream` does not import it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import io
import multiprocessing
import multiprocessing.context
import os
import sys
import threading
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from typing import Any

import anyio
import anyio.from_thread
import numpy as np
import orjson
import torch
import torch.utils.data

import lakestream
from lakestream._buffers import pool
from lakestream._records import check_job
from lakestream._segment import npy_info

__all__ = ["CheckpointHook", "MountDataset", "StreamDataset", "checkpoint_hook", "resolve_rank"]

NPY_MAGIC = b"\x93NUMPY"
META_NAME = "_meta.json"
BATCH_NAME = "_batch"
STATUS_NAME = "_status.json"


# -- rank, world size ---------------------------------------------------------------------------


def resolve_rank(rank: int | None = None, world_size: int | None = None) -> tuple[int, int | None]:
    """(rank, world size) of this process.

    An explicit `rank` wins (with `world_size`, None: whatever the stream has); else the
    initialised default `torch.distributed` process group; else torchrun's environment (`RANK`,
    `WORLD_SIZE`); else a single process: rank 0 of a world of 1.
    """
    r, w, _ = _resolve_rank(rank, world_size)
    return r, w


def _resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int | None, bool]:
    """`resolve_rank`, and whether the rank is the single-process default (found nowhere)."""
    if rank is not None:
        if type(rank) is not int or rank < 0:
            raise ValueError(f"rank must be a non-negative integer, got {rank!r}")
        return rank, world_size, False
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size() if world_size is None else world_size, False
    env_rank = os.environ.get("RANK")
    if env_rank is not None:
        env_world = os.environ.get("WORLD_SIZE")
        try:
            r = int(env_rank)
            w = int(env_world) if env_world is not None and world_size is None else world_size
        except ValueError:
            raise ValueError(f"RANK={env_rank!r} / WORLD_SIZE={env_world!r}: expected integers") from None
        return r, w, False
    return 0, 1 if world_size is None else world_size, True


def _rank_hint(error: lakestream.ConfigMismatch, defaulted: bool) -> lakestream.ConfigMismatch:
    """`error`, saying how to give the rank if it was the single-process default."""
    if not defaulted:
        return error
    return lakestream.ConfigMismatch(
        f"{error}: outside torchrun and torch.distributed this dataset reads as rank 0 of a world of "
        "1; pass rank= and world_size= (or run under torchrun)"
    )


def _check_steps(start: int, stop: int | None) -> None:
    if type(start) is not int or start < 0:
        raise ValueError(f"start must be a non-negative integer, got {start!r}")
    if stop is not None and (type(stop) is not int or stop < start):
        raise ValueError(f"stop must be None or an integer >= start ({start}), got {stop!r}")


# -- values -------------------------------------------------------------------------------------


def to_tensor(a: np.ndarray) -> torch.Tensor | np.ndarray:
    """`torch.from_numpy(a)` (made native-endian and writable first); `a` itself if torch has no
    tensor type for its dtype (strings, objects, structured arrays)."""
    if a.dtype.byteorder not in "=|" and a.dtype.fields is None:
        a = a.astype(a.dtype.newbyteorder("="))
    if not a.flags.writeable:
        a = a.copy()
    try:
        return torch.from_numpy(a)
    except TypeError:
        return a


def _convert(sample: dict[str, Any]) -> dict[str, Any]:
    return {k: to_tensor(v) if isinstance(v, np.ndarray) else v for k, v in sample.items()}


def _collated(step: int, columns: dict[str, Any]) -> dict[str, Any]:
    """The item of a step read as columns: arrays as tensors (no copy), lists' arrays as tensors."""
    item: dict[str, Any] = {"step": step}
    for name, column in columns.items():
        if name == "step":
            raise ValueError(f"step {step}: a field named 'step' cannot be collated: use collate=False")
        if isinstance(column, np.ndarray):
            item[name] = to_tensor(column)
        elif name == "keys":
            item[name] = column
        else:
            item[name] = [to_tensor(v) if isinstance(v, np.ndarray) else v for v in column]
    return item


def decode_file(name: str, data: bytes, tag: str | None = None) -> Any:
    """The value of a mounted `<key>.<field>` file.

    With the field's type tag (from `_meta.json`'s "types": `b` bytes, `s` UTF-8 text, `n` .npy,
    `j` JSON) exactly the value that was put (arrays as tensors). Without one, a guess from the
    extension and the bytes: `.npy` or the npy magic -> tensor, `.json` -> JSON, `.txt` -> str,
    anything else (or what fails to decode as guessed) -> bytes.
    """
    if tag is not None:
        if tag == "b":
            return data
        if tag == "s":
            return data.decode()
        if tag == "n":
            return to_tensor(np.load(io.BytesIO(data), allow_pickle=False))
        if tag == "j":
            return orjson.loads(data)
        raise ValueError(f"{name}: unknown field type {tag!r}")
    ext = name.rpartition(".")[2]
    try:
        if ext == "npy" or data.startswith(NPY_MAGIC):
            return to_tensor(np.load(io.BytesIO(data), allow_pickle=False))
        if ext == "json":
            return orjson.loads(data)
        if ext == "txt":
            return data.decode()
    except (ValueError, UnicodeDecodeError, orjson.JSONDecodeError):
        pass
    return data


# -- the async reader on a background event loop ------------------------------------------------


_DONE = object()


async def _anext(agen: AsyncIterator[Any]) -> Any:
    try:
        return await agen.__anext__()
    except StopAsyncIteration:
        return _DONE


async def _owned_steps(reader: lakestream.Reader, start: int, stop: int | None, stride: int) -> AsyncGenerator[Any]:
    """Steps start, start+stride, … below stop; like `Reader.steps` (which prefetches) for stride 1.
    The consumer times its own stalls (`reader.consumer_paced`)."""
    if stride == 1:
        async for batch in reader.steps(start, stop):
            yield batch
        return
    rewinds = reader.state.rewinds
    last: tuple[int, int] | None = None  # (step, version) of the last step yielded
    step = start
    while stop is None or step < stop:
        if stop is None and await reader.wait_for_step_or_end(step) is None:
            return  # the stream is closed before this step
        batch = await reader.read_step(step)
        state = reader.state
        if state.rewinds != rewinds and last is not None:
            entry = state.step(last[0])
            if entry is None or entry.version != last[1]:
                raise lakestream.StepUnavailable(
                    f"{reader.url}: step {last[0]}, already read, was discarded by a rewind: "
                    "restart reading from the restored checkpoint"
                )
        last = (batch.step, batch.version)
        yield batch
        step += stride


_PORTALS: weakref.WeakSet[Any] = weakref.WeakSet()  # the portals (context managers) this process started
_INHERITED: list[Any] = []  # in a forked child: its parent's portals, kept for good


def _start_portal(name: str) -> Any:
    """`anyio.from_thread.start_blocking_portal(name=name)`, remembered for `_keep_inherited_portals`."""
    cm = anyio.from_thread.start_blocking_portal(name=name)
    _PORTALS.add(cm)
    return cm


def _keep_inherited_portals() -> None:
    """In a forked child (a DataLoader worker): never let go of the parent's portals. Their event
    loop threads were not forked, and letting go of one closes its generator, which waits for its
    thread to stop: for ever, here."""
    _INHERITED.extend(_PORTALS)
    _PORTALS.clear()


os.register_at_fork(after_in_child=_keep_inherited_portals)

HELD_MAX = 1024  # tensors a StreamDataset holds that the trainer still refers to (see `_Source`)


class _Source:
    """A reader on an event loop in a background thread. Holds no reference to its iterator,
    so that the iterator's finalizer can close it.

    Each batch is asked for by handing a future to a task on the loop (`_serve`) that fills it,
    and the next one is asked for as the trainer's last act in handing a batch over (`ask_next`):
    the loop gets it ready while the trainer uses this one, so that a trainer ahead of the stream
    takes each batch without a wakeup of the loop or a wait for the GIL the loop holds while it
    starts the next fetches. The loop starts on an ask only once the asking thread is back from
    posting it (`_posting`): else, woken by the post, it could take the GIL first and keep it for
    the ~1 ms of a step's bookkeeping and inline fetch while the trainer still returns its batch.
    (`BlockingPortal.start_task_soon` waits for the loop to have started the task before it
    returns, a second round trip, which costs about as much CPU as a step's checks and decoding:
    docs/benchmarks.md, "Thread hops".) The trainer's stalls and pace are timed here, where it
    asks, not on the loop, which asks a step ahead (`Reader.consumer_paced`).

    The tensors handed over are let go of on the loop, not in the trainer's thread (`hold`,
    `_release`): PyTorch gives up the GIL in every tensor's deallocation and a tensor over numpy
    memory takes it back in its deleter, so a trainer dropping its last batch would wait for
    whichever thread took the GIL meanwhile (the loop at work on the next step, a loader's pump
    thread) for up to a switch interval. Held here too, a batch the trainer drops only loses a
    reference; the loop, at the next ask, deallocates the tensors nobody else refers to."""

    def __init__(self, url: str, rank: int, world_size: int | None, start: int, stop: int | None, stride: int,
                 options: dict[str, Any]) -> None:  # fmt: skip
        self.closed = False
        self.pid = os.getpid()
        self.pending: Future[Any] | None = None  # the next batch, asked for
        self.waiting = False  # the trainer waits for `pending` (or was interrupted waiting)
        self.received: float | None = None  # when the trainer was handed its last batch
        self.took: float | None = None  # the trainer's time between its last two batches
        self._posting = threading.Lock()  # held by a thread posting an ask: see `_asked`
        self._lock = threading.Lock()
        self._held: list[Any] = []  # tensors handed over, until nothing else refers to them
        self._held_lock = threading.Lock()
        self._stack = contextlib.ExitStack()
        self.portal = self._stack.enter_context(_start_portal("lakestream-torch"))
        try:
            self.loop_thread = self.portal.call(threading.get_ident)
            self._scope = self.portal.call(anyio.CancelScope)  # `_serve`'s
            cm = self.portal.wrap_async_context_manager(lakestream.open_reader(url, rank, world_size, **options))
            self.reader = self._stack.enter_context(cm)
            self.reader.consumer_paced = True
            self.agen = _owned_steps(self.reader, start, stop, stride)
            self.loop = self.portal.call(asyncio.get_running_loop)
            self.asks: asyncio.Queue[Future[Any]] = asyncio.Queue()
            self.served = self.portal.start_task_soon(self._serve)
        except BaseException:
            self._stack.close()
            raise

    async def _serve(self) -> None:
        """Fill each future asked for with the next batch (or _DONE, or the reader's error), in
        turn, until cancelled (`close`)."""
        with self._scope:
            while True:
                answer = await self.asks.get()
                try:
                    answer.set_result(await _anext(self.agen))
                except BaseException as e:
                    answer.set_exception(e)
                    if not isinstance(e, Exception):
                        raise

    def _ask(self, took: float | None) -> None:
        answer: Future[Any] = Future()
        with self._posting:
            self.loop.call_soon_threadsafe(self._asked, answer, took)
        self.pending = answer

    def _asked(self, answer: Future[Any], took: float | None) -> None:  # on the loop
        # The post woke this thread, which may have taken the GIL as the poster gave it up for the
        # wakeup's system call: wait (GIL released) until the poster is back and has let go of
        # `_posting`, so that it finishes its `next()` before the loop's work takes the GIL.
        # The timeout only guards against a poster that never comes back.
        if self._posting.acquire(timeout=1.0):
            self._posting.release()
        if took is not None:
            self.reader.paced(took)
        self.asks.put_nowait(answer)
        self._release()

    def hold(self, values: list[Any]) -> None:
        """Keep the tensors among `values`, handed to the trainer, until it lets go of them (`_release`)."""
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        with self._held_lock:
            self._held += tensors

    def _release(self) -> None:
        """Let go, on the loop, of the tensors held that nothing else refers to (so that they are
        deallocated here), keeping the newest `HELD_MAX` of the others."""
        with self._held_lock:
            held, self._held = self._held, []
        if not held:
            return
        held.insert(0, object())  # referred to by `held` alone: the count of a tensor let go of
        counts = [sys.getrefcount(x) for x in held]
        keep = [x for x, n in zip(held, counts) if n > counts[0]][-HELD_MAX:]
        with self._held_lock:
            self._held[:0] = keep
        del held, keep  # the others are deallocated here

    def ask_next(self) -> None:
        """Ask for the batch after the one `next` handed over (once: later calls do nothing). The
        trainer's thread calls it last, with the batch's item built."""
        if self.pending is None and not self.closed:
            self._ask(self.took)

    def next(self) -> Any:
        """The next RankBatch, or _DONE. After an interrupted call, waits for the same batch."""
        if self.pid != os.getpid():
            raise RuntimeError("a StreamDataset iterator cannot be used in a forked process: create it there")
        if self.pending is None:
            self._ask(None)
        assert self.pending is not None
        asked = time.perf_counter()
        self.waiting = True
        try:
            batch = self.pending.result()  # raises the reader's error, if it failed
        finally:
            if self.pending.done():  # else a signal handler's error interrupted the wait
                self.waiting, self.pending = False, None
        if batch is _DONE:
            return batch
        now = time.perf_counter()
        self.reader._metrics.stalled(now - asked)
        self.took, self.received = (None if self.received is None else asked - self.received), now
        return batch

    @property
    def interrupted(self) -> bool:
        """True if waiting for the next batch was interrupted (KeyboardInterrupt) while it runs."""
        return self.waiting and self.pending is not None and not self.pending.done()

    async def _shutdown(self) -> None:
        self._scope.cancel()  # a batch asked for ahead may wait for a step not committed yet
        with contextlib.suppress(BaseException):  # whatever `_serve` ended with was handed over
            await asyncio.wrap_future(self.served)
        await self.agen.aclose()

    def close(self) -> None:
        if self.pid != os.getpid():  # a copy in a forked process: the thread is not here
            self.closed = True
            return
        if threading.get_ident() == getattr(self, "loop_thread", None):
            # finalised by a garbage collection on the loop's own thread: it cannot wait for itself
            threading.Thread(target=self.close, daemon=True, name="lakestream-torch-close").start()
            return
        with self._lock:
            if self.closed:
                return
            self.closed = True
            try:
                if self.interrupted:  # cancel what still runs
                    with contextlib.suppress(RuntimeError):
                        self.portal.call(self.portal.stop, True)
                else:
                    with contextlib.suppress(Exception):
                        self.portal.call(self._shutdown)
            finally:
                with contextlib.suppress(RuntimeError):  # RuntimeError: the portal was stopped above
                    self._stack.close()
                with self._held_lock:
                    self._held = []


def _close_source(source: _Source) -> None:
    source.close()


class _StreamIterator(Iterator[dict[str, Any]]):
    def __init__(self, dataset: StreamDataset) -> None:
        self._dataset = dataset
        start, self._stride = dataset._begin()
        stop = dataset.stop
        self._source: _Source | None = None
        if (stop is not None and start >= stop) or dataset._done:
            return
        options = {"prefetch": dataset.prefetch, "job": dataset.job, **dataset.reader_options}
        if dataset.collate:
            options["collate"] = True
        try:
            self._source = _Source(dataset.url, dataset.rank, dataset.world_size, start, stop, self._stride, options)
        except lakestream.ConfigMismatch as e:
            raise _rank_hint(e, dataset._rank_defaulted) from None
        self._finalizer = weakref.finalize(self, _close_source, self._source)

    def __iter__(self) -> _StreamIterator:
        return self

    def __next__(self) -> dict[str, Any]:
        if self._source is None:
            raise StopIteration
        try:
            batch = self._source.next()
        except BaseException:
            if not self._source.interrupted:  # an error of the reader: it is finished
                self.close()
            raise
        if batch is _DONE:
            self.close()
            if self._dataset.stop is None:
                self._dataset._done = True  # the stream ended: it was closed before the next step
            raise StopIteration
        self._dataset._next_step = batch.step + self._stride
        if batch.columns is not None:
            item = _collated(batch.step, batch.columns)
            self._source.hold([x for v in item.values() for x in (v if isinstance(v, list) else (v,))])
        else:
            item = {"step": batch.step, "samples": [_convert(s) for s in batch.samples]}
            self._source.hold([v for s in item["samples"] for v in s.values()])
        self._source.ask_next()  # the next batch, got ready while the trainer uses this one
        return item

    def close(self) -> None:
        """Stop reading: the reader and its event-loop thread are closed (also when exhausted or
        garbage-collected)."""
        if self._source is not None:
            self._finalizer()
            self._source = None

    def __enter__(self) -> _StreamIterator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Resumable:
    """`state_dict` / `load_state_dict` over the next step to read, in this process or in a
    DataLoader worker (as torchdata's StatefulDataLoader calls them there)."""

    _next_step: int  # in a worker that has iterated: this worker's own next step
    _done: bool  # an iteration with no stop ended at the end of a closed stream
    _worker: tuple[int, int] | None  # (id, num_workers) of that worker; None: the position of step n
    _read_by_workers: Any  # a byte shared with the copies of DataLoader workers: 1 once one iterates
    _rank_defaulted: bool

    def _init_position(self, start: int) -> None:
        self._next_step = start
        self._done = False
        self._worker = None
        self._read_by_workers = multiprocessing.RawValue("b", 0)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if multiprocessing.context.get_spawning_popen() is None:  # not a worker being started: a copy
            state["_read_by_workers"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self._read_by_workers is None:
            self._read_by_workers = multiprocessing.RawValue("b", 0)

    def _begin(self) -> tuple[int, int]:
        """(first step, stride) of a new iterator here, which then sets `_next_step` to the step
        after each it yields. A DataLoader worker's first iterator starts at its share of the
        position it was given (step n + id), and later ones where its last one stopped."""
        info = torch.utils.data.get_worker_info()
        if info is None:
            return self._next_step, 1
        self._read_by_workers.value = 1
        if self._worker is None:
            self._next_step += info.id
            self._worker = (info.id, info.num_workers)
        return self._next_step, info.num_workers

    def state_dict(self) -> dict[str, int]:
        """`{"next_step": n}`: the step after the last one yielded (where the next iterator starts),
        with `"done": True` once an iteration with no stop ended at the end of a closed stream.

        In a DataLoader worker that has iterated: `{"next_step": m, "worker": id, "num_workers": W}`,
        m the next step of this worker's share. In the training process once DataLoader workers
        have read the dataset: RuntimeError (the workers' copies advance, this one does not)."""
        done = {"done": True} if self._done else {}
        if self._worker is not None:
            return {"next_step": self._next_step, "worker": self._worker[0], "num_workers": self._worker[1]} | done
        if self._read_by_workers.value and torch.utils.data.get_worker_info() is None:
            raise RuntimeError(
                f"{type(self).__name__}.state_dict(): DataLoader worker processes read this dataset, so "
                "its position here does not advance. Save the DataLoader's state instead: with "
                "torchdata's StatefulDataLoader(ds, batch_size=None, num_workers=W), loader.state_dict() "
                "(every worker's position; restore it with loader.load_state_dict); with a plain "
                "DataLoader, {'next_step': item['step'] + 1} of the last item trained on "
                "(restore it with ds.load_state_dict before iterating)"
            )
        return {"next_step": self._next_step} | done

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Make the next iterator start at `state["next_step"]` (a worker's state: in that worker);
        with `"done": True`, end at once (the stream had ended)."""
        n = state["next_step"]
        _check_steps(n, None)
        done = state.get("done", False)
        if type(done) is not bool:
            raise ValueError(f"{type(self).__name__} state: 'done' must be a bool, got {done!r}")
        self._done = done
        if "worker" not in state:
            self._next_step, self._worker = n, None
            if torch.utils.data.get_worker_info() is None:
                self._read_by_workers.value = 0
            return
        w, count = state["worker"], state.get("num_workers")
        if type(w) is not int or type(count) is not int or not 0 <= w < count:
            raise ValueError(f"{type(self).__name__} state: bad worker {w!r} of {count!r}")
        info = torch.utils.data.get_worker_info()
        if info is None or (info.id, info.num_workers) != (w, count):
            here = "the training process" if info is None else f"worker {info.id} of {info.num_workers}"
            raise ValueError(
                f"{type(self).__name__} state of DataLoader worker {w} of {count}, loaded in {here}: "
                f"restore the DataLoader's state (StatefulDataLoader.load_state_dict, num_workers={count})"
            )
        self._next_step, self._worker = n, (w, count)


class StreamDataset(_Resumable, torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """This rank's slice of every step of a stream: one item `{"step", "samples"}` per step (with
    `collate`, `{"step", "keys", field: tensor or list, …}`: see the module docstring).

    `rank`/`world_size`: see `resolve_rank` (explicit, else torch.distributed, else torchrun's
    environment, else rank 0 of 1), resolved when the dataset is created (so create it after
    `init_process_group`); the reader fails with ConfigMismatch if the stream has another world
    size (saying to pass `rank=` and `world_size=` if they were found nowhere). `start`: the first
    step; `stop`: exclusive, None to follow the stream until it is closed (waiting for steps not committed
    yet). `prefetch`: committed steps fetched ahead at least (more at a fast pace: about a second's
    worth, `prefetch_seconds` in `reader_options`; from a local `file://` store, the next one
    fetched and the others read into the page cache). `job`: the training job whose consumption mark
    rank 0 publishes (each job on a stream has its own checkpoints and mark; see `checkpoint_hook`).
    `reader_options`: more `lakestream.open_reader` options (poll_interval, verify, …).

    Use with `DataLoader(ds, batch_size=None)`, or torchdata's `StatefulDataLoader` to resume with
    `num_workers > 0` (see the module docstring). Each iterator runs its reader on an event loop in
    a background thread, closed when the iterator is exhausted, closed or garbage-collected. It asks
    for the next batch as it hands one over, so that the batch is fetched and decoded while the
    trainer uses this one; rank 0's consumption mark (back-pressure) counts a batch handed over as
    consumed. It also keeps a reference to the tensors it hands over until, at the next batch
    asked for, nothing else refers to them, so that they are deallocated on that thread rather than
    the trainer's (a tensor's deallocation gives up the GIL); it keeps at most `HELD_MAX` tensors
    that the trainer still holds, and none once the iterator is closed.
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        rank: int | None = None,
        world_size: int | None = None,
        *,
        start: int = 0,
        stop: int | None = None,
        prefetch: int = 4,
        reader_options: dict[str, Any] | None = None,
        collate: bool = False,
        job: str = "main",
    ) -> None:
        super().__init__()
        _check_steps(start, stop)
        self.url = os.fspath(url)
        self.collate = collate
        self.job = check_job(job)
        self.rank, self.world_size, self._rank_defaulted = _resolve_rank(rank, world_size)
        self.start = start
        self.stop = stop
        self.prefetch = prefetch
        self.reader_options = dict(reader_options or {})
        self._init_position(start)

    def __iter__(self) -> _StreamIterator:
        return _StreamIterator(self)

    def __repr__(self) -> str:
        return (
            f"StreamDataset({self.url!r}, rank={self.rank}, world_size={self.world_size}, "
            f"next_step={self._next_step}, stop={self.stop})"
        )


# -- a mounted stream ---------------------------------------------------------------------------


class _MountIterator(Iterator[dict[str, Any]]):
    def __init__(self, dataset: MountDataset) -> None:
        self._dataset = dataset
        dataset._check_mount()
        self._step, self._stride = dataset._begin()

    def __iter__(self) -> _MountIterator:
        return self

    def __next__(self) -> dict[str, Any]:
        stop = self._dataset.stop
        if (stop is not None and self._step >= stop) or self._dataset._done:
            raise StopIteration
        step = self._step
        try:
            if self._dataset.collate:
                item = _collated(step, self._dataset.read_columns(step))
            else:
                item = {"step": step, "samples": self._dataset.read_step(step)}
        except _Ended:
            if stop is not None:
                raise
            self._dataset._done = True
            raise StopIteration from None
        self._step += self._stride
        self._dataset._next_step = self._step
        return item


class _Ended(lakestream.StepUnavailable):
    """The mounted stream is closed before the step asked for: it will never be committed."""


class MountDataset(_Resumable, torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """The same items as `StreamDataset`, read with plain file I/O from a `lakestream mount`.

    For step n it opens `MOUNTPOINT/rank-<r>/<n:012d>/_meta.json` (the mount's lookup of the step
    directory waits for the step to be committed, up to its `--wait`; after that this retries until `timeout`, None: forever),
    unless the stream is closed before step n (the lookup fails at once and `_status.json` says
    `closed_after`: with `stop=None` the iteration ends there; reading such a step raises
    StepUnavailable),
    reads it for the keys and files in put order, and decodes every `<key>.<field>` file
    with `decode_file` (exact with `_meta.json`'s "types", else guessed from the extension), but
    for short text and JSON fields, whose values `_meta.json` holds ("values").
    With `collate`, a field the mount serves as `_batch/<field>.npy` (`_meta.json`'s "batch": the
    producer stored it as one block) is read with one open and one read, and any other field whose
    files are `.npy` of one dtype and shape for every sample straight into one array (`read_columns`). Options and `state_dict` semantics as for `StreamDataset`.
    `job`: the training job it reads as. The mount publishes that job's consumption mark
    (`lakestream mount --job NAME`), so iterating refuses (ValueError) a mount of another job, and
    for a job other than `main` a mount that publishes no mark.
    """

    def __init__(
        self,
        mountpoint: str | os.PathLike[str],
        rank: int | None = None,
        world_size: int | None = None,
        *,
        start: int = 0,
        stop: int | None = None,
        timeout: float | None = None,
        retry_interval: float = 0.1,
        collate: bool = False,
        job: str = "main",
    ) -> None:
        super().__init__()
        _check_steps(start, stop)
        self.job = check_job(job)
        self.mountpoint = os.fspath(mountpoint)
        self.collate = collate
        self.rank, self.world_size, self._rank_defaulted = _resolve_rank(rank, world_size)
        self.start = start
        self.stop = stop
        self.timeout = timeout
        self.retry_interval = retry_interval
        self._init_position(start)

    def __iter__(self) -> _MountIterator:
        return _MountIterator(self)

    def status(self) -> dict[str, Any]:
        """The mount's `_status.json`."""
        path = os.path.join(self.mountpoint, STATUS_NAME)
        try:
            with open(path, "rb", buffering=0) as f:  # unbuffered: see `_read_file`
                status: dict[str, Any] = orjson.loads(f.read())
                return status
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: not found: is a lakestream mount serving at {self.mountpoint}?") from None

    def _check_mount(self) -> None:
        status = self.status()
        w = status.get("world_size")
        if self.world_size is not None and w is not None and w != self.world_size:
            error = lakestream.ConfigMismatch(
                f"{self.mountpoint}: expected world size {self.world_size}, the stream has {w}"
            )
            raise _rank_hint(error, self._rank_defaulted)
        if self.rank not in status.get("ranks", [self.rank]):
            served = status.get("ranks")
            raise ValueError(f"{self.mountpoint}: the mount does not serve rank {self.rank} (it serves {served})")
        job = status.get("job")
        if job != self.job and (job is not None or self.job != "main"):
            mounted = "publishes no consumption mark" if job is None else f"reads as job {job!r:.80}"
            raise ValueError(
                f"{self.mountpoint}: MountDataset of job {self.job!r}, but the mount {mounted} "
                f"(mount it with --job {self.job})"
            )

    def step_dir(self, step: int) -> str:
        return os.path.join(self.mountpoint, f"rank-{self.rank}", f"{step:012d}")

    def read_step(self, step: int) -> list[dict[str, Any]]:
        """This rank's samples of `step`, waiting for it to be committed."""
        d, meta = self._open_step(step)
        types: dict[str, str] = meta.get("types") or {}
        values = _values(meta)
        by_key: dict[str, dict[str, Any]] = {key: {"__key__": key} for key in meta["keys"]}
        for name in meta["files"]:
            key, _, field = name.partition(".")
            by_key[key][field] = values[name] if name in values else _read_file(d, name, types.get(name))
        return list(by_key.values())

    def read_columns(self, step: int) -> dict[str, Any]:
        """This rank's samples of `step` as columns, waiting for it to be committed: `{"keys": [...],
        field: numpy array or list, ...}` (see the module docstring), each array read from the
        files straight into one `(n, *shape)` array."""
        d, meta = self._open_step(step)
        types: dict[str, str] = meta.get("types") or {}
        values = _values(meta)
        keys: list[str] = meta["keys"]
        batch: dict[str, int] = meta.get("batch") or {}  # `_batch/<field>.npy` -> size
        files: dict[str, dict[str, str]] = {}  # field -> key -> file name, fields in put order
        for name in meta["files"]:
            key, _, field = name.partition(".")
            files.setdefault(field, {})[key] = name
        columns: dict[str, Any] = {"keys": keys}
        for field, names in files.items():
            if field == "keys":
                raise ValueError(f"{d}: a field named 'keys' cannot be collated: use collate=False")
            column: Any = None
            size = batch.get(f"{field}.npy")
            if type(size) is int:
                column = _read_batch(os.path.join(d, BATCH_NAME, f"{field}.npy"), size, len(keys))
            elif len(names) == len(keys) and all(types.get(n) == "n" for n in names.values()):
                column = _read_npy_column([os.path.join(d, names[k]) for k in keys])
            if column is None:
                column = []
                for key in keys:
                    name = names.get(key)
                    if name is None:
                        column.append(None)
                    elif name in values:
                        column.append(values[name])
                    else:
                        column.append(_numpy(_read_file(d, name, types.get(name))))
            columns[field] = column
        return columns

    def _open_step(self, step: int) -> tuple[str, dict[str, Any]]:
        """The directory of `step` and its `_meta.json`, waiting for it to be committed."""
        d = self.step_dir(step)
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        misses = 0  # lookups that failed although the step was committed
        while True:
            try:
                # The lookup of the step directory waits (up to the mount's --wait) for the step to commit.
                with open(os.path.join(d, META_NAME), "rb", buffering=0) as f:  # see `_read_file`
                    meta = orjson.loads(f.read())
                break
            except InterruptedError:  # a signal ended the mount's wait and its handler returned
                continue
            except FileNotFoundError:
                status = self.status()
                if step < status["first_step"]:
                    raise lakestream.StepUnavailable(
                        f"{d}: step {step} was reclaimed (first readable step {status['first_step']})"
                    ) from None
                if step <= status["head_step"]:  # committed meanwhile: look again, once
                    misses += 1
                    if misses > 1:
                        raise
                    continue
                end = status.get("closed_after")
                if type(end) is int and step > end:
                    raise _Ended(f"{d}: the stream is closed after step {end}") from None
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"{d}: step {step} not committed within {self.timeout} s") from None
                time.sleep(self.retry_interval)
        return d, meta

    def __repr__(self) -> str:
        of = f", job={self.job!r}" if self.job != "main" else ""
        return f"MountDataset({self.mountpoint!r}, rank={self.rank}{of}, next_step={self._next_step}, stop={self.stop})"


def _values(meta: dict[str, Any]) -> dict[str, Any]:
    """`_meta.json`'s "values": the short text and JSON fields, as their files would decode."""
    values = meta.get("values")
    return values if isinstance(values, dict) else {}


def _read_file(d: str, name: str, tag: str | None) -> Any:
    # Unbuffered here, or in a BufferedReader made over a FileIO (`_read_npy_column`): open()'s
    # default buffering asks whether the file is a terminal (an ioctl), which on the mount is one
    # more request to the daemon for every file.
    with open(os.path.join(d, name), "rb", buffering=0) as f:
        return decode_file(name, f.read(), tag)


def _numpy(value: Any) -> Any:
    """A decoded file's value with tensors back as numpy arrays (columns hold numpy until the item)."""
    return value.numpy() if isinstance(value, torch.Tensor) else value


def _read_batch(path: str, size: int, n: int) -> np.ndarray:
    """A step's `_batch/<field>.npy` of `size` bytes (from `_meta.json`): one open and one read
    into one buffer (pooled memory, _buffers.py), whose array part is the column (`(n, *shape)`,
    writable, no other copy). The file's length is checked from its attributes, which the kernel
    has from the lookup, not with a read at the end (a request to the mount, read with O_DIRECT)."""
    view = pool.take(size)
    buf = np.frombuffer(view, np.uint8)
    if _read_whole(path, view) != size:
        raise lakestream.CorruptData(f"{path}: not the {size} bytes _meta.json says")
    try:
        dtype, shape, fortran, start = npy_info(buf)
    except ValueError as e:
        raise lakestream.CorruptData(f"{path}: {e}") from None
    if fortran or not shape or shape[0] != n:
        raise lakestream.CorruptData(f"{path}: an array of shape {shape}, expected {n} C-order rows")
    return buf[start:].view(dtype).reshape(shape)


def _read_whole(path: str, view: memoryview) -> int:
    """Read the file at `path`, of `len(view)` bytes by its attributes (else CorruptData), into
    `view`: the bytes read. With O_DIRECT where the filesystem takes it (FUSE does): a batch is
    read once, whole, so it goes straight from the mount into the reader's buffer, not through the
    page cache, which fills and copies it page by page. Without it where the filesystem refuses it
    (EINVAL), at the open or at the first read (ext4 takes the open of a `_batch` file copied
    there, and refuses a read into memory not aligned as O_DIRECT wants)."""
    try:
        return _read_into(path, view, _direct)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    return _read_into(path, view, None)


def _read_into(path: str, view: memoryview, opener: Callable[[str, int], int] | None) -> int:
    with open(path, "rb", buffering=0, opener=opener) as f:
        if os.fstat(f.fileno()).st_size != len(view):
            raise lakestream.CorruptData(f"{path}: not the {len(view)} bytes _meta.json says")
        got = 0
        while got < len(view) and (k := f.readinto(view[got:])):  # one read, unless the kernel returns less
            got += k
        return got


def _direct(path: str, flags: int) -> int:
    return os.open(path, flags | getattr(os, "O_DIRECT", 0))


def _read_npy_column(paths: list[str]) -> np.ndarray | None:
    """The `.npy` files at `paths` read into one `(n, *shape)` array, each file's data straight
    into its row; None unless every file is a C-order array of the first one's dtype and shape."""
    out: np.ndarray | None = None
    for j, path in enumerate(paths):
        with io.BufferedReader(io.FileIO(path)) as f:  # not open(): see `_read_file`
            try:
                version = np.lib.format.read_magic(f)
                read_header = (
                    np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                )
                shape, fortran, dtype = read_header(f)
            except ValueError:
                return None
            if out is None:
                if fortran or dtype.hasobject:
                    return None
                out = np.empty((len(paths), *shape), dtype)
            elif fortran or dtype != out.dtype or tuple(shape) != out.shape[1:]:
                return None
            row = memoryview(out[j, ...].reshape(-1).view(np.uint8).data)
            got = 0
            while got < len(row):
                n = f.readinto(row[got:])
                if not n:
                    return None
                got += n
            if f.read(1):
                return None
    return out


# -- checkpoints ---------------------------------------------------------------------------------


def _close_portal(cm: Any, pid: int, thread: int) -> None:
    """Stop a portal's event-loop thread (a CheckpointHook's finalizer). In a forked child (a
    DataLoader worker that inherited the hook and garbage-collects it) that thread is not there:
    waiting for it would hang the child for ever, so there is nothing to do. On that thread itself
    (a garbage collection running there), from another thread: it cannot wait for itself."""
    if os.getpid() != pid:
        return
    if threading.get_ident() == thread:
        threading.Thread(target=_close_portal, args=(cm, pid, -1), daemon=True, name="lakestream-hook-close").start()
        return
    cm.__exit__(None, None, None)


class CheckpointHook:
    """`hook(step, checkpoint_id=None, *, wait=False) -> bool`: records, on rank 0, that the
    trainer's checkpoint at `step` is durable (`lakestream.checkpoint`). Other ranks: a no-op
    returning False. Made by `checkpoint_hook`.

    Rank 0 records in a background thread, on one view of the log that it follows from call to
    call (no reload of the log each time), so a training step is held up for no store request:
    the call returns True at once. Checkpoints are recorded in the order asked; a failure is
    raised by the next call or by `wait()`. `wait=True` (or `wait()`) waits until every
    checkpoint asked for is recorded; with `wait=True` the call returns True if recorded, False if
    it already was. A throttled or unreachable store is retried for as long as it takes.
    """

    def __init__(self, url: str, rank: int, job: str = "main") -> None:
        self.url, self.rank, self.job = url, rank, check_job(job)
        self._portal_cm: Any = None
        self._portal: Any = None
        self._pending: list[Future[bool]] = []
        self._lock = threading.Lock()
        self._view: tuple[Any, Any] | None = None  # (store, Manifest), opened on first use
        self._order: anyio.Lock | None = None

    def __call__(self, step: int, checkpoint_id: str | None = None, *, wait: bool = False) -> bool:
        if self.rank != 0:
            return False
        self._raise_failed()
        cid = checkpoint_id if checkpoint_id is not None else f"step-{step}"
        with self._lock:
            if self._portal is None:
                self._portal_cm = _start_portal("lakestream-checkpoint")
                self._portal = self._portal_cm.__enter__()
                thread = self._portal.call(threading.get_ident)
                weakref.finalize(self, _close_portal, self._portal_cm, os.getpid(), thread)
            future: Future[bool] = self._portal.start_task_soon(self._record, cid, step)
            self._pending.append(future)
        if not wait:
            return True
        self.wait()
        return future.result()

    def wait(self) -> None:
        """Wait until every checkpoint asked for is recorded; raise the first failure."""
        with self._lock:
            pending, self._pending = self._pending, []
        failed = None
        for f in pending:
            if (e := f.exception()) is not None and failed is None:
                failed = e
        if failed is not None:
            raise failed

    def _raise_failed(self) -> None:
        with self._lock:
            done = [f for f in self._pending if f.done()]
            self._pending = [f for f in self._pending if not f.done()]
        for f in done:
            if (e := f.exception()) is not None:
                raise e

    async def _record(self, checkpoint_id: str, step: int) -> bool:
        from ._lifecycle import checkpoint
        from ._manifest import Manifest

        if self._order is None:
            self._order = anyio.Lock()  # fair: the portal starts tasks, and they queue, in the order asked
        async with self._order:
            if self._view is None:
                store = lakestream.open_store(self.url)
                manifest = Manifest(store, retries=None)
                await manifest.load()
                self._view = (store, manifest)
            store, manifest = self._view
            return await checkpoint(store, checkpoint_id, step, manifest=manifest, job=self.job)


def checkpoint_hook(url: str | os.PathLike[str], rank: int | None = None, *, job: str = "main") -> CheckpointHook:
    """The hook that records, on rank 0, that the trainer's checkpoint at `step` is durable
    (`CheckpointHook`: in the background; other ranks: a no-op returning False).

    Call it after the trainer's own checkpoint is durable (written, fsynced, renamed). `step` is
    the last step the checkpoint has trained on (the last item's `step`); the id defaults to
    `step-<step>`. `rank`: see `resolve_rank`. `job`: the training job it is a checkpoint of.
    """
    r, _ = resolve_rank(rank)
    return CheckpointHook(os.fspath(url), r, job)
