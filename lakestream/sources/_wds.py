"""`wds:`: WebDataset tar shards, local or in S3."""

from __future__ import annotations

import bz2
import collections
import contextlib
import fnmatch
import glob
import gzip
import lzma
import os
import posixpath
import re
import tarfile
import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, BinaryIO, cast

from .._errors import ConfigMismatch, InvalidSample, LakestreamError
from .._layout import RESERVED_FIELDS
from ._base import _File, _fingerprint, _remote_file, _Sharded, _share, _stat, expand_braces, key_text, reserved_names

if TYPE_CHECKING:
    from .._remote import RemoteObject, S3Objects


def _glob_match(pattern: str, key: str) -> bool:
    """Whether `key` matches the glob `pattern` as a path: `*`, `?` and `[...]` never match a `/`."""
    parts, names = pattern.split("/"), key.split("/")
    return len(parts) == len(names) and all(fnmatch.fnmatchcase(n, p) for p, n in zip(parts, names))


def _match_s3(what: str, pattern: str) -> tuple[list[_File], S3Objects]:
    """The objects `s3://BUCKET/PATTERN` names (globs and braces in the key), sorted by key, and the bucket.

    One listing under the literal prefix all expansions share; a key without glob characters must exist."""
    from .._remote import S3Objects, split_s3

    parsed = [split_s3(p) for p in expand_braces(pattern)]
    buckets = {b for b, _ in parsed}
    bucket = parsed[0][0]
    if len(buckets) != 1 or glob.has_magic(bucket):
        raise ValueError(f"{what}: name one bucket, without patterns in its name")
    literal = [re.split(r"[*?\[]", k, maxsplit=1)[0] for _, k in parsed]
    remote = S3Objects(bucket)
    shared = os.path.commonprefix(literal)  # noqa: RUF071 - a key prefix, compared as text
    listed = {o.key: o for o in remote.list(shared)}
    chosen: dict[str, RemoteObject] = {}
    for _, k in parsed:
        if glob.has_magic(k):
            chosen.update((key, o) for key, o in listed.items() if _glob_match(k, key))
        elif k in listed:
            chosen[k] = listed[k]
        else:
            raise FileNotFoundError(f"{what}: no object s3://{bucket}/{k} ({remote.where()})")
    if not chosen:
        raise FileNotFoundError(f"{what}: no object matches ({remote.where()})")
    keys = sorted(chosen)
    root = posixpath.commonpath([posixpath.dirname(k) for k in keys])
    return [_remote_file(bucket, chosen[k], root) for k in keys], remote


class WdsSource(_Sharded):
    """`wds:PATTERN`: WebDataset tar shards on the local file system or in S3 (`s3://BUCKET/KEY-PATTERN`).

    PATTERN is a glob, a brace pattern such as `/data/train-{000..127}.tar`, or both; a pattern
    without glob characters must name an existing file (object). In S3 the keys under the literal
    prefix of the pattern are listed once and matched, `*` never matching a `/`. The files are
    sorted by path (key). Members are read in order in streaming mode (a shard is never loaded
    whole) and grouped as WebDataset does: consecutive members with the same key (the member path,
    without a leading `./`, up to the first dot of its base name) make one sample, the rest of the
    base name is the field, the bytes are as stored. The sample's key is that member key as
    `key_text` writes it (`a/0017.seg.png`: key `a%2F0017`, field `seg.png`). Directory entries and
    hidden members are skipped; a member without a field extension, a field twice in one sample, a
    key whose members are not adjacent, or a reserved field name (`__key__`, `__cost__`,
    `__source__`) raises InvalidSample. The cursor's `sample` counts samples within the shard.

    A shard is read to its real end: its end-of-archive (a zero block followed by nothing but
    zeros) or the end of its data at a member boundary. Anything else where tarfile stops (a
    damaged header, a truncated one, data after a zeroed block), a truncated or damaged compressed
    stream (`.tar.gz`, `.tar.bz2`, `.tar.xz`, told by their magic numbers; their checksums are
    checked at their end), raises InvalidSample naming the file. With `max_sample_bytes` set (the
    producer pipeline sets it to the stream's), a sample whose members add up to more is refused by
    their tar headers before they are read.
    """

    max_sample_bytes: int | None = None

    def __init__(self, pattern: str, shard: tuple[int, int] = (0, 1)) -> None:
        self.what, self.shard = f"wds:{pattern}", shard
        if pattern.startswith("s3://"):
            files, self.remote = _match_s3(self.what, pattern)
            self.share = _share(files, shard)
            self.fp = _fingerprint(self.share)
            return
        if "://" in pattern:
            raise ValueError(f"{self.what}: only local paths and s3:// URLs are read")
        paths: set[str] = set()
        for p in expand_braces(pattern):
            if glob.has_magic(p):
                paths.update(x for x in glob.glob(p) if os.path.isfile(x))
            elif os.path.isfile(p):
                paths.add(p)
            else:
                raise FileNotFoundError(f"{self.what}: {p} is not a file")
        if not paths:
            raise FileNotFoundError(f"{self.what}: no file matches")
        ordered = sorted(paths)
        root = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in ordered])
        files = [_stat(p, os.path.relpath(os.path.abspath(p), root)) for p in ordered]
        self.share = _share(files, shard)
        self.fp = _fingerprint(self.share)

    def _samples(self, f: _File, skip: int) -> Iterator[dict[str, Any]]:
        where = f"{self.what}: {f.path}"
        limit = self.max_sample_bytes
        sample: dict[str, Any] | None = None
        size = 0  # the bytes of the sample's fields, by their headers
        seen = 0
        keys: set[str] = set()
        try:
            with (
                self._open(f) as raw,
                contextlib.closing(_TarData(raw, where)) as data,
                tarfile.open(fileobj=cast(BinaryIO, data), mode="r|") as tar,
            ):
                for member in tar:
                    if not member.isfile():
                        continue
                    path = member.name
                    while path.startswith("./"):
                        path = path[2:]
                    directory, _, base = path.rpartition("/")
                    if base.startswith("."):
                        continue
                    head, dot, field = base.partition(".")
                    if not dot or not head or not field:
                        raise InvalidSample(f"{where}: member {member.name!r} has no <key>.<field> name")
                    if field in RESERVED_FIELDS:
                        raise InvalidSample(
                            f"{where}: member {member.name!r}: field {field!r} is a reserved name "
                            f"({reserved_names()} are not data fields); rename the member"
                        )
                    key = key_text(f"{directory}/{head}" if directory else head)
                    if sample is not None and sample["__key__"] != key:
                        seen += 1
                        if seen > skip:
                            yield sample
                        sample = None
                    if sample is None:
                        if key in keys:
                            raise InvalidSample(
                                f"{where}: sample {key!r} appears twice (member {member.name!r} is not next "
                                "to the other members of its key)"
                            )
                        keys.add(key)
                        sample, size = {"__key__": key}, 0
                    if field in sample:
                        raise InvalidSample(f"{where}: sample {key!r} has field {field!r} twice")
                    if seen < skip:
                        sample[field] = b""  # skipped: its bytes are not needed
                        continue
                    size += member.size
                    if limit is not None and size > limit:
                        raise InvalidSample(
                            f"{where}: sample {key!r} is at least {size} bytes with member {member.name!r}, "
                            f"over the stream's maximum of {limit} (max_sample_bytes); it is not read"
                        )
                    extracted = tar.extractfile(member)
                    assert extracted is not None  # a regular file
                    sample[field] = extracted.read()
                data.check_end(tar.offset)
        except tarfile.TarError as e:
            raise InvalidSample(f"{where}: not a readable tar file: {e}") from None
        if sample is not None:
            seen += 1
            if seen > skip:
                yield sample
        if seen < skip:
            raise ConfigMismatch(f"{where}: the committed cursor is {skip} samples into it, but it holds {seen}")


_BLOCK = 512  # a tar block
_COMPRESSED = ((b"\x1f\x8b", "gzip"), (b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"))


class _TarData:
    """A tar file's bytes for tarfile's stream mode: decompressed when the file starts with the magic
    number of gzip, bzip2 or xz (their decompressors check the stream's checksum at its end), counted,
    and the last of them kept, so that `check_end` can look at the block where tarfile stopped.
    Decompression errors, a truncated stream included, raise InvalidSample naming the file."""

    READ = 1 << 16  # at most this many bytes a read
    KEEP = 1 << 18  # at least this many of the last bytes are kept (tarfile reads 10 KiB ahead)

    def __init__(self, raw: BinaryIO, where: str) -> None:
        self.where = where
        head = b""
        while len(head) < 6 and (more := raw.read(6 - len(head))):
            head += more
        self.kind = next((kind for magic, kind in _COMPRESSED if head.startswith(magic)), None)
        plain = cast(BinaryIO, _Prefixed(head, raw))
        self.inner: Any = plain  # closed by `close` (which leaves `raw` open)
        if self.kind == "gzip":
            self.inner = gzip.GzipFile(fileobj=plain, mode="rb")
        elif self.kind == "bzip2":
            self.inner = bz2.BZ2File(plain)
        elif self.kind == "xz":
            self.inner = lzma.LZMAFile(plain)  # noqa: SIM115
        self.count = 0  # bytes read so far
        self.tail: collections.deque[tuple[int, bytes]] = collections.deque()  # (offset, bytes) of the last reads
        self.kept = 0

    def read(self, n: int = -1) -> bytes:
        n = self.READ if n < 0 else min(n, self.READ)
        try:
            data: bytes = self.inner.read(n)
        except LakestreamError:
            raise
        except (OSError, EOFError, zlib.error, lzma.LZMAError) as e:
            if self.kind is None:
                raise
            raise InvalidSample(f"{self.where}: not a readable {self.kind} stream: {e}") from None
        if data:
            self.tail.append((self.count, data))
            self.count += len(data)
            self.kept += len(data)
            while self.kept - len(self.tail[0][1]) >= self.KEEP:
                self.kept -= len(self.tail.popleft()[1])
        return data

    def close(self) -> None:
        if self.kind is not None:
            self.inner.close()

    def check_end(self, offset: int) -> None:
        """Raise InvalidSample unless the archive really ends where tarfile stopped, at `offset`: there the
        data ends, or a zero block is followed by nothing but zeros up to the end (read through, so that a
        compressed stream's checksum is checked)."""
        at = f"byte {offset}" + (f" of the decompressed {self.kind} stream" if self.kind else "")
        if self.count < offset:
            raise InvalidSample(f"{self.where}: the tar data ends before {at}: the shard is truncated")
        assert self.tail and self.tail[0][0] <= offset, "tarfile stopped before the bytes kept"
        rest = b"".join(data for _, data in self.tail)[offset - self.tail[0][0] :]
        if not rest:
            return  # no end-of-archive blocks: the data ends at a member boundary
        if len(rest) < _BLOCK:
            raise InvalidSample(f"{self.where}: the tar header at {at} is truncated: the shard is truncated")
        if rest[:_BLOCK].count(0) != _BLOCK:
            raise InvalidSample(f"{self.where}: the tar header at {at} is damaged (bad checksum or format)")
        while rest:
            if rest.count(0) != len(rest):
                raise InvalidSample(
                    f"{self.where}: data follows the end-of-archive block at {at}: a zeroed header, or a "
                    "second archive appended; the shard is damaged"
                )
            rest = self.read()


class _Prefixed:
    """`head`, then the rest of `raw`: a stream whose first bytes were already read."""

    def __init__(self, head: bytes, raw: BinaryIO) -> None:
        self.head, self.raw = head, raw

    def read(self, n: int = -1) -> bytes:
        if not self.head:
            return self.raw.read(n)
        if n < 0:
            data, self.head = self.head, b""
            return data + self.raw.read()
        data = self.head[:n]
        self.head = self.head[len(data) :]
        return data
