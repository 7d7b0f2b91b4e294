"""The FUSE filesystem: each mounted rank's committed steps as read-only directories.

    MOUNTPOINT/_status.json                        head step, version, producers, lag
    MOUNTPOINT/rank-<r>/latest -> <step:012d>      the newest committed step
    MOUNTPOINT/rank-<r>/<step:012d>/<key>.<field>  one file per sample field
    MOUNTPOINT/rank-<r>/<step:012d>/_meta.json     step, version, producer, keys, sizes

Theory of operation. A step directory and everything in it is immutable once it exists, so inode
numbers are a pure function of (rank, step, file index) and the kernel may cache entries, attributes
and pages for as long as it likes (`keep_cache`, day-long timeouts). Only `latest` and
`_status.json` change; they get zero timeouts and direct I/O. One manifest follower serves every
rank; a lookup of a step that is not committed yet waits for it (bounded by `wait`), which gives
plain-file loaders back-pressure. Reads come from a bounded cache of whole rank slices, fetched
with one range GET each; concurrent reads of one slice share the fetch.

Every handler goes through `_handler`, the one place that logs exceptions (pyfuse3 in asyncio
mode drops them otherwise) and maps them to an errno.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import orjson
import pyfuse3

import lakestream

from ._mounts import mounts_at

__all__ = ["LakeFS", "SliceCache"]

log = logging.getLogger("lakestream.mount")

ROOT = pyfuse3.ROOT_INODE
STATUS = 2
RANK_BASE = 1 << 8  # rank directory: RANK_BASE + r
LATEST_BASE = 1 << 30  # latest symlink: LATEST_BASE + r
STEP_FLAG = 1 << 62  # step directory: STEP_FLAG | r << 41 | step
FILE_FLAG = 1 << 63  # file: FILE_FLAG | r << 52 | step << 20 | index
MAX_RANK = 1 << 11
MAX_STEP = 1 << 32
META_INDEX = (1 << 20) - 1
FOREVER = 24 * 3600.0
STATUS_NAME = b"_status.json"
META_NAME = b"_meta.json"
LATEST_NAME = b"latest"

T = TypeVar("T")


def step_inode(rank: int, step: int) -> int:
    return STEP_FLAG | rank << 41 | step


def file_inode(rank: int, step: int, index: int) -> int:
    return FILE_FLAG | rank << 52 | step << 20 | index


def decode_inode(inode: int) -> tuple[str, int, int, int]:
    """(kind, rank, step, index) for any inode this filesystem hands out."""
    if inode & FILE_FLAG:
        return "file", (inode >> 52) & (MAX_RANK - 1), (inode >> 20) & (MAX_STEP - 1), inode & META_INDEX
    if inode & STEP_FLAG:
        return "step", (inode >> 41) & ((1 << 20) - 1), inode & ((1 << 41) - 1), 0
    if inode >= LATEST_BASE:
        return "latest", inode - LATEST_BASE, 0, 0
    if inode >= RANK_BASE:
        return "rank", inode - RANK_BASE, 0, 0
    return ("root" if inode == ROOT else "status" if inode == STATUS else "?"), 0, 0, 0


def _invalidate_inode(inode: int) -> None:
    try:
        pyfuse3.invalidate_inode(inode)
    except OSError:  # the kernel does not have it: nothing to forget
        pass


def _handler(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Log every exception of a handler and map it to an errno, in one place."""

    @functools.wraps(fn)
    async def wrapper(self: LakeFS, *args: Any) -> T:
        try:
            return await fn(self, *args)
        except pyfuse3.FUSEError:
            raise
        except lakestream.StepUnavailable as e:
            log.info("%s: %s", fn.__name__, e)
            raise pyfuse3.FUSEError(errno.ENOENT) from None
        except lakestream.CorruptData as e:
            log.error("%s: %s", fn.__name__, e)
            raise pyfuse3.FUSEError(errno.EIO) from None
        except lakestream.StoreError as e:
            log.error("%s: object store failed: %s", fn.__name__, e)
            raise pyfuse3.FUSEError(errno.EIO) from None
        except Exception:
            log.exception("%s%r failed", fn.__name__, args)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper


@dataclass(frozen=True, slots=True)
class Slice:
    """A fetched rank slice with what serving it needs: file names and `_meta.json`, computed once."""

    entry: lakestream.Step
    rank: int
    data: memoryview
    files: list[lakestream.FieldRef]
    names: dict[bytes, int]  # file name -> index in `files`
    meta: bytes  # the `_meta.json` content

    @classmethod
    def of(cls, raw: lakestream.RawSlice) -> Slice:
        e, files = raw.entry, raw.files
        names = {f"{f.key}.{f.field}".encode(): i for i, f in enumerate(files)}
        meta = orjson.dumps(
            {
                "step": e.step, "rank": raw.rank, "version": e.version, "producer": e.producer,
                "epoch": e.epoch, "seq": e.seq, "segment": e.segment, "samples": e.ranks[raw.rank].samples,
                "keys": list(dict.fromkeys(f.key for f in files)),
                "files": {f"{f.key}.{f.field}": f.length for f in files},
                "types": {f"{f.key}.{f.field}": f.tag for f in files},
            },
            option=orjson.OPT_INDENT_2,
        )  # fmt: skip
        return cls(e, raw.rank, memoryview(raw.data), files, names, meta)


@dataclass(slots=True)
class _Pending:
    done: anyio.Event = field(default_factory=anyio.Event)
    result: Slice | None = None
    error: BaseException | None = None


class SliceCache:
    """A bounded LRU of rank slices; concurrent gets of one slice share one fetch."""

    def __init__(self, fetch: Callable[[int, int, int], Awaitable[Slice]], capacity: int) -> None:
        self._fetch = fetch
        self.capacity = capacity
        self.nbytes = 0
        self.fetches = 0
        self._slices: OrderedDict[tuple[int, int, int], Slice] = OrderedDict()
        self._pending: dict[tuple[int, int, int], _Pending] = {}

    def __contains__(self, key: tuple[int, int, int]) -> bool:
        return key in self._slices or key in self._pending

    async def get(self, rank: int, step: int, version: int) -> Slice:
        key = (rank, step, version)  # a rewind gives a step a new TGB at a new version
        hit = self._slices.get(key)
        if hit is not None:
            self._slices.move_to_end(key)
            return hit
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = _Pending()
            try:
                self.fetches += 1
                pending.result = await self._fetch(rank, step, version)
                self._insert(key, pending.result)
            except BaseException as e:
                pending.error = e
                raise
            finally:
                del self._pending[key]
                pending.done.set()
            return pending.result
        await pending.done.wait()
        if pending.error is not None:
            raise pending.error
        assert pending.result is not None
        return pending.result

    def _insert(self, key: tuple[int, int, int], value: Slice) -> None:
        self._slices[key] = value
        self.nbytes += len(value.data)
        while self.nbytes > self.capacity and len(self._slices) > 1:
            _, old = self._slices.popitem(last=False)
            self.nbytes -= len(old.data)

    def drop(self, keep: Callable[[int, int, int], bool]) -> None:
        for key in [k for k in self._slices if not keep(*k)]:
            self.nbytes -= len(self._slices.pop(key).data)


class LakeFS(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = False

    def __init__(
        self,
        reader: lakestream.Reader,
        ranks: list[int],
        *,
        prefetch: int = 2,
        cache_size: int = 1 << 30,
        wait: float = 60.0,
        poll_interval: tuple[float, float] = (0.002, 0.25),
        mountpoint: str = "",
    ) -> None:
        super().__init__()
        self.reader = reader
        self.ranks = ranks
        self.prefetch = prefetch
        self.wait = wait
        self.poll_min, self.poll_max = poll_interval
        self.cache = SliceCache(self._fetch, cache_size)
        self.uid, self.gid = os.getuid(), os.getgid()
        self.mounted_at = time.time_ns()
        self._changed = anyio.Event()
        self._poke = anyio.Event()
        self._status: dict[int, bytes] = {}
        self._next_fh = 1
        self._cursor = {r: reader.state.head for r in ranks}  # prefetch window start per rank
        self._seen: dict[tuple[int, int], tuple[int, int]] = {}  # (rank, step) -> (version, files) served
        self._rewinds = reader.state.rewinds
        self._max_head = reader.state.head
        self.closing = anyio.Event()
        self._waiters = 0
        self.detached = False
        self.mountpoint = mountpoint
        self._checked_mount = time.monotonic()
        self._tg: anyio.abc.TaskGroup | None = None

    @property
    def state(self) -> lakestream.State:
        return self.reader.state

    # -- following the manifest and prefetching ----------------------------------------------

    async def follow(self, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """Poll the manifest (fast while someone waits for a step), wake waiters, prefetch."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            task_status.started()
            interval = self.poll_min
            self._prefetch()
            while not self.closing.is_set():
                old_head = max(self._max_head, self.state.head)
                try:
                    changed = await self.reader.manifest.refresh()  # versions applied
                except lakestream.StoreError as e:
                    log.warning("manifest poll failed (retrying): %s", e)
                    changed = None
                if changed:
                    interval = self.poll_min
                    if self.state.rewinds != self._rewinds:
                        await self._forget_discarded(old_head)
                    self._max_head = self.state.head
                    for key in [k for k in self._seen if k[1] < self.state.first_step]:
                        del self._seen[key]  # reclaimed
                    self._changed.set()
                    self._changed = anyio.Event()
                    self._prefetch()
                    self.cache.drop(lambda r, s, v: (e := self.state.step(s)) is not None and e.version == v)
                elif self._waiters:
                    interval = self.poll_min  # someone waits for a step: keep looking
                else:
                    interval = min(interval * 2, self.poll_max)
                with anyio.move_on_after(interval):
                    await self._poke.wait()
                    interval = self.poll_min
                if self._poke.is_set():
                    self._poke = anyio.Event()
                if self.unmounted():
                    log.warning("%s was unmounted", self.mountpoint)
                    self.detached = True
                    self.shutdown()

    async def _forget_discarded(self, old_head: int) -> None:
        """After a rewind, make the kernel forget every entry, attribute and page of the steps it
        discarded: their numbers (and so their inodes) will name other TGBs."""
        self._rewinds = self.state.rewinds
        lowest = min((step for _, step in self._seen), default=old_head + 1)
        for r in self.ranks:
            self._cursor[r] = min(self._cursor[r], self.state.head)
            for step in range(min(lowest, self.state.head + 1), old_head + 1):
                entry = self.state.step(step)
                seen = self._seen.get((r, step))
                if entry is not None and (seen is None or seen[0] == entry.version):
                    continue  # untouched by the rewind, or recommitted and never served
                try:
                    pyfuse3.invalidate_entry_async(RANK_BASE + r, b"%012d" % step, ignore_enoent=True)
                except OSError as e:  # pragma: no cover - depends on the kernel's cache
                    log.debug("invalidate entry rank %d step %d: %s", r, step, e)
                if seen is not None:
                    del self._seen[(r, step)]
                    inodes = [step_inode(r, step)] + [file_inode(r, step, i) for i in [*range(seen[1]), META_INDEX]]
                    for ino in inodes:
                        await anyio.to_thread.run_sync(_invalidate_inode, ino)
        log.warning("rewind to step %d: discarded steps forgotten", self.state.head)

    def _prefetch(self) -> None:
        if self._tg is None:
            return
        s = self.state
        for r in self.ranks:
            for step in range(max(self._cursor[r] + 1, s.first_step), min(s.head, self._cursor[r] + self.prefetch) + 1):
                entry = s.step(step)
                if entry is not None and (r, step, entry.version) not in self.cache:
                    self._tg.start_soon(self._prefetch_one, r, step)

    async def _prefetch_one(self, rank: int, step: int) -> None:
        try:
            await self._slice(rank, step, move=False)
        except Exception as e:  # the read that needs it will fetch again and report
            log.warning("prefetch of rank %d step %d failed: %s", rank, step, e)

    async def _fetch(self, rank: int, step: int, version: int) -> Slice:
        entry = self.state.step(step)
        if entry is None or entry.version != version:
            raise lakestream.StepUnavailable(f"{self.reader.url}: step {step} is no longer retained")
        return Slice.of(await self.reader.fetch_raw(entry, rank))

    async def _slice(self, rank: int, step: int, *, move: bool = True) -> Slice:
        entry = self.state.step(step)
        if entry is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if move and step > self._cursor[rank]:
            self._cursor[rank] = step
            self._prefetch()
        sl = await self.cache.get(rank, step, entry.version)
        self._seen[(rank, step)] = (entry.version, len(sl.files))
        return sl

    async def _wait_for(self, step: int) -> bool:
        """True once `step` is committed; False if it is not retained, `wait` ran out, or the
        mount is shutting down."""
        deadline = time.monotonic() + self.wait
        self._waiters += 1
        try:
            while step > self.state.head:
                left = deadline - time.monotonic()
                if left <= 0 or self.closing.is_set():
                    return False
                self._poke.set()
                changed = self._changed
                with anyio.move_on_after(left):
                    await changed.wait()
        finally:
            self._waiters -= 1
        return step >= self.state.first_step

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

    def _status_bytes(self) -> bytes:
        s = self.state
        now = time.time()
        newest = max((p.last_ts for p in s.producers.values()), default=0.0)
        return orjson.dumps(
            {
                "url": self.reader.url,
                "head_step": s.head,
                "first_step": s.first_step,
                "version": s.version,
                "watermark": s.watermark,
                "world_size": s.config.world_size if s.config else None,
                "ranks": self.ranks,
                "producers": {
                    k: {"epoch": p.epoch, "seq": p.seq, "cursor": p.cursor, "last_commit": p.last_ts}
                    for k, p in sorted(s.producers.items())
                },
                "lag_seconds": round(now - newest, 3) if newest else None,
                "cache_bytes": self.cache.nbytes,
            },
            option=orjson.OPT_INDENT_2,
        )

    def _file_attr(self, rank: int, step: int, sl: Slice, index: int) -> pyfuse3.EntryAttributes:
        size = len(sl.meta) if index == META_INDEX else sl.files[index].length
        return self._attr(file_inode(rank, step, index), stat.S_IFREG | 0o444, size)

    def _rank_of(self, inode: int) -> int:
        kind, r, _, _ = decode_inode(inode)
        if r not in self._cursor:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return r

    @_handler
    async def getattr(self, inode: int, ctx: Any = None) -> pyfuse3.EntryAttributes:
        kind, r, step, index = decode_inode(inode)
        if kind == "root":
            return self._attr(ROOT, stat.S_IFDIR | 0o555)
        if kind == "status":
            return self._attr(STATUS, stat.S_IFREG | 0o444, len(self._status_bytes()), timeout=0)
        self._rank_of(inode)
        if kind == "rank":
            return self._attr(inode, stat.S_IFDIR | 0o555)
        if kind == "latest":
            return self._attr(inode, stat.S_IFLNK | 0o444, 12, timeout=0)
        if self.state.step(step) is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if kind == "step":
            return self._attr(inode, stat.S_IFDIR | 0o555)
        if kind == "file":
            sl = await self._slice(r, step)
            if index != META_INDEX and index >= len(sl.files):
                raise pyfuse3.FUSEError(errno.ENOENT)
            return self._file_attr(r, step, sl, index)
        raise pyfuse3.FUSEError(errno.ENOENT)

    @_handler
    async def lookup(self, parent: int, name: bytes, ctx: Any = None) -> pyfuse3.EntryAttributes:
        kind, r, step, _ = decode_inode(parent)
        if kind == "root":
            if name == STATUS_NAME:
                return await self.getattr(STATUS)
            if name.startswith(b"rank-") and name[5:].isdigit() and int(name[5:]) in self._cursor:
                if name == b"rank-%d" % int(name[5:]):
                    return await self.getattr(RANK_BASE + int(name[5:]))
            raise pyfuse3.FUSEError(errno.ENOENT)
        if kind == "rank":
            self._rank_of(parent)
            if name == LATEST_NAME:
                if self.state.head < self.state.first_step:
                    raise pyfuse3.FUSEError(errno.ENOENT)
                return await self.getattr(LATEST_BASE + r)
            if len(name) != 12 or not name.isdigit():
                raise pyfuse3.FUSEError(errno.ENOENT)
            want = int(name)
            if want >= MAX_STEP or not await self._wait_for(want):
                raise pyfuse3.FUSEError(errno.ENOENT)
            entry = self.state.step(want)
            assert entry is not None
            self._seen.setdefault((r, want), (entry.version, 0))
            return self._attr(step_inode(r, want), stat.S_IFDIR | 0o555)
        if kind == "step":
            if self.state.step(step) is None:
                raise pyfuse3.FUSEError(errno.ENOENT)
            sl = await self._slice(r, step)
            if name == META_NAME:
                return self._file_attr(r, step, sl, META_INDEX)
            index = sl.names.get(name)
            if index is not None:
                return self._file_attr(r, step, sl, index)
        raise pyfuse3.FUSEError(errno.ENOENT)

    @_handler
    async def readlink(self, inode: int, ctx: Any = None) -> bytes:
        self._rank_of(inode)
        return b"%012d" % self.state.head

    # -- directories ---------------------------------------------------------------------------

    @_handler
    async def opendir(self, inode: int, ctx: Any = None) -> int:
        await self.getattr(inode)
        return inode

    @_handler
    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        kind, r, step, _ = decode_inode(fh)
        if kind == "root":
            entries = [(STATUS_NAME, STATUS)] + [(b"rank-%d" % x, RANK_BASE + x) for x in self.ranks]
            for i in range(start_id, len(entries)):
                name, ino = entries[i]
                if not pyfuse3.readdir_reply(token, name, await self.getattr(ino), i + 1):
                    return
        elif kind == "rank":
            s = self.state
            # ids: 0 = start, 1 = after `latest`, step + 2 = after that step
            if start_id == 0 and s.head >= s.first_step:
                if not pyfuse3.readdir_reply(token, LATEST_NAME, await self.getattr(LATEST_BASE + r), 1):
                    return
            for n in range(max(s.first_step, start_id - 1 if start_id > 1 else 0), s.head + 1):
                attr = self._attr(step_inode(r, n), stat.S_IFDIR | 0o555)
                if not pyfuse3.readdir_reply(token, b"%012d" % n, attr, n + 2):
                    return
        elif kind == "step":
            sl = await self._slice(r, step)
            names = [(META_NAME, META_INDEX), *sl.names.items()]
            for i in range(start_id, len(names)):
                name, index = names[i]
                if not pyfuse3.readdir_reply(token, name, self._file_attr(r, step, sl, index), i + 1):
                    return

    async def releasedir(self, fh: int) -> None:
        pass

    # -- files ---------------------------------------------------------------------------------

    @_handler
    async def open(self, inode: int, flags: int, ctx: Any = None) -> pyfuse3.FileInfo:
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT):
            raise pyfuse3.FUSEError(errno.EROFS)
        kind, r, step, index = decode_inode(inode)
        if kind == "status":
            fh = self._next_fh = self._next_fh + 1
            self._status[fh] = self._status_bytes()
            return pyfuse3.FileInfo(fh=fh, direct_io=True)
        if kind != "file":
            raise pyfuse3.FUSEError(errno.EISDIR if kind in ("root", "rank", "step") else errno.ENOENT)
        await self.getattr(inode)
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    @_handler
    async def read(self, fh: int, off: int, size: int) -> bytes:
        status = self._status.get(fh)
        if status is not None:
            return status[off : off + size]
        _, r, step, index = decode_inode(fh)
        sl = await self._slice(r, step)
        if index == META_INDEX:
            return sl.meta[off : off + size]
        f = sl.files[index]
        start = f.offset + min(off, f.length)
        end = f.offset + min(off + size, f.length)
        return sl.data[start:end]  # a memoryview: no copy before pyfuse3's own

    async def release(self, fh: int) -> None:
        self._status.pop(fh, None)

    async def statfs(self, ctx: Any = None) -> pyfuse3.StatvfsData:
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 1 << 20
        s.f_namemax = 255
        return s

    # -- everything that would change something ------------------------------------------------

    async def _read_only(self, *args: Any) -> Any:
        raise pyfuse3.FUSEError(errno.EROFS)

    setattr = mknod = mkdir = unlink = rmdir = symlink = rename = link = create = write = _read_only
    setxattr = removexattr = _read_only
