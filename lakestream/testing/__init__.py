"""Test support for Lakestream and for what is built on it. The library itself never imports it.

* `FaultyStore` wraps any store and injects latency, throttling (503 SlowDown), lost answers of
  puts that landed, failures and arbitrary hooks, all from one seeded `random.Random`;
  `S3_LIKE` is a latency profile like S3's.
* `inject_faults(spec)` makes every store that `lakestream.open_store` opens from then on, in
  this process, a FaultyStore: how a test injects faults into a whole process (a CLI child, a
  producer or mount subprocess) that it starts with `python -m lakestream.testing SPEC ARGS…`.
* `Manifest.on_apply` (a callback after each applied version) lets a checker see every version,
  even a step that a rewind discards within one refresh.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable

from .._store import ObjectStore, set_store_wrapper
from ._faulty import S3_LIKE, FaultyStore

__all__ = ["S3_LIKE", "FaultyStore", "inject_faults", "parse_faults"]


def parse_faults(spec: str) -> tuple[dict[str, float], int | None]:
    """`ambiguous=P,fail=P,seed=N` -> (FaultyStore options, seed). Raises ValueError."""
    try:
        kv = dict(item.split("=", 1) for item in spec.split(",") if item)
        faults = {"ambiguous_put": float(kv.pop("ambiguous", 0)), "fail_before": float(kv.pop("fail", 0))}
        seed = int(kv.pop("seed", 0)) or None
    except ValueError as e:
        raise ValueError(f"faults {spec!r}: expected ambiguous=P,fail=P,seed=N ({e})") from None
    if kv:
        raise ValueError(f"faults {spec!r}: unknown keys {sorted(kv)} (ambiguous, fail, seed)")
    return faults, seed


def inject_faults(spec: str | None, configure: Callable[[FaultyStore], None] | None = None) -> None:
    """Wrap every store opened from now on in this process in a FaultyStore with `spec`'s faults
    (None: stop); `configure` may adjust each one (count injections, add a hook)."""
    if spec is None:
        set_store_wrapper(None)
        return
    faults, seed = parse_faults(spec)

    def wrap(store: ObjectStore) -> ObjectStore:
        faulty = FaultyStore(store, rng=random.Random(seed), **faults)  # type: ignore[arg-type]
        if configure is not None:
            configure(faulty)
        return faulty

    set_store_wrapper(wrap)


def main(argv: list[str]) -> int:
    """`python -m lakestream.testing SPEC ARGS…`: the `lakestream` command with SPEC's faults."""
    if not argv:
        print("usage: python -m lakestream.testing ambiguous=P,fail=P,seed=N COMMAND [ARGS…]", file=sys.stderr)
        return 2
    inject_faults(argv[0])
    from .._cli import main as cli

    return cli(argv[1:])
