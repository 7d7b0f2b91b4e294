"""Step-aligned data mixtures: the pure share rule, mix records in the state machine, and producers
drawing from three named sources under a schedule of mixes, SIGKILLed and started again."""

from __future__ import annotations

import json
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import pytest
from cliutil import describe, run_cli, spawn_cli, wait_until
from hypothesis import given
from hypothesis import strategies as st
from mountutil import MountProc, read_tree
from test_sources import make_wds

import lakestream
from lakestream import _decisions as decisions
from lakestream._batching import mix_counts
from lakestream._config import Config
from lakestream._records import CommitRecord, CreateRecord, MixRecord, RegisterRecord, TgbRef, encode_record
from lakestream._state import State

# -- the rule -----------------------------------------------------------------------------------------

weights_st = st.lists(st.just(0.0) | st.floats(1e-6, 100), min_size=1, max_size=12).filter(lambda w: sum(w) > 0)


@given(weights_st, st.integers(0, 5000))
def test_shares_add_up_and_stay_within_one_of_the_exact_share(ws: list[float], batch: int) -> None:
    weights = [(f"s{i}", w) for i, w in enumerate(ws)]
    counts = mix_counts(weights, batch)
    assert sum(counts.values()) == batch and list(counts) == [n for n, _ in weights]
    for name, w in weights:
        exact = w / sum(ws) * batch
        assert int(exact) <= counts[name] <= int(exact) + 1
    assert mix_counts(weights, batch) == counts  # deterministic


@given(weights_st, st.integers(1, 5000), st.floats(0.01, 100))
def test_shares_do_not_depend_on_the_scale_of_the_weights(ws: list[float], batch: int, scale: float) -> None:
    a = mix_counts([(f"s{i}", w) for i, w in enumerate(ws)], batch)
    b = mix_counts([(f"s{i}", w * scale) for i, w in enumerate(ws)], batch)
    assert sum(abs(a[k] - b[k]) for k in a) <= 2 * len(ws)  # only float rounding of the remainders may differ


def test_largest_remainder_examples() -> None:
    assert mix_counts([("web", 0.6), ("code", 0.3), ("math", 0.1)], 10) == {"web": 6, "code": 3, "math": 1}
    assert mix_counts([("a", 1), ("b", 1), ("c", 1)], 10) == {"a": 4, "b": 3, "c": 3}
    assert mix_counts([("a", 0.55), ("b", 0.45)], 3) == {"a": 2, "b": 1}


# -- records and state --------------------------------------------------------------------------------


def state_with_producer() -> State:
    s = State()
    for v, r in enumerate([CreateRecord(Config(2, 10)), RegisterRecord("p", 1, "t")]):
        assert s.apply(v, encode_record(r)) is None
    return s


def tgb(seq: int, mix: int | None, sources: dict[str, int] | None) -> CommitRecord:
    n = sum(sources.values()) if sources else 10
    ref = TgbRef(f"segments/p/{seq}", ((0, 5, 0, n - n // 2), (5, 5, 0, n // 2)), seq + 1, mix, None)
    if sources is not None:
        ref = TgbRef(ref.segment, ref.ranks, ref.cursor, mix, tuple(sources.items()))
    return CommitRecord("p", 1, seq, (ref,))


def test_commits_under_a_mix_must_hold_its_shares_and_name_its_version() -> None:
    s = state_with_producer()
    record = decisions.mix(s, [("web", 6), ("code", 3), ("math", 1)], now=0.0)
    assert record is not None and s.apply(2, encode_record(record)) is None
    assert s.mix_at(0) is not None and s.mix_at(0).version == 2  # type: ignore[union-attr]
    for bad in (
        tgb(0, None, None),  # sealed under no mix
        tgb(0, 9, {"web": 6, "code": 3, "math": 1}),  # another mix's version
        tgb(0, 2, {"web": 5, "code": 4, "math": 1}),  # not the shares
        tgb(0, 2, {"web": 6, "code": 3, "other": 1}),  # a source the mix does not name
        tgb(0, 2, {"web": 7, "code": 1}),  # a short TGB with more than a share
    ):
        why = s.check(bad)
        assert why is not None, bad
    assert s.check(tgb(0, 2, {"web": 6, "code": 3, "math": 1})) is None
    assert s.check(tgb(0, 2, {"web": 4, "code": 1})) is None  # short (a source ended): at most each share
    assert s.apply(3, encode_record(tgb(0, 2, {"web": 6, "code": 3, "math": 1}))) is None
    with pytest.raises(ValueError, match="not committed yet"):
        decisions.mix(s, [("web", 1)], from_step=0, now=0.0)  # step 0 is committed
    later = decisions.mix(s, [("web", 1), ("code", 1)], from_step=5, now=0.0)
    assert later is not None and s.apply(4, encode_record(later)) is None
    again = State.from_json(s.to_json())
    assert again.mixes == s.mixes and again.to_dict() == s.to_dict()
    assert s.check_last_record(encode_record(later)) is None
    assert [m.from_step for m in s.mixes] == [0, 5] and s.mix_at(4).version == 2  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "weights",
    [[], [["a", -1]], [["a", 0]], [["a", 1], ["a", 2]], [["a/b", 1]], [["a", "1"]], [["a", float("inf")]]],
)
def test_bad_weights_are_refused(weights: list[Any]) -> None:
    s = state_with_producer()
    data = json.dumps({"kind": "mix", "from_step": 0, "weights": weights}).encode().replace(b"Infinity", b"1e999")
    assert s.apply(2, data) is not None and s.mixes == []
    with pytest.raises(ValueError):
        decisions.mix(s, weights, now=0.0)


def test_a_tgb_sealed_under_other_weights_is_never_committed() -> None:
    s = state_with_producer()
    assert s.apply(2, encode_record(MixRecord(0, (("a", 1.0), ("b", 1.0))))) is None

    class Pending:
        seq, ref = 0, TgbRef("segments/p/0", ((0, 5, 0, 5), (5, 5, 0, 5)), 1, None, None)

    with pytest.raises(lakestream.MixChanged, match="start again"):
        decisions.commit(s, "p", 1, [Pending()], 0, 0.0)  # type: ignore[list-item]


def test_verify_checks_each_steps_sources_against_the_mix_in_force(tmp_path: Path) -> None:
    """The manifest holds each TGB's count per source; verify checks the samples' own `__source__`
    fields against the shares of the mix in force, so a writer that labels samples wrongly is caught."""
    url = f"file://{tmp_path}/s"

    async def write(labels: list[str], run: int) -> None:
        async with lakestream.open_producer(url, "p") as p:
            version, _ = p.mix_now()
            for i, (name, label) in enumerate(zip(["a"] * 3 + ["b"] * 1, labels)):
                await p.put({"__key__": f"{name}-{run}-{i}", "__source__": label}, source=name, mix=version)

    async def setup() -> None:
        await lakestream.create(url, world_size=2, global_batch=4)
        await lakestream.mix(url, {"a": 3, "b": 1})

    anyio.run(setup)
    anyio.run(write, ["a", "a", "a", "b"], 0)
    assert anyio.run(lakestream.verify, url).ok
    anyio.run(write, ["a", "a", "b", "b"], 1)  # the manifest says 3 + 1; the samples say 2 + 2
    report = anyio.run(lakestream.verify, url)
    assert len(report.problems) == 1 and "step 1" in report.problems[0], report.problems
    assert "are not the shares {'a': 3, 'b': 1} of mix version" in report.problems[0]
    r = run_cli("verify", url)
    assert r.returncode != 0 and "step 1" in r.stdout + r.stderr


# -- three sources, a schedule, SIGKILL ---------------------------------------------------------------

SOURCES = {"web": 60, "code": 40, "math": 40}  # samples each (2 tar shards)


def test_three_sources_under_a_schedule_of_mixes_with_a_producer_killed(stream_url: str, tmp_path: Path) -> None:
    url = stream_url
    assert run_cli("init", url, "--world-size", "2", "--global-batch", "10").returncode == 0
    specs = []
    for name, n in SOURCES.items():
        make_wds(tmp_path / name, 2, n // 2, seed=len(name))
        specs += ["--source", f"{name}=wds:{tmp_path}/{name}/train-{{000..001}}.tar"]
    schedule = [(0, "web=0.6,code=0.3,math=0.1"), (4, "web=0.2,code=0.2,math=0.6"), (7, "web=1,code=1,math=0")]
    for step, weights in schedule:
        r = run_cli("mix", url, "--weights", weights, "--from-step", step)
        assert r.returncode == 0, describe(r)
    status = json.loads(run_cli("status", url, "--json").stdout)
    assert [(m["from_step"], m["shares"]) for m in status["mixes"]] == [
        (0, {"web": 6, "code": 3, "math": 1}),
        (4, {"web": 2, "code": 2, "math": 6}),
        (7, {"web": 5, "code": 5, "math": 0}),
    ]

    produce = ["produce", url, "--producer-id", "mixer", *specs]
    proc = spawn_cli(*produce, "--rate", 40)
    try:
        wait_until(lambda: anyio.run(lakestream.load_state, url).head >= 5, what="6 steps")
        proc.send_signal(signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)
    r = run_cli(*produce, "--stats-json")  # the same command again
    assert r.returncode == 0, describe(r)

    state = anyio.run(lakestream.load_state, url)
    seen: Counter[str] = Counter()
    for step in range(state.head + 1):
        samples = anyio.run(step_samples, url, step)
        by_source = Counter(s["__source__"] for s in samples)
        m = state.mix_at(step)
        assert m is not None
        shares = {n: c for n, c in mix_counts(m.weights, 10).items() if c}
        if len(samples) == 10:
            assert dict(by_source) == shares, f"step {step}"
        else:  # the last step: a source ended
            assert step == state.head and all(by_source[n] <= c for n, c in shares.items())
        for s in samples:
            assert s["__key__"].startswith(s["__source__"] + "-")
            seen[s["__key__"]] += 1
    assert max(seen.values()) == 1  # nothing twice
    for name in SOURCES:  # nothing lost: each source's samples are a prefix of its sequence
        got = sorted(k for k in seen if k.startswith(name + "-"))
        want = [f"{name}-s{sh:03d}-{i:04d}" for sh in range(2) for i in range(SOURCES[name] // 2)]
        assert got == want[: len(got)] and got
    ended = [n for n in SOURCES if sum(k.startswith(n + "-") for k in seen) == SOURCES[n]]
    assert ended, "the run stops when a source ends"
    assert run_cli("verify", url).returncode == 0

    mount = MountProc(url, tmp_path / "mnt", tmp_path / "mount.log").start().wait_ready()
    try:
        tree = read_tree(str(mount.mountpoint), [0, 1], state.head + 1)
    finally:
        mount.stop()
    for (rank, step), files in tree.items():
        meta = json.loads(files["_meta.json"])
        assert meta["world_size"] == 2 and meta["sources"] == {k: k.split("-")[0] for k in meta["keys"]}, (rank, step)


async def step_samples(url: str, step: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for rank in range(2):
        async with lakestream.open_reader(url, rank) as r:
            out += (await r.read_step(step)).samples
    return out


# -- two producers, each a shard of every source --------------------------------------------------------


def test_two_producers_each_a_shard_of_three_sources_under_a_schedule_one_killed(
    stream_url: str, tmp_path: Path
) -> None:
    """Producers `a` and `b` draw shards 0/2 and 1/2 of every source. Every step holds the shares of
    the mix in force whichever producer sealed it; `a` is SIGKILLed mid-run and both run again: each
    producer's samples of each source are a prefix of its shard's order, none twice."""
    from lakestream.sources import open_source

    url = stream_url
    assert run_cli("init", url, "--world-size", "2", "--global-batch", "10").returncode == 0
    specs: dict[str, str] = {}
    for name, n in SOURCES.items():  # twice the data: the producer to kill must still be running
        make_wds(tmp_path / name, 4, n // 2, seed=len(name) + 7)
        specs[name] = f"wds:{tmp_path}/{name}/train-{{000..003}}.tar"
    for step, weights in [(0, "web=0.5,code=0.3,math=0.2"), (3, "web=0.2,code=0.2,math=0.6"), (6, "web=1,code=1")]:
        assert run_cli("mix", url, "--weights", weights, "--from-step", step).returncode == 0

    def produce(pid: str, shard: int) -> list[Any]:
        args: list[Any] = ["produce", url, "--producer-id", pid, "--shard", f"{shard}/2"]
        for name, spec in specs.items():
            args += ["--source", f"{name}={spec}"]
        return args

    def a_committed() -> bool:
        p = anyio.run(lakestream.load_state, url).producers.get("a")
        return p is not None and p.tgbs >= 2

    a, b = spawn_cli(*produce("a", 0), "--rate", 12), spawn_cli(*produce("b", 1), "--rate", 12)
    try:
        wait_until(a_committed, what="2 TGBs of a")
        a.send_signal(signal.SIGKILL)
    finally:
        for proc in (a, b):
            if proc is a and proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=120)
    assert a.returncode == -signal.SIGKILL and b.returncode == 0, (a.returncode, b.returncode)
    for pid, shard in (("a", 0), ("b", 1)):  # the same commands again
        r = run_cli(*produce(pid, shard))
        assert r.returncode == 0, describe(r)

    state = anyio.run(lakestream.load_state, url)
    orders = {
        (pid, name): [f"{name}-{s['__key__']}" for s, _ in open_source(spec, shard=(shard, 2)).iterate()]
        for pid, shard in (("a", 0), ("b", 1))
        for name, spec in specs.items()
    }
    owner = {key: pid for (pid, _), keys in orders.items() for key in keys}
    by_producer: dict[str, list[str]] = {"a": [], "b": []}
    for step in range(state.head + 1):
        samples = anyio.run(step_samples, url, step)
        m = state.mix_at(step)
        assert m is not None
        shares = {n: c for n, c in mix_counts(m.weights, 10).items() if c}
        got = Counter(s["__source__"] for s in samples)
        assert dict(got) == shares if len(samples) == 10 else all(got[n] <= c for n, c in shares.items()), step
        at = state.step(step)
        assert at is not None
        if at.packed is not None:  # the leftovers packed by the last producer to finish: whose each is
            for s in samples:
                by_producer[owner[s["__key__"]]].append(s["__key__"])
        else:
            by_producer[at.producer] += [s["__key__"] for s in samples]
    keys = by_producer["a"] + by_producer["b"]
    assert len(keys) == len(set(keys))
    for pid in ("a", "b"):
        assert by_producer[pid], pid
        for name in specs:
            order = orders[pid, name]
            mine = [k for k in by_producer[pid] if k.startswith(name + "-")]
            assert sorted(mine) == sorted(order[: len(mine)]), (pid, name)
    assert run_cli("verify", url).returncode == 0
