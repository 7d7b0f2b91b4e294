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

import glob
import hashlib
import math
import os
import random
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ._errors import ConfigMismatch, InvalidSample
from ._sources import describe_cursor, dir_source

__all__ = [
    "SHUFFLE_WINDOW",
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
    """The source `spec` names: `wds:PATTERN`, `parquet:PATH` or `dir:PATH`.

    `shard=(i, n)`: this producer's share of a sharded source's files. `key_column`: the Parquet
    column holding the sample key. `epochs`, `shuffle_seed`: read the share `epochs` times, each
    epoch in its own deterministic shuffled order (see the module docs). Raises ValueError for an
    unknown kind or an option that does not apply, FileNotFoundError when no file matches.
    """
    kind, colon, where = spec.partition(":")
    if not colon or not where:
        raise ValueError(f"--source {spec!r}: expected wds:PATTERN, parquet:PATH or dir:PATH")
    i, n = shard
    if not 0 <= i < n:
        raise ValueError(f"shard {i}/{n}: expected 0 <= I < N")
    if split is not None and kind != "hf":
        raise ValueError("--split applies to hf: sources")
    if key_column is not None and kind != "parquet":
        raise ValueError("--key-column applies to parquet: sources")
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs {epochs!r}: expected an integer >= 1")
    if kind == "dir":
        if shard != (0, 1):
            raise ValueError("--shard applies to wds: and parquet: sources")
        if epochs != 1 or shuffle_seed is not None:
            raise ValueError("--epochs and --shuffle-seed apply to wds: and parquet: sources")
        return DirSource(where)
    src: _Sharded
    if kind == "wds":
        src = WdsSource(where, shard)
    elif kind == "parquet":
        src = ParquetSource(where, shard, key_column)
    else:
        raise ValueError(f"--source {spec!r}: unknown kind {kind!r} (wds, parquet or dir)")
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
    """What the sharded sources share: the share, its fingerprint, epochs, shuffling, and resuming."""

    what: str
    share: list[_File]
    fp: str
    epochs: int = 1
    seed: int | None = None

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
        names = [f.name for f in self.share]
        if cursor["fp"] == self.fp:
            if not 0 <= index < len(names) or names[self._order(epoch)[index]] != name:
                raise ConfigMismatch(f"{self.what}: the committed cursor {cursor!r} does not fit this share's order")
            return epoch, index, int(cursor["sample"])
        files = cursor.get("files")
        if isinstance(files, int) and files < len(names):
            change = f"{len(names) - files} file(s) were added"
        elif isinstance(files, int) and files > len(names):
            change = f"{files - len(names)} file(s) were removed"
        elif name not in names:
            change = f"{name!r} (the file being read) is no longer in this producer's share (removed or renamed)"
        elif index >= len(names) or names[self._order(epoch)[index]] != name:
            change = "files were renamed"
        else:
            change = "a file was rewritten (its size or modification time changed)"
        raise ConfigMismatch(
            f"{self.what}: this producer's share ({len(names)} files) changed under the committed cursor "
            f"({cursor['sample']} samples into {name!r}): {change}. Resuming would duplicate or lose samples; "
            "restore the files, or produce the changed source under a new --producer-id"
        )

    def _cursor(self, epoch: int, index: int, name: str, sample: int) -> dict[str, Any]:
        cursor: dict[str, Any] = {
            "epoch": epoch,
            "shard": name,
            "index": index,
            "sample": sample,
            "files": len(self.share),
            "fp": self.fp,
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
