"""Assigning a global batch's samples to ranks. Pure."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["assign_ranks"]


def assign_ranks(costs: Sequence[float] | None, n: int, world_size: int) -> list[list[int]]:
    """Sample indices for each rank, each rank's list in put order.

    Without costs, round-robin: sample i goes to rank i % world_size. With costs, every rank still
    gets the same number of samples (± 1), and the largest total cost is kept small: samples are
    placed, most costly first, on the least loaded rank that has room (LPT with capacities).
    """
    if costs is None:
        return [list(range(r, n, world_size)) for r in range(world_size)]
    if len(costs) != n:
        raise ValueError(f"{len(costs)} costs for {n} samples")
    base, extra = divmod(n, world_size)
    room = [base + (r < extra) for r in range(world_size)]
    load = [0.0] * world_size
    out: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(n), key=lambda i: (-costs[i], i)):
        r = min((r for r in range(world_size) if room[r]), key=lambda r: (load[r], r))
        out[r].append(i)
        room[r] -= 1
        load[r] += costs[i]
    for lst in out:
        lst.sort()
    return out
