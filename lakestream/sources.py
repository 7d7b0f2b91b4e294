"""Sources with exact, resumable cursors: WebDataset tar shards, Parquet files, a directory of files.

    src = open_source("wds:/data/train-{000..127}.tar", shard=(0, 4))
    for sample, cursor in src.iterate(producer.cursor):
        await producer.put(sample, cursor=cursor)

`open_source(spec)` takes `wds:PATTERN`, `parquet:PATH` or `dir:PATH` (the CLI's `--from-dir`). A
sample is a dict with `__key__` and its fields; the cursor after it is JSON and pins the position
exactly, so a producer started again with the committed cursor continues with the next sample.

Sharded sources (`wds:`, `parquet:`) list their files sorted by path; `shard=(i, n)` takes files
i, i+n, i+2n, ... of that list (this producer's *share*). Their cursor is
`{"shard": NAME, "index": I, "sample": S, "files": F, "fp": H}`: S samples of file NAME (the I-th
file of the share) were consumed, the share had F files, and H is the SHA-256 over the share's
names, sizes and modification times. Resuming with a cursor whose fingerprint does not match the
share as it is now raises ConfigMismatch naming the change (files added or removed, a file
rewritten), never duplicating or skipping samples silently.
"""

from __future__ import annotations

import glob
import hashlib
import math
import os
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ._errors import ConfigMismatch, InvalidSample
from ._sources import describe_cursor, dir_source

__all__ = [
    "DirSource",
    "ParquetSource",
    "Source",
    "WdsSource",
    "describe",
    "expand_braces",
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


def open_source(spec: str, *, shard: tuple[int, int] = (0, 1), key_column: str | None = None) -> Source:
    """The source `spec` names: `wds:PATTERN`, `parquet:PATH` or `dir:PATH`.

    `shard=(i, n)`: this producer's share of a sharded source's files. `key_column`: the Parquet
    column holding the sample key. Raises ValueError for an unknown kind or an option that does not
    apply, FileNotFoundError when no file matches.
    """
    kind, colon, where = spec.partition(":")
    if not colon or not where:
        raise ValueError(f"--source {spec!r}: expected wds:PATTERN, parquet:PATH or dir:PATH")
    i, n = shard
    if not 0 <= i < n:
        raise ValueError(f"shard {i}/{n}: expected 0 <= I < N")
    if key_column is not None and kind != "parquet":
        raise ValueError("--key-column applies to parquet: sources")
    if kind == "dir":
        if shard != (0, 1):
            raise ValueError("--shard applies to wds: and parquet: sources")
        return DirSource(where)
    if kind == "wds":
        return WdsSource(where, shard)
    if kind == "parquet":
        return ParquetSource(where, shard, key_column)
    raise ValueError(f"--source {spec!r}: unknown kind {kind!r} (wds, parquet or dir)")


def describe(cursor: Any) -> str:
    """A cursor for people: the file and sample of a sharded source's cursor, else as `describe_cursor`."""
    if isinstance(cursor, dict) and "shard" in cursor and "sample" in cursor:
        return f"{cursor['sample']} samples into {cursor['shard']!r} (file {cursor.get('index', 0) + 1} of the share)"
    return describe_cursor(cursor)


@dataclass(frozen=True, slots=True)
class DirSource:
    """`dir:PATH`: the files directly in PATH, as `--from-dir` reads them (see `dir_source`)."""

    path: str

    def iterate(self, cursor: Any = None) -> Iterator[tuple[dict[str, Any], Any]]:
        return dir_source(self.path, cursor)


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
    path: str
    name: str  # what the cursor names: the path relative to the source's root
    size: int
    mtime_ns: int


def _share(files: list[_File], shard: tuple[int, int]) -> list[_File]:
    i, n = shard
    return files[i::n]


def _fingerprint(share: list[_File]) -> str:
    h = hashlib.sha256()
    for f in share:
        h.update(f"{f.name}\0{f.size}\0{f.mtime_ns}\0".encode())
    return h.hexdigest()


def _stat(path: str, name: str) -> _File:
    st = os.stat(path)
    return _File(path, name, st.st_size, st.st_mtime_ns)


class _Sharded:
    """What the sharded sources share: the share, its fingerprint, and resuming from a cursor."""

    what: str
    share: list[_File]
    fp: str

    def _start(self, cursor: Any) -> tuple[int, int]:
        """(file index in the share, samples to skip in it) after `cursor`; ConfigMismatch if it does not fit."""
        if cursor is None:
            return 0, 0
        keys = ("shard", "index", "sample", "fp")
        if not (isinstance(cursor, dict) and all(k in cursor for k in keys)):
            raise ConfigMismatch(f"{self.what}: the committed cursor {cursor!r} is not a cursor of this kind of source")
        if cursor["fp"] == self.fp:
            return int(cursor["index"]), int(cursor["sample"])
        names = [f.name for f in self.share]
        index, name = int(cursor["index"]), str(cursor["shard"])
        files = cursor.get("files")
        if isinstance(files, int) and files < len(names):
            change = f"{len(names) - files} file(s) were added"
        elif isinstance(files, int) and files > len(names):
            change = f"{files - len(names)} file(s) were removed"
        elif name not in names:
            change = f"{name!r} (the file being read) is no longer in this producer's share (removed or renamed)"
        elif names.index(name) != index:
            change = "files were renamed"
        else:
            change = "a file was rewritten (its size or modification time changed)"
        raise ConfigMismatch(
            f"{self.what}: this producer's share ({len(names)} files) changed under the committed cursor "
            f"({cursor['sample']} samples into {name!r}): {change}. Resuming would duplicate or lose samples; "
            "restore the files, or produce the changed source under a new --producer-id"
        )

    def _cursor(self, index: int, sample: int) -> dict[str, Any]:
        return {
            "shard": self.share[index].name,
            "index": index,
            "sample": sample,
            "files": len(self.share),
            "fp": self.fp,
        }

    def _samples(self, f: _File, skip: int) -> Iterator[dict[str, Any]]:
        raise NotImplementedError

    def iterate(self, cursor: Any = None) -> Iterator[tuple[dict[str, Any], Any]]:
        index, skip = self._start(cursor)
        for i in range(index, len(self.share)):
            n = skip if i == index else 0
            for sample in self._samples(self.share[i], n):
                n += 1
                yield sample, self._cursor(i, n)


# -- WebDataset tar shards --------------------------------------------------------------------------


class WdsSource(_Sharded):
    """`wds:PATTERN`: WebDataset tar shards on the local file system (`s3://` is not read yet).

    PATTERN is a glob, a brace pattern such as `/data/train-{000..127}.tar`, or both; a pattern
    without glob characters must name an existing file. The files are sorted by path. Members are
    read in order in streaming mode (a shard is never loaded whole) and grouped as WebDataset does:
    consecutive members with the same key (the member path up to the first dot of its base name)
    make one sample, the rest of the name is the field, the bytes are as stored. Directory entries
    and hidden members are skipped; a member without a field extension, or a field twice in one
    sample, raises InvalidSample. The cursor's `sample` counts samples within the shard.
    """

    def __init__(self, pattern: str, shard: tuple[int, int] = (0, 1)) -> None:
        self.what = f"wds:{pattern}"
        if "://" in pattern:
            raise ValueError(f"{self.what}: only local paths are read (no URLs yet)")
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
        sample: dict[str, Any] | None = None
        seen = 0
        try:
            with tarfile.open(f.path, "r|*") as tar:
                for member in tar:
                    if not member.isfile():
                        continue
                    base = os.path.basename(member.name)
                    if base.startswith("."):
                        continue
                    head, dot, field = base.partition(".")
                    if not dot or not head or not field:
                        raise InvalidSample(f"{where}: member {member.name!r} has no <key>.<field> name")
                    key = f"{os.path.dirname(member.name)}/{head}" if "/" in member.name else head
                    if sample is not None and sample["__key__"] != key:
                        seen += 1
                        if seen > skip:
                            yield sample
                        sample = None
                    if sample is None:
                        sample = {"__key__": key}
                    if field in sample:
                        raise InvalidSample(f"{where}: sample {key!r} has field {field!r} twice")
                    if seen < skip:
                        sample[field] = b""  # skipped: its bytes are not needed
                        continue
                    data = tar.extractfile(member)
                    assert data is not None  # a regular file
                    sample[field] = data.read()
        except tarfile.TarError as e:
            raise InvalidSample(f"{where}: not a readable tar file: {e}") from None
        if sample is not None:
            seen += 1
            if seen > skip:
                yield sample
        if seen < skip:
            raise ConfigMismatch(f"{where}: the committed cursor is {skip} samples into it, but it holds {seen}")


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
    """`parquet:PATH`: a Parquet file, or the `.parquet` files under a directory (sorted by path).

    One row is one sample. With `key_column` that column's value (text or an integer) is the key
    and is not stored as a field; without it the key is `<file stem>-<row index>`. Every other
    column is a field, as the Python value pyarrow gives (bytes, str, int, float, bool, None,
    lists and structs of those); other values (timestamps, decimals, NaN) raise InvalidSample
    naming the file, row and column. The cursor's `sample` counts rows within the file; resuming
    skips whole row groups before it.
    """

    def __init__(self, path: str, shard: tuple[int, int] = (0, 1), key_column: str | None = None) -> None:
        self.what = f"parquet:{path}"
        self.key_column = key_column
        if "://" in path:
            raise ValueError(f"{self.what}: only local paths are read (no URLs yet)")
        root = Path(path)
        if root.is_file():
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
        with pq.ParquetFile(f.path) as pf:
            columns = pf.schema_arrow.names
            if self.key_column is not None and self.key_column not in columns:
                raise ValueError(f"{where}: no column {self.key_column!r} (--key-column); columns: {columns}")
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
            stem = Path(f.name).name.removesuffix(".parquet")
            for batch in pf.iter_batches(row_groups=groups):
                for values in batch.to_pylist():
                    if row < skip:
                        row += 1
                        continue
                    yield self._sample(values, stem, row, where)
                    row += 1

    def _sample(self, values: dict[str, Any], stem: str, row: int, where: str) -> dict[str, Any]:
        if self.key_column is None:
            key: Any = f"{stem}-{row:09d}"
        else:
            key = values.pop(self.key_column)
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise InvalidSample(f"{where} row {row}: key column {self.key_column!r} holds {key!r}, not text")
            key = str(key)
        sample: dict[str, Any] = {"__key__": key}
        for column, value in values.items():
            if not _storable(value):
                raise InvalidSample(
                    f"{where} row {row} column {column!r}: cannot store {type(value).__name__} {value!r:.60}"
                )
            sample[column] = value
        return sample
