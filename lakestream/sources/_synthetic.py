"""Synthetic samples: what `produce` makes without a source, and the demo."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from typing import Any

import numpy as np


def synthetic_sample(i: int, size: int, *, prefix: str = "s", work_ms: float = 0.0) -> dict[str, Any]:
    """A multimodal-looking sample of about `size` bytes: an image-like blob, a caption, tokens."""
    deadline = time.perf_counter() + work_ms / 1000
    rng = np.random.default_rng(i)
    n_tokens = int(rng.integers(16, 256))
    blob = rng.integers(0, 256, size=max(0, size - 4 * n_tokens), dtype=np.uint8).tobytes()
    while time.perf_counter() < deadline:  # stand-in for decode/tokenise CPU work
        hashlib.sha256(blob[:4096]).digest()
    return {
        "__key__": f"{prefix}{i:09d}",
        "jpg": blob,
        "txt": f"synthetic sample {i} of a stream of frames",
        "tokens": rng.integers(0, 50_000, size=n_tokens, dtype=np.int32),
        "json": {"index": i, "tokens": n_tokens},
    }


def synthetic_source(
    n: int, size: int, *, start: int = 0, prefix: str = "s", work_ms: float = 0.0
) -> Iterator[tuple[dict[str, Any], int]]:
    for i in range(start, n):
        yield synthetic_sample(i, size, prefix=prefix, work_ms=work_ms), i + 1
