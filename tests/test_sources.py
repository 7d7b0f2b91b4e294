"""Sources with exact, resumable cursors (`lakestream.sources`, `produce --source`): WebDataset tar shards,
Parquet files and `dir:`, split with `--shard`, resumed after SIGKILL, refused when changed."""

from __future__ import annotations

import io
import json
import os
import random
import tarfile
from pathlib import Path
from typing import Any

import anyio
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cliutil import describe, head_step, make_source_dir, read_out_dir, run_cli, spawn_cli, wait_until

import lakestream
from lakestream.sources import expand_braces, open_source


def file_url(path: Path) -> str:
    return f"file://{path}"


def status(url: str) -> dict[str, Any]:
    return json.loads(run_cli("status", url, "--json", check=True).stdout)


def make_wds(directory: Path, shards: int, per_shard: int, seed: int = 0) -> dict[str, bytes]:
    """`shards` tar files `train-000.tar`... of `per_shard` samples each; {`<key>.<field>`: bytes}."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    files: dict[str, bytes] = {}
    for s in range(shards):
        with tarfile.open(directory / f"train-{s:03d}.tar", "w") as tar:
            for i in range(per_shard):
                key = f"s{s:03d}-{i:04d}"
                members = {
                    f"{key}.jpg": rng.randbytes(rng.randrange(0, 300)),
                    f"{key}.txt": f"caption {s} {i}".encode(),
                }
                if i % 5 == 2:
                    members[f"{key}.seg.png"] = rng.randbytes(20)  # a field with a dot: WebDataset's `seg.png`
                for name, data in members.items():
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                files.update(members)
    return files


def make_parquet(directory: Path, files: int, rows: int, seed: int = 0) -> dict[str, dict[str, Any]]:
    """`files` Parquet files of `rows` rows (several row groups each); {id: the row without the id}."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    out: dict[str, dict[str, Any]] = {}
    for f in range(files):
        table: dict[str, list[Any]] = {"id": [], "img": [], "label": [], "score": [], "tags": [], "text": []}
        for r in range(rows):
            row = {
                "img": rng.randbytes(rng.randrange(0, 100)),
                "label": rng.randrange(1000),
                "score": rng.random(),
                "tags": [f"t{rng.randrange(9)}" for _ in range(rng.randrange(3))],
                "text": f"row {r} of file {f}",
            }
            out[f"f{f}-r{r:04d}"] = row
            table["id"].append(f"f{f}-r{r:04d}")
            for k, v in row.items():
                table[k].append(v)
        pq.write_table(pa.table(table), directory / f"part-{f:02d}.parquet", row_group_size=7)
    return out


def read_values(url: str, world: int) -> dict[str, dict[str, Any]]:
    """Every sample of every committed step, by key, as the Python reader decodes it; asserts each key once."""

    async def main() -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for rank in range(world):
            async with lakestream.open_reader(url, rank) as r:
                async for batch in r.steps(r.state.first_step, r.state.head + 1):
                    for sample in batch.samples:
                        key = sample.pop("__key__")
                        assert key not in out, f"{key} read twice"
                        out[key] = sample
        return out

    return anyio.run(main)


def read_files(url: str, world: int, out: Path) -> dict[str, bytes]:
    """`lakestream read --out` for every rank, merged; asserts no file read twice."""
    merged: dict[str, bytes] = {}
    for rank in range(world):
        run_cli("read", url, "--rank", rank, "--out", out / f"rank{rank}", check=True)
        for files in read_out_dir(out / f"rank{rank}").values():
            for name, data in files.items():
                assert name not in merged, f"{name} read twice"
                merged[name] = data
    return merged


def all_from(spec: str, cursor: Any = None, **kw: Any) -> list[tuple[dict[str, Any], Any]]:
    return list(open_source(spec, **kw).iterate(cursor))


# -- in process: patterns and cursors ---------------------------------------------------------------


def test_brace_patterns_expand_as_webdataset_does() -> None:
    assert expand_braces("a-{008..011}.tar") == ["a-008.tar", "a-009.tar", "a-010.tar", "a-011.tar"]
    assert expand_braces("{train,val}-{0..1}.tar") == ["train-0.tar", "train-1.tar", "val-0.tar", "val-1.tar"]
    assert expand_braces("plain.tar") == ["plain.tar"]


@pytest.mark.parametrize("kind", ["wds", "parquet"])
def test_every_cursor_resumes_with_exactly_the_next_sample(tmp_path: Path, kind: str) -> None:
    """From the cursor after any sample, the source yields exactly the samples after it, for each share."""
    if kind == "wds":
        make_wds(tmp_path, 3, 6)
        spec, kw = f"wds:{tmp_path}/train-{{000..002}}.tar", {}
    else:
        make_parquet(tmp_path, 3, 10)
        spec, kw = f"parquet:{tmp_path}", {"key_column": "id"}
    keys_by_share = []
    for i in range(2):
        whole = all_from(spec, shard=(i, 2), **kw)
        for k, (_, cursor) in enumerate(whole):
            json.dumps(cursor)  # JSON-able
            assert all_from(spec, cursor, shard=(i, 2), **kw) == whole[k + 1 :]
        keys_by_share.append([s["__key__"] for s, _ in whole])
    everything = [s["__key__"] for s, _ in all_from(spec, **kw)]
    assert sorted(keys_by_share[0] + keys_by_share[1]) == sorted(everything) and len(set(everything)) == len(everything)


def test_a_cursor_of_another_share_is_refused_and_one_without_a_share_resumes(tmp_path: Path) -> None:
    """The cursor records the share it was produced for: resuming it as another share is refused naming both
    (not taken for files added or removed); a cursor committed before shares were recorded resumes as before."""
    make_wds(tmp_path, 6, 3)
    spec = f"wds:{tmp_path}/*.tar"
    whole = all_from(spec, shard=(1, 2))
    cursor = whole[4][1]
    assert cursor["share"] == [1, 2]
    for other in ((1, 3), (0, 2)):
        with pytest.raises(lakestream.ConfigMismatch, match=rf"with --shard 1/2, not --shard {other[0]}/{other[1]};"):
            all_from(spec, cursor, shard=other)
    old = {k: v for k, v in cursor.items() if k != "share"}
    assert all_from(spec, old, shard=(1, 2)) == whole[5:]


def test_parquet_default_keys_and_unstorable_values(tmp_path: Path) -> None:
    pq.write_table(pa.table({"x": [1, 2], "y": [0.5, float("nan")]}), tmp_path / "t.parquet")
    src = open_source(f"parquet:{tmp_path / 't.parquet'}").iterate()
    assert next(src)[0] == {"__key__": "t-000000000", "x": 1, "y": 0.5}
    with pytest.raises(lakestream.InvalidSample, match="row 1 column 'y'"):
        next(src)


# -- the command: round trips, shards, crashes, changed sources --------------------------------------


def test_wds_shards_round_trip_every_sample_once(tmp_path: Path) -> None:
    """Producers 0/2 and 1/2 over a brace pattern together commit every member's bytes exactly once."""
    files = make_wds(tmp_path / "wds", 5, 12)
    url = file_url(tmp_path / "stream")
    run_cli("init", url, "--world-size", 2, "--global-batch", 8, check=True)
    spec = f"wds:{tmp_path}/wds/train-{{000..004}}.tar"
    for i in range(2):
        run_cli("produce", url, "--producer-id", f"p{i}", "--source", spec, "--shard", f"{i}/2", check=True)
    assert read_files(url, 2, tmp_path / "out") == files
    run_cli("verify", url, check=True)


def test_parquet_shards_round_trip_every_row_once(tmp_path: Path) -> None:
    rows = make_parquet(tmp_path / "pq", 3, 25)
    url = file_url(tmp_path / "stream")
    run_cli("init", url, "--world-size", 2, "--global-batch", 6, check=True)
    for i in range(2):
        run_cli("produce", url, "--producer-id", f"p{i}", "--source", f"parquet:{tmp_path / 'pq'}",
                "--shard", f"{i}/2", "--key-column", "id", check=True)  # fmt: skip
    assert read_values(url, 2) == rows
    run_cli("verify", url, check=True)


def test_dir_source_is_from_dir(tmp_path: Path) -> None:
    files = make_source_dir(tmp_path / "src", "a", 15, random.Random(3))
    url = file_url(tmp_path / "stream")
    run_cli("init", url, "--world-size", 1, "--global-batch", 4, check=True)
    run_cli("produce", url, "--producer-id", "p", "--source", f"dir:{tmp_path / 'src'}", check=True)
    assert read_files(url, 1, tmp_path / "out") == files
    assert status(url)["producers"]["p"]["cursor"]["files"] == len(files)
    r = run_cli("produce", url, "--producer-id", "q", "--from-dir", tmp_path / "src", "--shard", "0/2", check=False)
    assert "--shard and --key-column apply to --source wds: and parquet:" in r.stderr, describe(r)


@pytest.mark.parametrize("kind", ["wds", "parquet"])
def test_sigkill_mid_shard_then_rerun_commits_every_sample_once(tmp_path: Path, kind: str) -> None:
    if kind == "wds":
        make_wds(tmp_path / "src", 3, 40)
        source = ["--source", f"wds:{tmp_path}/src/*.tar"]
        total = 120
    else:
        total = len(make_parquet(tmp_path / "src", 3, 40))
        source = ["--source", f"parquet:{tmp_path / 'src'}", "--key-column", "id"]
    url = file_url(tmp_path / "stream")
    run_cli("init", url, "--world-size", 2, "--global-batch", 2, check=True)
    command = ["produce", url, "--producer-id", "p", *source, "--max-inflight-bytes", 1, "--rate", 40]
    proc = spawn_cli(*command)
    try:  # killed in the second file: 40 samples a file, 2 a step
        wait_until(lambda: head_step(url) >= 24, timeout=20, what="25 committed steps")
    finally:
        proc.kill()
        proc.communicate()
    cursor = status(url)["producers"]["p"]["cursor"]
    assert cursor is not None and cursor["sample"] > 0 and (cursor["index"], cursor["sample"]) != (2, 40), cursor
    r = run_cli(*command, check=True)
    assert "resumed at" in r.stdout and "samples into" in r.stdout, describe(r)
    values = read_values(url, 2)
    assert len(values) == total
    assert run_cli("verify", url, check=True).returncode == 0


def test_a_rewritten_added_or_removed_shard_is_refused(tmp_path: Path) -> None:
    make_wds(tmp_path / "wds", 4, 5)
    url = file_url(tmp_path / "stream")
    run_cli("init", url, "--world-size", 1, "--global-batch", 4, check=True)
    command = ["produce", url, "--producer-id", "p", "--source", f"wds:{tmp_path}/wds/*.tar", "--shard", "0/2"]
    run_cli(*command, check=True)
    head = status(url)["head_step"]

    def refused(what: str) -> None:
        r = run_cli(*command, check=False)
        assert what in r.stderr and "committed cursor" in r.stderr, describe(r)
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, describe(r)
        assert status(url)["head_step"] == head

    shard = tmp_path / "wds" / "train-000.tar"
    saved, st = shard.read_bytes(), shard.stat()
    with tarfile.open(shard, "a") as tar:
        info = tarfile.TarInfo("s000-9999.txt")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    refused("a file was rewritten")
    shard.write_bytes(saved)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert ", 0 samples," in run_cli(*command, check=True).stdout  # restored exactly: nothing more to do
    make_wds(tmp_path / "more", 6, 1)
    (tmp_path / "more" / "train-005.tar").rename(tmp_path / "wds" / "train-005.tar")  # joins share 0/2
    refused("1 file(s) were added")
    (tmp_path / "wds" / "train-005.tar").unlink()
    (tmp_path / "wds" / "train-002.tar").unlink()  # the file the cursor names
    refused("'train-002.tar' (the file being read) is no longer in this producer's share")
