"""A custom async producer pipeline: source -> decode -> tokenise -> put.

Each stage is a coroutine connected to the next by a bounded memory stream, so decoding and
tokenising overlap with uploads and commits. The cursor put with each sample is the source
position after it; a restarted pipeline resumes exactly after the last committed sample.

    python examples/producer_pipeline.py STREAM_URL [--producer-id ID] [--records N]
                                         [--world-size W] [--global-batch B]

Options:
  STREAM_URL        file://PATH (or a plain path) or s3://BUCKET/PREFIX
  --producer-id ID  this producer's id; a rerun with the same id resumes (default pipeline-0)
  --records N       produce source records 0..N-1 (default 1000); a rerun with a larger N adds the rest
  --world-size W    world size if the stream does not exist yet (default 2)
  --global-batch B  global batch if the stream does not exist yet (default 32)

A stream that exists (created by `lakestream init` or another program) is used as it is, whatever
its shape; --world-size and --global-batch only shape a stream this example creates.
"""

from __future__ import annotations

import argparse
import zlib

import anyio
import numpy as np

import lakestream


def source(start: int, n: int):
    """Stand-in for a shard reader: compressed documents with their positions."""
    for i in range(start, n):
        text = f"document {i}: " + " ".join(f"word{(i * 7 + j) % 97}" for j in range(20 + i % 30))
        yield i, zlib.compress(text.encode())


def tokenise(text: str) -> np.ndarray:
    return np.array([zlib.crc32(w.encode()) % 32_000 for w in text.split()], dtype=np.int32)


async def run(url: str, producer_id: str, records: int) -> int:
    async with lakestream.open_producer(url, producer_id, cost=lambda s: len(s["tokens"])) as producer:
        start = producer.cursor or 0
        raw_send, raw_recv = anyio.create_memory_object_stream[tuple[int, bytes]](64)
        doc_send, doc_recv = anyio.create_memory_object_stream[tuple[int, str]](64)

        async def read() -> None:
            async with raw_send:
                for item in source(start, records):
                    await raw_send.send(item)

        async def decode() -> None:
            async with raw_recv, doc_send:
                async for i, blob in raw_recv:
                    await doc_send.send((i, zlib.decompress(blob).decode()))

        async def tokenise_and_put() -> None:
            async with doc_recv:
                async for i, text in doc_recv:
                    sample = {"__key__": f"doc{i:08d}", "txt": text, "tokens": tokenise(text)}
                    await producer.put(sample, cursor=i + 1)

        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            tg.start_soon(decode)
            tg.start_soon(tokenise_and_put)
    stats = producer.stats
    print(f"{producer_id}: resumed at {start}, put {stats.samples}, committed {stats.tgbs_committed} TGBs")
    return producer.stats.samples


async def create_if_missing(url: str, world_size: int, global_batch: int) -> None:
    """Create the stream unless one exists (with any config: someone else may have created it)."""
    try:
        state = await lakestream.load_state(url)
    except lakestream.StreamNotFound:
        await lakestream.create(url, world_size=world_size, global_batch=global_batch)
        print(f"created {url}: world size {world_size}, global batch {global_batch}")
    else:
        assert state.config is not None
        print(f"using {url}: world size {state.config.world_size}, global batch {state.config.global_batch}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("url")
    ap.add_argument("--producer-id", default="pipeline-0")
    ap.add_argument("--records", type=int, default=1000)
    ap.add_argument("--world-size", type=int, default=2, help="only for a stream this example creates")
    ap.add_argument("--global-batch", type=int, default=32, help="only for a stream this example creates")
    a = ap.parse_args()

    async def go() -> None:
        await create_if_missing(a.url, a.world_size, a.global_batch)
        await run(a.url, a.producer_id, a.records)

    anyio.run(go)


if __name__ == "__main__":
    main()
