"""Step-aligned data mixtures: the pure share rule, mix records in the state machine, and producers
drawing from three named sources under a schedule of mixes, SIGKILLed and started again."""

from __future__ import annotations

import json
import math
import random
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
    ref = TgbRef(f"segments/p/1-{seq}-x.tgb", ((0, 5, 0, n - n // 2), (5, 5, 0, n // 2)), seq + 1, mix, None)
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
    [[["a", -1]], [["a", 0]], [["a", 1], ["a", 2]], [["a/b", 1]], [["a", "1"]], [["a", float("inf")]],
     [["a", 1e308], ["b", 1e308]], [["a", 1.5e308], ["b", 1e308], ["c", 0]]],
)  # fmt: skip
def test_bad_weights_are_refused(weights: list[Any]) -> None:
    s = state_with_producer()
    data = json.dumps({"kind": "mix", "from_step": 0, "weights": weights}).encode().replace(b"Infinity", b"1e999")
    assert s.apply(2, data) is not None and s.mixes == []
    with pytest.raises(ValueError):
        decisions.mix(s, weights, now=0.0)


def test_empty_weights_are_refused_where_a_mix_is_given() -> None:
    """`[]` in a record clears a mixture (`weights` None in `decisions.mix`); given as weights, it is refused."""
    s = state_with_producer()
    for weights in ([], {}):
        with pytest.raises(ValueError, match="1 to 256"):
            decisions.mix(s, weights, now=0.0)  # type: ignore[arg-type]


@given(st.lists(st.just(0.0) | st.floats(0, 1.7e308), min_size=1, max_size=8))
def test_weights_a_mix_accepts_give_shares_of_the_whole_batch(ws: list[float]) -> None:
    """Any weights a mix record may hold (finite, >= 0, a finite positive total) give counts from
    0 to the batch that add up to it; any others are refused, by the decision and the state alike."""
    s = state_with_producer()
    weights = [(f"s{i}", w) for i, w in enumerate(ws)]
    ok = 0 < sum(ws) < math.inf
    assert (s.copy().apply(2, encode_record(MixRecord(0, tuple(weights)))) is None) == ok
    if not ok:
        with pytest.raises(ValueError, match="add up to"):
            decisions.mix(s, weights, now=0.0)
        return
    record = decisions.mix(s, weights, now=0.0)
    assert record is not None and s.apply(2, encode_record(record)) is None
    counts = mix_counts(record.weights, 10)
    assert sum(counts.values()) == 10 and all(0 <= c <= 10 for c in counts.values())


@pytest.mark.parametrize("name", ["a.b", "a-b", "", "_" * 65, "é", "a b"])
def test_a_source_name_is_letters_digits_and_underscores(name: str) -> None:
    """So that `<name>-<key>` names one source and one key: no '-', and no '.' (no key has one)."""
    s = state_with_producer()
    with pytest.raises(ValueError, match="letters, digits and '_'"):
        decisions.mix(s, [(name, 1.0), ("web", 1.0)], now=0.0)
    assert decisions.mix(s, [("Web_2", 1.0), ("_" * 64, 1.0)], now=0.0) is not None


def test_a_tgb_sealed_under_other_weights_is_never_committed() -> None:
    s = state_with_producer()
    assert s.apply(2, encode_record(MixRecord(0, (("a", 1.0), ("b", 1.0))))) is None

    class Pending:
        seq, ref = 0, TgbRef("segments/p/1-0-x.tgb", ((0, 5, 0, 5), (5, 5, 0, 5)), 1, None, None)

    with pytest.raises(lakestream.MixChanged, match="start again"):
        decisions.commit(s, "p", 1, [Pending()], 0, 0.0)  # type: ignore[list-item]


# -- clearing a mix ------------------------------------------------------------------------------------

mix_records_st = st.lists(
    st.tuples(st.integers(0, 12), st.none() | st.lists(st.integers(0, 3), min_size=1, max_size=3)),
    min_size=1,
    max_size=8,
)


@given(mix_records_st)
def test_a_mix_record_sets_the_mixture_from_its_step_on_and_an_empty_one_clears_it(
    records: list[tuple[int, list[int] | None]],
) -> None:
    """The oracle: a mix record from step S sets every step from S on to its weights, or to no
    mixture with none; `mix_at` agrees, through snapshots and each record's cross-check."""
    s = state_with_producer()
    oracle: list[tuple[tuple[str, float], ...] | None] = [None] * 16
    for from_step, ws in records:
        weights = () if ws is None else tuple((f"s{i}", float(w + 1)) for i, w in enumerate(ws))
        record = MixRecord(from_step, weights)
        assert s.apply(s.version + 1, encode_record(record)) is None
        assert s.check_last_record(encode_record(record)) is None
        oracle[from_step:] = [weights or None] * (16 - from_step)
        s = State.from_json(s.to_json())
    for step, want in enumerate(oracle):
        m = s.mix_at(step)
        assert (m.weights if m else None) == want, step


def test_after_a_clear_tgbs_name_no_mix_and_a_tgb_sealed_for_the_cleared_mix_is_never_committed() -> None:
    s = state_with_producer()
    assert s.apply(2, encode_record(MixRecord(0, (("a", 1.0), ("b", 1.0))))) is None
    assert s.apply(3, encode_record(tgb(0, 2, {"a": 5, "b": 5}))) is None
    record = decisions.mix(s, None, now=0.0)  # clear from the step after the head
    assert record == MixRecord(1, ()) and s.apply(4, encode_record(record)) is None
    assert s.mix_at(0) is not None and s.mix_at(1) is None and s.mix_at(10**9) is None
    assert decisions.mix(s, None, now=0.0) is None  # already clear: nothing to record
    assert decisions.mix(s, None, from_step=7, now=0.0) is None
    assert s.check(tgb(1, 2, {"a": 5, "b": 5})) is not None  # sealed for the cleared mix
    assert s.check(tgb(1, None, {"a": 2, "b": 8})) is None  # named sources, no mix: any counts
    assert s.check(tgb(1, None, None)) is None  # a plain producer's TGB

    class Pending:
        seq, ref = 1, tgb(1, 2, {"a": 5, "b": 5}).tgbs[0]

    with pytest.raises(lakestream.MixChanged, match="under no mix"):
        decisions.commit(s, "p", 1, [Pending()], 0, 0.0)  # type: ignore[list-item]
    later = decisions.mix(s, [("a", 1)], from_step=5, now=0.0)
    assert later is not None and s.apply(5, encode_record(later)) is None
    assert decisions.mix(s, None, from_step=3, now=0.0) == MixRecord(3, ())  # clears the later one too
    assert decisions.mix(s, None, from_step=5, now=0.0) == MixRecord(5, ())
    again = State.from_json(s.to_json())
    assert again.to_dict() == s.to_dict() and [m.weights for m in again.mixes] == [
        (("a", 1.0), ("b", 1.0)),
        (),
        (("a", 1.0),),
    ]
    with pytest.raises(ValueError, match="not committed yet"):
        decisions.mix(s, None, from_step=0, now=0.0)


def test_snapshots_written_before_clears_existed_still_load() -> None:
    s = state_with_producer()
    assert s.apply(2, encode_record(MixRecord(3, (("a", 1.0),)))) is None
    d = json.loads(s.to_json())
    del d["sha256"]
    assert d["mixes"] == [[3, 2, [["a", 1.0]]]]
    assert State.from_json(json.dumps(d).encode()).mixes == s.mixes
    d["mixes"] = [[3, 2, []]]
    assert State.from_json(json.dumps(d).encode()).mix_at(3) is None


# -- a source that ends, renormalised ---------------------------------------------------------------


@given(
    st.lists(st.integers(0, 4), min_size=2, max_size=6).filter(lambda ws: sum(ws[1:]) > 0),
    st.integers(0, 3),
    st.integers(0, 3),
    st.booleans(),
)
def test_dropping_an_ended_source_is_one_record_whoever_asks_first(
    ws: list[int], a_ahead: int, b_ahead: int, a_first: bool
) -> None:
    """Producers a and b both find source s0 ended and ask to go on without it, each from the step
    it would take next: the first one records the mix without s0 (the others' weights unchanged);
    the second records nothing if that mix is in force at its step, else the same weights from its
    earlier step. Either way every step from the earlier one on holds no s0, every record is valid,
    and asking again records nothing."""
    s = state_with_producer()
    weights = tuple((f"s{i}", float(w)) for i, w in enumerate(ws))
    assert s.apply(2, encode_record(MixRecord(0, weights))) is None
    want = tuple(w for w in weights if w[0] != "s0")
    asks = [a_ahead, b_ahead] if a_first else [b_ahead, a_ahead]
    records = []
    for ahead in asks:
        record = decisions.drop_source(s, "s0", from_step=s.head + 1 + ahead, now=0.0)
        if record is not None:
            assert s.check(record) is None and record.weights == want
            assert s.apply(s.version + 1, encode_record(record)) is None
            records.append(record)
    if ws[0] == 0:  # s0 had no share: nothing to record
        assert records == []
        return
    assert len(records) == 1 + (asks[1] < asks[0])
    for step in range(min(asks), 20):
        m = s.mix_at(step)
        assert m is not None and m.weights == want, step
        assert "s0" not in {n for n, c in mix_counts(m.weights, 10).items() if c}
    assert all(decisions.drop_source(s, "s0", from_step=k, now=0.0) is None for k in range(min(asks), 20))


def test_dropping_a_source_refuses_to_replace_a_later_mix_and_needs_another_weight() -> None:
    s = state_with_producer()
    assert s.apply(2, encode_record(MixRecord(0, (("a", 1.0), ("b", 1.0))))) is None
    assert s.apply(3, encode_record(MixRecord(4, (("a", 1.0), ("b", 3.0))))) is None
    with pytest.raises(lakestream.ConfigMismatch, match="recorded from step 4"):
        decisions.drop_source(s, "a", from_step=0, now=0.0)
    assert decisions.drop_source(s, "a", from_step=4, now=0.0) == MixRecord(4, (("b", 3.0),))
    assert decisions.drop_source(s, "c", from_step=4, now=0.0) is None  # no share: nothing to drop
    assert s.apply(4, encode_record(MixRecord(4, (("a", 1.0), ("b", 0.0))))) is None
    with pytest.raises(ValueError, match="no other source of the mix has a weight"):
        decisions.drop_source(s, "a", from_step=4, now=0.0)
    assert s.apply(5, encode_record(MixRecord(4, ()))) is None
    assert decisions.drop_source(s, "a", from_step=4, now=0.0) is None  # no mix in force


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


# -- what the command refuses ----------------------------------------------------------------------


def test_mix_refuses_weights_whose_total_overflows_in_one_line(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/s"
    run_cli("init", url, "--world-size", 2, "--global-batch", 10, check=True)
    r = run_cli("mix", url, "--weights", "a=1e308,b=1e308", check=False)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "add up to inf" in r.stderr, describe(r)
    r = run_cli("mix", url, "--weights", "a=1,a=2", check=False)
    assert r.returncode == 2 and "'a' is given twice" in r.stderr, describe(r)
    assert anyio.run(lakestream.load_state, url).mixes == []
    run_cli("mix", url, "--weights", "a=8e307,b=8e307", check=True)  # large, with a finite total
    status = json.loads(run_cli("status", url, "--json", check=True).stdout)
    assert status["mixes"][0]["shares"] == {"a": 5, "b": 5}


def test_source_names_that_could_make_one_key_of_two_sources_are_refused(tmp_path: Path) -> None:
    """Sources `a` (file `b-x.parquet`) and `a-b` (file `x.parquet`) would both key their first row
    `a-b-x-…`: '-' (and '.', which no key has) is refused where a name is given, `mix` and `produce`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    url = f"file://{tmp_path}/s"
    run_cli("init", url, "--world-size", 1, "--global-batch", 2, check=True)
    for d, f in (("a", "b-x"), ("ab", "x")):
        (tmp_path / d).mkdir()
        pq.write_table(pa.table({"v": [d]}), tmp_path / d / f"{f}.parquet")
    for weights in ("a=1,a-b=1", "a.b=1"):
        r = run_cli("mix", url, "--weights", weights, check=False)
        assert r.returncode == 1 and r.stderr.count("\n") == 1 and "letters, digits and '_'" in r.stderr, describe(r)
    produce = ["produce", url, "--producer-id", "p", "--source", f"a=parquet:{tmp_path}/a"]
    for name in ("a-b", "a.b"):
        r = run_cli(*produce, "--source", f"{name}=parquet:{tmp_path}/ab", check=False)
        assert r.returncode == 1 and r.stderr.count("\n") == 1 and f"source name {name!r}" in r.stderr, describe(r)
    assert anyio.run(lakestream.load_state, url).head == -1
    run_cli(*produce, "--source", f"a_b=parquet:{tmp_path}/ab", check=True)
    keys = [k for line in run_cli("read", url, "--rank", 0, "--json").stdout.splitlines() for k in line_keys(line)]
    assert len(keys) == len(set(keys)) == 2
    assert run_cli("verify", url).returncode == 0


def line_keys(line: str) -> list[str]:
    return list(json.loads(line).get("keys", []))


def test_a_named_dir_source_refuses_shard_epochs_and_shuffle(tmp_path: Path) -> None:
    """A directory has no shards: two producers `--shard 0/2` and `1/2` would each commit all of it."""
    from cliutil import make_source_dir

    url = f"file://{tmp_path}/s"
    run_cli("init", url, "--world-size", 2, "--global-batch", 4, check=True)
    make_source_dir(tmp_path / "d", "k", 8, random.Random(0))
    make_wds(tmp_path / "w", 2, 4)
    sources = ["--source", f"d=dir:{tmp_path}/d", "--source", f"w=wds:{tmp_path}/w/train-{{000..001}}.tar"]
    for i, extra in enumerate([("--shard", "0/2"), ("--shard", "1/2"), ("--epochs", 2), ("--shuffle-seed", 1)]):
        r = run_cli("produce", url, "--producer-id", f"p{i}", *sources, *extra, check=False)
        assert r.returncode == 1 and r.stderr.count("\n") == 1, describe(r)
        assert f"--source d=dir:{tmp_path}/d: --shard, --epochs and --shuffle-seed apply to" in r.stderr, describe(r)
    assert anyio.run(lakestream.load_state, url).head == -1
    run_cli("produce", url, "--producer-id", "p", *sources, check=True)  # one producer reads it whole
    assert run_cli("verify", url).returncode == 0


# -- clearing a mix and a source that ends, from the command line ----------------------------------------


def wds_sources(tmp_path: Path, sizes: dict[str, int]) -> list[str]:
    """`--source NAME=wds:…` options for sources of `sizes[name]` samples (2 shards each)."""
    args = []
    for i, (name, n) in enumerate(sizes.items()):
        make_wds(tmp_path / name, 2, n // 2, seed=i)
        args += ["--source", f"{name}=wds:{tmp_path}/{name}/train-{{000..001}}.tar"]
    return args


def source_counts(url: str) -> list[dict[str, int]]:
    """Each step's samples per `__source__`."""
    state = anyio.run(lakestream.load_state, url)
    return [
        dict(Counter(s["__source__"] for s in anyio.run(step_samples, url, step))) for step in range(state.head + 1)
    ]


def test_a_cleared_mix_lets_a_plain_producer_commit_again(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/s"
    run_cli("init", url, "--world-size", 2, "--global-batch", 10, check=True)
    make_wds(tmp_path / "plain", 2, 15)
    plain = ["produce", url, "--producer-id", "plain", "--source", f"wds:{tmp_path}/plain/train-{{000..001}}.tar"]
    run_cli("mix", url, "--weights", "web=1,code=1", check=True)
    r = run_cli(*plain, check=False)
    assert r.returncode == 1 and "under a mixture" in r.stderr and r.stderr.count("\n") == 1, describe(r)
    r = run_cli("mix", url, "--clear", check=True)
    assert (
        r.stdout
        == f"{url}: from step 0 no mixture is in force (plain producers commit; named ones draw equal shares)\n"
    )
    status = json.loads(run_cli("status", url, "--json", check=True).stdout)
    assert [(m["from_step"], m["weights"], m["shares"]) for m in status["mixes"]] == [(0, {}, {})]  # replaced
    run_cli(*plain, check=True)
    state = anyio.run(lakestream.load_state, url)
    assert state.head == 2 and sum(s.samples for s in state.steps) == 30 and state.mix_at(0) is None
    run_cli("verify", url, check=True)
    r = run_cli("mix", url, "--clear", "--weights", "a=1", check=False)
    assert r.returncode == 2 and "not allowed with" in r.stderr, describe(r)


def test_named_sources_after_a_clear_draw_equal_shares_and_stop_says_what_was_left(tmp_path: Path) -> None:
    """Under the mix web 8 : code 2 for steps 0 and 1, then cleared: equal shares, TGBs naming no
    mix, as before any mix. web (30) ends first; code and math are left, and the last line says so."""
    url = f"file://{tmp_path}/s"
    run_cli("init", url, "--world-size", 2, "--global-batch", 10, check=True)
    sources = wds_sources(tmp_path, {"web": 30, "code": 40, "math": 40})
    run_cli("mix", url, "--weights", "web=8,code=2", check=True)
    run_cli("mix", url, "--clear", "--from-step", 2, check=True)
    r = run_cli("produce", url, "--producer-id", "p", *sources, "--stats-json", check=True)
    lines = r.stdout.splitlines()
    assert lines[-1] == (
        "source web ended; samples of code, math were left unread (--on-source-end renormalize goes on without web)"
    ), describe(r)
    figures = json.loads(lines[0])
    assert (figures["ended"], figures["unread"]) == (["web"], ["code", "math"])
    counts = source_counts(url)
    # 16 web in steps 0-1, then 4 + 3 + 3 a step: web's last 14 go in steps 2-5, the last one short.
    assert counts == [{"web": 8, "code": 2}] * 2 + [{"web": 4, "code": 3, "math": 3}] * 3 + [{"web": 2}], counts
    state = anyio.run(lakestream.load_state, url)
    assert state.mix_at(1) is not None and state.mix_at(2) is None
    run_cli("verify", url, check=True)


def test_renormalize_consumes_every_row_of_the_remaining_sources_once(stream_url: str, tmp_path: Path) -> None:
    """web 60, code 40, math 20 under 5 : 3 : 2. math ends at step 10 (its open batch committed short),
    the producer records web : code from step 11, web ends there, then code alone to its end: every
    row of every source once, each step holding the shares of the mix in force; verify agrees."""
    url = stream_url
    run_cli("init", url, "--world-size", 2, "--global-batch", 10, check=True)
    sizes = {"web": 60, "code": 40, "math": 20}
    sources = wds_sources(tmp_path, sizes)
    run_cli("mix", url, "--weights", "web=0.5,code=0.3,math=0.2", check=True)
    produce = ["produce", url, "--producer-id", "p", *sources, "--on-source-end", "renormalize"]
    r = run_cli(*produce, "--stats-json", check=True)
    assert r.stdout.splitlines()[-1] == "sources math, web, code ended; no source has samples left", describe(r)
    assert json.loads(r.stdout.splitlines()[0])["mix_restarts"] == 0
    state = anyio.run(lakestream.load_state, url)
    assert [(m.from_step, m.weights) for m in state.mixes] == [
        (0, (("web", 0.5), ("code", 0.3), ("math", 0.2))),
        (11, (("web", 0.5), ("code", 0.3))),
        (12, (("code", 0.3),)),
    ]
    counts = source_counts(url)
    assert counts == [{"web": 5, "code": 3, "math": 2}] * 10 + [{"web": 5, "code": 3}, {"web": 5}, {"code": 7}]
    keys = [s["__key__"] for step in range(state.head + 1) for s in anyio.run(step_samples, url, step)]
    want = [f"{name}-s{sh:03d}-{i:04d}" for name, n in sizes.items() for sh in range(2) for i in range(n // 2)]
    assert sorted(keys) == sorted(want)  # every row once
    run_cli("verify", url, check=True)
    r = run_cli(*produce, check=True)  # again: every source is at its end, nothing more
    assert anyio.run(lakestream.load_state, url).head == state.head and "no source has samples left" in r.stdout
    r = run_cli("produce", url, "--producer-id", "q", "--synthetic", 5, "--on-source-end", "renormalize", check=False)
    assert r.returncode == 1 and "--on-source-end applies to named sources" in r.stderr, describe(r)


def test_renormalize_refuses_to_replace_a_later_mix_in_one_line(tmp_path: Path) -> None:
    """web (20) ends at step 4 under 1 : 1; a mix from step 10 would be replaced by the record the
    producer would append: it refuses, naming the step, with everything before committed."""
    url = f"file://{tmp_path}/s"
    run_cli("init", url, "--world-size", 2, "--global-batch", 10, check=True)
    sources = wds_sources(tmp_path, {"web": 20, "code": 60})
    run_cli("mix", url, "--weights", "web=1,code=1", check=True)
    run_cli("mix", url, "--weights", "web=1,code=3", "--from-step", 10, check=True)
    r = run_cli("produce", url, "--producer-id", "p", *sources, "--on-source-end", "renormalize", check=False)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, describe(r)
    assert "source 'web' ended at step 4; renormalising the mix there would replace the one recorded from step 10" in (
        r.stderr
    ), describe(r)
    assert source_counts(url) == [{"web": 5, "code": 5}] * 4
    run_cli("verify", url, check=True)
