"""`file://` store: a directory on a local or shared POSIX filesystem.

Objects are written to a hidden temporary file in the target's directory and then renamed (put)
or hard-linked (put_if_absent) into place, so a reader sees a whole object or none, and exactly one
of any number of concurrent processes wins a put_if_absent (link(2) fails with EEXIST for the
others). With `durable=True` the file and its directory are fsynced before the call returns, so
an object a commit record points to survives a machine crash, not only a process crash.

Blocking calls run in worker threads, but for one case: on a local filesystem, a read of up to
4 MiB (`_tasks.INLINE_BYTES`) that the page cache holds whole is made on the calling thread
(`preadv2` with RWF_NOWAIT on a disk, which fails rather than wait for it; tmpfs holds everything
in memory), since a thread hop costs more CPU than such a read (`_tasks.run_sync`). A read that
would wait goes to a thread. On a network filesystem every read does: there even an `open` may
wait for a server.
"""

from __future__ import annotations

import errno
import os
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import anyio.to_thread

from .._buffers import MIN_POOLED, pool
from .._errors import AccessDenied, CorruptData, LakestreamError, ObjectNotFound, StoreError, StoreFull
from .._layout import TMP_SUFFIX
from .._tasks import INLINE_BYTES
from ._base import Data

__all__ = ["FileStore"]

# Filesystems whose `open` of a file does not wait for a network: reads from those on disk may
# still wait for it (RWF_NOWAIT says so), reads from those in memory do not (they cannot say).
DISK_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "bcachefs", "overlay"})
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})


def filesystem_of(path: Path) -> str:
    """The type of the filesystem `path` is on (its longest mount point prefix in
    /proc/self/mountinfo), or "" if that cannot be told."""
    target = os.path.realpath(path)
    best, fstype = "", ""
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    for line in lines:
        fields = line.split(" ")
        if " - " not in line or len(fields) < 5:
            continue
        point = fields[4].replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, fstype = point, line.split(" - ", 1)[1].split(" ", 1)[0]
    return fstype


class FileStore:
    def __init__(self, root: str | os.PathLike[str], *, durable: bool = True) -> None:
        self.root = Path(root).absolute()
        self._root = str(self.root)
        self.url = f"file://{self.root}"
        self.durable = durable
        self.requests = 0  # calls made (for cost accounting, as S3 counts requests)
        # preadv2 flags of reads made on the calling thread (None: not known yet; -1: none is)
        self._here: int | None = None
        self.waits = 0  # reads made on the calling thread that found the page cache lacking (`reads_tell`)

    def _file(self, key: str) -> str:
        """The file of object `key` (a str: pathlib's joins cost more than a small cached read)."""
        parts = key.split("/")
        if not key or any(p in ("", ".", "..") or p.startswith(".") for p in parts):
            raise ValueError(f"{self.url}: invalid object key {key!r}")
        return os.path.join(self._root, *parts)

    def _path(self, key: str) -> Path:
        return Path(self._file(key))

    # -- blocking helpers, run in threads -----------------------------------------------------

    def _read(self, key: str, offset: int, length: int | None, flags: int = 0, most: int | None = None) -> bytes | None:
        """`length` bytes of `key` from `offset` (None: to its end; a range past the end is cut
        short). Large ranges go to reused memory, the caller's alone: readers hand out views of it
        without a copy (_buffers.py: fresh memory costs more than the read); a whole object is
        bytes. On the calling thread (`most` set), None rather than read more than `most` bytes
        or, with RWF_NOWAIT in `flags`, wait for a disk (or where the filesystem cannot say)."""
        try:
            fd = os.open(self._file(key), os.O_RDONLY | os.O_CLOEXEC)
            try:
                size = os.fstat(fd).st_size
                pooled = length is not None and length >= MIN_POOLED
                length = max(0, size - offset if length is None else min(length, size - offset))
                if most is not None and length > most:
                    return None
                buf = pool.take(length, offset) if pooled else memoryview(bytearray(length))
                got = 0
                while got < length:
                    n = os.preadv(fd, [buf[got:]], offset + got, flags)
                    if not n:
                        break
                    got += n
            finally:
                os.close(fd)
        except BlockingIOError:  # RWF_NOWAIT: not all in the page cache
            self.waits += 1
            return None
        except FileNotFoundError:
            raise ObjectNotFound(f"{self.url}: no object {key!r}") from None
        except OSError as e:
            if flags and e.errno == errno.EOPNOTSUPP:  # this filesystem cannot say: every read goes to a thread
                self._here = -1
                return None
            raise self._error(e, "read", key) from None
        if not pooled:
            return bytes(buf[:got])
        return buf if got == length else buf[:got]  # type: ignore[return-value]  # a buffer, as the protocol allows

    @property
    def local(self) -> bool:
        """Whether the root is on a local filesystem (a disk or memory), not a network one: its
        page-cached reads are made on the calling thread and take no longer than a copy, so a
        reader has no latency to cover by fetching far ahead (`Reader.prefetch_depth`)."""
        if self._here is None:
            fs = filesystem_of(self.root)
            self._here = os.RWF_NOWAIT if fs in DISK_FILESYSTEMS else 0 if fs in MEMORY_FILESYSTEMS else -1
        return self._here >= 0

    def reads_tell(self, length: int) -> bool:
        """Whether a read of `length` bytes that the page cache lacks counts in `waits`: one made
        on the calling thread of a local disk (RWF_NOWAIT refuses it), not one made in a thread."""
        return self.local and self._here == os.RWF_NOWAIT and length <= INLINE_BYTES

    def in_page_cache(self, key: str, offset: int, length: int) -> bool:
        """Whether the page cache holds the last byte of `length` bytes of `key` from `offset` (a
        slice is written whole, and read ahead whole): a probe with RWF_NOWAIT, which never waits
        for the disk. True where there is nothing to read ahead: on a memory filesystem, where
        reads are not made here, for a missing object or an empty range (the fetch reports those)."""
        if not self.local or self._here == 0 or length <= 0:
            return True
        try:
            fd = os.open(self._file(key), os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.preadv(fd, [bytearray(1)], offset + length - 1, os.RWF_NOWAIT)
            finally:
                os.close(fd)
        except BlockingIOError:
            return False
        except (OSError, ValueError):
            pass
        return True

    def will_need(self, key: str, offset: int, length: int) -> None:
        """Have the page cache read `length` bytes of `key` from `offset` in the background
        (`posix_fadvise` WILLNEED), so that a read of them later takes no wait. Blocking (it
        starts the disk's reads: most of a millisecond a 2.35 MB slice while a disk is busy), so
        for a worker thread; best effort (a missing object is the later read's to report)."""
        try:
            fd = os.open(self._file(key), os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)
        except (OSError, ValueError):
            pass

    def read_here(self, key: str, offset: int, length: int | None) -> bytes | None:
        """`get_range` (`length` None: to the end) made on the calling thread where it takes no
        wait: a local store's range of at most INLINE_BYTES that the page cache holds whole. Else
        None: `get_range` reads it in a worker thread (and counts the request: this counts one
        only when it reads, or raises)."""
        if not self.local:
            return None
        assert self._here is not None
        try:
            data = self._read(key, offset, length, self._here, INLINE_BYTES)
        except LakestreamError:
            self.requests += 1
            raise
        self.requests += data is not None
        return data

    async def _get(self, key: str, offset: int, length: int | None) -> bytes:
        data = self.read_here(key, offset, length)
        if data is not None:
            return data
        self.requests += 1
        data = await anyio.to_thread.run_sync(self._read, key, offset, length)
        assert data is not None  # in a thread it waits
        return data

    def _error(self, e: OSError, op: str, key: str) -> LakestreamError:
        """The one translation of a filesystem error into a Lakestream error naming the object."""
        where = f"{self.url}: {op} {key!r}"
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return StoreFull(
                f"{where}: {e.strerror} on {self.root}; free space there (`lakestream gc` deletes what no "
                "retained checkpoint needs, and only deletes before it writes) and run the command again"
            )
        if isinstance(e, PermissionError) or e.errno == errno.EROFS:
            return AccessDenied(f"{where}: {e.strerror}")
        if isinstance(e, (IsADirectoryError, NotADirectoryError)):
            return CorruptData(f"{where}: a directory stands where an object should be ({e.strerror})")
        return StoreError(f"{where}: {e.strerror or e}")

    def _write_temp(self, path: Path, data: Data) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}{TMP_SUFFIX}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if self.durable:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)  # a failed write (a full disk) leaves nothing behind
            raise
        os.close(fd)
        return tmp

    def _remove_temporaries(self, older_than: float) -> tuple[int, int]:
        """Delete temporary files of puts that never finished (a killed process leaves them), if
        modified more than `older_than` seconds ago; (files, bytes) removed."""
        files = nbytes = 0
        cutoff = time.time() - older_than
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for name in filenames:
                if name.startswith(".") and name.endswith(TMP_SUFFIX):
                    path = os.path.join(dirpath, name)
                    try:
                        st = os.stat(path)
                        if st.st_mtime < cutoff:
                            os.unlink(path)
                            files, nbytes = files + 1, nbytes + st.st_size
                    except FileNotFoundError:
                        pass
        return files, nbytes

    def _sync_dir(self, path: Path) -> None:
        if self.durable:
            fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _put(self, key: str, data: Data) -> None:
        path = self._path(key)
        try:
            tmp = self._write_temp(path, data)
            os.replace(tmp, path)
            self._sync_dir(path)
        except OSError as e:
            raise self._error(e, "put", key) from None

    def _put_if_absent(self, key: str, data: Data) -> bool:
        path = self._path(key)
        try:
            if path.exists():
                return False
            tmp = self._write_temp(path, data)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
            self._sync_dir(path)
        except OSError as e:
            raise self._error(e, "put", key) from None
        return True

    def _list_sizes(self, prefix: str) -> dict[str, int]:
        sizes = {}
        for key in self._list(prefix):
            try:
                sizes[key] = os.stat(self._path(key)).st_size
            except FileNotFoundError:
                pass  # deleted since it was listed
        return sizes

    def _list(self, prefix: str) -> list[str]:
        # Walk only the directory that can hold the prefix.
        base, _, _ = prefix.rpartition("/")
        start = self.root.joinpath(*base.split("/")) if base else self.root
        out: list[str] = []
        for dirpath, dirnames, filenames in os.walk(start):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel = os.path.relpath(dirpath, self.root)
            rel = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            out.extend(rel + f for f in filenames if not f.startswith(".") and (rel + f).startswith(prefix))
        out.sort()
        return out

    def _delete(self, keys: list[str]) -> None:
        for key in keys:
            try:
                os.unlink(self._path(key))
            except FileNotFoundError:
                pass
            except OSError as e:
                raise self._error(e, "delete", key) from None

    # -- the protocol ----------------------------------------------------------------------

    async def get(self, key: str) -> bytes:
        return await self._get(key, 0, None)

    async def get_range(self, key: str, offset: int, length: int) -> bytes:
        return await self._get(key, offset, length)

    async def put(self, key: str, data: Data) -> None:
        self.requests += 1
        await anyio.to_thread.run_sync(self._put, key, data)

    async def put_if_absent(self, key: str, data: Data) -> bool:
        self.requests += 1
        return await anyio.to_thread.run_sync(self._put_if_absent, key, data)

    async def list(self, prefix: str) -> list[str]:
        self.requests += 1
        return await anyio.to_thread.run_sync(self._list, prefix)

    async def list_sizes(self, prefix: str) -> dict[str, int]:
        self.requests += 1
        return await anyio.to_thread.run_sync(self._list_sizes, prefix)

    async def delete(self, keys: Sequence[str]) -> None:
        self.requests += 1
        await anyio.to_thread.run_sync(self._delete, list(keys))

    async def remove_temporaries(self, older_than: float) -> tuple[int, int]:
        """Delete what interrupted puts left behind, older than `older_than` seconds: (files, bytes)."""
        return await anyio.to_thread.run_sync(self._remove_temporaries, older_than)

    async def aclose(self) -> None:
        pass

    async def __aenter__(self) -> FileStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
