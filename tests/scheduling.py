"""How pytest-xdist hands this suite's tests to its workers (`-n 4 --dist loadgroup`, pyproject.toml).

xdist's own `loadgroup` groups by the `xdist_group` mark through the node id, which pytest 9.2 no
longer lets it change (pytest-xdist issue 1386): the marks would be ignored without a word. So the
groups are named here, by node id, and the controller's scheduler (conftest.py) reads them:

* Four workers for two cores: many tests spend much of their time waiting (on child processes,
  servers, a cluster starting, sleeps), and a fourth worker fills that time; two runs one after
  the other beside the same other work took 17 min 44 s with four and 20 min 02 s with three.
* A group runs on one worker, one test after the other: `ray` holds every test that starts a Ray
  cluster (one cluster on the machine at a time, and test_fleet's module cluster started once);
  `torture` holds the two torture runs (each needs the machine's chaos to happen on time).
* Every other test is a unit of its own, handed to the next idle worker.
* The longest units start first (FIRST, slowest first, measured), so that none of them is left to
  run alone at the end; the rest follow in collection order. Their tests are marked `slow`
  (`pytest -m "not slow"` is a quicker run, not the suite).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from xdist.scheduler.loadscope import LoadScopeScheduling

#: (node id prefix, group): the tests of a group run on one worker, one after the other.
GROUPS = [
    ("tests/test_fleet.py::", "ray"),
    ("tests/test_metrics.py::test_fleet_serves_one_endpoint_per_actor", "ray"),
    ("tests/test_bench.py::test_sources_bench_smoke", "ray"),  # its fleet section starts a local cluster
    ("tests/test_torture.py::test_torture", "torture"),  # two at once starve each other's chaos on 2 cores
]

#: Units that start first, in this order (node id prefixes or group names): the longest ones.
FIRST = [
    "ray",
    "torture",
    "tests/test_torture.py::",
    "tests/test_bench.py::test_e2e_bench_smoke",
    "tests/test_scale_processes.py::test_128_combining_producers",
    "tests/test_torch.py::test_crash_and_resume_reproduce_the_uninterrupted_losses_bit_for_bit",
    "tests/test_mount.py::test_the_mount_outlives_an_s3_outage_and_follows_the_stream_again",
    "tests/test_elastic_torch.py::",
    "tests/test_reshape.py::test_a_new_global_batch_",
    "tests/test_bench.py::",
    "tests/test_mixture.py::test_two_producers_each_a_shard_of_three_sources_under_a_schedule_one_killed",
    "tests/test_crash.py::test_exactly_once_under_sigkill",
    "tests/test_transform.py::test_workers_give_the_same_stream_and_stats",
    "tests/test_transform.py::test_sigkill_mid_expansion_then_rerun_commits_every_output_once",
    "tests/test_outage.py::",
    "tests/test_dev_s3.py::",
    "tests/test_leftovers.py::test_a_packer_killed_after_its_finish_packs_on_its_next_run",
]


def group_of(nodeid: str) -> str:
    """The unit a test belongs to: its group, or the test itself."""
    return next((group for prefix, group in GROUPS if nodeid.startswith(prefix)), nodeid)


def is_slow(nodeid: str) -> bool:
    """Whether a test is one of the longest (FIRST): conftest.py marks those `slow`."""
    return rank(group_of(nodeid)) < len(FIRST)


def rank(unit: str) -> int:
    """Where a unit starts: its place in FIRST, else after all of them."""
    return next((i for i, p in enumerate(FIRST) if unit == p or unit.startswith(p)), len(FIRST))


class _Queue(OrderedDict[str, Any]):
    """The scheduler's queue of units: taken from the front by rank, then in the order they were added."""

    def popitem(self, last: bool = True) -> tuple[str, Any]:
        unit = min(self, key=rank) if not last else next(reversed(self))
        return unit, self.pop(unit)


class Scheduling(LoadScopeScheduling):
    """xdist's `loadscope` scheduler with the units and the order above."""

    def __init__(self, config: Any, log: Any = None) -> None:
        super().__init__(config, log)
        self.workqueue = _Queue()

    def _split_scope(self, nodeid: str) -> str:
        return group_of(nodeid)
