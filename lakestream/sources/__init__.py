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

from typing import Any

from ._base import SHUFFLE_WINDOW, Source, _Sharded, expand_braces, key_text, parse_shard
from ._dir import DirSource, describe_cursor
from ._hf import HF_BLOCK_ROWS, HfSource
from ._parquet import ParquetSource
from ._wds import WdsSource

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

    `SHUFFLE_WINDOW` and `HF_BLOCK_ROWS` are read here, at each call, for the source it opens.
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
        src = HfSource(where, shard, key_column, split, block_rows=HF_BLOCK_ROWS)
    else:
        raise ValueError(f"--source {spec!r}: unknown kind {kind!r} (wds, parquet, hf or dir)")
    src.epochs, src.seed, src.window = epochs, shuffle_seed, SHUFFLE_WINDOW
    return src


def describe(cursor: Any) -> str:
    """A cursor for people: the file and sample of a sharded source's cursor, else as `describe_cursor`."""
    if isinstance(cursor, dict) and "shard" in cursor and "sample" in cursor:
        where = f"{cursor['sample']} samples into {cursor['shard']!r} (file {cursor.get('index', 0) + 1} of the share"
        return where + (f", data epoch {cursor['epoch'] + 1})" if cursor.get("epoch") else ")")
    return describe_cursor(cursor)
