"""`hf:PATH` sources: Hugging Face datasets saved with `save_to_disk` (a Dataset or a DatasetDict and
`--split`), one row a sample, split by row ranges with `--shard`, resumed exactly, refused when changed."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import anyio
import datasets
import pytest
from cliutil import describe, run_cli, spawn_cli, wait_until
from test_sources import file_url, read_values, status

import lakestream
from lakestream import sources
from lakestream.sources import open_source

FEATURES = datasets.Features(
    {
        "id": datasets.Value("string"),
        "img": datasets.Image(),
        "label": datasets.ClassLabel(names=["cat", "dog", "owl"]),
        "score": datasets.Value("float64"),
        "tokens": datasets.Sequence(datasets.Value("int32")),
        "meta": {"lang": datasets.Value("string"), "n": datasets.Value("int64")},
        "text": datasets.Value("string"),
    }
)


def make_rows(n: int, prefix: str, seed: int) -> dict[str, list[Any]]:
    rng = random.Random(seed)
    rows: dict[str, list[Any]] = {name: [] for name in FEATURES}
    for i in range(n):
        rows["id"].append(f"{prefix}{i:05d}")
        rows["img"].append({"bytes": rng.randbytes(rng.randrange(1, 80)), "path": None})
        rows["label"].append(rng.randrange(3))
        rows["score"].append(rng.random())
        rows["tokens"].append([rng.randrange(50000) for _ in range(rng.randrange(0, 6))])
        rows["meta"].append({"lang": rng.choice(["en", "fr"]), "n": i})
        rows["text"].append(f"row {i} of {prefix}" if i % 9 else None)
    return rows


def make_hf(path: Path, splits: dict[str, int], seed: int = 0, shards: int = 3) -> dict[str, dict[str, dict[str, Any]]]:
    """A DatasetDict of `splits` ({name: rows}) saved at `path`, `shards` arrow files a split;
    {split: {id: the row as a sample should hold it}}."""
    built = {
        name: datasets.Dataset.from_dict(make_rows(n, f"{name}-", seed + k), features=FEATURES)
        for k, (name, n) in enumerate(splits.items())
    }
    datasets.DatasetDict(built).save_to_disk(str(path), num_shards={k: min(shards, n) for k, n in splits.items()})
    return {name: expected(d) for name, d in built.items()}


def expected(d: datasets.Dataset) -> dict[str, dict[str, Any]]:
    """The rows as datasets itself reads them, images as their bytes, keyed by id."""
    raw = d.cast_column("img", datasets.Image(decode=False))
    out = {}
    for row in raw:
        row = dict(row)
        row["img"] = row["img"]["bytes"]
        out[row.pop("id")] = row
    return out


def state(url: str) -> Any:
    """The stream's state, read in process (quicker than `status` in a subprocess, for polling)."""
    return anyio.run(lakestream.load_state, url)


def keys(spec: str, cursor: Any = None, **kw: Any) -> list[str]:
    return [s["__key__"] for s, _ in open_source(spec, **kw).iterate(cursor)]


# -- in process ----------------------------------------------------------------------------------------


def test_rows_as_samples_and_every_cursor_resumes_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "HF_BLOCK_ROWS", 4)
    want = make_hf(tmp_path / "ds", {"train": 23, "test": 5})
    spec = f"hf:{tmp_path / 'ds'}"
    whole = list(open_source(spec, split="train", key_column="id").iterate())
    assert {s.pop("__key__"): s for s, _ in whole} == want["train"]  # values as datasets reads them
    assert [s["__key__"] for s, _ in open_source(spec, split="test").iterate()] == [f"test-{i:09d}" for i in range(5)]
    shares = []
    for i in range(3):
        run = list(open_source(spec, split="train", shard=(i, 3)).iterate())
        for k, (_, cursor) in enumerate(run):
            cursor = json.loads(json.dumps(cursor))
            assert set(cursor) == {"epoch", "shard", "index", "sample", "files", "fp", "rows", "share"}
            assert cursor["rows"] == 23 and cursor["share"] == [i, 3]
            assert list(open_source(spec, split="train", shard=(i, 3)).iterate(cursor)) == run[k + 1 :]
        shares.append([s["__key__"] for s, _ in run])
    assert [len(s) for s in shares] == [7, 8, 8]  # contiguous row ranges: rows [0, 7), [7, 15), [15, 23)
    assert shares[0] + shares[1] + shares[2] == [f"train-{i:09d}" for i in range(23)]


def test_shuffled_epochs_resume_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "HF_BLOCK_ROWS", 6)
    monkeypatch.setattr(sources, "SHUFFLE_WINDOW", 4)
    make_hf(tmp_path / "ds", {"train": 30})
    spec = f"hf:{tmp_path / 'ds'}"
    whole = list(open_source(spec, epochs=2, shuffle_seed=5).iterate())
    run = [s["__key__"] for s, _ in whole]
    plain = keys(spec)
    assert sorted(run[:30]) == sorted(plain) and run[:30] != plain
    assert [k.removesuffix("-e1") for k in run[30:]] != run[:30] and sorted(
        k.removesuffix("-e1") for k in run[30:]
    ) == plain
    for k, (_, cursor) in enumerate(whole):
        rest = list(open_source(spec, epochs=2, shuffle_seed=5).iterate(json.loads(json.dumps(cursor))))
        assert rest == whole[k + 1 :], (k, cursor)


def test_splits_and_unusable_values_are_refused_clearly(tmp_path: Path) -> None:
    make_hf(tmp_path / "dd", {"train": 3, "validation": 2})
    with pytest.raises(ValueError, match=r"splits \['train', 'validation'\]: choose one with --split"):
        open_source(f"hf:{tmp_path / 'dd'}")
    with pytest.raises(ValueError, match="no split 'test'"):
        open_source(f"hf:{tmp_path / 'dd'}", split="test")
    with pytest.raises(FileNotFoundError, match="save_to_disk"):
        open_source(f"hf:{tmp_path}")
    media = {"bytes": datasets.Value("binary"), "path": datasets.Value("string")}  # as Image and Audio store theirs
    features = datasets.Features({"x": datasets.Value("float64"), "im": media})
    im = [{"bytes": None, "path": "elsewhere/a.png"}, {"bytes": b"png", "path": None}]
    one = datasets.Dataset.from_dict({"x": [1.0, float("nan")], "im": im}, features=features)
    one.save_to_disk(str(tmp_path / "one"))
    with pytest.raises(ValueError, match="--split 'train' does not apply"):
        open_source(f"hf:{tmp_path / 'one'}", split="train")
    with pytest.raises(lakestream.InvalidSample, match="row 0 column 'im': the media value holds only a path"):
        next(open_source(f"hf:{tmp_path / 'one'}").iterate())  # a Dataset: no --split needed
    one.map(lambda r: {"im": {"bytes": b"png", "path": None}}).save_to_disk(str(tmp_path / "nan"))
    with pytest.raises(lakestream.InvalidSample, match="row 1 column 'x': cannot store float nan"):
        list(open_source(f"hf:{tmp_path / 'nan'}").iterate())


# -- the command ---------------------------------------------------------------------------------------


def test_produce_split_in_two_shards_round_trips_every_row_once(tmp_path: Path) -> None:
    want = make_hf(tmp_path / "ds", {"train": 40, "test": 11})
    url = file_url(tmp_path / "stream")
    run_cli("init", url, "--world-size", 2, "--global-batch", 6, check=True)
    spec = f"hf:{tmp_path / 'ds'}"
    r = run_cli("produce", url, "--producer-id", "x", "--source", spec, check=False)
    assert "choose one with --split" in r.stderr and len(r.stderr.strip().splitlines()) == 1, describe(r)
    for i in range(2):
        run_cli("produce", url, "--producer-id", f"p{i}", "--source", spec, "--split", "train",
                "--shard", f"{i}/2", "--key-column", "id", check=True)  # fmt: skip
    run_cli("produce", url, "--producer-id", "t", "--source", spec, "--split", "test", "--key-column", "id", check=True)
    assert read_values(url, 2) == want["train"] | want["test"]
    run_cli("verify", url, check=True)


def test_sigkill_mid_run_then_rerun_commits_every_row_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_hf(tmp_path / "ds", {"train": 300})
    url = file_url(tmp_path / "stream")
    run_cli("init", url, "--world-size", 2, "--global-batch", 2, check=True)
    command = ["produce", url, "--producer-id", "p", "--source", f"hf:{tmp_path / 'ds'}", "--max-inflight-bytes", 1]
    proc = spawn_cli(*command, "--rate", 60)
    try:
        wait_until(lambda: state(url).head >= 20, timeout=30, what="21 committed steps")
    finally:
        proc.kill()
        proc.communicate()
    cursor = state(url).producers["p"].cursor  # 3 arrow files of 100 rows: units [0:100] of each
    assert cursor["shard"].endswith(".arrow[0:100]") and (cursor["index"], cursor["sample"]) != (2, 100), cursor
    r = run_cli(*command, check=True)
    assert f"resumed at {cursor['sample']} samples into {cursor['shard']!r}" in r.stdout, describe(r)
    assert sorted(read_values(url, 2)) == [f"train-{i:09d}" for i in range(300)]
    run_cli("verify", url, check=True)


def test_a_changed_dataset_is_refused_naming_the_change(tmp_path: Path) -> None:
    make_hf(tmp_path / "ds", {"train": 20})
    url = file_url(tmp_path / "stream")
    run_cli("init", url, "--world-size", 1, "--global-batch", 4, check=True)
    command = ["produce", url, "--producer-id", "p", "--source", f"hf:{tmp_path / 'ds'}", "--shard", "1/2"]
    run_cli(*command, check=True)
    head = status(url)["head_step"]

    def refused(what: str) -> None:
        r = run_cli(*command, check=False)
        assert what in r.stderr and "committed cursor" in r.stderr, describe(r)
        assert len(r.stderr.strip().splitlines()) == 1 and status(url)["head_step"] == head, describe(r)

    r = run_cli(*command[:-1], "1/3", check=False)
    assert "the committed cursor was produced with --shard 1/2, not --shard 1/3;" in r.stderr, describe(r)
    make_hf(tmp_path / "ds", {"train": 24})  # saved again, with more rows
    refused("the split 'train' now has 24 rows, not 20")
    make_hf(tmp_path / "ds", {"train": 20}, seed=1)  # as many rows, other values
    refused("an arrow file of the split was rewritten")


def test_a_hostile_dataset_dict_is_refused(tmp_path: Path) -> None:
    make_hf(tmp_path / "dd", {"train": 3})
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["../../etc"]}')
    with pytest.raises(ValueError, match="unusable split names"):
        open_source(f"hf:{tmp_path / 'dd'}", split="../../etc")
    state = tmp_path / "dd" / "train" / "state.json"
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    files = json.loads(state.read_text())["_data_files"]
    state.write_text(json.dumps({"_data_files": files + files[:1]}))
    with pytest.raises(ValueError, match="unusable data file"):
        open_source(f"hf:{tmp_path / 'dd'}")
