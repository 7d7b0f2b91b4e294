"""Terminal views: `lakestream top` and the progress of long commands (rich, from the `metrics` extra).

`lakestream top URL` shows a stream from its manifest alone, so anyone who can read the stream can
watch it, without any agent: `view(before, after, seconds, now)` turns two manifest states taken
`seconds` apart into one JSON-able dict (what `--once --json` prints; docs/observability.md lists
its members), and `render` draws that dict with rich. The view is a pure function of the two
states, tested without a terminal.

The jobs reading the stream come with their lag: `view` takes the consumption marks `run_top` read
(one small GET per job, beside the manifest) as `marks`.

Rates are over the interval between the two states: steps/s from the TGBs the producers' records
count (so a rewind does not make it negative), commits/s from their commit counts. The conflict
rate is how DAC estimates the loss probability of a put: the races lost by the latest commit of
each producer that committed in the interval, over those races plus those commits.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import anyio

from ._manifest import Manifest
from ._records import MAIN_JOB
from ._state import State
from ._store import open_store
from ._text import safe

__all__ = ["Progress", "progress", "render", "run_top", "view"]

ACTIVE_WINDOW = 10.0  # seconds since its last record within which a producer counts as active
TGB_SAMPLE = 64  # newest steps the TGB size is averaged over when none was committed in the interval


def _rate(delta: float, seconds: float) -> float:
    return round(delta / seconds, 3) if seconds > 0 else 0.0


def view(
    before: State,
    after: State,
    seconds: float,
    now: float,
    url: str = "",
    marks: Mapping[str, tuple[int, float] | None] | None = None,
) -> dict[str, Any]:
    """What `top` shows: `after` (the newer state) with the rates since `before`, taken `seconds`
    earlier; `now` is the wall-clock time of `after` (producers' record times and marks are
    wall-clock). `marks`: (step, time) of each job's consumption mark, by job (absent or None: no mark)."""
    cfg = after.config
    window = max(ACTIVE_WINDOW, 3 * seconds)
    producers: list[dict[str, Any]] = []
    lost = committed = 0
    steps = commits = 0
    for pid, p in sorted(after.producers.items()):
        old = before.producers.get(pid)
        d_tgbs = p.tgbs - (old.tgbs if old is not None else 0)
        d_commits = p.commits - (old.commits if old is not None else 0)
        if old is not None and old.epoch != p.epoch and d_commits < 0:  # counters kept across epochs; guard anyway
            d_tgbs = d_commits = 0
        d_tgbs, d_commits = max(d_tgbs, 0), max(d_commits, 0)
        steps += d_tgbs
        commits += d_commits
        if d_commits:
            lost += p.lost
            committed += 1
        age = now - p.last_ts if p.last_ts else None
        producers.append(
            {
                "id": pid,
                "epoch": p.epoch,
                "active": age is not None and age <= window,
                "last_commit": p.last_ts or None,
                "last_commit_age_seconds": None if age is None else round(age, 3),
                "steps_per_second": _rate(d_tgbs, seconds),
                "commits_per_second": _rate(d_commits, seconds),
                "pace_seconds": round(seconds / d_commits, 3) if d_commits else None,
                "tgbs_per_commit": round(d_tgbs / d_commits, 2) if d_commits else None,
                "lost_races_last_commit": p.lost,
                "tgbs": p.tgbs,
                "commits": p.commits,
            }
        )
    new = [s for s in after.steps if s.step > before.head]
    sample = new or after.steps[-TGB_SAMPLE:]
    base = after.watermark if after.checkpoints else after.first_step - 1
    limit = cfg.max_steps_ahead if cfg is not None else 0
    ahead = after.head - base
    last_cp = after.checkpoints[-1] if after.checkpoints else None
    return {
        "url": url,
        "time": round(now, 3),
        "interval_seconds": round(seconds, 3),
        "version": after.version,
        "head_step": after.head,
        "first_step": after.first_step,
        "world_size": after.world_at(after.head + 1) if cfg is not None else None,
        "global_batch": after.batch_at(after.head + 1) if cfg is not None else None,
        "steps_per_second": _rate(steps, seconds),
        "commits_per_second": _rate(commits, seconds),
        "versions_per_second": _rate(after.version - before.version, seconds),
        "active_producers": sum(1 for p in producers if p["active"]),
        "producers": producers,
        "conflict_rate": round(lost / (lost + committed), 3) if committed else None,
        "tgb": {
            "steps": len(sample),
            "samples": round(sum(s.samples for s in sample) / len(sample), 2) if sample else None,
            "bytes": round(sum(s.nbytes for s in sample) / len(sample)) if sample else None,
        },
        "watermark": after.watermark,
        "last_checkpoint": None if last_cp is None else {"id": last_cp.id, "step": last_cp.step},
        "steps_ahead": ahead,
        "max_steps_ahead": limit,
        "backpressure": bool(limit) and ahead >= limit,
        "gc": {
            "first_step": after.first_step,
            "reclaimed_steps": after.first_step - before.first_step,
            "retained_steps": len(after.steps),
        },
        "rewinds": after.rewinds,
        "jobs": [_job(job, (marks or {}).get(job), after.head, now) for job in [MAIN_JOB, *after.jobs]],
    }


def _job(job: str, mark: tuple[int, float] | None, head: int, now: float) -> dict[str, Any]:
    step, ts = mark if mark is not None else (None, None)
    return {
        "job": job,
        "consumed": step,
        "lag": None if step is None else head - step,
        "mark_age_seconds": None if ts is None else round(now - ts, 3),
    }


# -- rendering ------------------------------------------------------------------------------------------


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    if seconds < 120:
        return f"{seconds:.1f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def render(v: dict[str, Any]) -> Any:
    """The view as a rich renderable: the stream's figures, one row per producer, then (once there is more
    than `main`) one row per job. Strings of the view are shown as text, never as rich markup, with what
    a terminal would interpret escaped (`safe`)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    conflict = "-" if v["conflict_rate"] is None else f"{v['conflict_rate']:.0%}"
    cp = v["last_checkpoint"]
    gc = v["gc"]
    limit = v["max_steps_ahead"] or "no limit"
    rows = [
        ("stream", f"{v['url']}  (version {v['version']}, world size {v['world_size']}, "
                   f"global batch {v['global_batch']})"),
        ("head step", f"{v['head_step']}  {v['steps_per_second']:.2f} steps/s, {v['commits_per_second']:.2f} "
                      f"commits/s"),
        ("producers", f"{v['active_producers']} active of {len(v['producers'])}, conflict rate {conflict}"),
        ("TGB", f"{v['tgb']['samples'] or 0:g} samples, {_bytes(v['tgb']['bytes'])} (mean of {v['tgb']['steps']})"),
        ("watermark", f"{v['watermark']}" + (f" (checkpoint {cp['id']})" if cp else " (no checkpoint)")
                      + f", {v['steps_ahead']} steps ahead of it (max {limit})"),
        ("back-pressure", Text("producers held", style="bold red") if v["backpressure"] else "no"),
        ("gc", f"steps below {gc['first_step']} reclaimed ({gc['reclaimed_steps']} in the last "
               f"{v['interval_seconds']:.1f} s), {gc['retained_steps']} retained"),
    ]  # fmt: skip
    for name, value in rows:  # text, not markup: ids and the URL come from the store and the user
        head.add_row(name, Text(safe(value)) if isinstance(value, str) else value)
    table = Table(expand=False)
    for col in ("producer", "epoch", "last commit", "steps/s", "pace", "TGBs/commit", "lost races"):
        table.add_column(col, justify="left" if col == "producer" else "right")
    for p in v["producers"]:
        style = None if p["active"] else "dim"
        pace = "-" if p["pace_seconds"] is None else f"{p['pace_seconds']:.2f} s"
        per = "-" if p["tgbs_per_commit"] is None else f"{p['tgbs_per_commit']:g}"
        table.add_row(
            Text(safe(p["id"])), str(p["epoch"]), _age(p["last_commit_age_seconds"]), f"{p['steps_per_second']:.2f}",
            pace, per, str(p["lost_races_last_commit"]), style=style,
        )  # fmt: skip
    if len(v["jobs"]) <= 1:  # `main` alone: the watermark and back-pressure lines say it
        return Group(head, table)
    jobs = Table(expand=False)
    for col in ("job", "consumed", "steps behind head", "mark"):
        jobs.add_column(col, justify="left" if col == "job" else "right")
    for j in v["jobs"]:
        none = j["consumed"] is None
        jobs.add_row(
            Text(safe(j["job"])), "-" if none else str(j["consumed"]), "-" if none else str(j["lag"]),
            _age(j["mark_age_seconds"]),
        )  # fmt: skip
    return Group(head, table, jobs)


# -- the command ---------------------------------------------------------------------------------------


async def run_top(url: str, *, interval: float = 2.0, once: bool = False, as_json: bool = False) -> int:
    """`lakestream top`: follow the stream's manifest (reads only) and show the view every `interval`
    seconds until interrupted (`once`: one view, after one interval); `as_json`: each view as one
    line of JSON instead of a table."""
    import orjson
    from rich.console import Console
    from rich.live import Live

    if not interval > 0:
        raise ValueError(f"--interval must be a positive number of seconds, got {interval!r}")
    async with open_store(url) as store:
        m = Manifest(store, retries=8 if once else None)  # live: an outage is waited out
        await m.load()
        before, t0 = m.state.copy(), time.monotonic()
        live = None if once or as_json else Live(console=Console(), auto_refresh=False)
        with live if live is not None else contextlib.nullcontext():
            while True:
                await anyio.sleep(interval)
                await m.refresh()
                now = time.monotonic()
                after = m.state.copy()
                marks = {job: await m.read_mark(job) for job in [MAIN_JOB, *after.jobs]}
                v = view(before, after, now - t0, time.time(), store.url, marks)
                if as_json:
                    sys.stdout.write(orjson.dumps(v).decode() + "\n")
                    sys.stdout.flush()
                elif live is None:
                    Console().print(render(v))
                else:
                    live.update(render(v), refresh=True)
                if once:
                    return 0
                before, t0 = after, now


# -- progress ------------------------------------------------------------------------------------------


class Progress:
    """Progress bars on stderr when it is a terminal (rich); otherwise every call does nothing."""

    def __init__(self, bars: Any = None) -> None:
        self._bars = bars
        self._tasks: dict[str, Any] = {}

    def __bool__(self) -> bool:
        """Whether bars are shown."""
        return self._bars is not None

    def update(self, what: str, done: float, total: float | None = None) -> None:
        """Set `what`'s progress to `done` of `total` (None: unknown, a counter), creating its bar."""
        if self._bars is None:
            return
        task = self._tasks.get(what)
        if task is None:
            task = self._tasks[what] = self._bars.add_task(what, total=total)
        self._bars.update(task, completed=done, total=total)

    def __call__(self, what: str, done: int, total: int) -> None:
        """The `(what, done, total)` callback GC takes."""
        self.update(what, done, total)


@contextmanager
def progress(unit: str = "") -> Iterator[Progress]:
    """Progress bars on stderr while the block runs, if stderr is a terminal and rich is installed;
    else a Progress that shows nothing (logs and pipes stay clean)."""
    try:
        if not sys.stderr.isatty():
            raise ImportError
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as Bars
    except ImportError:
        yield Progress()
        return
    columns = [
        TextColumn("{task.description:<14}"), BarColumn(), MofNCompleteColumn(), TaskProgressColumn(),
        TextColumn(unit), TimeElapsedColumn(),
    ]  # fmt: skip
    with Bars(*columns, console=Console(stderr=True), transient=False) as bars:
        yield Progress(bars)
