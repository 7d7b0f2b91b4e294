"""Sources with exact, resumable cursors: WebDataset tar shards, Parquet files, Hugging Face datasets, a
directory of files.

    src = open_source("wds:s3://bucket/train-{000..127}.tar", shard=(0, 4))
    for sample, cursor in src.iterate(producer.cursor):
        await producer.put(sample, cursor=cursor)

`open_source(spec)` takes `wds:PATTERN`, `parquet:PATH`, `hf:PATH` or `dir:PATH` (the CLI's
`--from-dir`); `wds:` and `parquet:` also read `s3://BUCKET/...` (see `_remote`). A sample is a dict
with `__key__` and its fields; the cursor after it is JSON and pins the position exactly, so a
producer started again with the committed cursor continues with the next sample. docs/sources.md
describes every kind and the cursor formats exactly.

Sharded sources (`wds:`, `parquet:`, `hf:`) list their files sorted by path; `shard=(i, n)` takes
files i, i+n, i+2n, ... of that list (this producer's *share*; for `hf:` the units are row ranges,
see HfSource). Their cursor is
`{"shard": NAME, "index": I, "sample": S, "files": F, "fp": H, "share": [i, n]}`: S samples of file
NAME (the I-th file of the share) were consumed, the share had F files, H is the SHA-256 over the
share's names, sizes and modification times (S3: ETags), and the share was `shard=(i, n)`. Resuming
with a cursor of another share, or whose fingerprint does not match the share as it is now, raises
ConfigMismatch naming the change (another --shard, files added or removed, a file rewritten), never
duplicating or skipping samples silently.

Epochs and shuffling (`epochs=E`, `shuffle_seed=S`, sharded sources only): the share is read E
times. Epoch e (0-based) visits the share's files in the order `random.Random(f"{S}:{e}")`
shuffles them to (sorted order when S is None), and, with a seed, the samples of each file are
shuffled within consecutive windows of `SHUFFLE_WINDOW` samples (window w of file NAME by
`random.Random(f"{S}:{e}:{NAME}:{w}")`): a tar shard is streamed, so only one window is ever held in
memory, and the shuffle is a window shuffle, not a shuffle of the whole file. With E > 1 the keys of
epoch e > 0 get the suffix `-e<e>` (`k` becomes `k-e1`), so keys stay unique in the stream. The
cursor then also holds `"epoch": e` (absent: 0) and, with a seed, `"seed": S`; its `index` is the
position in epoch e's file order and `sample` the samples consumed in that file (in shuffled
order). Resuming replays the window the cursor falls in, so a resumed producer emits exactly the
sequence an uninterrupted one would; a cursor committed with another seed is refused.
"""

from __future__ import annotations

import bz2
import collections
import contextlib
import fnmatch
import glob
import gzip
import hashlib
import json
import lzma
import math
import os
import posixpath
import random
import re
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, cast

from ._errors import ConfigMismatch, InvalidSample, LakestreamError
from ._layout import RESERVED_FIELDS
from ._sources import describe_cursor, dir_source, reserved_names

if TYPE_CHECKING:  # botocore is imported only for a source in S3: it takes a second to import
    from ._remote import RemoteObject, S3Objects

__all__ = [
    "HF_BLOCK_ROWS",
    "SHUFFLE_WINDOW",
    "DirSource",
    "HfSource",
    "ParquetSource",
    "Source",
    "WdsSource",
    "describe",
    "expand_braces",
    "key_text",
    "open_source",
    "parse_shard",
]


class Source(Protocol):
    def iterate(self, cursor: Any = None) -> Iterator[tuple[dict[str, Any], Any]]:
        """(sample, cursor after it) from just after `cursor` (None: from the start)."""
        ...


def parse_shard(text: str) -> tuple[int, int]:
    """`"I/N"` as (I, N) with 0 <= I < N; ValueError otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m or not int(m.group(1)) < int(m.group(2)):
        raise ValueError(f"--shard {text!r}: expected I/N with 0 <= I < N, such as 0/4")
    return int(m.group(1)), int(m.group(2))


SHUFFLE_WINDOW = 256
"""Samples shuffled together within a file when a shuffle seed is given (see the module docs)."""


def open_source(
    spec: str,
    *,
    shard: tuple[int, int] = (0, 1),
    key_column: str | None = None,
    epochs: int = 1,
    shuffle_seed: int | None = None,
    split: str | None = None,
) -> Source:
    """The source `spec` names: `wds:PATTERN`, `parquet:PATH`, `hf:PATH` or `dir:PATH`.

    `shard=(i, n)`: this producer's share of a sharded source's files (hf: its rows). `key_column`:
    the column holding the sample key (parquet:, hf:). `split`: the split of an hf: DatasetDict. `epochs`, `shuffle_seed`: read the share `epochs` times, each
    epoch in its own deterministic shuffled order (see the module docs). Raises ValueError for an
    unknown kind or an option that does not apply, FileNotFoundError when no file matches.
    """
    kind, colon, where = spec.partition(":")
    if not colon or not where:
        raise ValueError(f"--source {spec!r}: expected wds:PATTERN, parquet:PATH, hf:PATH or dir:PATH")
    i, n = shard
    if not 0 <= i < n:
        raise ValueError(f"shard {i}/{n}: expected 0 <= I < N")
    if split is not None and kind != "hf":
        raise ValueError("--split applies to hf: sources")
    if key_column is not None and kind not in ("parquet", "hf"):
        raise ValueError("--key-column applies to parquet: and hf: sources")
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs {epochs!r}: expected an integer >= 1")
    if kind == "dir":
        if shard != (0, 1):
            raise ValueError("--shard applies to wds:, parquet: and hf: sources")
        if epochs != 1 or shuffle_seed is not None:
            raise ValueError("--epochs and --shuffle-seed apply to wds:, parquet: and hf: sources")
        return DirSource(where)
    src: _Sharded
    if kind == "wds":
        src = WdsSource(where, shard)
    elif kind == "parquet":
        src = ParquetSource(where, shard, key_column)
    elif kind == "hf":
        src = HfSource(where, shard, key_column, split)
    else:
        raise ValueError(f"--source {spec!r}: unknown kind {kind!r} (wds, parquet, hf or dir)")
    src.epochs, src.seed = epochs, shuffle_seed
    return src


def describe(cursor: Any) -> str:
    """A cursor for people: the file and sample of a sharded source's cursor, else as `describe_cursor`."""
    if isinstance(cursor, dict) and "shard" in cursor and "sample" in cursor:
        where = f"{cursor['sample']} samples into {cursor['shard']!r} (file {cursor.get('index', 0) + 1} of the share"
        return where + (f", data epoch {cursor['epoch'] + 1})" if cursor.get("epoch") else ")")
    return describe_cursor(cursor)


@dataclass(frozen=True, slots=True)
class DirSource:
    """`dir:PATH`: the files directly in PATH, as `--from-dir` reads them (see `dir_source`)."""

    path: str
    decode: bool = False
    follow_symlinks: bool = False

    def iterate(self, cursor: Any = None) -> Iterator[tuple[dict[str, Any], Any]]:
        return dir_source(self.path, cursor, decode=self.decode, follow_symlinks=self.follow_symlinks)


# -- file lists, shares and fingerprints ------------------------------------------------------------


def expand_braces(pattern: str) -> list[str]:
    """WebDataset's brace patterns: `a-{000..127}.tar` (numeric ranges keep the zero padding of
    their first bound) and `{train,val}` alternatives, expanded left to right."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    head, body, tail = pattern[: m.start()], m.group(1), pattern[m.end() :]
    r = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if r:
        lo, hi = int(r.group(1)), int(r.group(2))
        width = len(r.group(1))
        options = [f"{k:0{width}d}" for k in range(lo, hi + 1)]
    elif "," in body:
        options = body.split(",")
    else:
        options = ["{" + body + "}"]
        return [head + options[0] + rest for rest in expand_braces(tail)]
    return [head + o + rest for o in options for rest in expand_braces(tail)]


@dataclass(frozen=True, slots=True)
class _File:
    path: str  # a local path, or s3://BUCKET/KEY
    name: str  # what the cursor names: the path relative to the source's root
    size: int
    mtime_ns: int
    etag: str | None = None  # an S3 object's ETag: what tells its versions apart (not its modification time)


def _is_shard(value: Any) -> bool:
    """Whether `value` (read from a cursor) is a share `[i, n]`: integers, 0 <= i < n."""
    return (
        isinstance(value, list) and len(value) == 2 and all(type(x) is int for x in value) and 0 <= value[0] < value[1]
    )


def _share(files: list[_File], shard: tuple[int, int]) -> list[_File]:
    i, n = shard
    return files[i::n]


def _fingerprint(share: list[_File]) -> str:
    h = hashlib.sha256()
    for f in share:
        version = f.mtime_ns if f.etag is None else f.etag
        h.update(f"{f.name}\0{f.size}\0{version}\0".encode())
    return h.hexdigest()


def _stat(path: str, name: str) -> _File:
    st = os.stat(path)
    return _File(path, name, st.st_size, st.st_mtime_ns)


def _remote_file(bucket: str, o: RemoteObject, root: str) -> _File:
    """An S3 object as a file of the share, named by its key relative to `root` (a key prefix without its `/`)."""
    name = o.key[len(root) + 1 :] if root else o.key
    return _File(f"s3://{bucket}/{o.key}", name, o.size, o.mtime_ns, o.etag)


def _glob_match(pattern: str, key: str) -> bool:
    """Whether `key` matches the glob `pattern` as a path: `*`, `?` and `[...]` never match a `/`."""
    parts, names = pattern.split("/"), key.split("/")
    return len(parts) == len(names) and all(fnmatch.fnmatchcase(n, p) for p, n in zip(parts, names))


def _match_s3(what: str, pattern: str) -> tuple[list[_File], S3Objects]:
    """The objects `s3://BUCKET/PATTERN` names (globs and braces in the key), sorted by key, and the bucket.

    One listing under the literal prefix all expansions share; a key without glob characters must exist."""
    from ._remote import S3Objects, split_s3

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


def _list_s3_parquet(what: str, url: str) -> tuple[list[_File], S3Objects]:
    """The object `url` names, else the `.parquet` objects under it as a directory, sorted by key."""
    from ._remote import S3Objects, split_s3

    bucket, key = split_s3(url)
    remote = S3Objects(bucket)
    if key and not key.endswith("/") and (o := remote.head(key)) is not None:
        return [_remote_file(bucket, o, posixpath.dirname(key))], remote
    root = key.rstrip("/")
    found = [
        o
        for o in remote.list(root + "/" if root else "")
        if o.key.endswith(".parquet") and not posixpath.basename(o.key).startswith(".")
    ]
    if not found:
        raise FileNotFoundError(f"{what}: no .parquet objects under s3://{bucket}/{root} ({remote.where()})")
    return [_remote_file(bucket, o, root) for o in found], remote


class _Sharded:
    """What the sharded sources share: the share, its fingerprint, epochs, shuffling, and resuming."""

    what: str
    shard: tuple[int, int] = (0, 1)  # this producer's share: (i, n) of --shard i/n
    share: list[_File]
    fp: str
    epochs: int = 1
    seed: int | None = None
    remote: S3Objects | None = None  # the bucket, for a source in S3

    def _order(self, epoch: int) -> list[int]:
        """Epoch `epoch`'s order of the share: positions into `share`."""
        order = list(range(len(self.share)))
        if self.seed is not None:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def _start(self, cursor: Any) -> tuple[int, int, int]:
        """(epoch, position in its order, samples to skip in that file) after `cursor`; ConfigMismatch
        if it does not fit."""
        if cursor is None:
            return 0, 0, 0
        keys = ("shard", "index", "sample", "fp")
        if not (isinstance(cursor, dict) and all(k in cursor for k in keys)):
            raise ConfigMismatch(f"{self.what}: the committed cursor {cursor!r} is not a cursor of this kind of source")
        epoch, index, name = int(cursor.get("epoch", 0)), int(cursor["index"]), str(cursor["shard"])
        if cursor.get("seed") != self.seed:
            raise ConfigMismatch(
                f"{self.what}: the committed cursor was produced with shuffle seed {cursor.get('seed')!r}, "
                f"not {self.seed!r}; resuming with another order would duplicate or lose samples"
            )
        share = cursor.get("share", list(self.shard))  # absent in cursors of earlier versions
        if share != list(self.shard):
            i, n = self.shard
            was = f"--shard {share[0]}/{share[1]}" if _is_shard(share) else f"share {share!r:.40}"
            raise ConfigMismatch(
                f"{self.what}: the committed cursor was produced with {was}, not --shard {i}/{n}; another share "
                "of the source would duplicate or lose samples"
            )
        names = [f.name for f in self.share]
        if cursor["fp"] == self.fp:
            if not 0 <= index < len(names) or names[self._order(epoch)[index]] != name:
                raise ConfigMismatch(f"{self.what}: the committed cursor {cursor!r} does not fit this share's order")
            return epoch, index, int(cursor["sample"])
        raise ConfigMismatch(
            f"{self.what}: this producer's share ({len(names)} files) changed under the committed cursor "
            f"({cursor['sample']} samples into {name!r}): {self._changed(cursor, names)}. Resuming would "
            "duplicate or lose samples; restore the files, or produce the changed source under a new --producer-id"
        )

    def _changed(self, cursor: dict[str, Any], names: list[str]) -> str:
        """What changed, for a cursor whose fingerprint no longer matches the share."""
        files, name, index = cursor.get("files"), str(cursor["shard"]), int(cursor["index"])
        if isinstance(files, int) and files < len(names):
            return f"{len(names) - files} file(s) were added"
        if isinstance(files, int) and files > len(names):
            return f"{files - len(names)} file(s) were removed"
        if name not in names:
            return f"{name!r} (the file being read) is no longer in this producer's share (removed or renamed)"
        if index >= len(names) or names[self._order(int(cursor.get("epoch", 0)))[index]] != name:
            return "files were renamed"
        if self.remote is not None:
            return "a file was rewritten (its size or ETag changed)"
        return "a file was rewritten (its size or modification time changed)"

    def _open(self, f: _File, *, ranged: bool = False) -> BinaryIO:
        """`f` as a binary file: a local file, or an S3 object at the ETag it was listed with (`ranged`:
        each read after a seek one ranged GET, for random access; else one streamed GET body)."""
        if self.remote is None:
            return open(f.path, "rb")
        from ._remote import RemoteObject, split_s3

        bucket, key = split_s3(f.path)
        assert bucket == self.remote.bucket and f.etag is not None
        return cast(BinaryIO, self.remote.open(RemoteObject(key, f.size, f.etag, f.mtime_ns), ranged=ranged))

    def _cursor(self, epoch: int, index: int, name: str, sample: int) -> dict[str, Any]:
        cursor: dict[str, Any] = {
            "epoch": epoch,
            "shard": name,
            "index": index,
            "sample": sample,
            "files": len(self.share),
            "fp": self.fp,
            "share": list(self.shard),
        }
        if self.seed is not None:
            cursor["seed"] = self.seed
        return cursor

    def _samples(self, f: _File, skip: int) -> Iterator[dict[str, Any]]:
        raise NotImplementedError

    def _shuffled(self, f: _File, epoch: int, skip: int) -> Iterator[dict[str, Any]]:
        """The samples of `f` after the first `skip`, in epoch `epoch`'s order: as stored without a
        seed, else shuffled within windows of SHUFFLE_WINDOW (the window `skip` falls in is read again)."""
        if self.seed is None:
            yield from self._samples(f, skip)
            return
        w = skip // SHUFFLE_WINDOW
        drop = skip - w * SHUFFLE_WINDOW
        window: list[dict[str, Any]] = []

        def flush() -> list[dict[str, Any]]:
            random.Random(f"{self.seed}:{epoch}:{f.name}:{w}").shuffle(window)
            return window[drop:]

        for sample in self._samples(f, w * SHUFFLE_WINDOW):
            window.append(sample)
            if len(window) == SHUFFLE_WINDOW:
                yield from flush()
                window, w, drop = [], w + 1, 0
        if len(window) < drop:
            raise ConfigMismatch(
                f"{self.what}: {f.path}: the committed cursor is {skip} samples into it, "
                f"but it holds {w * SHUFFLE_WINDOW + len(window)}"
            )
        yield from flush()

    def iterate(self, cursor: Any = None) -> Iterator[tuple[dict[str, Any], Any]]:
        epoch, index, skip = self._start(cursor)
        for e in range(epoch, self.epochs):
            order = self._order(e)
            for pos in range(index if e == epoch else 0, len(order)):
                f = self.share[order[pos]]
                n = skip if (e, pos) == (epoch, index) else 0
                for sample in self._shuffled(f, e, n):
                    n += 1
                    if e > 0:
                        sample["__key__"] = f"{sample['__key__']}-e{e}"
                    yield sample, self._cursor(e, pos, f.name, n)


# -- WebDataset tar shards --------------------------------------------------------------------------


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


def key_text(text: str) -> str:
    """`text` (a path) as part of a sample key: `%` written `%25`, `/` `%2F` and `.` `%2E`, which keys
    cannot hold. Different texts give different keys; `urllib.parse.unquote` gives the text back."""
    return text.replace("%", "%25").replace("/", "%2F").replace(".", "%2E")


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


# -- Parquet ---------------------------------------------------------------------------------------


def _pyarrow_parquet() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError("parquet: sources need pyarrow: pip install 'lakestream[sources]'") from None
    return pq


def _storable(value: Any) -> bool:
    """A value the stream stores exactly: bytes, text, finite numbers, booleans, None, and lists or
    string-keyed dicts of those."""
    if value is None or isinstance(value, (bytes, str, bool, int)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_storable(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _storable(v) for k, v in value.items())
    return False


class ParquetSource(_Sharded):
    """`parquet:PATH`: a Parquet file, or the `.parquet` files under a directory (sorted by path); in
    S3, `parquet:s3://BUCKET/KEY` names an object, or else the `.parquet` objects under `KEY/`.

    One row is one sample. With `key_column` that column's value (text or an integer) is the key
    and is not stored as a field; without it the key is `<name>-<row index:09d>`, `<name>` the
    file's name (its path relative to the source's root, as the cursor names it) without its
    `.parquet` suffix, as `key_text` writes it (`y=1/part-0.parquet` row 3: `y=1%2Fpart-0-000000003`),
    so that no two rows of the source share a key. A column named `__key__`, `__cost__` or
    `__source__` (other than `key_column`) raises InvalidSample. Every other column is a field, as the Python value pyarrow gives (bytes, str, int, float, bool, None,
    lists and structs of those); other values (timestamps, decimals, NaN) raise InvalidSample
    naming the file, row and column. Row groups are read one at a time (from S3: ranged GETs of
    that group's column chunks), so memory holds one row group. The cursor's `sample` counts rows
    within the file; resuming skips whole row groups before it.
    """

    def __init__(self, path: str, shard: tuple[int, int] = (0, 1), key_column: str | None = None) -> None:
        self.what, self.shard = f"parquet:{path}", shard
        self.key_column = key_column
        root = Path(path)
        if path.startswith("s3://"):
            files, self.remote = _list_s3_parquet(self.what, path)
        elif "://" in path:
            raise ValueError(f"{self.what}: only local paths and s3:// URLs are read")
        elif root.is_file():
            files = [_stat(str(root), root.name)]
        elif root.is_dir():
            found = sorted(p for p in root.rglob("*.parquet") if p.is_file() and not p.name.startswith("."))
            files = [_stat(str(p), p.relative_to(root).as_posix()) for p in found]
        else:
            raise FileNotFoundError(f"{self.what}: no such file or directory")
        if not files:
            raise FileNotFoundError(f"{self.what}: no .parquet files")
        _pyarrow_parquet()
        self.share = _share(files, shard)
        self.fp = _fingerprint(self.share)

    def _samples(self, f: _File, skip: int) -> Iterator[dict[str, Any]]:
        pq = _pyarrow_parquet()
        where = f"{self.what}: {f.path}"
        source: Any = f.path if self.remote is None else self._open(f, ranged=True)
        with contextlib.closing(source) if self.remote else contextlib.nullcontext(), pq.ParquetFile(source) as pf:
            columns = pf.schema_arrow.names
            if self.key_column is not None and self.key_column not in columns:
                raise ValueError(f"{where}: no column {self.key_column!r} (--key-column); columns: {columns}")
            _check_columns(columns, self.key_column, where)
            meta = pf.metadata
            if skip > meta.num_rows:
                raise ConfigMismatch(
                    f"{where}: the committed cursor is {skip} rows into it, but it holds {meta.num_rows}"
                )
            groups: list[int] = []
            row = 0
            for g in range(meta.num_row_groups):
                n = meta.row_group(g).num_rows
                if row + n > skip or groups:
                    groups.append(g)
                else:
                    row += n
            if not groups:
                return
            prefix = key_text(f.name.removesuffix(".parquet"))
            for g in groups:  # a row group at a time: what is read (in S3: fetched) and held is one row group
                for batch in pf.read_row_group(g).to_batches(max_chunksize=256):
                    for values in batch.to_pylist():
                        if row < skip:
                            row += 1
                            continue
                        yield _row_sample(values, f"{prefix}-{row:09d}", self.key_column, f"{where} row {row}")
                        row += 1


def _check_columns(columns: list[str], key_column: str | None, where: str) -> None:
    """InvalidSample naming the columns with a reserved name (`RESERVED_FIELDS`), but `key_column`."""
    reserved = [c for c in columns if c in RESERVED_FIELDS and c != key_column]
    if reserved:
        raise InvalidSample(
            f"{where}: column(s) {reserved} have reserved names ({reserved_names()} are not data fields); "
            "rename them, or name one with --key-column to make it the key"
        )


def _row_sample(values: dict[str, Any], key: str, key_column: str | None, where: str) -> dict[str, Any]:
    """A table row as a sample: keyed `key`, or by the value of `key_column` (text or an integer, not
    stored as a field); every other column a field, refused with InvalidSample unless `_storable`."""
    if key_column is not None:
        value = values.pop(key_column)
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise InvalidSample(f"{where}: key column {key_column!r} holds {value!r}, not text")
        key = str(value)
    sample: dict[str, Any] = {"__key__": key}
    for column, value in values.items():
        if not _storable(value):
            raise InvalidSample(f"{where} column {column!r}: cannot store {type(value).__name__} {value!r:.60}")
        sample[column] = value
    return sample


# -- Hugging Face datasets (save_to_disk) ------------------------------------------------------------

HF_BLOCK_ROWS = 4096
"""Rows in one unit of an `hf:` share: what the cursor's `shard` names and an epoch's order shuffles."""


class _NotEmbedded(Exception):
    """A media value holding only a path: its bytes are not in the dataset."""


def _media(t: Any) -> Any:
    """A function turning values of Arrow type `t` that hold datasets' media (Image, Audio, Video:
    a struct of exactly `bytes` and `path`) into the bytes, anywhere in lists and structs; None if
    `t` holds none."""
    import pyarrow as pa

    if pa.types.is_struct(t):
        names = [t.field(i).name for i in range(t.num_fields)]
        if sorted(names) == ["bytes", "path"] and (
            pa.types.is_binary(t.field("bytes").type) or pa.types.is_large_binary(t.field("bytes").type)
        ):
            return _media_bytes
        inner = {t.field(i).name: f for i in range(t.num_fields) if (f := _media(t.field(i).type)) is not None}
        if not inner:
            return None
        return lambda v: v if v is None else {k: inner[k](x) if k in inner else x for k, x in v.items()}
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        item = _media(t.value_type)
        return None if item is None else (lambda v: v if v is None else [item(x) for x in v])
    return None


def _media_bytes(v: Any) -> Any:
    if v is None:
        return None
    if v.get("bytes") is None:
        raise _NotEmbedded(v.get("path"))
    return v["bytes"]


class HfSource(_Sharded):
    """`hf:PATH`: a Hugging Face dataset saved with `save_to_disk`, read with pyarrow, memory-mapped.

    PATH holds a Dataset (`state.json` and its `data-XXXXX-of-NNNNN.arrow` files) or a DatasetDict
    (`dataset_dict.json` and one such directory per split): `split` picks the split, and may be left
    out when there is only one. The rows of the split (its arrow files in the order `state.json`
    lists them) are numbered from 0; `shard=(i, n)` takes the contiguous rows `[i*R//n, (i+1)*R//n)`
    of R, cut into units of at most HF_BLOCK_ROWS rows that do not cross a file, named
    `<file>[<start>:<stop>]` (rows of that file). Units play the part files play for wds: and
    parquet: (the cursor's `shard`, an epoch's shuffled order); the cursor also holds `"rows": R`.

    One row is one sample, as for parquet: (`key_column`, else the key `<split>-<row index:09d>`, the
    split `train` for a Dataset saved without one, dots in it as `-`); a media value (datasets'
    Image, Audio, Video: `{"bytes", "path"}`) becomes its bytes, and one saved without its bytes
    raises InvalidSample. The fingerprint covers every arrow file of the split (name, size,
    modification time) and the share's units.
    """

    def __init__(
        self, path: str, shard: tuple[int, int] = (0, 1), key_column: str | None = None, split: str | None = None
    ) -> None:
        self.what, self.shard = f"hf:{path}", shard
        self.key_column = key_column
        if "://" in path:
            raise ValueError(f"{self.what}: only local paths are read")
        _pyarrow_parquet()
        import pyarrow as pa

        root = Path(path)
        if (root / "dataset_dict.json").is_file():
            splits = self._json(root / "dataset_dict.json").get("splits")
            if not isinstance(splits, list) or not splits:
                raise ValueError(f"{self.what}: dataset_dict.json lists no splits")
            if not all(isinstance(x, str) and re.fullmatch(r"\w+(\.\w+)*", x) for x in splits):
                raise ValueError(f"{self.what}: dataset_dict.json lists unusable split names {splits!r:.200}")
            if split is None and len(splits) > 1:
                raise ValueError(f"{self.what}: a DatasetDict with splits {splits}: choose one with --split")
            split = split if split is not None else splits[0]
            if split not in splits:
                raise ValueError(f"{self.what}: no split {split!r}; the splits are {splits}")
            where = root / split
        elif (root / "state.json").is_file():
            where = root
        else:
            raise FileNotFoundError(
                f"{self.what}: no dataset saved with save_to_disk (no dataset_dict.json or state.json)"
            )
        state = self._json(where / "state.json")
        own = state.get("_split")
        if split is not None and where == root and split != own:
            raise ValueError(
                f"{self.what}: a Dataset (split {own!r}), not a DatasetDict: --split {split!r} does not apply"
            )
        self.split = str(split or own or "train")
        entries = state.get("_data_files")
        if not isinstance(entries, list) or not entries:
            raise ValueError(f"{self.what}: {where / 'state.json'} lists no data files")
        files: list[_File] = []
        seen: set[str] = set()
        for e in entries:
            name = e.get("filename") if isinstance(e, dict) else None
            if not isinstance(name, str) or not name or "/" in name or name.startswith(".") or name in seen:
                raise ValueError(f"{self.what}: {where / 'state.json'} lists an unusable data file {e!r:.80}")
            if not (where / name).is_file():
                raise FileNotFoundError(f"{self.what}: {where / name} (listed in state.json) is missing")
            seen.add(name)
            files.append(_stat(str(where / name), name))
        self._pa = pa
        self._arrow: _ArrowFile | None = None  # the file last read, where it is
        counts = [sum(b.num_rows for _, b in _ArrowFile(pa, f.path, self.what).batches(0)) for f in files]
        self.rows = sum(counts)
        i, n = shard
        lo, hi = i * self.rows // n, (i + 1) * self.rows // n
        self.units: dict[str, tuple[_File, int, int, int]] = {}  # name: (file, first row of the file, start, stop)
        share: list[_File] = []
        first = 0
        for f, count in zip(files, counts):
            start = max(lo - first, 0)
            stop = min(hi - first, count)
            for a in range(start, stop, HF_BLOCK_ROWS):
                b = min(a + HF_BLOCK_ROWS, stop)
                unit = _File(f.path, f"{f.name}[{a}:{b}]", f.size, f.mtime_ns)
                self.units[unit.name] = (f, first, a, b)
                share.append(unit)
            first += count
        self.share = share
        self.fp = _fingerprint(files + share)

    def _json(self, path: Path) -> dict[str, Any]:
        try:
            value = json.loads(path.read_bytes())
        except (OSError, ValueError) as e:
            raise ValueError(f"{self.what}: {path} is not readable JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"{self.what}: {path} is not a JSON object")
        return value

    def _take(self, path: str, start: int) -> _ArrowFile:
        """The arrow file at `path`, to be read from row `start` on: the one last read, if it is not past
        that row (units of a file read in order continue where the last one stopped), else opened again.
        It is the caller's until it hands it back (`self._arrow = ...`)."""
        arrow, self._arrow = self._arrow, None
        if arrow is None or arrow.path != path or arrow.row > start:
            arrow = _ArrowFile(self._pa, path, self.what)
        return arrow

    def _cursor(self, epoch: int, index: int, name: str, sample: int) -> dict[str, Any]:
        cursor = super()._cursor(epoch, index, name, sample)
        cursor["rows"] = self.rows
        return cursor

    def _changed(self, cursor: dict[str, Any], names: list[str]) -> str:
        rows, name, files = cursor.get("rows"), str(cursor["shard"]), cursor.get("files")
        if isinstance(rows, int) and rows != self.rows:
            return f"the split {self.split!r} now has {self.rows} rows, not {rows}"
        if name not in names or files != len(names):
            return f"the share's row ranges differ ({name!r} was being read), as they do with another --shard"
        return "an arrow file of the split was rewritten (its size or modification time changed)"

    def _samples(self, f: _File, skip: int) -> Iterator[dict[str, Any]]:
        file, first, start, stop = self.units[f.name]
        where = f"{self.what}: {file.path}"
        if skip > stop - start:
            raise ConfigMismatch(
                f"{where}: the committed cursor is {skip} rows into {f.name}, which has {stop - start}"
            )
        arrow = self._take(file.path, start + skip)
        try:
            columns = arrow.schema.names
            if self.key_column is not None and self.key_column not in columns:
                raise ValueError(f"{where}: no column {self.key_column!r} (--key-column); columns: {columns}")
            _check_columns(columns, self.key_column, where)
            media = {c.name: m for c in arrow.schema if (m := _media(c.type)) is not None}
            prefix = self.split.replace(".", "-")
            row = start + skip  # in the file
            for at, batch in arrow.batches(row):  # a record batch at a time: what is held is one batch
                end = min(stop, at + batch.num_rows)
                for a in range(row, end, 256):
                    for values in batch.slice(a - at, min(end - a, 256)).to_pylist():
                        where_row = f"{where} row {row}"
                        for column, convert in media.items():
                            try:
                                values[column] = convert(values[column])
                            except _NotEmbedded as e:
                                raise InvalidSample(
                                    f"{where_row} column {column!r}: the media value holds only a path ({e}), not its bytes"
                                ) from None
                        yield _row_sample(values, f"{prefix}-{first + row:09d}", self.key_column, where_row)
                        row += 1
                if row == stop:
                    break
            if row < stop:
                raise ConfigMismatch(f"{where}: it holds {row} rows, not {stop} as it did when listed")
        finally:
            self._arrow = arrow  # for the next unit


class _ArrowFile:
    """An arrow stream file (`save_to_disk`'s `.arrow`), memory-mapped and read one record batch at a
    time: a compressed batch is decompressed when it is read, so memory holds one batch, never the file.
    An arrow error (not an arrow stream, a damaged batch) raises InvalidSample naming the file."""

    def __init__(self, pa: Any, path: str, what: str) -> None:
        self.path, self.where, self._pa = path, f"{what}: {path}", pa
        try:
            self._reader = pa.ipc.open_stream(pa.memory_map(path))
        except pa.ArrowException as e:
            raise InvalidSample(f"{self.where} is not an arrow stream file: {e}") from None
        self.schema = self._reader.schema
        self.row = 0  # the first row of `batch`, or of the next batch read
        self.batch: Any = None

    def batches(self, start: int) -> Iterator[tuple[int, Any]]:
        """(first row, record batch) for every batch from the one holding row `start` on. A batch left
        unfinished (the consumer stopped) is the first one again for the next call."""
        while True:
            if self.batch is None:
                try:
                    self.batch = self._reader.read_next_batch()
                except StopIteration:
                    return
                except self._pa.ArrowException as e:
                    raise InvalidSample(f"{self.where}: unreadable record batch at row {self.row}: {e}") from None
            if self.row + self.batch.num_rows > start:
                yield self.row, self.batch
            self.row += self.batch.num_rows
            self.batch = None
