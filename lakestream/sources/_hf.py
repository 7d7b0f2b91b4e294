"""`hf:`: Hugging Face datasets saved with `save_to_disk`."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .._errors import ConfigMismatch, InvalidSample
from ._base import _check_columns, _File, _fingerprint, _pyarrow_parquet, _row_sample, _Sharded, _stat, one_line

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
    of R, cut into units of at most `block_rows` (HF_BLOCK_ROWS) rows that do not cross a file, named
    `<file>[<start>:<stop>]` (rows of that file). Units play the part files play for wds: and
    parquet: (the cursor's `shard`, an epoch's shuffled order); the cursor also holds `"rows": R`.

    One row is one sample, as for parquet: (`key_column`, else the key `<split>-<row index:09d>`, the
    split `train` for a Dataset saved without one, dots in it as `-`); a media value (datasets'
    Image, Audio, Video: `{"bytes", "path"}`) becomes its bytes, and one saved without its bytes
    raises InvalidSample. The fingerprint covers every arrow file of the split (name, size,
    modification time) and the share's units.
    """

    def __init__(
        self,
        path: str,
        shard: tuple[int, int] = (0, 1),
        key_column: str | None = None,
        split: str | None = None,
        *,
        block_rows: int = HF_BLOCK_ROWS,
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
            for a in range(start, stop, block_rows):
                b = min(a + block_rows, stop)
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
                arrow.check(at, batch)
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
        except (pa.ArrowException, OSError) as e:
            raise InvalidSample(f"{self.where} is not an arrow stream file: {one_line(e)}") from None
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
                except (self._pa.ArrowException, OSError) as e:
                    raise InvalidSample(
                        f"{self.where}: unreadable record batch at row {self.row}: {one_line(e)}"
                    ) from None
            if self.row + self.batch.num_rows > start:
                yield self.row, self.batch
            self.row += self.batch.num_rows
            self.batch = None

    def check(self, at: int, batch: Any) -> None:
        """InvalidSample unless `batch` (its first row `at`) holds valid data: offsets within its buffers,
        text that is UTF-8 (what `to_pylist` trusts). Only batches that are read are checked: counting
        the rows reads no data."""
        try:
            batch.validate(full=True)
        except self._pa.ArrowException as e:
            raise InvalidSample(f"{self.where}: damaged record batch at row {at}: {one_line(e)}") from None
