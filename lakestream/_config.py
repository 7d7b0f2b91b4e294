"""A stream's configuration: what `create` fixes for its life, within documented limits. No I/O."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["FORMAT_VERSION", "LIMITS", "Config"]

FORMAT_VERSION = 1

# The shapes a stream may have. Everything that reads a stream (readers, the mount, `status`)
# allocates in proportion to these, so they are refused at `create`, not discovered later.
LIMITS = {
    "world_size": (1, 1 << 16),
    "global_batch": (1, 1 << 24),
    "snapshot_every": (1, 1 << 20),
    "max_sample_bytes": (1, 1 << 32),
    "keep_checkpoints": (0, 1 << 16),
    "max_steps_ahead": (0, 1 << 32),  # 0: unbounded
}


@dataclass(frozen=True, slots=True)
class Config:
    """What `create` fixes for the life of a stream."""

    world_size: int
    global_batch: int
    snapshot_every: int = 1000
    keep_checkpoints: int = 3
    max_steps_ahead: int = 0  # 0: unbounded
    max_sample_bytes: int = 1 << 30
    format: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        for name, (lo, hi) in LIMITS.items():
            v = getattr(self, name)
            if type(v) is not int or not lo <= v <= hi:
                raise ValueError(f"{name} must be an integer from {lo} to {hi}, got {v!r}")
        if self.global_batch < self.world_size:
            raise ValueError(
                f"global_batch {self.global_batch} is smaller than world_size {self.world_size}: "
                "some ranks would get no samples (and a data-parallel job would hang)"
            )
        if self.format != FORMAT_VERSION:
            raise ValueError(f"unsupported stream format {self.format!r} (this library reads {FORMAT_VERSION})")

    def to_dict(self) -> dict[str, int]:
        return {
            "format": self.format,
            "world_size": self.world_size,
            "global_batch": self.global_batch,
            "snapshot_every": self.snapshot_every,
            "keep_checkpoints": self.keep_checkpoints,
            "max_steps_ahead": self.max_steps_ahead,
            "max_sample_bytes": self.max_sample_bytes,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Config:
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        return cls(**known)
