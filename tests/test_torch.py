"""`lakestream.torch`: StreamDataset, MountDataset (over a real FUSE mount), the checkpoint hook,
and examples/train_torch.py under torchrun: a crash and a resume reproduce an uninterrupted run's
losses bit for bit."""

from __future__ import annotations

import gc
import json
import mmap
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch  # the 'torch' extra (scripts/setup.sh installs it): a missing torch fails, never skips
from cliutil import wait_until
from mountutil import is_mounted
from torch.utils.data import DataLoader

import lakestream
import lakestream.torch as torch_module
from lakestream._buffers import MIN_POOLED, block_size
from lakestream.torch import MountDataset, StreamDataset, checkpoint_hook, decode_file, resolve_rank

ROOT = Path(__file__).parent.parent
EXAMPLE = ROOT / "examples" / "train_torch.py"
WORLD, BATCH = 2, 4  # 2 samples per rank per step


# -- streams --------------------------------------------------------------------------------------


def sample(i: int) -> dict[str, Any]:
    return {
        "__key__": f"k{i:05d}",
        "x": np.arange(3, dtype=np.float32) + i,
        "tokens": np.arange(i % 5 + 1, dtype=np.int32),
        "txt": f"text {i}",
        "json": {"i": i, "even": i % 2 == 0},
        "bin": bytes([i % 256]) * (i % 3),
        "cls": i % 3,  # JSON, and no telling extension: the mount needs _meta.json's "types"
    }


async def _produce(url: str, first: int, n: int, create: bool) -> None:
    if create:
        await lakestream.create(url, world_size=WORLD, global_batch=BATCH)
    async with lakestream.open_producer(url, "p", policy="eager") as p:
        for i in range(first, first + n):
            await p.put(sample(i), cursor=i + 1)


def make_stream(path: Path, steps: int) -> str:
    url = f"file://{path}"
    anyio.run(_produce, url, 0, steps * BATCH, True)
    return url


def add_steps(url: str, first_step: int, steps: int) -> None:
    anyio.run(_produce, url, first_step * BATCH, steps * BATCH, False)


def expected(rank: int, step: int) -> dict[str, Any]:
    """The item StreamDataset yields: round-robin ranks, arrays as tensors."""
    samples = []
    for i in range(step * BATCH + rank, (step + 1) * BATCH, WORLD):
        s = sample(i)
        samples.append({k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in s.items()})
    return {"step": step, "samples": samples}


def assert_same(got: Any, want: Any, where: str = "item") -> None:
    """Equal, with tensors compared by dtype, shape and values."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__}, expected a tensor"
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), (
            f"{where}: {got} != {want}"
        )
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), f"{where}: fields {list(got)} != {list(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: {len(got)} entries, expected {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        assert type(got) is type(want) and got == want, f"{where}: {got!r} != {want!r}"


def portal_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("lakestream-torch")]


def assert_no_leaked_threads(before: set[threading.Thread], timeout: float = 10.0) -> None:
    """No reader thread is left, and every other new thread (anyio's idle workers of a closed
    loop) exits soon. (A DataLoader iterator left in a reference cycle by an error's traceback
    ends its queue's feeder thread only when the cycle is collected: collected here, so that the
    check does not depend on when Python's cyclic GC runs.)"""
    assert not portal_threads(), portal_threads()
    gc.collect()
    deadline = time.monotonic() + timeout
    while (extra := set(threading.enumerate()) - before) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not extra, f"threads left running: {extra}"


@pytest.fixture(scope="module")
def stream(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A stream of 7 steps, world size 2, global batch 4."""
    return make_stream(tmp_path_factory.mktemp("torch") / "stream", 7)


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def no_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)


# -- (a) StreamDataset ------------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [0, 1])
def test_one_item_per_step_with_tensors_for_arrays(stream: str, rank: int) -> None:
    before = set(threading.enumerate())
    items = list(StreamDataset(stream, rank=rank, world_size=WORLD, stop=7))
    assert [it["step"] for it in items] == list(range(7))
    for item in items:
        assert_same(item, expected(rank, item["step"]))
        assert all(isinstance(s["x"], torch.Tensor) and s["x"].dtype == torch.float32 for s in item["samples"])
    assert_no_leaked_threads(before)


def collated(rank: int, step: int) -> dict[str, Any]:
    """The item StreamDataset(collate=True) yields: `x` (the same shape in every sample) one
    tensor, every other field a list (`tokens`' arrays as tensors)."""
    samples = expected(rank, step)["samples"]
    item: dict[str, Any] = {"step": step, "keys": [s["__key__"] for s in samples]}
    item["x"] = torch.stack([s["x"] for s in samples])
    for f in ("tokens", "txt", "json", "bin", "cls"):
        item[f] = [s[f] for s in samples]
    return item


@pytest.mark.parametrize("rank", [0, 1])
def test_collate_yields_one_tensor_per_array_field(stream: str, rank: int) -> None:
    items = list(StreamDataset(stream, rank=rank, world_size=WORLD, stop=7, collate=True))
    assert_same(items, [collated(rank, s) for s in range(7)])
    items[0]["x"] += 1  # writable: a copy of the fetched slice, not the store's read-only bytes
    # the items of the stream as stored, per sample, are unchanged
    assert_same(list(StreamDataset(stream, rank=rank, world_size=WORLD, stop=7)), [expected(rank, s) for s in range(7)])


def test_collated_tensors_are_views_of_one_buffer_through_worker_processes(tmp_path: Path) -> None:
    """Two block fields of a step are views of the one fetched slice: 64-byte aligned blocks at the
    offsets the format gives, not per-sample decodes stacked; read through DataLoader workers."""
    url = f"file://{tmp_path / 's'}"
    n = 6

    async def produce() -> None:
        await lakestream.create(url, world_size=1, global_batch=n)
        async with lakestream.open_producer(url, "p") as p:
            for i in range(3 * n):
                await p.put({"x": np.full((5,), i, np.float32), "y": np.full((2, 2), i, np.uint8), "t": str(i)})

    anyio.run(produce)
    for item in [*StreamDataset(url, rank=0, world_size=1, stop=1, collate=True)]:
        x, y = item["x"], item["y"]
        assert x.shape == (n, 5) and y.shape == (n, 2, 2) and item["t"] == [str(i) for i in range(n)]
        assert y.data_ptr() - x.data_ptr() == n * 5 * 4 + (-(n * 5 * 4) % 64)  # the next block of one buffer
    got = list(DataLoader(StreamDataset(url, rank=0, world_size=1, stop=3, collate=True), batch_size=None,
                          num_workers=2))  # fmt: skip
    assert [it["step"] for it in got] == [0, 1, 2]
    for it in got:
        s = it["step"]
        assert_same(it["x"], torch.stack([torch.full((5,), float(i)) for i in range(s * n, (s + 1) * n)]))
        assert_same(it["y"], torch.stack([torch.full((2, 2), i, dtype=torch.uint8) for i in range(s * n, (s + 1) * n)]))


async def test_a_collated_reader_hands_out_views_of_one_copy_of_the_slice(stream: str) -> None:
    async with lakestream.open_reader(stream, 0, WORLD, collate=True) as r:
        batch = await r.read_step(3)
        entry = r.state.step(3)
    assert entry is not None and batch.samples == [] and len(batch) == 2
    x = batch.columns["x"]
    owner = _memory_owner(x)  # one buffer of the slice's size (pooled: rounded up), x a view of it
    length = entry.ranks[0].length  # a small slice is not pooled
    assert memoryview(owner).nbytes == (block_size(length) if length >= MIN_POOLED else length)
    assert np.shares_memory(x, np.frombuffer(owner, np.uint8))


async def test_batches_a_consumer_holds_keep_their_data_while_later_ones_are_read(stream_url: str) -> None:
    """Slices large enough for pooled memory (a file's range, an S3 response's body): every batch
    held keeps its own samples while the reader fetches the next ones into memory it reuses."""
    url = stream_url
    await lakestream.create(url, world_size=1, global_batch=4)
    async with lakestream.open_producer(url, "p") as p:
        for i in range(48):
            await p.put({"__key__": f"{i:04d}", "img": np.full((300, 300), i, np.uint8)})
    held = []
    async with lakestream.open_reader(url, 0, 1, collate=True, prefetch=6) as r:
        async for batch in r.steps(0, 12):
            assert batch.nbytes >= MIN_POOLED
            held.append(batch.columns["img"])
    held += [item["img"] for item in StreamDataset(url, rank=0, world_size=1, stop=12, collate=True)]
    for n, img in enumerate(held):
        s = n % 12
        assert img[:, 0, 0].tolist() == list(range(4 * s, 4 * s + 4)), f"step {s} holds other data"
        assert (img == np.arange(4 * s, 4 * s + 4, dtype=np.uint8).reshape(4, 1, 1)).all()


@pytest.mark.parametrize("collate", [True, False])
async def test_tensors_a_trainer_lets_go_of_are_deallocated_on_the_datasets_thread(
    tmp_path: Path, collate: bool
) -> None:
    """PyTorch gives up the GIL in every tensor's deallocation, so a trainer dropping its last batch
    would wait for whichever thread took the GIL meanwhile. The dataset holds the tensors it hands
    over and lets go of them on its own thread once the trainer has; a batch the trainer keeps is
    neither let go of nor changed, and what the dataset holds is bounded."""
    url = f"file://{tmp_path}/s"
    await lakestream.create(url, world_size=1, global_batch=2)
    async with lakestream.open_producer(url, "p") as p:
        for i in range(24):
            await p.put({"__key__": f"{i:04d}", "img": np.full((300, 300), i, np.uint8)})
    died: dict[int, int] = {}  # step -> the thread its last tensor was deallocated on
    trainer = threading.get_ident()
    kept: list[Any] = []

    def gone(step: int) -> None:
        died[step] = threading.get_ident()

    it = iter(StreamDataset(url, rank=0, world_size=1, stop=12, collate=collate))
    for item in it:
        tensors = [item["img"]] if collate else [s["img"] for s in item["samples"]]
        for t in tensors:
            weakref.finalize(t, gone, item["step"])
        if item["step"] == 3:
            kept.append(tensors)
        assert it._source is not None and len(it._source._held) <= torch_module.HELD_MAX
    del item, tensors
    gc.collect()
    assert 3 not in died
    assert all(
        torch.equal(t, torch.full((300, 300), 6 + j, dtype=torch.uint8))
        for j, t in enumerate([kept[0][0][0], kept[0][0][1]] if collate else kept[0])
    )
    released = {s: t for s, t in died.items() if s <= 8}
    assert sorted(released) == [0, 1, 2, 4, 5, 6, 7, 8]
    assert trainer not in released.values(), released


def test_a_dataset_holds_no_more_tensors_than_its_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer that keeps every batch: the dataset's own references stop at `HELD_MAX` tensors."""
    monkeypatch.setattr(torch_module, "HELD_MAX", 3)
    url = f"file://{tmp_path}/s"

    async def fill() -> None:
        await lakestream.create(url, world_size=1, global_batch=1)
        async with lakestream.open_producer(url, "p") as p:
            for i in range(10):
                await p.put({"__key__": f"{i:04d}", "x": np.full(4, i, np.int32)})

    anyio.run(fill)
    it = iter(StreamDataset(url, rank=0, world_size=1, stop=10, collate=True))
    items = []
    for item in it:
        items.append(item)
        assert it._source is not None and len(it._source._held) <= 4  # the bound, and the newest
    assert [i["x"].tolist() for i in items] == [[[s] * 4] for s in range(10)]


@pytest.mark.parametrize("where", ["disk", "memory"])
def test_a_batch_file_is_read_whole_and_checked_against_its_size(tmp_path: Path, where: str) -> None:
    """`_batch/<field>.npy` as MountDataset reads it: exactly the size `_meta.json` gives, checked
    from the file's attributes (no read past the end); a file of another length is CorruptData.
    Also from a copy outside a mount (O_DIRECT wants aligned memory there: read plainly)."""
    from lakestream.torch import _read_batch

    a = np.arange(96, dtype=np.uint16).reshape(4, 24)
    path = (tmp_path if where == "disk" else Path("/dev/shm")) / f"batch-{os.getpid()}-{where}.npy"
    np.save(path, a)
    try:
        size = path.stat().st_size
        got = _read_batch(str(path), size, 4)
        assert got.dtype == a.dtype and got.tolist() == a.tolist()
        for wrong in (size - 1, size + 1):
            with pytest.raises(lakestream.CorruptData, match=f"not the {wrong} bytes"):
                _read_batch(str(path), wrong, 4)
        with pytest.raises(lakestream.CorruptData, match="expected 5"):
            _read_batch(str(path), size, 5)
    finally:
        path.unlink()


def _memory_owner(a: Any) -> Any:
    """The object owning the memory an array views, through numpy bases and memoryviews."""
    while True:
        if isinstance(a, np.ndarray) and a.base is not None:
            a = a.base
        elif isinstance(a, memoryview):
            a = a.obj
        else:
            return a


async def test_a_raw_slice_is_the_store_buffer(stream_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the mount serves: the buffer the store read the slice into, as it is (no copy of 1 MiB
    a step): a file's range, and an S3 response's body (the lean GET reads it straight into
    memory), each in pooled memory of the reader's own (the file could change after the check:
    what was checked is what is served)."""
    monkeypatch.delenv("LAKESTREAM_S3_LEAN_GET", raising=False)  # on, as by default
    await lakestream.create(stream_url, world_size=1, global_batch=2)
    async with lakestream.open_producer(stream_url, "p") as p:
        for i in range(2):
            await p.put({"x": np.full(1 << 19, i, np.uint8)})
    async with lakestream.open_reader(stream_url, None) as r:
        entry = r.state.step(0)
        assert entry is not None and entry.ranks[0].length > MIN_POOLED
        raw = await r.fetch_raw(entry, 0)
    block = raw.blocks["x"].array(raw.data)
    assert block.shape == (2, 1 << 19) and block[1].min() == 1
    view = memoryview(raw.data)
    assert not view.readonly and view.nbytes == entry.ranks[0].length
    owner = _memory_owner(raw.data)  # a pool block (anonymous memory), not the file or a copy
    assert isinstance(owner, mmap.mmap) and len(owner) == block_size(entry.ranks[0].length)


def test_start_stop_and_empty_range(stream: str) -> None:
    assert [it["step"] for it in StreamDataset(stream, rank=0, start=3, stop=5)] == [3, 4]
    assert list(StreamDataset(stream, rank=0, start=4, stop=4)) == []
    with pytest.raises(ValueError):
        StreamDataset(stream, rank=0, start=5, stop=4)


def test_rank_and_world_size_from_torchrun_env(stream: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    ds = StreamDataset(stream, stop=2)
    assert (ds.rank, ds.world_size) == (1, 2)
    assert_same(list(ds), [expected(1, 0), expected(1, 1)])
    explicit = StreamDataset(stream, rank=0, stop=1)  # explicit wins over the environment
    assert (explicit.rank, explicit.world_size) == (0, None)
    assert_same(list(explicit), [expected(0, 0)])
    assert checkpoint_hook(stream)(0) is False  # rank 1: a no-op


def test_single_process_default_is_rank_0_of_1(stream: str) -> None:
    assert resolve_rank() == (0, 1)
    before = set(threading.enumerate())
    with pytest.raises(lakestream.ConfigMismatch, match=r"world size 1, the stream has 2.*pass rank= and world_size="):
        iter(StreamDataset(stream))
    with pytest.raises(lakestream.ConfigMismatch, match="pass rank= and world_size="):
        list(DataLoader(StreamDataset(stream), batch_size=None, num_workers=1))
    with pytest.raises(lakestream.ConfigMismatch) as explicit:  # given explicitly: no hint
        iter(StreamDataset(stream, rank=0, world_size=1))
    assert "rank=" not in str(explicit.value)
    with pytest.raises(lakestream.StreamNotFound):
        iter(StreamDataset(stream + "-missing", rank=0))
    assert_no_leaked_threads(before)


def test_rank_from_torch_distributed_wins_over_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        assert resolve_rank() == (0, 1)
        assert (StreamDataset("unused").rank, MountDataset("unused").world_size) == (0, 1)
    finally:
        dist.destroy_process_group()
    assert resolve_rank() == (1, 2)


def test_state_dict_and_resume(stream: str) -> None:
    ds = StreamDataset(stream, rank=1, stop=7)
    assert ds.state_dict() == {"next_step": 0}
    for item in ds:
        if item["step"] == 2:
            break
    assert ds.state_dict() == {"next_step": 3}
    # a new iterator continues where the last one stopped
    assert [it["step"] for it in ds] == [3, 4, 5, 6]
    assert ds.state_dict() == {"next_step": 7}
    assert list(ds) == []

    restored = StreamDataset(stream, rank=1, stop=7)
    restored.load_state_dict({"next_step": 3})
    assert restored.state_dict() == {"next_step": 3}
    assert_same(list(restored), [expected(1, s) for s in range(3, 7)])


def test_dataloader_batch_size_none(stream: str) -> None:
    ds = StreamDataset(stream, rank=0, stop=7)
    got = []
    for item in DataLoader(ds, batch_size=None):
        got.append(item)
        assert ds.state_dict() == {"next_step": item["step"] + 1}  # one item at a time: exact
    assert_same(got, [expected(0, s) for s in range(7)])


@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # 3 workers on 2 CPUs
def test_dataloader_workers_shard_steps_in_order(stream: str, workers: int) -> None:
    ds = StreamDataset(stream, rank=1, stop=7)
    ds.load_state_dict({"next_step": 1})
    got = list(DataLoader(ds, batch_size=None, num_workers=workers))
    assert [it["step"] for it in got] == list(range(1, 7))  # every step once, in order
    assert_same(got, [expected(1, s) for s in range(1, 7)])


def test_dataset_state_in_the_main_process_after_workers_read_it_is_an_error(stream: str) -> None:
    """The workers' copies advance, the dataset in this process does not: its state_dict would
    restart from the beginning, so it says what to save instead."""
    ds = StreamDataset(stream, rank=0, stop=7)
    assert ds.state_dict() == {"next_step": 0}
    loader = DataLoader(ds, batch_size=None, num_workers=2)
    for item in loader:
        if item["step"] == 3:
            break
    with pytest.raises(RuntimeError, match=r"StatefulDataLoader.*item\["):
        ds.state_dict()
    del loader, item
    gc.collect()
    ds.load_state_dict({"next_step": 4})  # {"next_step": item["step"] + 1}: set here again, known again
    assert ds.state_dict() == {"next_step": 4}
    assert [it["step"] for it in DataLoader(ds, batch_size=None, num_workers=2)] == [4, 5, 6]
    # a worker's own state belongs to that worker
    with pytest.raises(ValueError, match="DataLoader worker 1 of 2"):
        ds.load_state_dict({"next_step": 5, "worker": 1, "num_workers": 2})


@pytest.mark.parametrize(
    ("workers", "taken", "every"),
    [(0, 3, 1), (2, 0, 1), (2, 1, 1), (2, 4, 1), (3, 5, 1), (2, 6, 1), (2, 5, 2)],
)
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # 3 workers on 2 CPUs
def test_stateful_dataloader_resumes_every_worker_exactly(stream: str, workers: int, taken: int, every: int) -> None:
    """torchdata's StatefulDataLoader saves each worker's dataset state with the loader's; a new
    loader restored from it yields the steps after the last one taken, in order, none twice."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    def loader() -> StatefulDataLoader:
        ds = StreamDataset(stream, rank=1, world_size=WORLD, start=1, stop=7)
        return StatefulDataLoader(ds, batch_size=None, num_workers=workers, snapshot_every_n_steps=every)

    first = loader()
    it = iter(first)
    got = [next(it) for _ in range(taken)]
    state = first.state_dict()
    del it, first
    gc.collect()
    second = loader()
    second.load_state_dict(state)
    got += list(second)
    assert [it["step"] for it in got] == list(range(1, 7))
    assert_same(got, [expected(1, s) for s in range(1, 7)])


def test_follows_steps_committed_later(tmp_path: Path) -> None:
    url = make_stream(tmp_path / "stream", 2)
    before = set(threading.enumerate())
    ds = StreamDataset(url, rank=0, reader_options={"poll_interval": (0.005, 0.05)})
    it = iter(ds)
    assert [next(it)["step"], next(it)["step"]] == [0, 1]
    producer = threading.Thread(target=lambda: (time.sleep(0.3), add_steps(url, 2, 2)))
    producer.start()
    try:
        t0 = time.monotonic()
        assert_same(next(it), expected(0, 2))
        assert time.monotonic() - t0 > 0.2  # it waited for the commit
        assert_same(next(it), expected(0, 3))
    finally:
        producer.join()
    assert ds.state_dict() == {"next_step": 4}
    assert portal_threads()
    it.close()  # stop following: the reader and its thread are closed
    assert_no_leaked_threads(before)


def test_iterators_close_their_thread(stream: str) -> None:
    before = set(threading.enumerate())
    ds = StreamDataset(stream, rank=0)  # follow forever
    it = iter(ds)
    next(it)
    assert len(portal_threads()) == 1
    it.close()
    it.close()  # idempotent
    assert not portal_threads()
    with pytest.raises(StopIteration):
        next(it)

    it = iter(ds)  # garbage-collected while following
    next(it)
    del it
    gc.collect()
    assert not portal_threads()

    for _ in DataLoader(ds, batch_size=None):  # a loop left early
        break
    gc.collect()
    assert_no_leaked_threads(before)
    assert ds.state_dict() == {"next_step": 3}


class Interrupted(Exception):
    pass


def test_an_interrupted_wait_resumes_or_closes(tmp_path: Path) -> None:
    """A signal handler's exception (KeyboardInterrupt, say) while waiting for a step: next() waits
    for the same step again, and close() cancels the wait instead of hanging."""
    url = make_stream(tmp_path / "stream", 1)
    before = set(threading.enumerate())

    def interrupt(*_: Any) -> None:
        raise Interrupted

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        it = iter(StreamDataset(url, rank=1, reader_options={"poll_interval": (0.005, 0.02)}))
        assert next(it)["step"] == 0
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(Interrupted):
            next(it)  # step 1 is not committed
        add_steps(url, 1, 1)
        assert_same(next(it), expected(1, 1))  # the same wait, resumed
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(Interrupted):
            next(it)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    t0 = time.monotonic()
    it.close()  # cancels the pending wait for step 2
    assert time.monotonic() - t0 < 5
    assert_no_leaked_threads(before)


def test_the_next_batch_is_got_ready_while_the_trainer_uses_one_and_stalls_are_the_trainers(tmp_path: Path) -> None:
    """StreamDataset asks for the next batch as it hands one over, so a trainer ahead of the stream
    finds it ready; the stall histogram counts the trainer's own waits, not the time the batch
    asked for ahead waited for its step while the trainer was busy."""
    from prometheus_client import REGISTRY

    url = make_stream(tmp_path / "stream", 2)
    labels = {"stream": url, "rank": "0"}

    def stalls(le: str | None = None) -> float:
        if le is None:
            return REGISTRY.get_sample_value("lakestream_reader_stall_seconds_count", labels) or 0.0
        return REGISTRY.get_sample_value("lakestream_reader_stall_seconds_bucket", labels | {"le": le}) or 0.0

    it = iter(StreamDataset(url, rank=0))
    try:
        assert next(it)["step"] == 0
        source = it._source
        assert source is not None and source.pending is not None
        wait_until(
            lambda: source.pending is not None and source.pending.done(), what="step 1 ready before it is asked for"
        )
        assert next(it)["step"] == 1
        adding = threading.Timer(0.3, add_steps, (url, 2, 1))  # step 2, committed while the trainer is busy
        adding.start()
        time.sleep(1.0)  # the trainer's step
        adding.join()
        assert_same(next(it), expected(0, 2))
        assert stalls() == 3
        assert stalls(le="0.25") == 3, "the wait of the batch asked for ahead was counted as the trainer's"
        adding = threading.Timer(0.5, add_steps, (url, 3, 1))  # asked for before it is committed: a stall
        adding.start()
        assert_same(next(it), expected(0, 3))
        adding.join()
        assert (stalls(), stalls(le="0.25")) == (4, 3)
    finally:
        it.close()


def test_the_loop_starts_on_an_ask_only_once_the_asking_thread_is_back_from_posting_it(tmp_path: Path) -> None:
    """Posting the next ask wakes the loop's thread, which could take the GIL while the trainer's
    thread is still in its `next()` and keep it for a step's bookkeeping and inline fetch (a p99
    of 1.5-2 ms for a trainer ahead of the stream): the loop waits until the asking thread is back."""
    url = make_stream(tmp_path / "stream", 3)
    it = iter(StreamDataset(url, rank=0))
    try:
        assert next(it)["step"] == 0
        source = it._source
        assert source is not None
        wait_until(lambda: source.pending is not None and source.pending.done(), what="step 1 ready")
        events: list[str] = []
        put = source.asks.put_nowait
        source.asks.put_nowait = lambda answer: (events.append("loop starts"), put(answer))[1]  # type: ignore[method-assign]

        class Descheduled:  # the asking thread, off the CPU for 0.2 s right after its post
            def __init__(self, lock: Any) -> None:
                self.lock = lock

            def acquire(self, *args: Any, **kwargs: Any) -> bool:
                return bool(self.lock.acquire(*args, **kwargs))

            def release(self) -> None:
                self.lock.release()

            def __enter__(self) -> None:
                self.lock.acquire()

            def __exit__(self, *exc: object) -> None:
                time.sleep(0.2)
                events.append("trainer back")
                self.lock.release()

        source._posting = Descheduled(source._posting)  # type: ignore[assignment]
        assert next(it)["step"] == 1  # asks for step 2 as it returns
        wait_until(lambda: "loop starts" in events, what="the ask for step 2 taken up")
        assert events == ["trainer back", "loop starts"]
        assert next(it)["step"] == 2
    finally:
        it.close()


def test_datasets_pickle(stream: str, tmp_path: Path) -> None:
    import pickle

    ds = StreamDataset(stream, rank=1, stop=3)
    ds.load_state_dict({"next_step": 1})
    copy = pickle.loads(pickle.dumps(ds))
    assert copy.state_dict() == {"next_step": 1} and (copy.rank, copy.stop) == (1, 3)
    assert_same(list(copy), [expected(1, 1), expected(1, 2)])
    m = pickle.loads(pickle.dumps(MountDataset(tmp_path, rank=1, start=2)))
    assert (m.rank, m.state_dict()) == (1, {"next_step": 2})
    with pytest.raises(FileNotFoundError, match="is a lakestream mount serving"):
        iter(m)


def test_mount_dataset_of_a_job_refuses_a_mount_of_another_job(tmp_path: Path) -> None:
    """The mount publishes its job's consumption mark (`_status.json` names the job), so a MountDataset
    of another job would read unseen by back-pressure and rewinds: it is refused before any step is read.
    (Read from a mount of its own job: test_mount.py, the readers of a stream being produced.)"""

    def status(**job: Any) -> Path:
        d = tmp_path / f"m{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        (d / "_status.json").write_bytes(
            json.dumps({"world_size": 1, "ranks": [0], "first_step": 0, "head_step": -1} | job).encode()
        )
        return d

    for mp, job, problem in (
        (status(job="eval"), "main", "job 'main', but the mount reads as job 'eval' (mount it with --job main)"),
        (status(job="main"), "eval", "job 'eval', but the mount reads as job 'main' (mount it with --job eval)"),
        (status(job=None), "eval", "job 'eval', but the mount publishes no consumption mark"),
        (status(), "eval", "job 'eval', but the mount publishes no consumption mark"),
    ):
        with pytest.raises(ValueError, match=re.escape(problem)):
            iter(MountDataset(mp, rank=0, world_size=1, job=job))
    for mp, job in ((status(job="eval"), "eval"), (status(job=None), "main"), (status(), "main")):
        with pytest.raises(TimeoutError):  # the mount's job: on to its first step (none here)
            next(iter(MountDataset(mp, rank=0, world_size=1, job=job, timeout=0)))
    with pytest.raises(ValueError, match="job name"):
        MountDataset(tmp_path, job="a/b")
    assert "job='eval'" in repr(MountDataset(tmp_path, job="eval")) and "job=" not in repr(MountDataset(tmp_path))


def test_checkpoint_hook_records_on_rank_0_only(tmp_path: Path) -> None:
    url = make_stream(tmp_path / "stream", 3)
    assert checkpoint_hook(url, rank=1)(1) is False
    assert anyio.run(lakestream.load_state, url).checkpoints == []
    hook = checkpoint_hook(url, rank=0)
    assert hook(1) is True  # at once: recorded in the background
    assert hook(1, wait=True) is False  # already recorded
    assert hook(2, "mine") is True
    hook.wait()
    assert [(c.id, c.step) for c in anyio.run(lakestream.load_state, url).checkpoints] == [("step-1", 1), ("mine", 2)]
    hook(0)  # older than the newest: fails in the background, raised by the next call or wait()
    with pytest.raises(ValueError, match="older than the newest checkpoint"):
        hook.wait()
    assert hook(3, wait=False) is True


@pytest.mark.parametrize("what", ["hook", "iterator"])
def test_what_a_forked_child_inherits_and_lets_go_of_does_not_hang_it(tmp_path: Path, what: str) -> None:
    """A DataLoader worker forked from the trainer inherits its checkpoint hook and any StreamDataset
    iterator it has open, but not their event-loop threads: letting go of them there (a garbage
    collection) must not wait for those threads."""
    url = make_stream(tmp_path / "stream", 3)
    hook = checkpoint_hook(url, rank=0)
    assert hook(1, wait=True) is True
    it = iter(StreamDataset(url, rank=0, world_size=2))
    next(it)
    pid = os.fork()
    if pid == 0:  # the child: let go of it, then exit
        try:
            if what == "hook":
                del hook
            else:
                del it
            gc.collect()
        finally:
            os._exit(0)
    deadline = time.monotonic() + 20
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung letting go of the hook")
        time.sleep(0.05)
    assert hook(2, wait=True) is True  # the parent's are untouched
    assert next(it)["step"] == 1
    threads = threading.active_count()
    del hook, it
    gc.collect()
    wait_until(lambda: threading.active_count() <= threads - 2, timeout=10)  # their portals' threads ended


def test_decode_file() -> None:
    import io

    buf = io.BytesIO()
    np.save(buf, np.arange(4, dtype=">i4"))  # big-endian: made native
    npy = buf.getvalue()
    for name, tag in [("k.tokens", None), ("k.x.npy", None), ("k.x", "n")]:
        value = decode_file(name, npy, tag)
        assert_same(value, torch.arange(4, dtype=torch.int32))
    assert decode_file("k.json", b'{"a": 1}') == {"a": 1}
    assert decode_file("k.cls", b"7", "j") == 7
    assert decode_file("k.cls", b"7") == b"7"  # no type, unknown extension: bytes
    assert decode_file("k.txt", "é".encode()) == "é"
    assert decode_file("k.json", b"{not json") == b"{not json"  # a guess that fails: bytes
    assert decode_file("k.txt", b"abc", "b") == b"abc"  # the type wins over the extension
    assert decode_file("k.bin", b"abc", "s") == "abc"
    with pytest.raises(ValueError):
        decode_file("k.bin", b"abc", "?")
    buf = io.BytesIO()
    np.save(buf, np.array(["a", "bc"]))  # no tensor type for strings: stays a numpy array
    strings = decode_file("k.names", buf.getvalue(), "n")
    assert isinstance(strings, np.ndarray) and strings.tolist() == ["a", "bc"]


def test_import_lakestream_does_not_need_torch() -> None:
    code = "import sys; sys.modules['torch'] = None; import lakestream; assert lakestream.open_reader; print('ok')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


# -- (b) MountDataset over a real mount ----------------------------------------------------------------


class Mount:
    """`lakestream mount URL MP` in a subprocess; stop() unmounts lazily and terminates it."""

    def __init__(self, url: str, mountpoint: Path, log: Path) -> None:
        if not os.access("/dev/fuse", os.R_OK | os.W_OK):
            pytest.fail("MountDataset tests need a FUSE mount: /dev/fuse is missing or not accessible", pytrace=False)
        self.mountpoint, self.log_path = mountpoint, log
        mountpoint.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "lakestream._cli", "mount", url, str(mountpoint)],
                stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                rc = self.proc.returncode
                pytest.fail(f"lakestream mount exited with {rc} before serving:\n{self.log()}", pytrace=False)
            try:
                json.loads((self.mountpoint / "_status.json").read_bytes())
                return
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"lakestream mount not serving within {timeout} s:\n{self.log()}", pytrace=False)
            time.sleep(0.05)

    def stop(self) -> None:
        if is_mounted(self.mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True, timeout=30)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        assert not is_mounted(self.mountpoint), f"{self.mountpoint} is still mounted"


@pytest.fixture
def mounted(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """(url, mountpoint) of a 5-step stream mounted with `lakestream mount`."""
    url = make_stream(tmp_path / "stream", 5)
    m = Mount(url, tmp_path / "mnt", tmp_path / "mount.log")
    try:
        m.wait_ready()
        yield url, m.mountpoint
    finally:
        m.stop()


def test_mount_dataset_collates_as_the_stream_dataset(mounted: tuple[str, Path]) -> None:
    url, mp = mounted
    for rank in range(WORLD):
        items = list(MountDataset(mp, rank=rank, world_size=WORLD, stop=5, collate=True))
        assert_same(items, [collated(rank, s) for s in range(5)])
        assert_same(items, list(StreamDataset(url, rank=rank, stop=5, collate=True)))
    # per-sample reads of the same mount are unchanged: a block's rows are .npy files
    assert_same(list(MountDataset(mp, rank=0, stop=5)), [expected(0, s) for s in range(5)])


def test_mount_dataset_reads_the_same_items_as_the_stream(mounted: tuple[str, Path]) -> None:
    url, mp = mounted
    meta = json.loads((mp / "rank-0" / f"{0:012d}" / "_meta.json").read_bytes())
    assert meta["types"]["k00000.cls"] == "j" and meta["types"]["k00000.x"] == "n"
    for rank in range(WORLD):
        ds = MountDataset(mp, rank=rank, world_size=WORLD, stop=5)
        items = list(ds)
        assert [it["step"] for it in items] == list(range(5))
        assert_same(items, list(StreamDataset(url, rank=rank, stop=5)))
        assert_same(items, [expected(rank, s) for s in range(5)])
        assert ds.state_dict() == {"next_step": 5}

    ds = MountDataset(mp, stop=5, rank=1)
    ds.load_state_dict({"next_step": 2})
    assert_same(list(DataLoader(ds, batch_size=None)), [expected(1, s) for s in range(2, 5)])
    ds.load_state_dict({"next_step": 1})
    got = list(DataLoader(ds, batch_size=None, num_workers=2))
    assert [it["step"] for it in got] == [1, 2, 3, 4]
    assert_same(got, [expected(1, s) for s in range(1, 5)])
    with pytest.raises(RuntimeError, match="StatefulDataLoader"):
        ds.state_dict()

    # resumed through torchdata's StatefulDataLoader: each worker where it stopped
    from torchdata.stateful_dataloader import StatefulDataLoader

    first = StatefulDataLoader(MountDataset(mp, rank=1, stop=5), batch_size=None, num_workers=2)
    it = iter(first)
    got = [next(it) for _ in range(3)]
    state = first.state_dict()
    del it, first
    second = StatefulDataLoader(MountDataset(mp, rank=1, stop=5), batch_size=None, num_workers=2)
    second.load_state_dict(state)
    got += list(second)
    assert_same(got, [expected(1, s) for s in range(5)])

    with pytest.raises(lakestream.ConfigMismatch):
        iter(MountDataset(mp, rank=0, world_size=3))
    with pytest.raises(lakestream.ConfigMismatch, match="pass rank= and world_size="):
        iter(MountDataset(mp))


def test_mount_dataset_waits_for_steps_committed_later(mounted: tuple[str, Path]) -> None:
    """Also while signals whose handler returns arrive: the mount ends a wait with EINTR on a
    signal, and the dataset looks again."""
    url, mp = mounted
    ds = MountDataset(mp, rank=0, start=4, stop=7)
    handled = []

    def signal_then_produce() -> None:
        for _ in range(2):
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.3)
        add_steps(url, 5, 2)

    previous = signal.signal(signal.SIGUSR1, lambda *_: handled.append(time.monotonic()))
    producer = threading.Thread(target=signal_then_produce)
    producer.start()
    try:
        t0 = time.monotonic()
        items = list(ds)
        waited = time.monotonic() - t0
    finally:
        producer.join()
        signal.signal(signal.SIGUSR1, previous)
    assert_same(items, [expected(0, s) for s in range(4, 7)])
    assert waited > 1.2 and len(handled) == 2
    assert ds.state_dict() == {"next_step": 7}


WORKERS_READ = """
import faulthandler, pickle, sys
from torch.utils.data import DataLoader
def stacks_if_stuck(worker_id):
    faulthandler.dump_traceback_later(100)  # a worker still at it after 100 s: its stacks on stderr
loader = DataLoader(pickle.loads(sys.stdin.buffer.read()), batch_size=None, num_workers=2, timeout=120,
                    worker_init_fn=stacks_if_stuck)
print(sorted(item["step"] for item in loader))
"""


def workers_read(dataset: Any) -> list[int]:
    """The steps a DataLoader with two (forked) workers yields from `dataset`, in a process of its
    own: a training script forks its workers from a young process, not from a pytest worker
    holding the threads of hundreds of tests (a fork of one hung a worker for good once, in a
    loaded full run)."""
    r = subprocess.run([sys.executable, "-c", WORKERS_READ], input=pickle.dumps(dataset), capture_output=True,
                       timeout=200)  # fmt: skip
    assert r.returncode == 0, r.stderr.decode(errors="replace")[-4000:]
    return json.loads(r.stdout)


def test_both_datasets_with_no_stop_end_at_the_close_and_say_the_stream_is_done(
    stream_url: str, tmp_path: Path
) -> None:
    url = stream_url
    anyio.run(_produce, url, 0, 3 * BATCH, True)  # steps 0..2
    m = Mount(url, tmp_path / "mnt", tmp_path / "mount.log")
    try:
        m.wait_ready()
        anyio.run(lakestream.close, url)
        datasets: list[Any] = [
            lambda: StreamDataset(url, rank=1, world_size=WORLD),
            lambda: MountDataset(m.mountpoint, rank=1, world_size=WORLD, timeout=20),
        ]
        for make in datasets:
            ds = make()
            t0 = time.monotonic()
            items = list(DataLoader(ds, batch_size=None))
            assert time.monotonic() - t0 < 10, f"{ds!r} waited at the end"
            assert_same(items, [expected(1, s) for s in range(3)])
            assert ds.state_dict() == {"next_step": 3, "done": True}, repr(ds)
            assert list(ds) == []  # done: iterating again yields nothing
            resumed = make()
            resumed.load_state_dict(ds.state_dict())
            assert list(resumed) == [] and resumed.state_dict() == {"next_step": 3, "done": True}
            with pytest.raises(ValueError, match="'done' must be a bool"):
                resumed.load_state_dict({"next_step": 3, "done": 1})
            assert workers_read(make()) == [0, 1, 2]  # each worker's share ends
        with pytest.raises(lakestream.StepUnavailable, match="closed after step 2"):
            MountDataset(m.mountpoint, rank=1, world_size=WORLD).read_step(3)
    finally:
        m.stop()


# -- (c) training under torchrun: crash and resume reproduce the uninterrupted run ---------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(url: str, ckpt: Path, losses: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
        "--master-port", str(free_port()), str(EXAMPLE), "train", url, "--ckpt-dir", str(ckpt),
        "--steps", "20", "--checkpoint-every", "5", "--losses", str(losses), *args,
    ]  # fmt: skip
    # its own process group, so that a timeout stops all of it: torchrun stops its workers (each in
    # a process group of its own, with rank 0's producer) when terminated
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, stdin=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    t0 = time.monotonic()
    try:
        out, err = proc.communicate(timeout=TORCHRUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        err += f"\n[test] timed out after {TORCHRUN_TIMEOUT} s"
    err += f"\n[test] {' '.join(args)}: {time.monotonic() - t0:.1f} s"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


TORCHRUN_TIMEOUT = 150.0


def describe(r: subprocess.CompletedProcess[str], ckpt: Path) -> str:
    log = ckpt / "producer.log"
    producer = log.read_text(errors="replace") if log.exists() else ""
    return f"exit {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}\n--- producer.log\n{producer}"


def read_losses(path: Path) -> list[tuple[int, float]]:
    out = []
    for line in path.read_text().splitlines():
        step, value = line.split()
        out.append((int(step), float.fromhex(value)))
    return out


@pytest.mark.timeout(600)
def test_crash_and_resume_reproduce_the_uninterrupted_losses_bit_for_bit(tmp_path: Path) -> None:
    t0 = time.monotonic()
    ref, crash = tmp_path / "ref", tmp_path / "crash"
    ref_url, crash_url = f"file://{ref}/stream", f"file://{crash}/stream"

    r = torchrun(ref_url, ref / "ckpt", ref / "losses.txt")
    assert r.returncode == 0, describe(r, ref / "ckpt")
    full = read_losses(ref / "losses.txt")
    assert [s for s, _ in full] == list(range(20))
    assert full[-1][1] < full[0][1] / 2, f"the model does not learn: {full}"
    t1 = time.monotonic()

    r = torchrun(crash_url, crash / "ckpt", crash / "killed.txt", "--kill-at", "13")
    assert r.returncode != 0 and re.search(r"exitcode\s*:\s*17\b", r.stderr), describe(r, crash / "ckpt")
    killed = read_losses(crash / "killed.txt")
    assert killed == full[:13]  # steps 0..12, then the crash
    assert sorted(p.name for p in (crash / "ckpt").glob("ckpt-*.pt")) == ["ckpt-000000004.pt", "ckpt-000000009.pt"]
    t2 = time.monotonic()

    r = torchrun(crash_url, crash / "ckpt", crash / "resumed.txt", "--resume")
    assert r.returncode == 0, describe(r, crash / "ckpt")
    assert "resumed from ckpt-000000009.pt, next step 10" in r.stdout, describe(r, crash / "ckpt")
    resumed = read_losses(crash / "resumed.txt")
    assert [s for s, _ in resumed] == list(range(10, 20))
    # bit for bit: the same floats (compared exactly, as their hex spelling too)
    assert [v.hex() for _, v in resumed] == [v.hex() for _, v in full[10:]]
    assert killed[:10] + resumed == full

    # every trainer checkpoint was recorded in the stream, the newest three retained
    state = anyio.run(lakestream.load_state, crash_url)
    assert [(c.id, c.step) for c in state.checkpoints] == [("step-9", 9), ("step-14", 14), ("step-19", 19)]
    assert state.head == 19 and state.producers["features"].cursor == 20 * 16
    assert [(c.id, c.step) for c in anyio.run(lakestream.load_state, ref_url).checkpoints][-1] == ("step-19", 19)
    report = anyio.run(lakestream.verify, crash_url)
    assert report.ok, report.problems
    print(f"torchrun: uninterrupted {t1 - t0:.1f} s, killed {t2 - t1:.1f} s, resumed {time.monotonic() - t2:.1f} s")


# -- (d) a StatefulDataLoader job with 2 workers, SIGKILLed and resumed ---------------------------------

TRAINER = Path(__file__).parent / "stateful_trainer.py"
TRAINER_STEPS = 24


def run_trainer(url: str, ckpt: Path, log: Path, kill_after: int | None = None) -> int:
    """Run tests/stateful_trainer.py to the end (its exit code), or SIGKILL it with its DataLoader
    workers once its checkpoint holds `kill_after` steps."""
    cmd = [sys.executable, str(TRAINER), url, str(ckpt), "--steps", str(TRAINER_STEPS), "--workers", "2"]
    if kill_after is not None:
        cmd += ["--step-time", "0.05"]
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        if kill_after is None:
            return proc.wait(timeout=120)
        deadline = time.monotonic() + 120
        while not (ckpt.exists() and len(consumed(ckpt)) >= kill_after):
            assert proc.poll() is None, f"the trainer exited with {proc.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"no {kill_after} steps within 120 s:\n{log.read_text()}"
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGKILL)  # the trainer and its DataLoader workers
        return proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def consumed(ckpt: Path) -> list[tuple[int, list[str]]]:
    return [(int(row[0]), list(row[1:])) for row in torch.load(ckpt, weights_only=True)["consumed"]]


async def _produce_world_1(url: str) -> None:
    await lakestream.create(url, world_size=1, global_batch=2)
    async with lakestream.open_producer(url, "p", policy="eager") as p:
        for i in range(TRAINER_STEPS * 2):
            await p.put({"__key__": f"k{i:05d}", "x": np.arange(3, dtype=np.float32) + i}, cursor=i + 1)


@pytest.mark.timeout(300)
def test_a_killed_two_worker_job_resumes_exactly(tmp_path: Path) -> None:
    """`StatefulDataLoader(StreamDataset(url, rank=0, world_size=1), num_workers=2)`, its state
    saved every step, SIGKILLed after an odd number of steps (the next step is worker 1's) while
    the workers have read ahead, then restarted from the saved state: the steps trained on are
    the uninterrupted run's, in order, none twice."""
    url = f"file://{tmp_path}/stream"
    anyio.run(_produce_world_1, url)
    log = tmp_path / "trainer.log"
    assert run_trainer(url, tmp_path / "ref.pt", log) == 0, log.read_text()
    reference = consumed(tmp_path / "ref.pt")
    assert reference == [(s, [f"k{2 * s:05d}", f"k{2 * s + 1:05d}"]) for s in range(TRAINER_STEPS)]

    ckpt = tmp_path / "ckpt.pt"
    assert run_trainer(url, ckpt, log, kill_after=7) == -signal.SIGKILL
    killed = consumed(ckpt)
    assert 7 <= len(killed) < TRAINER_STEPS, f"killed after {len(killed)} steps"
    assert killed == reference[: len(killed)]
    assert run_trainer(url, ckpt, log) == 0, log.read_text()
    assert f"resumed after {len(killed)} steps" in log.read_text()
    assert consumed(ckpt) == reference


def test_collate_on_a_re_sliced_step_concatenates_the_pieces(tmp_path: Path) -> None:
    """A step stored as 2 slices, read as 1 rank: `x`, a block in both, is one tensor of both pieces."""
    url = make_stream(tmp_path / "s", 2)
    anyio.run(lambda: lakestream.reshape(url, world_size=1, from_step=0))
    items = list(StreamDataset(url, rank=0, world_size=1, stop=2, collate=True))
    for item in items:
        want = {"step": item["step"], "keys": [], "x": [], "tokens": [], "txt": [], "json": [], "bin": [], "cls": []}
        for rank in range(WORLD):
            part = collated(rank, item["step"])
            for f in want:
                if f != "step":
                    want[f] += list(part[f])
        want["x"] = torch.stack(want["x"])
        assert_same(item, want)
