"""Assigning a global batch's samples to ranks. Pure."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["assign_ranks", "mix_counts", "pack_plan", "packed_cursor", "reslice"]


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


def reslice(counts: Sequence[int], world_size: int) -> list[list[tuple[int, int, int]]]:
    """What each of `world_size` ranks reads of a TGB stored as `len(counts)` rank slices.

    Rank r gets a list of pieces (stored slice, first sample, end sample), in stored order. The
    ranks partition the TGB and their counts differ by at most one; each rank fetches (whole,
    checksummed) only the stored slices its pieces are in. With W stored slices read as W2 ranks:

    - W2 = W: every rank reads its own slice (the cost balancing of `assign_ranks` holds);
    - W2 divides W: whole slices are dealt round-robin, largest count first (rank r gets the
      slices at positions r, r + W2, … of that order): every slice is read once, by one rank;
    - W divides W2: each slice is cut into W2 / W runs (the first ones one longer), rank r
      getting run r % (W2 / W) of slice r // (W2 / W): every slice is read by W2 / W ranks;
    - otherwise, or when the stored counts differ by more than one (so the above would not
      balance): the slices in order as one sequence cut into W2 consecutive runs, the first
      n % W2 one longer; every new boundary splits at most one slice (at most W + W2 - 1 reads).
    """
    w = len(counts)
    if world_size < 1 or any(c < 0 for c in counts):
        raise ValueError(f"reslice: world size {world_size}, counts {list(counts)[:8]}")
    if w == world_size:
        return [[(r, 0, c)] if c else [] for r, c in enumerate(counts)]
    if w and max(counts) - min(counts) <= 1:
        if w % world_size == 0:
            order = sorted(range(w), key=lambda i: (-counts[i], i))
            return [[(i, 0, counts[i]) for i in sorted(order[r::world_size]) if counts[i]] for r in range(world_size)]
        if world_size % w == 0:
            k = world_size // w
            out = []
            for i, c in enumerate(counts):
                base, extra = divmod(c, k)
                first = 0
                for j in range(k):
                    take = base + (j < extra)
                    out.append([(i, first, first + take)] if take else [])
                    first += take
            return out
    return _consecutive(counts, world_size)


def _consecutive(counts: Sequence[int], world_size: int) -> list[list[tuple[int, int, int]]]:
    n = sum(counts)
    base, extra = divmod(n, world_size)
    out: list[list[tuple[int, int, int]]] = []
    stored, first = 0, 0  # the cut: sample `first` of stored slice `stored`
    for r in range(world_size):
        want = base + (r < extra)
        pieces = []
        while want:
            while counts[stored] == first:  # skip exhausted (or empty) slices
                stored, first = stored + 1, 0
            take = min(want, counts[stored] - first)
            pieces.append((stored, first, first + take))
            first += take
            want -= take
        out.append(pieces)
    return out


def mix_counts(weights: Sequence[tuple[str, float]], batch: int) -> dict[str, int]:
    """Each source's samples in a global batch of `batch`: the largest-remainder rounding of
    weight / total weight x batch (ties to the source listed first). The counts add up to `batch`."""
    total = sum(w for _, w in weights)
    if not weights or not 0 < total < math.inf or batch < 0:  # a finite total: each share is from 0 to 1
        raise ValueError(f"mix_counts: weights {list(weights)[:8]}, batch {batch}")
    exact = [(name, w / total * batch) for name, w in weights]
    counts = {name: int(x) for name, x in exact}
    order = sorted(range(len(exact)), key=lambda i: (-(exact[i][1] - int(exact[i][1])), i))
    for i in order[: batch - sum(counts.values())]:
        counts[exact[i][0]] += 1
    return counts


def pack_plan(
    leftovers: Sequence[tuple[str, int, Sequence[str] | None]],
    shape: Callable[[int], tuple[int, dict[str, int] | None]],
) -> list[list[tuple[str, int]]]:
    """How held leftovers are packed: each TGB's samples as (producer, index in its leftover).

    `leftovers` are (producer, samples, each sample's source or None), in producer order;
    `shape(k)` is (global batch, each source's share or None outside a mixture) at the k-th TGB.
    Without a mixture (at the first TGB) every sample is taken in that order (each producer's in its own order) and cut
    into global batches, the last one short. Under a mixture each source's samples are taken in that
    order: a TGB is a whole global batch of the shares while every share can be met, then the rest
    goes into short TGBs of at most each share, so more than one TGB may be short when one source
    has more than its share left. Raises ValueError for samples of a source without a share in the mix in force.
    """
    out: list[list[tuple[str, int]]] = []
    if shape(0)[1] is None or all(src is None for _, _, src in leftovers):
        flat = [(pid, i) for pid, n, _ in leftovers for i in range(n)]
        at = 0
        while at < len(flat):
            batch, _ = shape(len(out))
            out.append(flat[at : at + batch])
            at += batch
        return out
    pools: dict[str, deque[tuple[str, int]]] = {}
    for pid, n, src in leftovers:
        if src is None or len(src) != n:
            raise ValueError(f"the leftover of {pid!r} names no source for some of its samples")
        for i, name in enumerate(src):
            pools.setdefault(name, deque()).append((pid, i))
    while any(pools.values()):
        _, shares = shape(len(out))
        shares = shares or {}
        tgb = [
            pools[name].popleft()
            for name, c in shares.items()
            if name in pools
            for _ in range(min(c, len(pools[name])))
        ]
        if not tgb:
            left = sorted(name for name, pool in pools.items() if pool)
            raise ValueError(f"samples of sources {left} have no share in the mix in force")
        out.append(tgb)
    return out


def packed_cursor(cursors: Sequence[Any], sources: Sequence[str] | None, done: set[int], before: Any) -> Any:
    """A producer's cursor once the samples `done` (indices) of its leftover are packed: after the
    last of them when they are the first ones (else `before`, the cursor before the leftover).

    Under a mixture they may be the first ones of each source rather than the first ones: the
    pipeline's cursors `{"sources": {name: cursor}}` then compose, each source's cursor being the one
    after its last packed sample; ValueError for other cursors.
    """
    k = 0
    while k in done:
        k += 1
    if k == len(done):
        return cursors[k - 1] if k else before
    docs = [before, *cursors]
    if sources is None or not all(isinstance(c, dict) and isinstance(c.get("sources"), dict) for c in docs if c):
        raise ValueError("packed samples that are not the first ones of a leftover need cursors of named sources")
    out = dict(before["sources"]) if before else {}
    for i in sorted(done):
        out[sources[i]] = cursors[i]["sources"].get(sources[i])
    return {"sources": out}
