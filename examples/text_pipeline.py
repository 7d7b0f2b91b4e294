"""A text pipeline: Parquet documents -> byte-level tokens packed into 512-token sequences -> ranks balanced by tokens.

    python examples/text_pipeline.py [--docs N] [--dir DIR] [--url STREAM_URL]
                                     [--world-size W] [--global-batch B] [--workers K]

    python examples/text_pipeline.py --docs 200                  # from the repository root

Options:
  --docs N          synthetic documents to generate (default 300)
  --dir DIR         where the Parquet files (DIR/docs) and the default stream (DIR/stream) go (default: a
                    new temporary directory, removed at the end); files already in DIR are used as they are
  --url STREAM_URL  the stream: file://PATH (or a plain path) or s3://BUCKET/PREFIX (default file://DIR/stream)
  --world-size W    ranks of a stream this example creates (default 2)
  --global-batch B  sequences per step of a stream this example creates (default 16)
  --workers K       processes running the map function (default 0: in the producer; tokenising bytes
                    costs less than sending a record to another process)

Three parts, one after the other:

1. Data: N documents of synthetic sentences (a few blank or null, a few a couple of words, most a
   few dozen to several hundred words, some with non-ASCII letters) in FILES Parquet files with the
   columns `id` and `text`.
2. Producing: `lakestream.produce` reads the files (`parquet:` source, `id` as the key) and maps every
   document with `text_transform.pack`: byte-level tokens cut into 512-token sequences (a long
   document gives several, a short one is dropped; see text_transform.py for why packing stays
   within a document). Each sequence's `__cost__` is its real tokens, so the producer assigns every step's sequences to ranks balancing tokens rather than counts.
3. Reading: each rank reads its slices with `lakestream.open_reader`; the example prints, per step,
   the real tokens every rank got, their spread (largest minus smallest), and the spread dealing the
   same sequences round-robin in put order would have given.

Balancing: every rank gets the same number of sequences (± 1), and sequences are placed most tokens
first, each on the rank with the fewest tokens that still has room; a step's spread then stays
within the longest sequence's tokens (at most 512; tests/test_example_pipelines.py says why).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import anyio
import numpy as np

import lakestream

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the map function's module, also in workers
from text_transform import SEQ_LEN, pack

FILES = 3
PRODUCER_ID = "text-0"
WORDS = (
    "the", "a", "data", "stream", "batch", "rank", "step", "model", "token", "sequence", "river", "lake", "cloud",
    "object", "store", "commit", "global", "train", "worker", "shard", "epoch", "cursor", "resume", "exact", "once",
    "order", "random", "cafe", "café", "naïve", "über", "façade", "read", "write", "pack", "byte", "learn",
    "gradient", "loss", "weight", "small", "large", "quick", "slow", "bright", "quiet",
)  # fmt: skip


# -- 1. the data: synthetic documents in Parquet --------------------------------------------------------


def make_text(rng: np.random.Generator) -> str | None:
    """A document: None, blank, a fragment, or sentences of random words (lengths vary widely)."""
    kind = rng.random()
    if kind < 0.02:
        return None
    if kind < 0.05:
        return " " * int(rng.integers(0, 3))
    if kind < 0.12:
        n = int(rng.integers(1, 3))
    elif kind < 0.65:
        n = int(rng.integers(10, 120))
    else:
        n = int(rng.integers(120, 700))
    words = [WORDS[int(i)] for i in rng.integers(0, len(WORDS), size=n)]
    sentences = []
    while words:
        k = int(rng.integers(4, 15))
        part, words = words[:k], words[k:]
        sentences.append(" ".join(part).capitalize() + ".")
    return " ".join(sentences)


def write_docs(docs_dir: Path, docs: int, seed: int = 0) -> None:
    """`docs` documents keyed `doc-000000`, … in FILES Parquet files (ids ascending across the files)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs_dir.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    per_file = -(-docs // FILES)
    for f in range(FILES):
        ids = range(f * per_file, min(docs, (f + 1) * per_file))
        table = pa.table({"id": [f"doc-{i:06d}" for i in ids], "text": [make_text(rng) for _ in ids]})
        tmp = docs_dir / f".docs-{f:03d}.parquet.tmp"
        pq.write_table(table, tmp)
        tmp.rename(docs_dir / f"docs-{f:03d}.parquet")


# -- 2. producing: tokenise and pack, costs = tokens ------------------------------------------------


async def produce(url: str, docs_dir: Path, world_size: int, global_batch: int, workers: int) -> Any:
    """Create the stream unless it exists, then produce every document through `pack`."""
    try:
        await lakestream.load_state(url)
    except lakestream.StreamNotFound:
        await lakestream.create(url, world_size=world_size, global_batch=global_batch)
    return await lakestream.produce(url, PRODUCER_ID, f"parquet:{docs_dir}", key_column="id", map=pack, workers=workers)


# -- 3. reading: tokens per rank per step ---------------------------------------------------------------


async def read_ranks(url: str) -> list[dict[int, list[tuple[str, int]]]]:
    """For every rank, step -> [(key, real tokens)] of its slice, for every committed step."""
    state = await lakestream.load_state(url)
    world = state.world_at(state.head + 1)
    out: list[dict[int, list[tuple[str, int]]]] = []
    for rank in range(world):
        steps: dict[int, list[tuple[str, int]]] = defaultdict(list)
        async with lakestream.open_reader(url, rank, prefetch=8) as reader:
            async for batch in reader.steps(0, state.head + 1):
                for s in batch.samples:
                    if s["tokens"].shape != (SEQ_LEN,):
                        raise ValueError(f"{s['__key__']}: a sequence of shape {s['tokens'].shape}")
                    steps[batch.step].append((s["__key__"], int(s["n_tokens"])))
        out.append(steps)
    return out


def spread(loads: list[int]) -> int:
    return max(loads) - min(loads)


def report(ranks: list[dict[int, list[tuple[str, int]]]]) -> None:
    """Print tokens per rank per step, the spread, and the round-robin spread for comparison."""
    world = len(ranks)
    header = "  ".join(f"rank {r} tokens" for r in range(world))
    print(f"step  {header}  spread  round-robin spread")
    worst = worst_rr = 0
    totals = [0] * world
    steps = sorted(set().union(*ranks))
    for step in steps:
        loads = [sum(n for _, n in ranks[r].get(step, [])) for r in range(world)]
        in_order = sorted(item for r in range(world) for item in ranks[r].get(step, []))  # keys sort in put order
        rr = [sum(n for _, n in in_order[r::world]) for r in range(world)]
        worst, worst_rr = max(worst, spread(loads)), max(worst_rr, spread(rr))
        totals = [t + x for t, x in zip(totals, loads)]
        cells = "  ".join(f"{x:13d}" for x in loads)
        print(f"{step:4d}  {cells}  {spread(loads):6d}  {spread(rr):18d}")
    for r in range(world):
        count = sum(len(v) for v in ranks[r].values())
        print(f"rank {r}: {count} sequences, {totals[r]} tokens")
    print(f"largest spread in a step: {worst} tokens balanced by cost, {worst_rr} dealt round-robin")


def run(a: argparse.Namespace, workdir: Path) -> None:
    docs_dir = workdir / "docs"
    url = a.url or f"file://{workdir / 'stream'}"
    if docs_dir.is_dir():
        print(f"using the Parquet files in {docs_dir}", flush=True)
    else:
        t0 = time.perf_counter()
        write_docs(docs_dir, a.docs)
        print(f"generated {a.docs} documents in {FILES} Parquet files in {time.perf_counter() - t0:.1f} s: {docs_dir}")
    r = anyio.run(produce, url, docs_dir, a.world_size, a.global_batch, a.workers)
    print(
        f"produced {r.stats.samples} sequences of {SEQ_LEN} tokens from {r.map.records} documents "
        f"({r.map.dropped} dropped) in {r.stats.tgbs_committed} TGBs in {r.seconds:.1f} s: {url}",
        flush=True,
    )
    report(anyio.run(read_ranks, url))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=300)
    ap.add_argument("--dir", default=None, help="default: a new temporary directory, removed at the end")
    ap.add_argument("--url", default=None, help="default: file://DIR/stream")
    ap.add_argument("--world-size", type=int, default=2, help="only for a stream this example creates")
    ap.add_argument("--global-batch", type=int, default=16, help="only for a stream this example creates")
    ap.add_argument("--workers", type=int, default=0)
    a = ap.parse_args()
    if a.docs < 1 or a.world_size < 1 or a.global_batch < 1 or a.workers < 0:
        ap.error("--docs, --world-size and --global-batch must be positive, --workers not negative")
    if a.dir is not None:
        Path(a.dir).mkdir(parents=True, exist_ok=True)
        run(a, Path(a.dir))
    else:
        with tempfile.TemporaryDirectory(prefix="lakestream-text-") as d:
            run(a, Path(d))


if __name__ == "__main__":
    main()
