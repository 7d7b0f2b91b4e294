"""A producer fleet on Ray (extra `ray`): `lakestream fleet` and `run_fleet`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["FleetReport", "run_fleet"]


@dataclass
class FleetReport:
    """What a fleet run did, summed over its producers."""

    producers: int
    samples: int = 0
    steps: int = 0
    bytes: int = 0
    restarts: int = 0
    skipped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # producer id -> why it failed for good
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed

    def to_dict(self) -> dict[str, Any]:
        return {
            "producers": self.producers, "samples": self.samples, "steps": self.steps, "bytes": self.bytes,
            "restarts": self.restarts, "skipped": self.skipped, "failed": self.failed, "seconds": self.seconds,
            "ok": self.ok,
        }  # fmt: skip

    def summary(self) -> str:
        return (
            f"fleet of {self.producers}: {self.samples} samples, {self.steps} steps, {self.bytes / 1e6:.1f} MB, "
            f"{self.restarts} restarts, {len(self.skipped)} skipped in {self.seconds:.1f} s"
            + "".join(f"; {p} failed: {why}" for p, why in self.failed.items())
        )


def run_fleet(
    url: str,
    source: str,
    producers: int,
    *,
    name: str = "fleet",
    map: str | None = None,
    workers_per_producer: int = 0,
    on_error: str = "fail",
    key_column: str | None = None,
    split: str | None = None,
    epochs: int = 1,
    shuffle_seed: int | None = None,
    max_restarts: int = -1,
    ray_address: str | None = None,
) -> FleetReport:
    """Run `producers` producer actors on Ray until every one has finished its share of `source`."""
    raise NotImplementedError("the Ray fleet is being built")
