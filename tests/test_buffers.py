"""The pool of slice buffers (lakestream/_buffers.py): a block is reused only once nothing made
from its buffer is left, and idle blocks are bounded."""

from __future__ import annotations

import gc
import os
import threading

import numpy as np
import torch

from lakestream._buffers import GRAIN, MIN_POOLED, PAGE, BufferPool, block_size

N = MIN_POOLED + 12_345


def test_a_block_returns_when_the_last_view_of_it_goes() -> None:
    pool = BufferPool()
    buf = pool.take(N)
    assert buf.nbytes == N and not buf.readonly
    buf[:3] = b"abc"
    arr = np.frombuffer(buf, np.uint8)[1:7].reshape(2, 3)  # what a reader hands out
    tensor = torch.from_numpy(arr)[1:]
    del buf, arr
    gc.collect()
    assert pool.idle_bytes == 0  # the tensor still views it
    other = pool.take(N)
    assert pool.reused == 0  # so a new block is made
    del tensor
    assert pool.idle_bytes == block_size(N)
    again = pool.take(N - 100)  # same size class
    assert pool.reused == 1 and pool.idle_bytes == 0 and again.nbytes == N - 100
    assert not np.shares_memory(np.frombuffer(again, np.uint8), np.frombuffer(other, np.uint8))


def test_a_sub_view_or_a_copy_keeps_or_frees_it() -> None:
    pool = BufferPool()
    part = pool.take(N)[10:20]
    gc.collect()
    assert pool.idle_bytes == 0
    del part
    assert pool.idle_bytes > 0
    copy = pool.copy(b"x" * N)
    assert bytes(copy[:2]) == b"xx" and not copy.readonly and pool.reused == 1
    kept = bytes(copy[:4])
    del copy
    assert kept == b"xxxx" and pool.idle_bytes > 0


def test_small_requests_are_not_pooled_and_idle_blocks_are_bounded() -> None:
    pool = BufferPool(max_idle=3 * block_size(8 * GRAIN))
    small = pool.take(100)
    assert small.nbytes == 100 and isinstance(small.obj, bytearray)
    bufs = [pool.take(8 * GRAIN) for _ in range(5)]
    del bufs
    assert pool.idle_bytes == 3 * block_size(8 * GRAIN)  # two were freed, not kept
    pool.clear()
    assert pool.idle_bytes == 0


def test_threads_taking_and_dropping_never_share_a_live_block() -> None:
    pool = BufferPool()
    errors: list[str] = []

    def work(tag: int) -> None:
        for i in range(200):
            buf = pool.take(N)
            buf[:] = bytes([tag]) * N
            arr = np.frombuffer(buf, np.uint8)
            if arr.min() != tag or arr.max() != tag:
                errors.append(f"thread {tag} round {i}: its buffer changed under it")
            del buf, arr

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and pool.reused > 0


def test_a_forked_child_starts_with_an_empty_pool_and_a_free_lock() -> None:
    import os

    from lakestream._buffers import pool

    pool.take(N)  # dropped at once: an idle block in the parent
    assert pool.idle_bytes > 0
    with pool._lock:  # held by this thread while the child is forked
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            ok = pool.idle_bytes == 0 and pool.take(N).nbytes == N  # would block on the parent's lock
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_buffer_starts_where_the_kernel_copies_into_it_fast() -> None:
    """64-127 bytes past the source's place in a page, on a 64-byte boundary, for any source
    offset and however the block was placed (a reused block too)."""
    pool = BufferPool()
    for src in [0, 1, 16, 63, 64, 100, 4000, 4095, 4096 + 17, 123_456_789]:
        for _ in range(2):  # a fresh block, then the same one reused
            buf = pool.take(N, src)
            address = np.frombuffer(buf, np.uint8).__array_interface__["data"][0]
            assert address % 64 == 0 and (address - src) % PAGE in range(64, 128), (src, address)
            assert buf.nbytes == N
            del buf
    assert pool.reused >= 10


def test_an_array_made_from_a_buffer_in_any_way_keeps_its_block() -> None:
    """However an array, tensor or view is made from a pooled buffer, its block is not handed out
    again while it lives (NumPy names an array's memory owner through memoryviews and views: a
    numpy block would be named instead of the lease, which then died under the array)."""
    pool = BufferPool()
    makers = {
        "np.ndarray(buffer=)": lambda b: np.ndarray((4, 100), np.uint8, buffer=b, offset=64),
        "np.frombuffer": lambda b: np.frombuffer(b, np.uint8)[64:],
        "np.asarray": lambda b: np.asarray(b)[5:9],
        "view of a view": lambda b: np.ndarray((N // 2,), np.uint8, buffer=b)[10:].reshape(-1, 2)[3:],
        "torch.from_numpy": lambda b: torch.from_numpy(np.ndarray((N,), np.uint8, buffer=b))[1:],
        "torch.frombuffer": lambda b: torch.frombuffer(b, dtype=torch.uint8)[7:],
        "memoryview slice": lambda b: b[100:200],
    }
    for how, make in makers.items():
        buf = pool.take(N)
        buf[:] = b"\x07" * N
        kept = make(buf)
        del buf
        gc.collect()
        assert pool.idle_bytes == 0, f"{how}: the block went back while an array made from it lives"
        other = pool.take(N)
        other[:] = b"\x09" * N
        assert bytes(memoryview(np.ascontiguousarray(kept)).cast("B")[:1]) == b"\x07", how
        del kept, other
        gc.collect()
        assert pool.idle_bytes == 2 * block_size(N), how
        pool.clear()


def test_a_forked_child_writing_a_pooled_buffer_leaves_the_parents_alone() -> None:
    """Blocks are private memory: a DataLoader worker forked while the parent holds a batch may
    write to its copy of it without changing the parent's (copy on write, as with malloc)."""
    pool = BufferPool()
    buf = pool.take(N)
    buf[:] = b"a" * N
    pid = os.fork()
    if pid == 0:  # the child: write its copy, then leave without running the parent's cleanup
        buf[:] = b"b" * N
        os._exit(0 if bytes(buf[:1]) == b"b" else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert bytes(buf[:1]) == b"a" and bytes(buf[-1:]) == b"a"
