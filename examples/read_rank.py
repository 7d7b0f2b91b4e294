"""One rank reading its batches with the Python reader.

    python examples/read_rank.py STREAM_URL --rank R [--from-step A] [--steps N]

Prints one line per step: the step, the number of samples, and the tokens in this rank's slice.
Without --steps it reads up to the newest committed step and stops; with it, it waits for steps
that are not committed yet.
"""

from __future__ import annotations

import argparse

import anyio

import lakestream


async def run(url: str, rank: int, start: int, steps: int | None) -> int:
    async with lakestream.open_reader(url, rank, prefetch=4) as reader:
        stop = start + steps if steps is not None else reader.state.head + 1
        total = 0
        async for batch in reader.steps(start, stop):
            tokens = sum(len(s["tokens"]) for s in batch.samples if "tokens" in s)
            print(f"step {batch.step:6d}  rank {rank}  samples {len(batch):4d}  tokens {tokens}")
            total += len(batch)
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--from-step", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None)
    a = ap.parse_args()
    total = anyio.run(run, a.url, a.rank, a.from_step, a.steps)
    print(f"rank {a.rank}: {total} samples")


if __name__ == "__main__":
    main()
