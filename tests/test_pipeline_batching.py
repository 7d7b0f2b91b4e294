"""`produce` reads its source ahead in a thread of its own and puts the samples from the event loop.

Whatever was read ahead, the stream holds exactly what putting the source's samples one by one gives:
the committed keys, in order, are a prefix of the source's sequence and the committed cursor is the
one of the last of them (plain, `{"at", "skip"}` inside an expanded record, `{"sources": ...}` for a
mixture); an error of the source is raised after every sample before it was put; a source that
gives its samples one at a time has each committed before it gives the next; SIGKILL and a rerun
commit every sample exactly once.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from cliutil import describe, run_cli, spawn_cli, wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_sources import make_parquet, make_wds
from test_transform import MAP_MODULE, expected_keys

import lakestream
from lakestream import _pipeline
from lakestream._batching import mix_counts
from lakestream._transform import transform

# -- sources and a map, in process -------------------------------------------------------------------


@dataclass(frozen=True)
class Counted:
    """`n` samples `<prefix>-<i>`; the cursor is the count consumed. Reading sample `fail_at` raises
    InvalidSample, as a source does on a corrupt record."""

    n: int
    prefix: str = "k"
    fail_at: int | None = None

    def iterate(self, cursor: Any = None) -> Iterator[tuple[dict[str, Any], Any]]:
        assert cursor is None or isinstance(cursor, int), cursor
        return self._samples(cursor or 0)

    def _samples(self, start: int) -> Iterator[tuple[dict[str, Any], Any]]:
        for i in range(start, self.n):
            if i == self.fail_at:
                raise lakestream.InvalidSample(f"{self.prefix}: sample {i} is unreadable")
            yield {"__key__": f"{self.prefix}-{i:04d}", "v": i.to_bytes(4, "big")}, i + 1


def expand(sample: dict[str, Any]) -> Any:
    """Deterministic: every third record into two samples, some dropped, the rest as they are."""
    i = int(sample["__key__"].rsplit("-", 1)[1])
    if i % 3 == 0:
        return [{**sample, "part": b"a"}, {**sample, "part": b"b"}]
    if i % 5 == 1:
        return None
    return sample


def sequence(src: Counted, mapped: bool) -> list[tuple[str, Any]]:
    """(key, cursor) of every sample `src` gives (through `expand` when `mapped`), one by one."""
    it = Counted(src.n, src.prefix).iterate()
    return [(s["__key__"], c) for s, c in (transform(it, expand) if mapped else it)]


def outputs_before(src: Counted, mapped: bool) -> int:
    """How many samples come before the failing record of `src`."""
    assert src.fail_at is not None
    return len(sequence(Counted(src.fail_at, src.prefix), mapped))


async def committed(url: str) -> tuple[list[str], Any]:
    """Every committed key in step order (world size 1), and producer p's committed cursor."""
    keys: list[str] = []
    async with lakestream.open_reader(url, 0) as r:
        async for batch in r.steps(r.state.first_step, r.state.head + 1):
            keys += [s["__key__"] for s in batch.samples]
    p = (await lakestream.load_state(url)).producers.get("p")
    return keys, p.cursor if p is not None else None


def run(url: str, source: Any, **kw: Any) -> tuple[lakestream.ProduceReport | None, BaseException | None, Any]:
    """`produce` into `url` as producer p: (report, None) or (None, the error), and the producer."""
    opened: list[Any] = []

    async def main() -> lakestream.ProduceReport:
        return await lakestream.produce(url, "p", source, on_open=opened.append, **kw)

    try:
        return anyio.run(main), None, opened[-1]
    except (lakestream.LakestreamError, ValueError) as e:
        return None, e, opened[-1] if opened else None


def assert_prefix(keys: list[str], cursor: Any, seq: list[tuple[str, Any]]) -> None:
    """The committed keys are the first len(keys) of `seq`, and the cursor is the last one's."""
    assert keys == [k for k, _ in seq[: len(keys)]]
    assert cursor == (seq[len(keys) - 1][1] if keys else None)


# -- one source: the same keys and cursors as one sample at a time -----------------------------------


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(0, 70),
    batch=st.integers(1, 9),
    mapped=st.booleans(),
    fail=st.one_of(st.none(), st.floats(0, 1, exclude_max=True)),
    drop_last=st.booleans(),
    limit=st.integers(1, 40),
)
def test_one_source_commits_exactly_what_one_by_one_would(
    n: int, batch: int, mapped: bool, fail: float | None, drop_last: bool, limit: int
) -> None:
    """A first run fails at a random sample, a second runs to the end: the stream holds the
    source's sequence once, in order, with its cursors, however far the source was read ahead."""
    fail_at = int(fail * n) if fail is not None and n else None
    seq = sequence(Counted(n), mapped)
    kw: dict[str, Any] = {"map": expand} if mapped else {}
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        mp.setattr(_pipeline, "READ_AHEAD", limit)
        url = f"file://{tmp}/s"
        anyio.run(lambda: lakestream.create(url, world_size=1, global_batch=batch))
        if fail_at is not None:
            failing = Counted(n, fail_at=fail_at)
            report, error, p = run(url, failing, drop_last=drop_last, **kw)
            assert isinstance(error, lakestream.InvalidSample) and f"sample {fail_at} is unreadable" in str(error)
            before = outputs_before(failing, mapped)
            # every sample before the failing one was put, in whole global batches with drop_last
            assert p.stats.samples == (before // batch * batch if drop_last else before)
            assert_prefix(*anyio.run(committed, url), seq)
        report, error, _ = run(url, Counted(n), drop_last=drop_last, **kw)
        assert error is None and report is not None
        keys, cursor = anyio.run(committed, url)
        whole = len(seq) // batch * batch if drop_last else len(seq)
        assert len(keys) == whole and report.held_back == len(seq) - whole
        assert_prefix(keys, cursor, seq)


# -- a mixture: each global batch takes its shares, each source exactly its prefix -------------------


def draws(
    seqs: dict[str, list[tuple[str, Any]]], batch: int, after: Sequence[tuple[str, str, Any]] = ()
) -> tuple[list[tuple[str, str, Any]], str]:
    """(source, key, cursor of the source) in the order one-by-one draws put them in a run that
    resumes `after` the draws committed before: each global batch takes each source's
    largest-remainder share in turn (equal weights), until a source ends; and the source that ended."""
    counts = mix_counts([(name, 1.0) for name in seqs], batch)
    at = dict.fromkeys(seqs, 0)
    for name, _, _ in after:
        at[name] += 1
    out = list(after)
    while True:
        for name, c in counts.items():
            for _ in range(c):
                if at[name] == len(seqs[name]):
                    return out, name
                key, cursor = seqs[name][at[name]]
                out.append((name, f"{name}-{key}", cursor))
                at[name] += 1


def mixture_cursor(drawn: list[tuple[str, str, Any]]) -> Any:
    """The cursor committed with the last of `drawn`: each source's cursor after its last sample."""
    if not drawn:
        return None
    return {"sources": {name: cursor for name, _, cursor in drawn}}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.tuples(st.integers(0, 40), st.integers(0, 40)),
    batch=st.integers(1, 7),
    mapped=st.booleans(),
    fail=st.one_of(st.none(), st.tuples(st.sampled_from("ab"), st.floats(0, 1, exclude_max=True))),
    limit=st.integers(1, 12),
)
def test_a_mixture_commits_exactly_the_shares_one_by_one_would(
    sizes: tuple[int, int], batch: int, mapped: bool, fail: tuple[str, float] | None, limit: int
) -> None:
    """Sources read ahead further than a share needs keep the rest for the next batch: the stream
    holds each batch's shares in order, with the per-source cursors of one-by-one draws."""
    names = dict(zip("ab", sizes, strict=True))
    seqs = {name: sequence(Counted(size, name), mapped) for name, size in names.items()}
    want, _ = draws(seqs, batch)
    kw: dict[str, Any] = {"map": expand} if mapped else {}
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        mp.setattr(_pipeline, "READ_AHEAD", limit)
        url = f"file://{tmp}/s"
        anyio.run(lambda: lakestream.create(url, world_size=1, global_batch=batch))
        if fail is not None and names[fail[0]]:
            bad, at = fail[0], int(fail[1] * names[fail[0]])
            sources = {name: Counted(size, name, at if name == bad else None) for name, size in names.items()}
            report, error, p = run(url, sources, **kw)
            # one by one, the bad source raises when a draw asks it for the output after the last
            # one before its failing record; the draws before that one are put
            before = outputs_before(sources[bad], mapped)
            put, ended = draws({**seqs, bad: seqs[bad][:before]}, batch)
            if ended == bad:
                assert isinstance(error, lakestream.InvalidSample), (error, report)
                assert p.stats.samples == len(put)
            else:
                assert error is None, error
            keys, cursor = anyio.run(committed, url)
            assert keys == [k for _, k, _ in want[: len(keys)]] and cursor == mixture_cursor(want[: len(keys)])
            want, _ = draws(seqs, batch, after=want[: len(keys)])  # the rerun starts a new global batch
        report, error, _ = run(url, {name: Counted(size, name) for name, size in names.items()}, **kw)
        assert error is None and report is not None
        keys, cursor = anyio.run(committed, url)
        assert keys == [k for _, k, _ in want] and cursor == mixture_cursor(want)


# -- a slow source, an error in the middle of what was read ahead -------------------------------------


@dataclass(frozen=True)
class OneAtATime:
    """`n` samples; each one is given only once the one before it was committed (or after `patience`
    seconds: then it raises, and the run fails)."""

    n: int
    producer: list[Any]  # filled by on_open
    patience: float = 60.0

    def iterate(self, cursor: Any = None) -> Iterator[tuple[dict[str, Any], Any]]:
        for i in range(cursor or 0, self.n):
            if i > 0:
                give_up = time.monotonic() + self.patience
                while not (self.producer and self.producer[-1].stats.tgbs_committed >= i):
                    if time.monotonic() > give_up:
                        raise lakestream.InvalidSample(f"sample {i - 1} was read but never committed")
                    time.sleep(0.005)
            yield {"__key__": f"k-{i:04d}", "v": b"x"}, i + 1


@pytest.mark.parametrize("mixed", [False, True])
def test_a_source_that_gives_one_sample_at_a_time_has_each_committed(tmp_path: Path, mixed: bool) -> None:
    """The producer never waits for more samples than the source has given: each sample is put and
    committed while the source waits for exactly that before it gives the next."""
    url = f"file://{tmp_path}/s"
    anyio.run(lambda: lakestream.create(url, world_size=1, global_batch=1))
    opened: list[Any] = []
    src = OneAtATime(12, opened)
    source: Any = {"a": src} if mixed else src

    async def main() -> lakestream.ProduceReport:
        return await lakestream.produce(url, "p", source, on_open=opened.append)

    report = anyio.run(main)
    assert report.stats.samples == 12 and report.stats.tgbs_committed == 12
    keys, cursor = anyio.run(committed, url)
    want = [f"k-{i:04d}" for i in range(12)]
    assert keys == ([f"a-{k}" for k in want] if mixed else want)
    assert cursor == ({"sources": {"a": 12}} if mixed else 12)


def test_a_slow_source_is_taken_a_global_batch_at_a_time() -> None:
    """Waiting on a slow source (a decode), the feed takes what completes the open global batch in
    one wait, not a sample a thread hop; and never waits for more than the source will give."""

    def slow(n: int) -> Iterator[tuple[int, int]]:
        for i in range(n):
            time.sleep(0.01)
            yield i, i + 1

    async def takes(n: int, want: int) -> list[int]:
        reader = _pipeline._ReadAhead(slow(n))
        sizes = []
        try:
            while (items := await reader.take(want, gather=_pipeline.FILL_WAIT)) is not None:
                sizes.append(len(items))
        finally:
            await anyio.to_thread.run_sync(reader.stop)
        return sizes

    assert anyio.run(takes, 24, 8) == [8, 8, 8]
    assert anyio.run(takes, 5, 8) == [5]  # the source ended: what it gave, at once


def test_an_error_of_the_source_comes_after_the_samples_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The source fails at sample 40 of 100, which it reads in one go with the samples before it
    (up to 64 ahead): exactly those 40 are put, then the source's own error is raised; a rerun
    continues from the committed cursor."""
    monkeypatch.setattr(_pipeline, "READ_AHEAD", 64)
    url = f"file://{tmp_path}/s"
    anyio.run(lambda: lakestream.create(url, world_size=1, global_batch=4))
    report, error, p = run(url, Counted(100, fail_at=40))
    assert isinstance(error, lakestream.InvalidSample) and "sample 40 is unreadable" in str(error), error
    assert report is None and p.stats.samples == 40
    keys, cursor = anyio.run(committed, url)
    assert_prefix(keys, cursor, sequence(Counted(100), False))
    report, error, _ = run(url, Counted(100))
    assert error is None and report is not None
    assert anyio.run(committed, url) == ([f"k-{i:04d}" for i in range(100)], 100)


# -- SIGKILL and a rerun, through the command ----------------------------------------------------------


def stream_keys(url: str, world: int) -> list[str]:
    """Every committed key (all ranks), asserting none twice."""

    async def main() -> list[str]:
        keys: list[str] = []
        for rank in range(world):
            async with lakestream.open_reader(url, rank) as r:
                async for batch in r.steps(r.state.first_step, r.state.head + 1):
                    keys += [s["__key__"] for s in batch.samples]
        return keys

    keys = anyio.run(main)
    assert len(keys) == len(set(keys)), "a key committed twice"
    return keys


def kill_then_rerun(url: str, command: list[Any], env: dict[str, str], steps: int) -> None:
    """Start `command`, SIGKILL it once `steps` steps are committed, then run it again (without --rate)."""
    proc = spawn_cli(*command, "--rate", 40, env=env)
    try:
        wait_until(lambda: anyio.run(lakestream.load_state, url).head >= steps - 1, timeout=60, what=f"{steps} steps")
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    assert proc.returncode == -9, proc.returncode  # killed, not ended by itself
    r = run_cli(*command, env=env, check=True)
    assert "resumed at" in r.stdout, describe(r)
    run_cli("verify", url, check=True)


def test_sigkill_mid_expansion_then_rerun_commits_every_output_once(stream_url: str, tmp_path: Path) -> None:
    """wds shards through an expanding --map (cursors inside records), killed, then run again."""
    (tmp_path / "mod").mkdir()
    (tmp_path / "mod" / "mymap.py").write_text(MAP_MODULE)
    env = {"PYTHONPATH": str(tmp_path / "mod")}
    make_wds(tmp_path / "wds", 3, 20)
    url = stream_url
    run_cli("init", url, "--world-size", 2, "--global-batch", 3, check=True)
    command = ["produce", url, "--producer-id", "p", "--source", f"wds:{tmp_path}/wds/*.tar", "--map", "mymap:fn",
               "--max-inflight-bytes", 1]  # fmt: skip
    kill_then_rerun(url, command, env, steps=5)
    assert sorted(stream_keys(url, 2)) == sorted(expected_keys(3, 20))


def test_sigkill_mid_mixture_then_rerun_commits_each_source_once(tmp_path: Path) -> None:
    """A wds and a parquet source mixed, killed, then run again: each source's samples once, a prefix
    of its own sequence, and every full global batch holds each source's share."""
    make_wds(tmp_path / "wds", 2, 30)
    make_parquet(tmp_path / "pq", 3, 40)
    url = f"file://{tmp_path}/stream"
    run_cli("init", url, "--world-size", 2, "--global-batch", 5, check=True)
    run_cli("mix", url, "--weights", "w=2,t=3", check=True)
    command = ["produce", url, "--producer-id", "p", "--source", f"w=wds:{tmp_path}/wds/*.tar",
               "--source", f"t=parquet:{tmp_path / 'pq'}", "--max-inflight-bytes", 1]  # fmt: skip
    kill_then_rerun(url, command, {}, steps=4)
    keys = stream_keys(url, 2)
    wds = [f"w-s{s:03d}-{i:04d}" for s in range(2) for i in range(30)]
    pq = [f"t-part-{f:02d}-{r:09d}" for f in range(3) for r in range(40)]  # parquet's default keys
    got_w, got_t = sorted(k for k in keys if k.startswith("w-")), sorted(k for k in keys if k.startswith("t-"))
    assert got_w == wds and got_t == pq[: len(got_t)]  # wds ended first: 60 samples, 2 of every 5
    assert len(got_t) == 90 and len(keys) == 150
