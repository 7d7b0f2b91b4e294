"""Epochs and deterministic shuffling of the sharded sources (`open_source(epochs=, shuffle_seed=)`,
`produce --epochs --shuffle-seed`): each epoch in its own order, replayed identically, resumed exactly
from any cursor, keys unique across epochs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from cliutil import describe, head_step, run_cli, spawn_cli, wait_until
from test_sources import file_url, make_parquet, make_wds, read_values, status

from lakestream import ConfigMismatch, sources
from lakestream.sources import open_source


def keys(spec: str, cursor: Any = None, **kw: Any) -> list[str]:
    return [sample["__key__"] for sample, _ in open_source(spec, **kw).iterate(cursor)]


def test_each_epoch_has_its_own_order_and_every_run_the_same(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(sources, "SHUFFLE_WINDOW", 8)
    make_wds(tmp_path / "src", 4, 10)
    spec = f"wds:{tmp_path}/src/*.tar"
    plain = keys(spec)
    run = keys(spec, epochs=2, shuffle_seed=7)
    assert run == keys(spec, epochs=2, shuffle_seed=7)  # the same sequence on every run
    first, second = run[:40], run[40:]
    assert all(k.endswith("-e1") for k in second) and not any(k.endswith("-e1") for k in first)
    second = [k.removesuffix("-e1") for k in second]
    assert sorted(first) == sorted(second) == sorted(plain)  # each epoch: every sample once
    assert first != second and first != plain  # shuffled, and differently per epoch
    assert [k[:4] for k in first] != [k[:4] for k in plain]  # the shard order is shuffled too
    runs = [k[:4] for i, k in enumerate(first) if i == 0 or first[i - 1][:4] != k[:4]]
    assert len(runs) == 4  # one file after another
    for shard in runs:  # within each file the samples are shuffled, a window of 8 at a time
        within = [k for k in first if k.startswith(shard)]
        assert within != sorted(within) and sorted(within[:8]) == sorted(within)[:8], within
    assert keys(spec, epochs=2, shuffle_seed=8) != run
    assert len(set(run)) == 80
    # without a seed: every epoch in sorted order, keys still unique
    assert keys(spec, epochs=2) == plain + [f"{k}-e1" for k in plain]
    assert keys(spec, epochs=1, shuffle_seed=None) == plain


@pytest.mark.parametrize("kind", ["wds", "parquet"])
def test_every_cursor_of_a_shuffled_run_resumes_with_exactly_the_rest(
    tmp_path: Path, monkeypatch: Any, kind: str
) -> None:
    monkeypatch.setattr(sources, "SHUFFLE_WINDOW", 4)  # 10 samples a file: two whole windows and a short one
    if kind == "wds":
        make_wds(tmp_path / "src", 3, 10)
        spec, kw = f"wds:{tmp_path}/src/*.tar", {}
    else:
        make_parquet(tmp_path / "src", 3, 10)
        spec, kw = f"parquet:{tmp_path / 'src'}", {"key_column": "id"}
    whole = list(open_source(spec, epochs=2, shuffle_seed=3, **kw).iterate())
    assert len(whole) == 60
    for k, (_, cursor) in enumerate(whole):
        cursor = json.loads(json.dumps(cursor))  # as committed and read back
        rest = list(open_source(spec, epochs=2, shuffle_seed=3, **kw).iterate(cursor))
        assert rest == whole[k + 1 :], (k, cursor)
    assert whole[-1][1]["epoch"] == 1 and whole[0][1]["epoch"] == 0


def test_cursors_without_an_epoch_resume_and_another_seed_is_refused(tmp_path: Path) -> None:
    make_wds(tmp_path / "src", 3, 5)
    spec = f"wds:{tmp_path}/src/*.tar"
    whole = list(open_source(spec).iterate())
    old = {k: v for k, v in whole[6][1].items() if k != "epoch"}  # a cursor committed before epochs existed
    assert list(open_source(spec).iterate(old)) == whole[7:]
    shuffled = list(open_source(spec, epochs=2, shuffle_seed=1).iterate())
    with pytest.raises(ConfigMismatch, match="shuffle seed"):
        next(open_source(spec, epochs=2, shuffle_seed=2).iterate(shuffled[3][1]))
    with pytest.raises(ConfigMismatch, match="shuffle seed"):
        next(open_source(spec, epochs=2).iterate(shuffled[3][1]))
    with pytest.raises(ValueError, match="--epochs and --shuffle-seed"):
        open_source(f"dir:{tmp_path}", shuffle_seed=1)
    with pytest.raises(ValueError, match="epochs"):
        open_source(spec, epochs=0)


def test_produce_two_shuffled_epochs_killed_and_rerun_commits_the_sequence_once(tmp_path: Path) -> None:
    make_wds(tmp_path / "src", 3, 20)
    spec = f"wds:{tmp_path}/src/*.tar"
    url = file_url(tmp_path / "stream")
    run_cli("init", url, "--world-size", 1, "--global-batch", 2, check=True)
    command = ["produce", url, "--producer-id", "p", "--source", spec, "--epochs", 2, "--shuffle-seed", 7]
    proc = spawn_cli(*command, "--max-inflight-bytes", 1, "--rate", 50)
    try:  # killed in the second epoch: 60 samples an epoch, 2 a step
        wait_until(lambda: head_step(url) >= 34, timeout=20, what="35 committed steps")
    finally:
        proc.kill()
        proc.communicate()
    cursor = status(url)["producers"]["p"]["cursor"]
    assert cursor["epoch"] == 1 and cursor["seed"] == 7 and (cursor["index"], cursor["sample"]) != (2, 20), cursor
    r = run_cli(*command, check=True)
    assert "resumed at" in r.stdout and "of the share, data epoch 2)" in r.stdout, describe(r)
    # one rank: the committed steps in order are the producer's sequence, each key (with its suffix) once
    assert list(read_values(url, 1)) == keys(spec, epochs=2, shuffle_seed=7)
    assert run_cli("verify", url, check=True).returncode == 0
    r = run_cli("produce", url, "--producer-id", "d", "--source", f"dir:{tmp_path}", "--epochs", 2, check=False)
    assert "--epochs and --shuffle-seed apply to --source wds: and parquet:" in r.stderr, describe(r)
