"""Reused memory for fetched slices.

A slice read from a file or copied out of an S3 response needs megabytes of writable memory a
step. Fresh memory costs a page fault per 4 KiB page on first touch, which on a VM is several
times the copy itself (about 1.7 ms for a 2.35 MB slice, against 0.2 ms to copy it into memory
already mapped), and glibc gives such blocks back to the kernel when they are freed by another
thread than the one that asked for them, as readers do. So blocks come from a pool and return to
it when nothing refers to the memory any more: the caller gets a memoryview of a lease, a numpy
view of the block, and every array, tensor or view made from that memoryview keeps the lease
alive (the buffer protocol holds a reference to its exporter); when the last one goes, the
lease's weak-reference callback hands the block back.

A block is private anonymous memory (`mmap`, copied on write in a forked child as malloc's is),
not a numpy array, and the lease a numpy array over it. An array's `base` is the first object
that owns its memory, found by looking through memoryviews and array views: an array made from a
lease's buffer (`np.ndarray(..., buffer=...)`, as a slice's array blocks are) names the lease,
which owns nothing, only if what the lease views is not a numpy array too. With numpy blocks,
NumPy (1.26, 2.0, 2.3 and 2.4 alike) named the block: the lease died while the array lived, and
its block was handed out again for the next slice under the array.

Where a block's bytes start within a page is chosen too. The kernel copies a read into user memory
with `rep movsb`, which on AMD's Zen cores (most cloud VMs) runs about ten times slower when the
destination lies 1 to 31 bytes past the source modulo 4 KiB: 1.6 against 15-20 GB/s from the page
cache here. glibc's memmove avoids that case; the kernel's copy does not. A malloc'd (or numpy) block
starts 16 bytes into a page, so every slice read from a page-aligned file offset hit it. A buffer
from `take(n, src)` starts 64-127 bytes past `src` modulo a page, and on a 64-byte boundary (the
alignment of a slice's array blocks).

No I/O: the pool only holds memory. It is bounded (`MAX_IDLE` bytes of blocks waiting for reuse);
a block that would go over is freed, so a slow consumer costs fresh memory, never more of it.

Memory the pool does not hand out (an S3 client's response and request buffers, allocated by its
own threads) is glibc's. The processes Lakestream runs by itself (`lakestream mount`, `lakestream
produce`) ask glibc to keep what they free for reuse (`keep_freed_memory`), as the pool does.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import weakref
from typing import Any

import numpy as np

__all__ = ["GRAIN", "MAX_IDLE", "MIN_POOLED", "PAGE", "BufferPool", "block_size", "keep_freed_memory", "pool"]

GRAIN = 1 << 16  # block sizes are multiples of this: slices of one stream differ by a few bytes
MIN_POOLED = 1 << 18  # smaller requests come from malloc, whose small blocks are reused anyway
MAX_IDLE = 256 << 20  # bytes of blocks kept for reuse
ALIGN = 64  # a buffer's start is a multiple of this (a slice's array blocks are aligned so)
PAGE = 4096  # a buffer's start is placed within a page (see above)


def block_size(n: int) -> int:
    """The size of the pooled block a buffer of `n` bytes is cut from: room to place its start
    anywhere in a page, rounded up to GRAIN."""
    return -(-(n + PAGE) // GRAIN) * GRAIN


class BufferPool:
    def __init__(self, max_idle: int = MAX_IDLE) -> None:
        self.max_idle = max_idle
        self._free: dict[int, list[tuple[mmap.mmap, int]]] = {}  # size -> idle (block, address)
        self._idle = 0
        self._lock = threading.RLock()  # a lease may be finalized while its thread holds the lock
        # Leases out, by id of the weak reference whose callback gives their block back (a bare
        # weakref.ref costs a third of a weakref.finalize, whose registry this is the whole of).
        self._out: dict[int, tuple[weakref.ref[Any], tuple[mmap.mmap, int]]] = {}
        self.reused = 0  # blocks handed out again (for tests and benchmarks)

    @property
    def idle_bytes(self) -> int:
        return self._idle

    def take(self, n: int, src: int = 0) -> memoryview:
        """A writable buffer of exactly `n` bytes, its content undefined, starting 64-127 bytes past
        `src` modulo a page, 64-byte aligned: give the file offset (or the address) the kernel
        will copy into it from. Its block returns to the pool once nothing refers to the buffer
        or to anything made from it."""
        if n < MIN_POOLED:
            return memoryview(bytearray(n))
        size = block_size(n)
        with self._lock:
            blocks = self._free.get(size)
            got = blocks.pop() if blocks else None
            if got is not None:
                self._idle -= size
                self.reused += 1
        if got is None:
            block = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # not shared with forks
            got = block, np.frombuffer(block, np.uint8, 1).__array_interface__["data"][0]
        block, address = got
        want = -(-(src % PAGE + ALIGN) // ALIGN) * ALIGN  # 64-127 bytes past `src`, on a 64-byte boundary
        start = (want - address) % PAGE
        lease = np.frombuffer(block, np.uint8, n, start)  # `block` stays the pool's, the lease is what users hold
        ref = weakref.ref(lease, self._returned)
        self._out[id(ref)] = ref, got
        return lease.data  # a memoryview exported by the lease

    def copy(self, data: Any) -> memoryview:
        """A writable copy of the bytes-like `data` in a pooled buffer."""
        src = memoryview(data).cast("B")
        out = self.take(src.nbytes)
        out[:] = src
        return out

    def _returned(self, ref: weakref.ref[Any]) -> None:
        self._give_back(self._out.pop(id(ref))[1])

    def _give_back(self, got: tuple[mmap.mmap, int]) -> None:
        size = len(got[0])
        with self._lock:
            if self._idle + size <= self.max_idle:
                self._free.setdefault(size, []).append(got)
                self._idle += size

    def clear(self) -> None:
        """Free every idle block."""
        with self._lock:
            self._free.clear()
            self._idle = 0

    def reset(self) -> None:
        """Empty, with a new lock (in a forked child, where no other thread exists yet)."""
        self._lock = threading.RLock()
        self._free, self._idle = {}, 0


pool = BufferPool()  # the process's: readers, the mount and the file store share it


# A forked child (a DataLoader worker) starts with an empty pool and a new lock: the lock may have
# been held by a thread of the parent that the child does not have.
os.register_at_fork(after_in_child=lambda: pool.reset())


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for reuse in this process: blocks up to 32 MiB from
    its heaps rather than from fresh mappings, and up to MAX_IDLE bytes free at a heap's top kept
    rather than given back to the kernel. An S3 client's threads then take warm memory for each
    response (about a page fault less per 4 KiB: up to 190 a step fewer in a mount on S3); the
    process keeps up to that much more memory mapped. For a process Lakestream runs, not one it
    is imported into. False where malloc is not glibc's."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(M_TRIM_THRESHOLD, MAX_IDLE))
