"""The `lakestream` command, run as a real subprocess: init, produce, read, status, verify, demo."""

from __future__ import annotations

import json
import random
from pathlib import Path

import anyio
import pytest
from cliutil import describe, make_source_dir, read_out_dir, run_cli, spawn_cli, wait_until

import lakestream
from lakestream._log import log_key


def file_url(path: Path) -> str:
    return f"file://{path}"


def status(url: str, env: dict[str, str] | None = None) -> dict:
    r = run_cli("status", url, "--json", env=env, check=True)
    return json.loads(r.stdout)


def read_all(url: str, world: int, out: Path, *extra: object, env: dict[str, str] | None = None) -> list[dict]:
    """`lakestream read --out` for every rank; [{step: {file: bytes}}] by rank."""
    result = []
    for rank in range(world):
        run_cli("read", url, "--rank", rank, "--out", out / f"rank{rank}", *extra, env=env, check=True)
        result.append(read_out_dir(out / f"rank{rank}"))
    return result


def merged(per_rank: list[dict[int, dict[str, bytes]]]) -> dict[str, bytes]:
    """Every file read by any rank; asserts that no file name was read twice."""
    out: dict[str, bytes] = {}
    for steps in per_rank:
        for files in steps.values():
            for name, data in files.items():
                assert name not in out, f"{name} read twice"
                out[name] = data
    return out


@pytest.fixture
def produced(tmp_path: Path) -> tuple[str, dict[str, bytes]]:
    """A file:// stream (world size 3, global batch 8) holding one producer's 45 samples (6 steps)."""
    url = file_url(tmp_path / "stream")
    run_cli("init", url, "--world-size", 3, "--global-batch", 8, check=True)
    files = make_source_dir(tmp_path / "src", "a", 45, random.Random(1))
    run_cli("produce", url, "--producer-id", "a", "--from-dir", tmp_path / "src", check=True)
    return url, files


# -- init and status ------------------------------------------------------------------------------


def test_init_is_idempotent_and_names_a_config_mismatch(tmp_path: Path) -> None:
    url = file_url(tmp_path / "s")
    r = run_cli("init", url, "--world-size", 4, "--global-batch", 16, check=True)
    assert "created" in r.stdout
    r = run_cli("init", url, "--world-size", 4, "--global-batch", 16, check=True)
    assert "exists, same config" in r.stdout
    assert status(url)["version"] == 0

    r = run_cli("init", url, "--world-size", 2, "--global-batch", 16, check=False)
    assert "world_size" in r.stderr and "global_batch" not in r.stderr, describe(r)
    r = run_cli("init", url, "--world-size", 4, "--global-batch", 32, check=False)
    assert "global_batch" in r.stderr and "world_size" not in r.stderr, describe(r)
    r = run_cli("init", url, "--world-size", 8, "--global-batch", 8, check=False)
    assert "world_size" in r.stderr and "global_batch" in r.stderr, describe(r)
    r = run_cli("init", url, "--world-size", 4, "--global-batch", 16, "--snapshot-every", 7, check=False)
    assert "snapshot_every" in r.stderr, describe(r)
    assert "Traceback" not in r.stderr
    # Nothing was changed by the refused inits.
    st = status(url)
    assert (st["version"], st["world_size"], st["global_batch"]) == (0, 4, 16)

    r = run_cli("init", file_url(tmp_path / "bad"), "--world-size", 0, "--global-batch", 16, check=False)
    assert "world_size" in r.stderr and "Traceback" not in r.stderr, describe(r)


def test_status_of_an_empty_stream(tmp_path: Path) -> None:
    path = tmp_path / "s"
    run_cli("init", path, "--world-size", 2, "--global-batch", 5, check=True)  # a plain path works too
    st = status(file_url(path))
    assert st["head_step"] == -1
    assert st["version"] == 0
    assert st["producers"] == {}
    assert st["world_size"] == 2 and st["global_batch"] == 5
    assert st["rejected"] == []
    r = run_cli("status", path, check=True)
    assert "world size 2, global batch 5" in r.stdout


# -- produce and read -----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["file", pytest.param("s3", marks=pytest.mark.s3)])
def test_produce_then_read_reproduces_every_file(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if backend == "file":
        url, env = file_url(tmp_path / "stream"), {}
    else:
        env = request.getfixturevalue("s3_server").env()
        url = request.getfixturevalue("s3_url")
    world, batch = 3, 8
    run_cli("init", url, "--world-size", world, "--global-batch", batch, env=env, check=True)
    src = tmp_path / "src"
    files = make_source_dir(src, "k", 45, random.Random(7))
    # Field names with dots, an empty field, and what a directory source must skip.
    files["k-00002.seg.png"] = b"\x89PNG..."
    files["k-00003.empty"] = b""
    for name in ("k-00002.seg.png", "k-00003.empty"):
        (src / name).write_bytes(files[name])
    (src / ".hidden.txt").write_bytes(b"skip me")
    (src / "subdir.txt").mkdir()

    r = run_cli("produce", url, "--producer-id", "shard-0", "--from-dir", src, env=env, check=True)
    assert "resumed at 0, 45 samples" in r.stdout, describe(r)
    per_rank = read_all(url, world, tmp_path / "out", env=env)
    steps = -(-45 // batch)
    for rank, got in enumerate(per_rank):
        assert sorted(got) == list(range(steps)), f"rank {rank}"
        for step, names in got.items():  # round-robin: sample i of a TGB goes to rank i % world
            keys = {n.partition(".")[0] for n in names}
            want = {f"k-{i:05d}" for i in range(step * batch, min(45, (step + 1) * batch)) if i % batch % world == rank}
            assert keys == want, (rank, step)
    assert merged(per_rank) == files

    st = status(url, env)
    assert st["head_step"] == steps - 1
    p = st["producers"]["shard-0"]
    assert (p["epoch"], p["seq"], p["cursor"]) == (1, steps - 1, len(files))

    # Again with the same id: it resumes at the end, commits nothing, and bumps the epoch.
    r = run_cli("produce", url, "--producer-id", "shard-0", "--from-dir", src, env=env, check=True)
    assert f"epoch 2: resumed at {len(files)}, 0 samples" in r.stdout, describe(r)
    st2 = status(url, env)
    assert st2["head_step"] == steps - 1 and st2["producers"]["shard-0"]["epoch"] == 2

    # Without --out: one line per step on stdout.
    r = run_cli("read", url, "--rank", 0, env=env, check=True)
    lines = r.stdout.splitlines()
    assert len(lines) == steps and lines[0].startswith("step 0: 3 samples") and "k-00000,k-00003,k-00006" in lines[0]
    run_cli("verify", url, env=env, check=True)


def test_read_step_ranges(produced: tuple[str, dict[str, bytes]], tmp_path: Path) -> None:
    url, _ = produced
    full = read_all(url, 3, tmp_path / "full")
    for args, want in [
        (("--from-step", 2, "--to-step", 4), [2, 3, 4]),
        (("--from-step", 4), [4, 5]),
        (("--to-step", 1), [0, 1]),
        (("--from-step", 3, "--to-step", 3), [3]),
    ]:
        out = tmp_path / "-".join(map(str, args))
        part = read_all(url, 3, out, *args)
        for rank in range(3):
            assert part[rank] == {s: full[rank][s] for s in want}, (args, rank)


def test_read_to_a_future_step_waits_for_it(produced: tuple[str, dict[str, bytes]], tmp_path: Path) -> None:
    url, _ = produced
    reader = spawn_cli("read", url, "--rank", 2, "--out", tmp_path / "out", "--to-step", 7)
    try:
        wait_until(lambda: (tmp_path / "out" / f"{5:012d}").is_dir() or reader.poll() is not None, 60, "steps 0..5")
        assert reader.poll() is None, "the reader did not wait for step 6"
        more = make_source_dir(tmp_path / "src-b", "b", 16, random.Random(2))
        run_cli("produce", url, "--producer-id", "b", "--from-dir", tmp_path / "src-b", check=True)
        out, err = reader.communicate(timeout=60)
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.communicate()
    assert reader.returncode == 0, err
    got = read_out_dir(tmp_path / "out")
    assert sorted(got) == list(range(8))
    assert {n.partition(".")[0] for n in got[6]} | {n.partition(".")[0] for n in got[7]} == {
        f"b-{i:05d}" for i in (2, 5, 10, 13)
    }
    assert all(got[6][name] == more[name] for name in got[6])


# -- verify ---------------------------------------------------------------------------------------


def test_verify_names_step_rank_and_object_of_a_corrupt_byte(
    produced: tuple[str, dict[str, bytes]], tmp_path: Path
) -> None:
    url, _ = produced
    r = run_cli("verify", url, check=True)
    assert r.stdout.startswith("OK") and "45 samples" in r.stdout and "0 problems" in r.stdout, describe(r)

    state = anyio.run(lakestream.load_state, url)
    step = state.step(3)
    assert step is not None and step.segment.startswith("segments/")
    rank, sl = 1, step.ranks[1]
    path = tmp_path / "stream" / step.segment
    data = bytearray(path.read_bytes())
    data[sl.offset + sl.length // 2] ^= 0x01
    path.write_bytes(bytes(data))

    r = run_cli("verify", url, check=False)
    out = r.stdout + r.stderr
    assert f"step 3 rank {rank} object {step.segment}" in out, describe(r)
    assert "checksum" in out and "FAILED" in out, describe(r)
    assert out.count("FAIL ") == 1, describe(r)  # only that slice

    # Reading the corrupt rank fails naming the same place; the other ranks read fine.
    r = run_cli("read", url, "--rank", rank, "--out", tmp_path / "bad", check=False)
    assert f"step 3 rank {rank} object {step.segment}" in r.stderr, describe(r)
    assert not (tmp_path / "bad" / f"{3:012d}").exists()
    for other in (0, 2):
        run_cli("read", url, "--rank", other, "--out", tmp_path / f"ok{other}", check=True)


# -- bad input ------------------------------------------------------------------------------------


def test_commands_on_a_missing_stream(tmp_path: Path) -> None:
    url = file_url(tmp_path / "nothing-here")
    src = tmp_path / "src"
    make_source_dir(src, "x", 3, random.Random(0))
    for args in (
        ("produce", url, "--producer-id", "p", "--from-dir", src),
        ("read", url, "--rank", 0),
        ("status", url),
        ("verify", url),
    ):
        r = run_cli(*args, check=False)
        assert "no stream" in r.stderr and url in r.stderr, describe(r)
        assert "Traceback" not in r.stderr, describe(r)
    assert not (tmp_path / "nothing-here").exists() or not any((tmp_path / "nothing-here").rglob("*.json"))

    run_cli("init", url, "--world-size", 2, "--global-batch", 4, check=True)
    r = run_cli("produce", url, "--producer-id", "p", "--from-dir", tmp_path / "no-dir", check=False)
    assert "not a directory" in r.stderr, describe(r)
    r = run_cli("produce", url, "--producer-id", "bad/id", "--from-dir", src, check=False)
    assert "bad/id" in r.stderr and "Traceback" not in r.stderr, describe(r)
    r = run_cli("read", url, "--rank", 2, check=False)
    assert "rank 2" in r.stderr, describe(r)
    assert status(url)["head_step"] == -1


def test_field_names_at_and_over_the_limit(tmp_path: Path) -> None:
    url = file_url(tmp_path / "stream")
    run_cli("init", url, "--world-size", 2, "--global-batch", 4, check=True)
    src = tmp_path / "src"
    src.mkdir()
    longest = "k." + "f" * 253  # 255 bytes: the longest file name, and the longest `<key>.<field>`
    (src / longest).write_bytes(b"long")
    (src / "k.txt").write_bytes(b"short")
    run_cli("produce", url, "--producer-id", "p", "--from-dir", src, check=True)
    run_cli("read", url, "--rank", 0, "--out", tmp_path / "out", check=True)
    assert read_out_dir(tmp_path / "out") == {0: {longest: b"long", "k.txt": b"short"}}

    # Over the limit (only possible through the API: no file system allows such a file name).
    async def put(sample: dict) -> str:
        async with lakestream.open_producer(url, "api") as p:
            with pytest.raises(lakestream.InvalidSample) as info:
                await p.put(sample, cursor=1)
        return str(info.value)

    assert "is 256 bytes long" in anyio.run(put, {"__key__": "a", "f" * 256: b"x"})
    assert "over 255 bytes" in anyio.run(put, {"__key__": "abc", "f" * 252: b"x"})
    assert status(url)["head_step"] == 0  # nothing more was committed

    # A file without a field extension: the command fails naming it; fixed, a rerun completes.
    src2 = tmp_path / "src2"
    files = make_source_dir(src2, "m", 20, random.Random(3))
    (src2 / "zzz-no-extension").write_bytes(b"?")
    r = run_cli("produce", url, "--producer-id", "m", "--from-dir", src2, check=False)
    assert "zzz-no-extension" in r.stderr and "no field extension" in r.stderr, describe(r)
    (src2 / "zzz-no-extension").unlink()
    run_cli("produce", url, "--producer-id", "m", "--from-dir", src2, check=True)
    per_rank = read_all(url, 2, tmp_path / "all", "--from-step", 1)
    assert merged(per_rank) == files
    run_cli("verify", url, check=True)


def test_a_malformed_log_record_is_reported_and_skipped(produced: tuple[str, dict[str, bytes]], tmp_path: Path) -> None:
    url, files = produced
    before = status(url)
    bad = before["version"] + 1
    log = tmp_path / "stream" / "_lakestream" / "log"
    assert log_key(bad).startswith("_lakestream/log/") and f"{bad:020d}.json" in log_key(bad)
    (log / f"{bad:020d}.json").write_bytes(b'{"kind": "commit", "producer": "a", "tgbs": [garbage')
    (log / f"{bad + 1:020d}.json").write_bytes(b'{"kind": "bogus", "producer": "a"}')  # JSON, not a record

    st = status(url)
    assert st["version"] == bad + 1 and st["head_step"] == before["head_step"]
    assert [r["version"] for r in st["rejected"]] == [bad, bad + 1] and all(r["reason"] for r in st["rejected"])
    assert "bogus" in st["rejected"][1]["reason"]
    r = run_cli("status", url, check=True)
    assert f"malformed record at version {bad}" in r.stdout, describe(r)
    assert f"malformed record at version {bad + 1}" in r.stdout, describe(r)

    r = run_cli("verify", url, check=False)
    assert f"log version {bad} is malformed" in r.stdout, describe(r)
    assert f"log version {bad + 1} is malformed" in r.stdout, describe(r)
    assert r.stdout.rstrip().splitlines()[-1].startswith("FAILED"), describe(r)

    # The good steps still read, and the stream goes on after the bad version.
    assert merged(read_all(url, 3, tmp_path / "out")) == files
    more = make_source_dir(tmp_path / "src-b", "b", 10, random.Random(4))
    run_cli("produce", url, "--producer-id", "b", "--from-dir", tmp_path / "src-b", check=True)
    after = status(url)
    assert after["head_step"] == before["head_step"] + 2 and after["version"] > bad + 1
    assert merged(read_all(url, 3, tmp_path / "out2")) == {**files, **more}
    run_cli("verify", url, check=False)  # still reports the malformed version


def test_a_commit_record_with_a_float_seq_is_rejected(produced: tuple[str, dict[str, bytes]], tmp_path: Path) -> None:
    """A record of the wrong schema is a no-op that status and verify report (see `_manifest`).

    Fails (library bug): `epoch` and `seq` are compared with `==`, so `6.0` (or `true` for 1)
    passes for the integer due; the record takes effect, the producer's seq becomes a float, and
    that producer id can never produce again: `Producer.put` formats `f"{self._next_seq:06d}"`
    and raises "Unknown format code 'd' for object of type 'float'".
    """
    url, _ = produced
    before = status(url)
    log = tmp_path / "stream" / "_lakestream" / "log"
    last = json.loads((log / f"{before['version']:020d}.json").read_bytes())  # the producer's last commit
    assert last["kind"] == "commit" and last["producer"] == "a"
    bad = before["version"] + 1
    due = before["producers"]["a"]["seq"] + 1
    (log / f"{bad:020d}.json").write_bytes(json.dumps({**last, "seq": float(due)}).encode())  # "seq": 6.0

    st = status(url)
    make_source_dir(tmp_path / "src", "b", 10, random.Random(5))  # new samples after the committed cursor
    r = run_cli("produce", url, "--producer-id", "a", "--from-dir", tmp_path / "src")
    problems = []
    if [x["version"] for x in st["rejected"]] != [bad]:
        problems.append(f"the record at version {bad} was applied: producer a has seq {st['producers']['a']['seq']!r}")
    if r.returncode != 0:
        problems.append(f"producer a cannot produce any more: {r.stderr.strip()}")
    assert not problems, "\n".join(problems)


# -- demo -----------------------------------------------------------------------------------------


def test_demo(tmp_path: Path) -> None:
    r = run_cli("demo", "--samples", 300, "--sample-size", 8192, "--dir", tmp_path, timeout=120, check=True)
    assert "verification: OK" in r.stdout, describe(r)
