"""A custom async producer pipeline: source -> decode -> tokenise -> put.

Each stage is a coroutine connected to the next by a bounded memory stream, so decoding and
tokenising overlap with uploads and commits. The cursor put with each sample is the source
position after it; a restarted pipeline resumes exactly after the last committed sample.

    python examples/producer_pipeline.py STREAM_URL [--producer-id ID] [--records N]
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
    print(f"{producer_id}: resumed at {start}, put {producer.stats.samples}, committed {producer.stats.tgbs_committed} TGBs")
    return producer.stats.samples


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--producer-id", default="pipeline-0")
    ap.add_argument("--records", type=int, default=1000)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=32)
    a = ap.parse_args()

    async def go() -> None:
        await lakestream.create(a.url, world_size=a.world_size, global_batch=a.global_batch)
        await run(a.url, a.producer_id, a.records)

    anyio.run(go)


if __name__ == "__main__":
    main()
