"""`parquet:`: Parquet files, local or in S3."""

from __future__ import annotations

import contextlib
import posixpath
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._errors import ConfigMismatch
from ._base import (
    _check_columns,
    _File,
    _fingerprint,
    _pyarrow_parquet,
    _remote_file,
    _row_sample,
    _Sharded,
    _share,
    _stat,
    _unreadable,
    key_text,
)

if TYPE_CHECKING:
    from .._remote import S3Objects


def _list_s3_parquet(what: str, url: str) -> tuple[list[_File], S3Objects]:
    """The object `url` names, else the `.parquet` objects under it as a directory, sorted by key."""
    from .._remote import S3Objects, split_s3

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
        with (
            _unreadable(where, "Parquet file"),
            contextlib.closing(source) if self.remote else contextlib.nullcontext(),
            pq.ParquetFile(source) as pf,
        ):
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
                table = pf.read_row_group(g)
                table.validate(full=True)  # offsets in bounds, text UTF-8: what to_pylist trusts
                for batch in table.to_batches(max_chunksize=256):
                    for values in batch.to_pylist():
                        if row < skip:
                            row += 1
                            continue
                        yield _row_sample(values, f"{prefix}-{row:09d}", self.key_column, f"{where} row {row}")
                        row += 1
