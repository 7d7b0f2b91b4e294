"""A producer fleet on Ray (extra `ray`): `lakestream fleet` and `run_fleet`.

    report = lakestream.ray.run_fleet("s3://bucket/run1", "wds:/data/train-{000..127}.tar", 8,
                                      map="mypipeline:decode", workers_per_producer=2)

Producer i of N is a Ray actor running `lakestream.produce(url, f"{name}-{i}", source, shard=(i, N), ...)`
in its own worker process, so whatever ends that process (SIGKILL, OOM, a lost node) ends the producer
with it. Ray restarts a dead actor (`max_restarts`) and runs its task again (`max_task_retries`); the new
incarnation registers the same producer id, which fences anything the old one left behind, and resumes
from its committed cursor: nothing is produced twice or lost.

The figures of the report come from the stream, not from the actors: the steps, samples and bytes
the fleet's producer ids committed between the start and the end of the run, read from the
manifest, so they are exact whatever died and restarted in between. Restarts are counted by the
incarnations themselves (see `_Ledger`).
"""

from __future__ import annotations

import logging
import os
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import anyio

from ._errors import ConfigMismatch, LakestreamError, first_error
from ._transform import load_function
from .sources import HfSource, ParquetSource, WdsSource, open_source

__all__ = ["FleetReport", "run_fleet"]

log = logging.getLogger("lakestream.fleet")

#: Environment variables passed on to the actors (with PYTHONPATH): S3 and Azure endpoints and
#: credentials, Hugging Face caches, lakestream's own.
ENV_PREFIXES = ("AWS_", "AZURE_", "HF_", "LAKESTREAM_")


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
    closed_after: int | None = None  # with close: the step the stream was closed after

    @property
    def ok(self) -> bool:
        return not self.failed

    def to_dict(self) -> dict[str, Any]:
        return {
            "producers": self.producers, "samples": self.samples, "steps": self.steps, "bytes": self.bytes,
            "restarts": self.restarts, "skipped": self.skipped, "failed": self.failed, "seconds": self.seconds,
            "closed_after": self.closed_after, "ok": self.ok,
        }  # fmt: skip

    def summary(self) -> str:
        return (
            f"fleet of {self.producers}: {self.samples} samples, {self.steps} steps, {self.bytes / 1e6:.1f} MB, "
            f"{self.restarts} restarts, {len(self.skipped)} skipped in {self.seconds:.1f} s"
            + "".join(f"; {p} failed: {why}" for p, why in self.failed.items())
            + (f"; the stream is closed after step {self.closed_after}" if self.closed_after is not None else "")
        )

    def reason(self) -> str:
        """Why the run failed, one line: the producers that failed for the first reason, and how many
        others failed otherwise ("" when none failed)."""
        if not self.failed:
            return ""
        first = next(iter(self.failed.values()))
        same = [p for p, why in self.failed.items() if why == first]
        others = len(self.failed) - len(same)
        return f"{', '.join(same)} failed: {first}" + (f" (and {others} more failed otherwise)" if others else "")


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
    drop_last: bool = False,
    max_restarts: int = -1,
    ray_address: str | None = None,
    metrics_port: int | None = None,
    metrics_addr: str = "127.0.0.1",
    close: bool = False,
) -> FleetReport:
    """Run `producers` producer actors on Ray until every one has finished its share of `source`.

    The actors run on the cluster at `ray_address`, else at `RAY_ADDRESS`, else on a local cluster
    started for the run and shut down after it (when this process is already connected to Ray,
    that connection is used). The stream must exist. Each actor asks for `0.5 + workers_per_producer`
    CPUs. `max_restarts` bounds the restarts of each actor (-1: no limit). With `metrics_port`,
    actor i serves its Prometheus metrics at `metrics_addr:metrics_port + i` on its node.

    Every producer id is registered before any actor starts, so that one whose share ends before
    another actor has started holds its partial last global batch back: the last producer to finish
    packs them (only the stream's last step is short). `drop_last`: each producer commits whole
    global batches only, as `produce --drop-last`. `close`: once every actor has finished, and every
    other producer of the stream too (waiting for them), close the stream after its last step
    (`lakestream.close_when_done`); not when a producer failed for good.

    Before the cluster is reached, the source is opened here (it must open here as on the cluster) and
    must hold a file (hf: a row) for every producer, and `map` is loaded. A producer that fails for
    good (a damaged source file, a map error with `on_error="fail"`, a ConfigMismatch, restarts
    exhausted) is listed in `FleetReport.failed` with its reason; the others run to the end of their
    shares. Raises StreamNotFound; ValueError for bad arguments, a `map` that does not load or a source
    with fewer files than producers; FileNotFoundError for a source without files; OSError when the
    cluster cannot be reached, ImportError without Ray.
    """
    if producers < 1:
        raise ValueError(f"--producers {producers}: expected at least 1")
    if not name:
        raise ValueError("--name must not be empty")
    if workers_per_producer < 0:
        raise ValueError(f"--workers-per-producer {workers_per_producer}: expected 0 or more")
    if on_error not in ("fail", "skip"):
        raise ValueError(f"--on-error {on_error!r}: expected fail or skip")
    if map is None and (workers_per_producer or on_error != "fail"):
        raise ValueError("--workers-per-producer and --on-error apply to --map")
    if max_restarts < -1:
        raise ValueError(f"--max-restarts {max_restarts}: expected -1 (no limit) or more")

    import lakestream

    ids = [f"{name}-{i}" for i in range(producers)]
    before = anyio.run(lakestream.load_state, url)  # StreamNotFound before anything starts
    _check_producers(url, before, name, producers)
    if map is not None:
        load_function(map)  # a mistyped --map costs no cluster start
    _check_source(source, producers, key_column=key_column, split=split, epochs=epochs, shuffle_seed=shuffle_seed)
    anyio.run(_register, url, ids)
    options: dict[str, Any] = {
        "map": map, "workers": workers_per_producer, "on_error": on_error, "key_column": key_column,
        "split": split, "epochs": epochs, "shuffle_seed": shuffle_seed, "drop_last": drop_last,
    }  # fmt: skip
    if metrics_port is not None:  # taken out of the options by each actor (`_ProducerActor.run`)
        options["metrics"] = (metrics_port, metrics_addr)
    t0 = time.perf_counter()
    with _connected(ray_address, cpus=producers * _cpus(workers_per_producer)):
        outcomes, incarnations = _run_actors(url, source, ids, options, workers_per_producer, max_restarts)
    after = anyio.run(lakestream.load_state, url)

    report = FleetReport(producers, seconds=time.perf_counter() - t0)
    report.restarts = sum(max(0, n - 1) for n in incarnations.values())
    skipped: set[str] = set()
    for pid in ids:  # in producer order, whatever order they ended in
        outcome = outcomes.get(pid, {})
        if "error" in outcome:
            report.failed[pid] = outcome["error"]
        skipped.update(outcome.get("skipped", ()))
    report.skipped = sorted(skipped)
    _count_committed(report, before, after, ids)
    if close and report.ok:
        report.closed_after = anyio.run(lakestream.close_when_done, url).closed_after
    return report


def _check_producers(url: str, state: Any, name: str, producers: int) -> None:
    """Refuse to run the fleet `name` with another number of producers than its producers in `state` were
    started with: producer i's share of the source is (i, N), which its committed cursor records
    (`"share": [i, N]`), so another N would give it another share (and a new producer a share already
    produced). Producers whose cursor records no share (committed before it was recorded, or by another
    kind of source) tell only that N was above their index. ConfigMismatch naming both numbers."""
    from ._transform import is_sub_cursor

    pattern = re.compile(rf"{re.escape(name)}-(0|[1-9][0-9]*)")
    started: dict[int, list[str]] = {}  # N: the producers started with it
    beyond: list[tuple[int, str]] = []  # (index, id) of producers without a recorded share, index >= producers
    for pid, p in state.producers.items():
        if (m := pattern.fullmatch(pid)) is None or p.cursor is None:
            continue  # not one of the fleet's, or nothing committed
        cursor = p.cursor["at"] if is_sub_cursor(p.cursor) else p.cursor  # inside a record expanded by --map
        share = cursor.get("share") if isinstance(cursor, dict) else None
        if isinstance(share, list) and len(share) == 2 and type(share[1]) is int and share[1] > 0:
            started.setdefault(share[1], []).append(pid)
        elif int(m.group(1)) >= producers:
            beyond.append((int(m.group(1)), pid))
    why = "another number gives every producer another share of the source, producing samples twice or losing them"
    for n, pids in sorted(started.items()):
        if n != producers:
            pids.sort(key=lambda pid: int(pid.rsplit("-", 1)[1]))
            raise ConfigMismatch(
                f"{url}: fleet {name!r} was started with --producers {n} ({', '.join(pids)}), not {producers}: "
                f"{why}; run it with --producers {n}"
            )
    if beyond:
        index, pid = max(beyond)
        raise ConfigMismatch(
            f"{url}: fleet {name!r} was started with --producers {index + 1} or more ({pid} has committed samples), "
            f"not {producers}: {why}; run it with the same --producers"
        )


async def _register(url: str, ids: list[str]) -> None:
    """Register each producer id (its actor registers again): every one counts as producing from now on."""
    import lakestream

    from . import _decisions as decisions
    from ._manifest import Manifest
    from ._records import RegisterRecord
    from ._state import State

    token = f"fleet-{uuid.uuid4().hex}"
    async with lakestream.open_store(url) as store:
        m = Manifest(store)
        await m.load()
        for pid in ids:

            def decide(st: State, _: int, pid: str = pid) -> RegisterRecord | None:
                return decisions.register(st, pid, token, time.time())

            await m.append(decide)


def _check_source(source: str, producers: int, **order: Any) -> None:
    """Refuse a source that does not open here (no file matches, an option that does not apply) or that
    leaves a producer nothing to read: fewer files (hf: rows) than producers, or `dir:` with more than
    one producer. Raises what `open_source` raises, or ValueError."""
    src = open_source(source, **order)
    if producers == 1:
        return
    if not isinstance(src, (WdsSource, ParquetSource, HfSource)):
        raise ValueError(f"--source {source!r}: a fleet of {producers} producers needs a wds:, parquet: or hf: source")
    have, unit = (src.rows, "rows") if isinstance(src, HfSource) else (len(src.share), "files")
    if have < producers:
        raise ValueError(
            f"--source {source!r}: {have} {unit} for --producers {producers}: producers "
            f"{have}..{producers - 1} would have nothing to read; run at most {have} producers"
        )


def _cpus(workers: int) -> float:
    """CPUs one producer actor asks for: half a CPU for the producer (it mostly waits on the store), one per
    map worker process. Four producers without workers fit on two cores."""
    return 0.5 + workers


def _count_committed(report: FleetReport, before: Any, after: Any, ids: list[str]) -> None:
    """Steps, samples and bytes the producers `ids` committed between the states `before` and `after`.

    Steps, samples and bytes are summed over their retained steps with a sequence number above the one
    they had before (a step reclaimed by GC during the run is not in `after` any more: it is not counted)."""
    seq_before = {pid: p.seq for pid, p in before.producers.items()}
    for step in after.steps:
        if step.producer in ids and step.seq > seq_before.get(step.producer, -1):
            report.steps += 1
            report.samples += step.samples
            report.bytes += step.nbytes


#: How many times a local cluster is started before the run fails (see `_connected`).
LOCAL_STARTS = 3


class _connected:
    """Connected to Ray for the block: to `address`, else RAY_ADDRESS, else a new local cluster of at least
    `cpus` CPUs shut down on leaving (started up to LOCAL_STARTS times if it times out starting). An existing
    connection of this process is used as it is."""

    def __init__(self, address: str | None, cpus: float) -> None:
        self.address, self.cpus, self.started = address, cpus, False

    def __enter__(self) -> None:
        import ray

        if ray.is_initialized():
            return
        address = self.address or os.environ.get("RAY_ADDRESS") or "local"
        quiet: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.ERROR}
        if address == "local":
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no notice about usage statistics
            quiet |= {"num_cpus": max(os.cpu_count() or 1, int(-(-self.cpus // 1))), "include_dashboard": False}
        for attempt in range(1, LOCAL_STARTS + 1):
            try:
                ray.init(address=address, **quiet)
                break
            except (ConnectionError, TimeoutError) as e:
                hint = (
                    ""
                    if "RAY_AUTH_MODE" in os.environ
                    else " (a cluster with token authentication needs RAY_AUTH_MODE=token)"
                )
                raise OSError(f"cannot connect to the Ray cluster at {address}: {e}{hint}") from e
            except Exception as e:
                # Ray gives its raylet 30 s to register (a constant in ray/_private/node.py), which a busy machine
                # can exceed; it says so with a bare Exception, told only by its message.
                if address != "local" or "timed out during startup" not in str(e):
                    raise
                if attempt == LOCAL_STARTS:
                    raise OSError(f"a local Ray cluster did not start, {LOCAL_STARTS} times: {e}") from e
                log.warning("a local Ray cluster did not start (%s); starting another", e)
                ray.shutdown()
        log.info("connected to Ray at %s", address)
        self.started = True

    def __exit__(self, *exc: object) -> None:
        if self.started:
            import ray

            ray.shutdown()


def _runtime_env() -> dict[str, Any]:
    """What the actors need of this process's environment: its working directory and PYTHONPATH on their
    PYTHONPATH (so `--map MODULE:FUNCTION` imports there as here, without uploading a working_dir), and
    the variables named by ENV_PREFIXES (S3 and Azure endpoints and credentials)."""
    env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}
    path = [os.getcwd(), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in path if p))
    return {"env_vars": env}


def _run_actors(
    url: str, source: str, ids: list[str], options: dict[str, Any], workers: int, max_restarts: int
) -> tuple[dict[str, dict[str, Any]], dict[int, int]]:
    """Start one actor per producer id and wait for them all: ({producer id: outcome}, {index: incarnations})."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # Restarts are counted by the incarnations themselves: each one records itself in the ledger as it
    # starts. The driver cannot count them: with max_task_retries Ray runs the task again on the restarted
    # actor without the driver seeing an error, and an actor may die again before the driver would have
    # noticed the first death. The ledger lives on this node (it dies with the driver, and only then).
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    ledger_name = f"lakestream-fleet-{uuid.uuid4().hex}"  # found by name: a handle argument would go through
    ledger: Any = ray.remote(_Ledger).options(name=ledger_name, num_cpus=0, scheduling_strategy=here).remote()
    # the object store, where a restarted actor might not find it
    actor_class: Any = ray.remote(_ProducerActor).options(
        num_cpus=_cpus(workers), max_restarts=max_restarts, max_task_retries=-1, runtime_env=_runtime_env()
    )
    actors: list[Any] = [actor_class.remote(ledger_name, i, os.getcwd()) for i in range(len(ids))]
    n = len(ids)
    pending = {
        actor.run.remote(url, pid, source, shard=(i, n), options=options): i
        for i, (pid, actor) in enumerate(zip(ids, actors, strict=True))
    }
    outcomes: dict[str, dict[str, Any]] = {}
    log.info("%d producer actors submitted", n)
    try:
        while pending:
            # A timeout, so that Ctrl-C (handled between waits, not inside one) stops the fleet.
            done, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
            for ref in done:
                i = pending.pop(ref)
                try:
                    outcomes[ids[i]] = ray.get(ref)
                except RayTaskError as e:  # raised in the actor outside produce's own handling
                    outcomes[ids[i]] = {"error": _reason(e.cause if e.cause is not None else e)}
                except RayActorError as e:  # dead for good: restarts exhausted, or its constructor failed
                    outcomes[ids[i]] = {"error": _died(e, max_restarts)}
                log.info("%s: %s", ids[i], outcomes[ids[i]])
                ray.kill(actors[i], no_restart=True)  # frees its CPUs for actors still waiting for some
        incarnations: dict[int, int] = ray.get(ledger.incarnations.remote())
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        ray.kill(ledger, no_restart=True)
    return outcomes, incarnations


def _reason(e: BaseException) -> str:
    """`e` as one line, as the CLI reports errors: the message of the errors Lakestream means to raise, the
    type and message of anything else."""
    if isinstance(e, BaseExceptionGroup):
        e = first_error(e)
    if isinstance(e, (LakestreamError, OSError, ValueError, ImportError)):
        text = str(e) or type(e).__name__
    else:
        text = f"internal error: {type(e).__name__}: {e}"
    return " ".join(text.split())


def _died(e: BaseException, max_restarts: int) -> str:
    """Why an actor is dead for good, one line."""
    from ray.exceptions import RayTaskError

    cause = getattr(e, "cause", None)
    if isinstance(cause, RayTaskError):  # its constructor raised
        return _reason(cause.cause if cause.cause is not None else cause)
    limit = "no restart allowed" if max_restarts == 0 else f"{max_restarts} restarts allowed"
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
    return f"its actor died for good ({limit}): {first}"


class _Ledger:
    """Every producer actor's incarnations: the index of each records itself as it starts."""

    def __init__(self) -> None:
        self.pids: dict[int, list[int]] = {}

    def started(self, index: int, pid: int) -> int:
        """Record an incarnation of actor `index` in process `pid`; how many it has had."""
        self.pids.setdefault(index, []).append(pid)
        return len(self.pids[index])

    def incarnations(self) -> dict[int, int]:
        return {i: len(pids) for i, pids in self.pids.items()}


class _ProducerActor:
    """One producer of the fleet, in its own Ray worker process."""

    def __init__(self, ledger: str, index: int, cwd: str) -> None:
        import ray

        if os.path.isdir(cwd):  # relative paths (a source, a file:// stream) mean what they meant to the driver
            os.chdir(cwd)
        handle: Any = ray.get_actor(ledger)
        self.incarnation: int = ray.get(handle.started.remote(index, os.getpid()))

    def pid(self) -> int:
        return os.getpid()

    def run(self, url: str, producer_id: str, source: str, shard: tuple[int, int], options: dict[str, Any]) -> Any:
        """Produce this actor's share to the end (resuming from its committed cursor); the outcome: the keys
        skipped, or why it failed."""
        import lakestream
        import lakestream.metrics

        serve = options.pop("metrics", None)

        async def produce() -> lakestream.ProduceReport:
            return await lakestream.produce(url, producer_id, source, shard=shard, **options)

        try:
            if serve is not None:  # one endpoint per actor: PORT + its index
                lakestream.metrics.serve(serve[0] + shard[0], serve[1])
            report = anyio.run(produce)
        except (Exception, BaseExceptionGroup) as e:  # reported by the driver, one line
            return {"error": _reason(e)}
        skipped = report.map.skipped if report.map is not None else []
        return {"samples": report.stats.samples, "skipped": skipped, "incarnation": self.incarnation}
