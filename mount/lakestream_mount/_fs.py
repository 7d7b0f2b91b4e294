"""The FUSE filesystem: each mounted rank's committed steps as read-only directories.

    MOUNTPOINT/_status.json                        head step, version, producers, lag, closed_after, job
    MOUNTPOINT/rank-<r>/latest -> <step:012d>      the newest committed step
    MOUNTPOINT/rank-<r>/END                        {"closed_after": E} once the stream ended after step E
    MOUNTPOINT/rank-<r>/<step:012d>/<key>.<field>  one file per sample field
    MOUNTPOINT/rank-<r>/<step:012d>/_meta.json     step, version, producer, keys, sizes
    MOUNTPOINT/rank-<r>/<step:012d>/_batch/<field>.npy  an array field of every sample, one `.npy`

Theory of operation.

- Inodes. The root, `_status.json`, every rank directory, `latest` and `END` have fixed numbers
  below `NODE_BASE`. Everything else is a `Node` of one TGB: a step directory or one of
  its files, tied to the (rank, step, manifest version, world size) it was looked up at. Its number is drawn
  from a counter that never goes back, so no two nodes ever share one, whatever the world size,
  step number or files per slice; a node is dropped when the kernel forgets it (lookup count 0).
  A node's content never changes, so the kernel may cache its entry, attributes and pages for as
  long as it likes (`keep_cache`, day-long timeouts). Only `latest`, `_status.json` and `END`
  change; they get zero timeouts and direct I/O.
- Rewinds. A step number re-committed after a rewind is another TGB at another version, hence
  other nodes. Looking up, stat-ing or opening a node whose TGB is no longer the committed one
  fails with ESTALE (the kernel then walks the path again, asking us for every name, and finds
  the new TGB or nothing), and the kernel is told to drop the entries of such step names. A file
  opened before keeps reading its own TGB's bytes (checked again if refetched) or fails with
  ESTALE once they are gone; it never reads another TGB's.
- Reshapes. The root shows `rank-<r>` for the ranks in force (at a retained step or the next
  one) among those served (`--ranks`); a rank directory lists the steps that have that rank. A
  reshape that changes how committed steps are read makes their nodes stale just as a rewind
  does: the same step read as another world size holds other samples per rank.
- Waiting. The kernel serialises lookups within a directory (pyfuse3 does not negotiate
  parallel directory operations), so a lookup must never wait. A lookup of a step that is not
  committed yet answers at once with a `pending` directory node and zero timeouts; the kernel
  then asks for its attributes (every `stat`, and the permission check of a path walk through
  it) without holding the rank directory, and *that* waits for the commit (at most `wait`). Once
  committed, the node becomes that TGB's step directory; if the wait runs out it answers ENOENT,
  and so does a lookup of that step within `EXPIRED_GRACE` seconds after, so that `ls` of a
  missing step (a `stat`, then an `lstat`) says "no such file" after one wait, not two.
- The end. Once the stream is closed after step E (a `close` record), a step past E never comes:
  its lookup answers ENOENT at once, and a wait for one ends with ENOENT when the close record
  arrives. Once the head reached E, each rank directory holds `END`; a `reopen` record removes it.
- Marks. With a job (`lakestream mount --job`), the reader publishes that job's consumption mark,
  which a lookup of rank 0's step n moves to n - 1 (`_looked_up`): only up to the step after the
  head, and a rewind brings it down to the new head.
- Signals. Once a request reaches us the kernel waits for our answer whatever signal its caller
  gets; it sends FUSE_INTERRUPT, but pyfuse3 does not deliver that. So a waiting request looks,
  every `INTERRUPT_POLL` seconds, at whether its caller's thread has a signal pending that it does
  not block (what makes the kernel send FUSE_INTERRUPT), and if so answers EINTR: the caller then
  dies of the signal, runs its handler (Python's `open()` retries after one that returns, PEP
  475), or sees EINTR. Without a signal nothing changes: the request waits for the commit.
- Array blocks. A field the producer stored as one block (a numpy array of one dtype and shape
  in every sample of the slice) is served twice from the same bytes, never copied: each sample's
  `<key>.<field>` is a `.npy` header and that sample's row, and `_batch/<field>.npy` a header of
  shape (n, ...) and the whole block. `_batch` exists only in a step with such a field.
- Reads come from a bounded cache of whole rank slices, fetched with one range GET each, checked
  (CRC-32) and indexed into bytes the mount owns; concurrent reads of one slice share the fetch.
  Names from a slice are checked before they become file names: a hostile one is CorruptData.
- One manifest follower serves every rank. A store that fails never ends the mount: it keeps
  serving what it has and retries with exponential backoff and jitter until the store is back.

Every handler goes through `_handler`, the one place that logs exceptions (pyfuse3 in asyncio
mode drops them otherwise) and maps them to an errno.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import random
import stat
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec, TypeVar

import anyio
import orjson
import pyfuse3

import lakestream
from lakestream import _layout as layout
from lakestream import metrics
from lakestream._buffers import pool
from lakestream._config import LIMITS
from lakestream._pacing import StepPace
from lakestream._retry import Backoff  # the library's one backoff policy (same distribution)
from lakestream._segment import decode_value, npy_header
from lakestream._tasks import run_sync

from ._mounts import mounts_at

__all__ = ["NODE_BASE", "Inodes", "LakeFS", "Node", "SliceCache", "check_names", "signal_pending", "step_of_name"]

log = logging.getLogger("lakestream.mount")

ROOT = pyfuse3.ROOT_INODE
STATUS = 2
RANK_BASE = 16  # rank r: directory RANK_BASE + 2r, `latest` RANK_BASE + 2r + 1
MAX_WORLD = LIMITS["world_size"][1]
END_BASE = RANK_BASE + 2 * MAX_WORLD  # rank r: `END` END_BASE + r
NODE_BASE = END_BASE + MAX_WORLD  # nodes above every fixed number
META = -1  # the file index of `_meta.json`
BATCH = -2  # the index of a step's `_batch` directory in its listing
FOREVER = 24 * 3600.0
EXPIRED_GRACE = 0.5  # seconds a step whose wait ran out is reported missing without a new wait
INTERRUPT_POLL = 0.5  # seconds between looks at whether a waiting request's caller got a signal
POLL_FAST_FOR = 1.0  # seconds the log is read every `poll_min` after it moved or a wait started
POLL_UNAWAITED = 0.05  # seconds at least between reads of the log while no request waits for a step
KEEP_BEHIND = 8  # steps of a rank kept cached below the newest one looked up (DataLoader workers lag)
INLINE_MAX = 256  # bytes: a text or JSON field (and a source) at most this long has its value in `_meta.json` too
STATUS_NAME = layout.STATUS_NAME.encode()
META_NAME = layout.META_NAME.encode()
BATCH_NAME = b"_batch"
LATEST_NAME = layout.LATEST_NAME.encode()
END_NAME = layout.END_NAME.encode()

T = TypeVar("T")
P = ParamSpec("P")


def step_of_name(name: bytes) -> int | None:
    """The step a rank directory entry names (`%012d`, no other spelling), or None."""
    if len(name) < 12 or not name.isdigit():
        return None
    step = int(name)
    return step if name == b"%012d" % step else None


def signal_pending(tid: int) -> bool:
    """Whether thread `tid` (a FUSE request's caller) has a signal pending that it does not block:
    what makes the kernel interrupt the request it waits on. False if its /proc entry cannot be
    read (gone, or in a PID namespace we do not see: the kernel then sends pid 0)."""
    if tid <= 0:
        return False
    try:
        with open(f"/proc/{tid}/status", "rb", buffering=0) as f:  # unbuffered: no isatty ioctl
            status = f.read()
    except OSError:
        return False
    masks = {}
    for line in status.splitlines():
        name, _, value = line.partition(b":")
        if name in (b"SigPnd", b"ShdPnd", b"SigBlk"):
            masks[name] = int(value, 16)
    if len(masks) != 3:
        return False
    return bool((masks[b"SigPnd"] | masks[b"ShdPnd"]) & ~masks[b"SigBlk"])


def _leaf(e: BaseException) -> BaseException:
    """The first exception inside (nested) exception groups: what a task group really raised."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return e


def _invalid_name(name: object, *, dots: bool) -> str | None:
    if not isinstance(name, str):
        return f"is a {type(name).__name__}, not a string"
    if not name:
        return "is empty"
    if "/" in name or "\0" in name:
        return "contains '/' or NUL"
    if not dots and "." in name:
        return "contains '.'"
    if name in (".", ".."):
        return f"is {name!r}"
    return None


def check_names(files: list[lakestream.FieldRef], where: str) -> dict[bytes, int]:
    """{file name: index} of a slice's fields, or CorruptData naming `where` if a key or field name
    from the slice could not have been put, collides with `_meta.json` or with another name."""
    names: dict[bytes, int] = {}
    for i, f in enumerate(files):
        problem = _invalid_name(f.key, dots=False)
        what = f"sample key {f.key!r}"
        if problem is None:
            what = f"sample {f.key!r}: field name {f.field!r}"
            problem = _invalid_name(f.field, dots=True)
        if problem is None and (type(f.length) is not int or f.length < 0):
            problem = f"has length {f.length!r}"
        if problem is None:
            try:
                name = f"{f.key}.{f.field}".encode()
            except UnicodeEncodeError:
                name, problem = b"", "is not valid UTF-8"
            if len(name) > 255:
                problem = f"makes a file name of {len(name)} bytes (at most 255)"
            elif name == META_NAME:
                problem = "makes the reserved name _meta.json"
            elif name in names:
                problem = "occurs twice"
            names[name] = i
        if problem is not None:
            raise lakestream.CorruptData(f"{where}: {what} {problem}")
    return names


def _handler(
    fn: Callable[Concatenate[LakeFS, P], Awaitable[T]],
) -> Callable[Concatenate[LakeFS, P], Coroutine[Any, Any, T]]:
    """Log every exception of a handler and map it to an errno, in one place."""

    name = fn.__name__

    async def wrapper(self: LakeFS, /, *args: P.args, **kwargs: P.kwargs) -> T:
        self.requests[name] += 1
        try:
            return await fn(self, *args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except Exception as group:
            e = _leaf(group)
            if isinstance(e, pyfuse3.FUSEError):
                raise e from None
            if isinstance(e, lakestream.StepUnavailable):
                log.info("%s: %s", name, e)
                raise pyfuse3.FUSEError(errno.ENOENT) from None
            self.metrics.eio(name)
            if isinstance(e, lakestream.CorruptData):
                log.error("%s: %s", name, e)
            elif isinstance(e, lakestream.StoreError):
                log.error("%s: object store failed: %s", name, e)
            else:
                log.error("%s%r failed", name, args, exc_info=e)
            raise pyfuse3.FUSEError(errno.EIO) from None

    functools.update_wrapper(wrapper, fn)
    return wrapper


@dataclass(eq=False, slots=True)
class Node:
    """A step directory (`step`), its `_batch` directory (`batch`), a file of either (`file`), or a
    step directory not committed yet (`pending`), of one rank. `entry` is the TGB it shows (None while pending)."""

    inode: int
    kind: str
    rank: int
    step: int
    entry: lakestream.Step | None
    world: int  # the world size its step is read as (a reshape makes it stale like a rewind)
    index: int = META  # file: index in the slice's files (`Slice.files`), META for `_meta.json`
    size: int = 0
    lookups: int = 0
    invalidated: bool = False
    key: tuple[str, int, int, int, int, int] | None = None  # in `Inodes`, while it can be found by key

    @property
    def name(self) -> bytes:
        return b"%012d" % self.step


class Inodes:
    """Inode numbers of nodes: each handed out once, never reused; a node lives while the kernel
    holds a lookup of it."""

    def __init__(self, first: int) -> None:
        self._next = first
        self.nodes: dict[int, Node] = {}
        self._by_key: dict[tuple[str, int, int, int, int, int], int] = {}

    def get(
        self,
        kind: str,
        rank: int,
        step: int,
        entry: lakestream.Step | None,
        world: int,
        index: int = META,
        size: int = 0,
    ) -> Node:
        key = (kind, rank, step, -1 if entry is None else entry.version, world, index)
        inode = self._by_key.get(key)
        if inode is not None:
            return self.nodes[inode]
        node = Node(self._next, kind, rank, step, entry, world, index, size, key=key)
        self._next += 1
        self.nodes[node.inode] = node
        self._by_key[key] = node.inode
        return node

    def bind(self, node: Node, entry: lakestream.Step, world: int) -> None:
        """A pending node's step committed: it is that TGB's step directory from now on."""
        if node.key is not None:
            del self._by_key[node.key]
        node.kind, node.entry, node.world, node.key = "step", entry, world, None

    def forget(self, inode: int, n: int) -> None:
        node = self.nodes.get(inode)
        if node is None:
            return
        node.lookups -= n
        if node.lookups <= 0:
            self.drop(node)

    def drop(self, node: Node) -> None:
        del self.nodes[node.inode]
        if node.key is not None:
            del self._by_key[node.key]


@dataclass(frozen=True, slots=True)
class File:
    """A file of a step: `prefix` (a `.npy` header, or nothing) then `length` bytes of the slice
    from `offset` on. Its bytes are served from the fetched slice as they are, never copied into
    a file of their own."""

    prefix: bytes
    offset: int
    length: int

    @property
    def size(self) -> int:
        return len(self.prefix) + self.length

    def read(self, data: memoryview, off: int, size: int) -> bytes | memoryview:
        """Bytes `off`..`off + size` of the file."""
        n = len(self.prefix)
        end = min(off + size, n + self.length)
        if off >= n:  # past the header: a view of the slice, no copy before pyfuse3's own
            return data[self.offset + off - n : self.offset + max(end - n, off - n)]
        head = self.prefix[off:end]  # the header, then the data: one copy, into reused memory (up to 1 MiB)
        out = pool.take(end - off)
        out[: len(head)] = head
        out[len(head) :] = data[self.offset : self.offset + max(end - n, 0)]
        return out


@dataclass(frozen=True, slots=True)
class Slice:
    """A fetched rank slice with what serving it needs: its files, their names and `_meta.json`,
    computed once. `names`: the step directory's `<key>.<field>` files; `batch`: `_batch/`'s
    `<field>.npy` files, one per array block (a field of one dtype and shape in every sample)."""

    entry: lakestream.Step
    rank: int
    data: memoryview
    files: list[File]
    names: dict[bytes, int]  # file name -> index in `files`
    batch: dict[bytes, int]  # `_batch/` file name -> index in `files`
    meta: bytes  # the `_meta.json` content

    @classmethod
    def of(cls, raw: lakestream.RawSlice, where: str, world_size: int | None = None) -> Slice:
        e, refs = raw.entry, raw.files
        names = check_names(refs, where)
        headers = {name: npy_header(b.dtype, b.shape) for name, b in raw.blocks.items()}
        files = [File(headers[f.field] if f.tag == "a" else b"", f.offset, f.length) for f in refs]
        batch: dict[bytes, int] = {}
        for name, b in raw.blocks.items():
            file_name = f"{name}.npy".encode()
            if len(file_name) <= 255:  # else read from the samples' files only
                batch[file_name] = len(files)
                files.append(File(npy_header(b.dtype, (b.count, *b.shape)), b.offset, b.count * b.row_bytes))
        keys = list(dict.fromkeys(f.key for f in refs))
        sources = {  # under a mixture: the source of every sample
            f.key: bytes(raw.data[f.offset : f.offset + f.length]).decode("utf-8", "replace")
            for f in refs
            if f.field == layout.SOURCE_FIELD and f.tag == "s" and f.length <= INLINE_MAX
        }
        values = _inline_values(raw.data, refs)
        meta = orjson.dumps(
            {
                "step": e.step, "rank": raw.rank, "version": e.version, "producer": e.producer,
                "epoch": e.epoch, "seq": e.seq, "segment": e.segment, "samples": len(keys),
                "keys": keys,
                "files": {f"{f.key}.{f.field}": files[i].size for i, f in enumerate(refs)},
                "types": {f"{f.key}.{f.field}": "n" if f.tag == "a" else f.tag for f in refs},
                "world_size": world_size if world_size is not None else len(e.ranks),  # the shape of the step
                "stored_world_size": len(e.ranks),  # the slices it was sealed as (re-sliced when it differs)
            }
            | ({"sources": sources} if sources else {})
            | ({"values": values} if values else {})
            | ({"batch": {n.decode(): files[i].size for n, i in batch.items()}} if batch else {}),
            option=orjson.OPT_INDENT_2,
        )  # fmt: skip
        return cls(e, raw.rank, memoryview(raw.data), files, names, batch, meta)


def _inline_values(data: Any, refs: list[lakestream.FieldRef]) -> dict[str, Any]:
    """`_meta.json`'s "values": each short text or JSON field's value, so that a loader takes a
    class label or a caption with the step's `_meta.json` rather than with an open and a read of
    its own (16 of them a step for a label beside a `_batch` image). A field whose bytes do not
    decode is left out: its file says so when read."""
    values: dict[str, Any] = {}
    for f in refs:
        if f.tag in ("j", "s") and f.length <= INLINE_MAX:
            try:
                values[f"{f.key}.{f.field}"] = decode_value(f.tag, bytes(data[f.offset : f.offset + f.length]))
            except ValueError:  # orjson.JSONDecodeError and UnicodeDecodeError are ValueErrors
                pass
    return values


@dataclass(slots=True)
class _Pending:
    done: anyio.Event = field(default_factory=anyio.Event)
    result: Slice | None = None
    error: BaseException | None = None


class SliceCache:
    """A bounded LRU of rank slices of TGBs; concurrent gets of one slice share one fetch."""

    def __init__(self, fetch: Callable[[int, lakestream.Step, int], Awaitable[Slice]], capacity: int) -> None:
        self._fetch = fetch
        self.capacity = capacity
        self.nbytes = 0
        self.fetches = 0
        self.metrics: metrics.MountRecorder = metrics.NOOP_MOUNT  # hits and misses, per rank
        self._slices: OrderedDict[tuple[int, int, int, int], Slice] = OrderedDict()
        self._pending: dict[tuple[int, int, int, int], _Pending] = {}

    def __contains__(self, key: tuple[int, int, int, int]) -> bool:
        return key in self._slices or key in self._pending

    async def get(self, rank: int, entry: lakestream.Step, world: int) -> Slice:
        # a rewind gives a step a new TGB at a new version; a reshape reads it as another world size
        key = (rank, entry.step, entry.version, world)
        hit = self._slices.get(key)
        if hit is not None:
            self._slices.move_to_end(key)
            self.metrics.hit(rank)
            return hit
        pending = self._pending.get(key)
        if pending is None:
            self.metrics.miss(rank)
            pending = self._pending[key] = _Pending()
            try:
                self.fetches += 1
                pending.result = await self._fetch(rank, entry, world)
                self._insert(key, pending.result)
            except BaseException as e:
                pending.error = e
                raise
            finally:
                del self._pending[key]
                pending.done.set()
            return pending.result
        self.metrics.hit(rank)  # another request's fetch serves this one
        await pending.done.wait()
        if pending.error is not None:
            raise pending.error
        assert pending.result is not None
        return pending.result

    def _insert(self, key: tuple[int, int, int, int], value: Slice) -> None:
        self._slices[key] = value
        self.nbytes += len(value.data)
        while self.nbytes > self.capacity and len(self._slices) > 1:
            _, old = self._slices.popitem(last=False)
            self.nbytes -= len(old.data)

    def drop(self, keep: Callable[[int, int, int, int], bool]) -> None:
        for key in [k for k in self._slices if not keep(*k)]:
            self.nbytes -= len(self._slices.pop(key).data)


class LakeFS(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = False

    def __init__(
        self,
        reader: lakestream.Reader,
        ranks: list[int] | None,
        *,
        prefetch: int = 2,
        cache_size: int = 1 << 30,
        wait: float = 60.0,
        poll_interval: tuple[float, float] = (0.002, 0.5),
        retry_interval: tuple[float, float] = (0.5, 10.0),
        mountpoint: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.clock = clock  # of the log's following and lookups' waits (a test's simulated one)
        self.reader = reader
        self.served = ranks  # the ranks this node serves when in force (None: all)
        self._served = frozenset(ranks or ())
        self.prefetch = prefetch
        self.wait = wait
        self.poll_min, self.poll_max = poll_interval
        self.retry_min, self.retry_max = retry_interval
        self.backoff = Backoff(first=self.retry_min, cap=self.retry_max, jitter=0.5)
        self.rng = random.Random()
        self.cache = SliceCache(self._fetch, cache_size)
        self.uid, self.gid = os.getuid(), os.getgid()
        self.mounted_at = time.time_ns()
        self.inodes = Inodes(NODE_BASE)
        self._changed = anyio.Event()
        self._poke = anyio.Event()
        self._handles: dict[int, Node | int | bytes] = {}  # fh -> node, fixed inode, or status bytes
        self.requests: Counter[str] = Counter()  # FUSE requests served, by operation (`_status.json`)
        self._next_fh = 0
        self._cursor: dict[int, int] = {}  # the newest step looked up per rank: the prefetch window's start
        # (before any: the head at start), and the cache keeps KEEP_BEHIND steps below it
        self._start = reader.state.head
        self._shapes = list(reader.state.shapes)
        self._widest_seen = self._widest()
        self._expired: dict[tuple[int, int], float] = {}  # (rank, step) -> until when its wait counts as run out
        self._rewinds = reader.state.rewinds
        self._first_step = reader.state.first_step
        self._closed_after = reader.state.closed_after
        self.follow_error: str | None = None
        self.closing = anyio.Event()
        self._waiting: Counter[int] = Counter()  # steps lookups wait for, and how many wait for each
        self._wait_started = 0.0  # when the newest wait for a step started
        self._pace = StepPace()  # when the steps lookups waited for arrived
        self._empty = 0  # reads of the log that found nothing new since it moved or a new wait started
        self.detached = False
        self.mountpoint = mountpoint
        self._checked_mount = time.monotonic()
        self._tg: anyio.abc.TaskGroup | None = None
        self.metrics = self.cache.metrics = metrics.mount(self)

    @property
    def state(self) -> lakestream.State:
        return self.reader.state

    @property
    def _waiters(self) -> int:
        """Lookups waiting for a step to be committed."""
        return sum(self._waiting.values())

    @property
    def ranks(self) -> list[int]:
        """The ranks shown: those served that a retained step, the next one or a scheduled one is read as."""
        n = self._widest()
        return list(range(n)) if self.served is None else [r for r in self.served if r < n]

    def _widest(self) -> int:
        s = self.state
        assert s.config is not None
        shapes = [(0, s.config.world_size, 0), *s.shapes]
        return max(w for i, (_, w, _) in enumerate(shapes) if i + 1 == len(shapes) or shapes[i + 1][0] > s.first_step)

    def _shown(self, rank: int) -> bool:
        return rank < self._widest() and (self.served is None or rank in self._served)

    def _has(self, rank: int, step: int) -> bool:
        """Whether `step` has `rank` (as served, and in the world size the step is read as)."""
        return rank < self.state.world_at(step) and (self.served is None or rank in self._served)

    def _current(self, node: Node) -> bool:
        """Whether the node's TGB is still the committed one of its step, read as the same world size."""
        e = self.state.step(node.step)
        return (
            e is not None
            and node.entry is not None
            and e.version == node.entry.version
            and self.state.world_at(node.step) == node.world
        )

    # -- following the manifest and prefetching ----------------------------------------------

    async def follow(self, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """Poll the manifest (backing off while it does not move: `poll_delay`; at once when a
        request starts waiting for a step), wake waiters, prefetch.

        Never raises for a store that fails: it retries with backoff and jitter for as long as
        it takes, and the mount keeps serving what it has meanwhile."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            task_status.started()
            last_change = self.clock()
            failures = 0
            self._prefetch()
            while not self.closing.is_set():
                try:
                    # While lookups wait, a read that brings the newest step waited for stops there:
                    # the waiters wake a GET sooner, and the next lookup's read confirms the tail.
                    wanted, head = max(self._waiting, default=None), self.state.head
                    enough = None if wanted is None else lambda: self.state.head >= wanted
                    changed = await self.reader.manifest.refresh(enough=enough)  # versions applied
                except Exception as group:
                    failures += 1
                    e = _leaf(group)
                    delay = self.backoff.delay(failures, self.rng)
                    self.follow_error = f"{type(e).__name__}: {e}"
                    if failures == 1 or failures % 10 == 0:
                        log.warning("cannot follow %s (failure %d; serving what the mount has, retrying in "
                                    "%.1f s): %s", self.reader.url, failures, delay, self.follow_error)  # fmt: skip
                    with anyio.move_on_after(delay):
                        await self.closing.wait()
                    self._check_unmounted()
                    continue
                if failures:
                    log.warning("following %s again after %d failures", self.reader.url, failures)
                    failures, self.follow_error = 0, None
                now = self.clock()
                if changed:
                    last_change, self._empty = now, 0
                    if self._waiters and self.state.head > head:  # a lookup waited at the tail: a step arrived
                        self._pace.arrived(self.state.head, self.reader.manifest.found_at)
                    self._applied()
                else:
                    self._empty += 1
                with anyio.move_on_after(self.follow_delay(now - max(last_change, self._wait_started))):
                    await self._poke.wait()  # a new waiter: look once now
                if self._poke.is_set():
                    self._poke, self._empty = anyio.Event(), 0
                self._check_unmounted()

    def poll_delay(self, unchanged: float) -> float:
        """Seconds until the next read of the log, `unchanged` seconds after it last moved or a
        request started waiting for a step: `poll_min` for the first `POLL_FAST_FOR` seconds (the
        next commit usually comes at the producer's cadence), then an eighth of the time beyond
        that, within `poll_interval`. A step committed within a second of the previous one (or of
        the wait) is seen `poll_min` after its commit; a stream that stays still costs one read of
        the log per `poll_max` after the first few seconds, however long it waits and whoever waits."""
        return min(self.poll_max, max(self.poll_min, (unchanged - POLL_FAST_FOR) / 8))

    def follow_delay(self, unchanged: float) -> float:
        """Seconds until the next read of the log. While no request waits for a step, `poll_delay`
        and `POLL_UNAWAITED` at the least: what comes next is then prefetched, not awaited (a mount
        following a live stream that its trainer is behind reads the log 20 times a second, not
        every `poll_min`). While one waits at the stream's known pace (`StepPace`: the last steps
        arrived while lookups waited for them), once a read found the log ends at the head (after
        it moved, or the first look for a new waiter), until the next step is due, then `poll_min`
        doubling up to an eighth of the gap (`StepPace.longest`): a trainer waiting on a live
        stream costs its mount about four reads of the log a step, not one every `poll_min`
        (docs/benchmarks.md, "The mount at the tail, reused fetchers, the slice parse").
        Otherwise `poll_delay`."""
        if not self._waiters:
            return max(self.poll_delay(unchanged), POLL_UNAWAITED)
        step = self.state.head + 1
        if not self._pace.gap(step):
            return self.poll_delay(unchanged)
        return self._pace.delay(step, max(self._empty, 1), self.clock(), unchanged, self.poll_min, self.poll_max)

    def _applied(self) -> None:
        """After the manifest moved: forget what a rewind or reclamation made stale, wake waiters, prefetch."""
        s = self.state
        if s.rewinds != self._rewinds or s.first_step != self._first_step or s.shapes != self._shapes:
            if s.rewinds != self._rewinds:
                log.warning("rewind to step %d: discarded steps forgotten", s.head)
                self.reader.consumed = min(self.reader.consumed, s.head)  # the trainer resumes from a checkpoint
            if s.shapes != self._shapes:
                log.warning("reshaped: steps from %d on are read as %d ranks", s.shapes[-1][0], s.shapes[-1][1])
                for r in range(self._widest_seen):  # rank directories no longer shown
                    if not self._shown(r):
                        self._invalidate(ROOT, b"rank-%d" % r)
                self._widest_seen = self._widest()
            self._rewinds, self._first_step, self._shapes = s.rewinds, s.first_step, list(s.shapes)
            for r in self._cursor:
                self._cursor[r] = min(self._cursor[r], s.head)
            self._invalidate_stale()
        if s.closed_after != self._closed_after:
            self._closed_after = s.closed_after
            self._expired.clear()  # a step past a close that is gone (reopened) may come again
        self._changed.set()
        self._changed = anyio.Event()
        self._prefetch()
        self.cache.drop(
            lambda r, step, v, w: (e := s.step(step)) is not None and e.version == v and s.world_at(step) == w
        )

    def _invalidate_stale(self) -> None:
        """Tell the kernel to drop the entries of step names whose TGB it knows is no longer the
        committed one (asynchronously: never from a handler's own thread)."""
        for node in list(self.inodes.nodes.values()):
            if node.kind == "step" and not node.invalidated and not self._current(node):
                node.invalidated = True
                self._invalidate(RANK_BASE + 2 * node.rank, node.name)

    @staticmethod
    def _invalidate(parent: int, name: bytes) -> None:
        try:
            pyfuse3.invalidate_entry_async(parent, name, ignore_enoent=True)
        except OSError as e:  # pragma: no cover - depends on the kernel's cache
            log.debug("invalidate entry %s in inode %d: %s", name, parent, e)

    def _check_unmounted(self) -> None:
        if self.unmounted():
            log.warning("%s was unmounted", self.mountpoint)
            self.detached = True
            self.shutdown()

    def _prefetch(self) -> None:
        if self._tg is None:
            return
        s = self.state
        for r in self.ranks:
            at = self._cursor.get(r, self._start)
            for step in range(max(at + 1, s.first_step), min(s.head, at + self.prefetch) + 1):
                entry, world = s.step(step), s.world_at(step)
                if entry is not None and r < world and (r, step, entry.version, world) not in self.cache:
                    self._tg.start_soon(self._prefetch_one, r, entry, world)

    async def _prefetch_one(self, rank: int, entry: lakestream.Step, world: int) -> None:
        try:
            await self.cache.get(rank, entry, world)
        except Exception as e:  # the read that needs it will fetch again and report
            log.warning("prefetch of rank %d step %d failed: %s", rank, entry.step, _leaf(e))

    async def _fetch(self, rank: int, entry: lakestream.Step, world: int) -> Slice:
        where = f"{self.reader.url} step {entry.step} rank {rank} object {entry.segment}"
        if self.state.world_at(entry.step) != world:  # reshaped since it was looked up
            raise pyfuse3.FUSEError(errno.ESTALE)
        started = time.perf_counter()
        raw = await self.reader.fetch_rank_raw(entry, rank)
        if self.state.world_at(entry.step) != world:  # reshaped during the fetch: planned for another shape
            raise pyfuse3.FUSEError(errno.ESTALE)
        sl = await run_sync(Slice.of, raw, where, world, nbytes=0, items=len(raw.files))  # an index, no bytes
        self.metrics.fetch(time.perf_counter() - started)
        return sl

    async def _slice(self, node: Node) -> Slice:
        """The slice of a node's TGB: for the one committed now, moving the prefetch window."""
        assert node.entry is not None
        at = self._cursor.get(node.rank)
        if (at is None or node.step > at) and self._current(node):  # a first read may be below the start
            self._cursor[node.rank] = node.step
            self._prefetch()
            # Slices far behind are read again rarely: dropped, their memory is reused for the
            # next ones instead of growing up to the cache size, touched page by page for the first
            # time (docs/benchmarks.md, "Pooled memory").
            rank, low = node.rank, node.step - KEEP_BEHIND
            self.cache.drop(lambda r, step, v, w: r != rank or step >= low)
        return await self.cache.get(node.rank, node.entry, node.world)

    async def _wait_for(self, step: int, caller: int) -> bool:
        """True once `step` is committed; False if it is not retained, `wait` ran out, or the
        mount is shutting down. EINTR once the `caller` thread has a signal pending."""
        started = self.clock()
        deadline = started + self.wait
        self._waiting[step] += 1
        waited = False
        try:
            while step > self.state.head:
                left = deadline - self.clock()
                if left <= 0 or self.closing.is_set() or self._past_end(step):
                    return False
                # Looked at once the wait is under way, not as it starts: a wait at the tail usually
                # ends at the next commit, before INTERRUPT_POLL, and then costs no read of /proc.
                if waited and signal_pending(caller):
                    log.info("step %d: caller %d got a signal while waiting for it: EINTR", step, caller)
                    raise pyfuse3.FUSEError(errno.EINTR)
                if not waited:
                    waited = True
                    self._wait_started = self.clock()
                    self._poke.set()
                changed = self._changed
                with anyio.move_on_after(min(left, INTERRUPT_POLL) if caller > 0 else left):
                    await changed.wait()
        finally:
            self._waiting[step] -= 1
            if not self._waiting[step]:
                del self._waiting[step]
            self.metrics.waited(self.clock() - started)
        return step >= self.state.first_step

    def _looked_up(self, step: int) -> None:
        """A reader asked for rank 0's `step`: it consumed the step before (the consumption mark the
        reader publishes for the mount's job, if any). Only a step up to the next one counts, so
        that a lookup far ahead (a typo, a script) cannot lift back-pressure."""
        if self.reader.publish_consumed and step <= self.state.head + 1:
            self.reader.consumed = max(self.reader.consumed, step - 1)

    def _past_end(self, step: int) -> bool:
        """Whether the stream is closed before `step`: it will never be committed."""
        closed = self.state.closed_after
        return closed is not None and step > closed

    def _end_bytes(self) -> bytes:
        """The content of `END` (ENOENT while the stream has not ended)."""
        if not self.state.ended:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return orjson.dumps({"closed_after": self.state.closed_after}) + b"\n"

    def shutdown(self) -> None:
        """Stop serving: wake every waiting lookup (ENOENT) and end the FUSE main loop."""
        if not self.closing.is_set():
            self.closing.set()
            self._changed.set()
            self._poke.set()
            pyfuse3.terminate()

    def unmounted(self) -> bool:
        """Whether our mount is gone from the mount table (a lazy `umount` detaches it while files
        are still open, and the kernel would keep the connection, and us, alive)."""
        now = time.monotonic()
        if now - self._checked_mount < 1.0 or not self.mountpoint:
            return False
        self._checked_mount = now
        return not any(m.fstype == "fuse.lakestream" for m in mounts_at(self.mountpoint))

    # -- attributes ----------------------------------------------------------------------------

    def _attr(self, inode: int, mode: int, size: int = 0, timeout: float = FOREVER) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = inode
        a.st_mode = mode
        a.st_nlink = 2 if stat.S_ISDIR(mode) else 1
        a.st_uid, a.st_gid = self.uid, self.gid
        a.st_size = size
        a.st_blksize = 1 << 20
        a.st_blocks = (size + 511) // 512
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = self.mounted_at
        a.entry_timeout = a.attr_timeout = timeout
        return a

    def _node_attr(self, node: Node) -> pyfuse3.EntryAttributes:
        if node.kind == "file":
            return self._attr(node.inode, stat.S_IFREG | 0o444, node.size)
        return self._attr(node.inode, stat.S_IFDIR | 0o555, timeout=0 if node.kind == "pending" else FOREVER)

    def _ref(self, node: Node) -> pyfuse3.EntryAttributes:
        """The attributes of a node handed to the kernel by a lookup (one more lookup to forget)."""
        node.lookups += 1
        return self._node_attr(node)

    def _status_bytes(self) -> bytes:
        s = self.state
        now = time.time()
        newest = max((p.last_ts for p in s.producers.values()), default=0.0)
        return orjson.dumps(
            {
                "url": self.reader.url,
                "job": self.reader.job if self.reader.publish_consumed else None,  # whose mark it publishes
                "head_step": s.head,
                "first_step": s.first_step,
                "version": s.version,
                "watermark": s.watermark,
                "world_size": s.world_at(s.head + 1) if s.config else None,  # in force for the next step
                "ranks": self.ranks,
                "producers": {
                    k: {"epoch": p.epoch, "seq": p.seq, "cursor": p.cursor, "last_commit": p.last_ts}
                    for k, p in sorted(s.producers.items())
                },
                "lag_seconds": round(now - newest, 3) if newest else None,
                "closed_after": s.closed_after,  # the stream ends after this step (None: not closed)
                "ended": s.ended,  # closed, and that step is committed: no step follows the head
                "cache_bytes": self.cache.nbytes,
                "inodes": len(self.inodes.nodes),
                "follow_error": self.follow_error,
                "requests": dict(sorted(self.requests.items())),
            },
            option=orjson.OPT_INDENT_2,
        )

    def _fixed(self, inode: int) -> tuple[str, int]:
        """(kind, rank) of a fixed inode: root, status, rank, latest or end; ENOENT for others."""
        if inode == ROOT:
            return "root", 0
        if inode == STATUS:
            return "status", 0
        if END_BASE <= inode < NODE_BASE and self._shown(inode - END_BASE):
            return "end", inode - END_BASE
        r, latest = divmod(inode - RANK_BASE, 2)
        if RANK_BASE <= inode < RANK_BASE + 2 * MAX_WORLD and self._shown(r):
            return ("latest" if latest else "rank"), r
        raise pyfuse3.FUSEError(errno.ENOENT)

    async def _node(self, inode: int, ctx: Any) -> Node:
        """The node of `inode`, once committed (a pending one waits for the request's caller, or
        fails with ENOENT or EINTR); ESTALE if its TGB is no longer the committed one."""
        node = self.inodes.nodes.get(inode)
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if node.kind == "pending":
            caller = ctx.pid if ctx is not None else 0
            entry = self.state.step(node.step) if await self._wait_for(node.step, caller) else None
            if entry is None:
                now = time.monotonic()
                self._expired = {k: t for k, t in self._expired.items() if t > now}
                self._expired[node.rank, node.step] = now + EXPIRED_GRACE
                raise pyfuse3.FUSEError(errno.ENOENT)
            if node.kind == "pending":  # not bound by another request meanwhile
                if not self._has(node.rank, node.step):  # reshaped meanwhile to fewer ranks
                    raise pyfuse3.FUSEError(errno.ENOENT)
                self.inodes.bind(node, entry, self.state.world_at(node.step))
        if not self._current(node):
            raise pyfuse3.FUSEError(errno.ESTALE)
        return node

    @_handler
    async def getattr(self, inode: int, ctx: Any = None) -> pyfuse3.EntryAttributes:
        return await self._attributes(inode, ctx)

    async def _attributes(self, inode: int, ctx: Any = None) -> pyfuse3.EntryAttributes:
        """What `getattr` answers (lookups and listings answer it too, as no request of their own)."""
        if inode in self.inodes.nodes:
            return self._node_attr(await self._node(inode, ctx))
        kind, _ = self._fixed(inode)
        if kind == "root":
            return self._attr(ROOT, stat.S_IFDIR | 0o555)
        if kind == "status":
            return self._attr(STATUS, stat.S_IFREG | 0o444, len(self._status_bytes()), timeout=0)
        if kind == "rank":
            return self._attr(inode, stat.S_IFDIR | 0o555)
        if kind == "end":
            return self._attr(inode, stat.S_IFREG | 0o444, len(self._end_bytes()), timeout=0)
        return self._attr(inode, stat.S_IFLNK | 0o444, 12, timeout=0)

    @_handler
    async def lookup(self, parent: int, name: bytes, ctx: Any = None) -> pyfuse3.EntryAttributes:
        if parent in self.inodes.nodes:
            node = await self._node(parent, ctx)
            if node.kind not in ("step", "batch"):
                raise pyfuse3.FUSEError(errno.ENOTDIR)
            sl = await self._slice(node)
            assert node.entry is not None
            if node.kind == "step" and name == BATCH_NAME and sl.batch:
                return self._ref(self.inodes.get("batch", node.rank, node.step, node.entry, node.world))
            index = sl.batch.get(name) if node.kind == "batch" else META if name == META_NAME else sl.names.get(name)
            if index is None:
                raise pyfuse3.FUSEError(errno.ENOENT)
            size = len(sl.meta) if index == META else sl.files[index].size
            return self._ref(self.inodes.get("file", node.rank, node.step, node.entry, node.world, index, size))
        kind, r = self._fixed(parent)
        if kind == "root":
            if name == STATUS_NAME:
                return await self._attributes(STATUS)
            rank = int(name[5:]) if name.startswith(b"rank-") and name[5:].isdigit() and len(name) < 12 else -1
            if rank >= 0 and self._shown(rank) and name == b"rank-%d" % rank:
                return await self._attributes(RANK_BASE + 2 * rank)
            raise pyfuse3.FUSEError(errno.ENOENT)
        if kind != "rank":
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        s = self.state
        if name == LATEST_NAME:
            if s.head < s.first_step:
                raise pyfuse3.FUSEError(errno.ENOENT)
            return await self._attributes(RANK_BASE + 2 * r + 1)
        if name == END_NAME:
            return await self._attributes(END_BASE + r)
        step = step_of_name(name)
        if step is None or step < s.first_step or not self._has(r, step):
            raise pyfuse3.FUSEError(errno.ENOENT)
        if r == 0:
            self._looked_up(step)
        entry = s.step(step)
        if entry is not None:
            return self._ref(self.inodes.get("step", r, step, entry, s.world_at(step)))
        if step <= s.head or self.wait <= 0 or self.closing.is_set() or self._past_end(step):
            raise pyfuse3.FUSEError(errno.ENOENT)
        if self._expired.get((r, step), 0.0) > time.monotonic():
            raise pyfuse3.FUSEError(errno.ENOENT)  # its wait just ran out: `ls` does not wait twice
        return self._ref(self.inodes.get("pending", r, step, None, 0))

    @_handler
    async def readlink(self, inode: int, ctx: Any = None) -> bytes:
        if inode in self.inodes.nodes or self._fixed(inode)[0] != "latest":
            raise pyfuse3.FUSEError(errno.EINVAL)
        return b"%012d" % self.state.head

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        self.requests["forget"] += 1
        for inode, n in inode_list:
            self.inodes.forget(inode, n)

    # -- directories ---------------------------------------------------------------------------

    def _open_handle(self, target: Node | int | bytes) -> int:
        self._next_fh += 1
        self._handles[self._next_fh] = target
        return self._next_fh

    @_handler
    async def opendir(self, inode: int, ctx: Any = None) -> int:
        if inode in self.inodes.nodes:
            node = await self._node(inode, ctx)
            if node.kind not in ("step", "batch"):
                raise pyfuse3.FUSEError(errno.ENOTDIR)
            return self._open_handle(node)
        kind, _ = self._fixed(inode)
        if kind not in ("root", "rank"):
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return self._open_handle(inode)

    def _reply(self, token: Any, name: bytes, node: Node, next_id: int) -> bool:
        if pyfuse3.readdir_reply(token, name, self._node_attr(node), next_id):
            node.lookups += 1
            return True
        if node.lookups == 0:
            self.inodes.drop(node)
        return False

    @_handler
    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        target = self._handles.get(fh)
        if isinstance(target, Node):  # a step directory or its `_batch`, as of the TGB it was opened at
            assert target.entry is not None
            sl = await self.cache.get(target.rank, target.entry, target.world)
            t = target
            if t.kind == "batch":
                names = list(sl.batch.items())
            else:
                names = [(META_NAME, META), *([(BATCH_NAME, BATCH)] if sl.batch else []), *sl.names.items()]
            for i in range(start_id, len(names)):
                name, index = names[i]
                if index == BATCH:
                    node = self.inodes.get("batch", t.rank, t.step, t.entry, t.world)
                else:
                    size = len(sl.meta) if index == META else sl.files[index].size
                    node = self.inodes.get("file", t.rank, t.step, t.entry, t.world, index, size)
                if not self._reply(token, name, node, i + 1):
                    return
            return
        if not isinstance(target, int):
            raise pyfuse3.FUSEError(errno.EBADF)
        kind, r = self._fixed(target)
        if kind == "root":
            entries = [(STATUS_NAME, STATUS)] + [(b"rank-%d" % x, RANK_BASE + 2 * x) for x in self.ranks]
            for i in range(start_id, len(entries)):
                name, ino = entries[i]
                if not pyfuse3.readdir_reply(token, name, await self._attributes(ino), i + 1):
                    return
            return
        s = self.state
        # ids: 0 = start, 1 = after `latest`, 2 = after `END`, step + 3 = after that step
        latest = await self._attributes(RANK_BASE + 2 * r + 1)
        if start_id == 0 and s.head >= s.first_step and not pyfuse3.readdir_reply(token, LATEST_NAME, latest, 1):
            return
        end = await self._attributes(END_BASE + r) if start_id <= 1 and s.ended else None
        if end is not None and not pyfuse3.readdir_reply(token, END_NAME, end, 2):
            return
        for n in range(max(s.first_step, start_id - 2 if start_id > 2 else 0), s.head + 1):
            entry, world = s.step(n), s.world_at(n)
            if entry is None or r >= world:
                continue
            if not self._reply(token, b"%012d" % n, self.inodes.get("step", r, n, entry, world), n + 3):
                return

    async def releasedir(self, fh: int) -> None:
        self.requests["releasedir"] += 1
        self._handles.pop(fh, None)

    # -- files ---------------------------------------------------------------------------------

    @_handler
    async def open(self, inode: int, flags: int, ctx: Any = None) -> pyfuse3.FileInfo:
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT):
            raise pyfuse3.FUSEError(errno.EROFS)
        if inode == STATUS:
            return pyfuse3.FileInfo(fh=self._open_handle(self._status_bytes()), direct_io=True)
        if inode not in self.inodes.nodes:
            kind, _ = self._fixed(inode)
            if kind == "end":
                return pyfuse3.FileInfo(fh=self._open_handle(self._end_bytes()), direct_io=True)
            raise pyfuse3.FUSEError(errno.EISDIR if kind in ("root", "rank") else errno.ELOOP)
        node = await self._node(inode, ctx)
        if node.kind != "file":
            raise pyfuse3.FUSEError(errno.EISDIR)
        return pyfuse3.FileInfo(fh=self._open_handle(node), keep_cache=True)

    @_handler
    async def read(self, fh: int, off: int, size: int) -> bytes:
        target = self._handles.get(fh)
        if isinstance(target, bytes):
            return target[off : off + size]
        if not isinstance(target, Node) or target.kind != "file":
            raise pyfuse3.FUSEError(errno.EBADF)
        try:
            sl = await self._slice(target)  # the TGB it was opened at, even after a rewind
        except Exception as e:
            if not isinstance(_leaf(e), lakestream.StepUnavailable):
                raise
            log.info("read: %s", _leaf(e))  # its TGB was discarded or reclaimed, and its bytes are gone
            raise pyfuse3.FUSEError(errno.ESTALE) from None
        if target.index == META:
            return sl.meta[off : off + size]
        return sl.files[target.index].read(sl.data, off, size)  # type: ignore[return-value]  # see File.read

    async def release(self, fh: int) -> None:
        self.requests["release"] += 1
        self._handles.pop(fh, None)

    async def statfs(self, ctx: Any = None) -> pyfuse3.StatvfsData:
        self.requests["statfs"] += 1
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 1 << 20
        s.f_namemax = 255
        return s

    # -- everything that would change something ------------------------------------------------

    async def _read_only(self, *args: Any) -> Any:
        raise pyfuse3.FUSEError(errno.EROFS)

    # pyfuse3 types each of these with its own signature; one handler refuses them all.
    setattr = mknod = mkdir = unlink = rmdir = symlink = rename = link = create = write = _read_only  # type: ignore[assignment]
    setxattr = removexattr = _read_only  # type: ignore[assignment]
