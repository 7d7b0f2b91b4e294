"""What the sources share: the Source protocol, shares and their fingerprints, epochs, shuffling and
the cursor of the sharded sources (`_Sharded`), sample keys, and the checks of table rows."""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, cast

from .._errors import ConfigMismatch, InvalidSample, LakestreamError
from .._layout import RESERVED_FIELDS

if TYPE_CHECKING:  # botocore is imported only for a source in S3: it takes a second to import
    from .._remote import RemoteObject, S3Objects


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


class _Sharded:
    """What the sharded sources share: the share, its fingerprint, epochs, shuffling, and resuming."""

    what: str
    shard: tuple[int, int] = (0, 1)  # this producer's share: (i, n) of --shard i/n
    share: list[_File]
    fp: str
    epochs: int = 1
    seed: int | None = None
    window: int = SHUFFLE_WINDOW  # samples shuffled together (see `_shuffled`)
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
        from .._remote import RemoteObject, split_s3

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
        seed, else shuffled within windows of `self.window` (the window `skip` falls in is read again)."""
        if self.seed is None:
            yield from self._samples(f, skip)
            return
        w = skip // self.window
        drop = skip - w * self.window
        window: list[dict[str, Any]] = []

        def flush() -> list[dict[str, Any]]:
            random.Random(f"{self.seed}:{epoch}:{f.name}:{w}").shuffle(window)
            return window[drop:]

        for sample in self._samples(f, w * self.window):
            window.append(sample)
            if len(window) == self.window:
                yield from flush()
                window, w, drop = [], w + 1, 0
        if len(window) < drop:
            raise ConfigMismatch(
                f"{self.what}: {f.path}: the committed cursor is {skip} samples into it, "
                f"but it holds {w * self.window + len(window)}"
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


def key_text(text: str) -> str:
    """`text` (a path) as part of a sample key: `%` written `%25`, `/` `%2F` and `.` `%2E`, which keys
    cannot hold. Different texts give different keys; `urllib.parse.unquote` gives the text back."""
    return text.replace("%", "%25").replace("/", "%2F").replace(".", "%2E")


def reserved_names() -> str:
    """The field names a source's data may not use, for messages: `'__cost__', '__key__', '__source__'`."""
    return ", ".join(repr(n) for n in sorted(RESERVED_FIELDS))


# -- tables (parquet:, hf:) ------------------------------------------------------------------------


def _pyarrow_parquet() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError("parquet: sources need pyarrow: pip install 'lakestream[sources]'") from None
    return pq


@contextlib.contextmanager
def _unreadable(where: str, kind: str) -> Iterator[None]:
    """pyarrow's errors reading a file (and OSError) as InvalidSample naming it: `<where>: not a readable
    <kind>: <pyarrow's message, on one line>`. Lakestream errors (an S3 source's) pass as they are."""
    import pyarrow as pa

    try:
        yield
    except LakestreamError:
        raise
    except (pa.ArrowException, OSError) as e:
        raise InvalidSample(f"{where}: not a readable {kind}: {one_line(e)}") from None


def one_line(e: BaseException) -> str:
    """An exception's message on one line (pyarrow's may span several)."""
    return " ".join(str(e).split())


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
