"""Sources the CLI can produce from: a WebDataset-style directory, and synthetic samples."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ._errors import InvalidSample

__all__ = ["dir_source", "synthetic_sample", "synthetic_source"]


def dir_source(directory: str | os.PathLike[str], start: int = 0) -> Iterator[tuple[dict[str, Any], int]]:
    """(sample, cursor) for the files directly in `directory`, sorted by name.

    The name up to the first dot is the sample key, the rest the field (`00017.jpg` and
    `00017.json` make one sample). The cursor is the index in the sorted file list just after the
    sample's last file, so `start=cursor` resumes after it. Files of one key are adjacent in
    sorted order because they share the prefix `key.`. Hidden files and directories are skipped.
    """
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"--from-dir {directory}: not a directory")
    names = sorted(e.name for e in os.scandir(root) if e.is_file() and not e.name.startswith("."))
    i = start
    while i < len(names):
        key, dot, _ = names[i].partition(".")
        if not dot:
            raise InvalidSample(f"{root / names[i]}: no field extension (expected <key>.<field>)")
        sample: dict[str, Any] = {"__key__": key}
        while i < len(names) and names[i].partition(".")[0] == key and "." in names[i]:
            sample[names[i].partition(".")[2]] = (root / names[i]).read_bytes()
            i += 1
        yield sample, i


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
