"""Sources read from hostile or unusual files: corrupt and truncated tar shards, members and rows too large
to hold, reserved names in the data, and file and member names that keys must tell apart (Hive layouts,
Spark's file names, WebDataset's `./` members and directories)."""

from __future__ import annotations

import io
import json
import random
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cliutil import LAKESTREAM, cli_env, describe, read_out_dir, run_cli
from mountutil import MountProc, read_tree

import lakestream
from lakestream.sources import open_source


def file_url(path: Path) -> str:
    return f"file://{path}"


def write_tar(path: Path, members: list[tuple[str, bytes]], mode: str = "w") -> None:
    with tarfile.open(path, mode) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def numbered(n: int, size: int = 512) -> list[tuple[str, bytes]]:
    """`n` one-field samples `0000.bin`... of `size` bytes each (512: one header and one data block a member)."""
    return [(f"{i:04d}.bin", bytes([i % 251 + 1]) * size) for i in range(n)]


def keys_of(spec: str, **kw: Any) -> list[str]:
    return [s["__key__"] for s, _ in open_source(spec, **kw).iterate()]


def one_line_error(r: subprocess.CompletedProcess[str], *parts: str) -> None:
    assert r.returncode != 0, describe(r)
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, describe(r)
    for part in parts:
        assert part in r.stderr, describe(r)


# -- corrupt and truncated tar shards ----------------------------------------------------------------


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_bad_header_checksum_mid_shard_is_refused_not_taken_as_the_end(tmp_path: Path) -> None:
    """300 members of one header and one data block each; member 100's checksum field flipped: the CLI
    fails naming the file rather than commit 100 samples and call the shard done."""
    shard = tmp_path / "train-000.tar"
    write_tar(shard, numbered(300))
    flip(shard, 100 * 1024 + 148)
    url = file_url(tmp_path / "stream")
    run_cli("init", url, "--world-size", 1, "--global-batch", 10, check=True)
    r = run_cli("produce", url, "--producer-id", "p", "--source", f"wds:{shard}")
    one_line_error(r, str(shard), f"byte {100 * 1024}")


def gz_tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    write_tar(path, members, "w:gz")


@pytest.mark.parametrize(
    "damage",
    [
        "gz byte 5000",
        "gz header checksum",
        "gz data byte",
        "gz truncated",
        "gz trailing garbage",
        "tar truncated mid member",
        "tar truncated mid header",
        "tar zeroed header",
        "tar garbage header",
        "tar data after the end",
    ],
)
def test_a_damaged_shard_is_invalid_sample_naming_the_file(tmp_path: Path, damage: str) -> None:
    members = [(f"{i:04d}.txt", random.Random(i).randbytes(i % 7 * 20 + 100).hex().encode()) for i in range(300)]
    if damage in ("gz header checksum", "gz data byte"):  # stored, not compressed: it decompresses, but wrong
        shard = tmp_path / "a.tar.gz"
        with tarfile.open(shard, "w:gz", compresslevel=0) as tar:
            for name, data in numbered(300):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        at = shard.read_bytes().index(b"0100.bin") + (148 if damage == "gz header checksum" else 600)
        flip(shard, at)
    elif damage.startswith("gz"):
        shard = tmp_path / "a.tar.gz"
        gz_tar(shard, members)
        data = shard.read_bytes()
        if damage == "gz byte 5000":
            flip(shard, 5000)
        elif damage == "gz truncated":
            shard.write_bytes(data[: len(data) * 2 // 3])
        else:
            shard.write_bytes(data + b"junk after the gzip stream")
    else:
        shard = tmp_path / "a.tar"
        write_tar(shard, numbered(300))
        data = shard.read_bytes()
        if damage == "tar truncated mid member":
            shard.write_bytes(data[: 150 * 1024 + 700])
        elif damage == "tar truncated mid header":
            shard.write_bytes(data[: 150 * 1024 + 100])
        elif damage == "tar zeroed header":  # a zeroed page: tarfile sees the end-of-archive marker
            shard.write_bytes(data[: 150 * 1024] + bytes(1024) + data[151 * 1024 :])
        elif damage == "tar garbage header":
            shard.write_bytes(data[: 150 * 1024] + b"\x07" * 512 + data[150 * 1024 + 512 :])
        else:
            shard.write_bytes(data + data)  # another archive after the end: not read, so refused
    with pytest.raises(lakestream.InvalidSample, match=str(shard)):
        keys_of(f"wds:{shard}")


def test_intact_shards_read_to_their_end(tmp_path: Path) -> None:
    """Shards as tarfile and gzip write them, a .tar.bz2 and .tar.xz, and a tar without its end-of-archive
    blocks (ending at the file's size) read whole; so do shards resumed from every cursor."""
    members = numbered(40, 700)
    expected = [f"{i:04d}" for i in range(40)]
    for name, mode in [("a.tar", "w"), ("b.tar.gz", "w:gz"), ("c.tar.bz2", "w:bz2"), ("d.tar.xz", "w:xz")]:
        write_tar(tmp_path / name, members, mode)
        assert keys_of(f"wds:{tmp_path / name}") == expected
    raw = (tmp_path / "a.tar").read_bytes()
    end = 40 * (512 + 1024)  # each member: a header and two data blocks
    assert raw[end:] == bytes(len(raw) - end)
    (tmp_path / "e.tar").write_bytes(raw[:end])
    assert keys_of(f"wds:{tmp_path / 'e.tar'}") == expected
    whole = list(open_source(f"wds:{tmp_path / 'b.tar.gz'}").iterate())
    for k in (0, 17, 39):
        rest = list(open_source(f"wds:{tmp_path / 'b.tar.gz'}").iterate(whole[k][1]))
        assert rest == whole[k + 1 :]


# -- memory: refused by size before it is read, Arrow read a record batch at a time ------------------

PEAK_LIMIT_KB = 220_000  # the interpreter with pyarrow and the CLI imported is about 100 MB


# Runs the command given after it and writes its peak RSS (VmHWM, KiB) to the file named first. The
# process's own high-water mark is read, not the rusage of a waited-for child: Linux counts into the
# latter the parent's memory at fork, so a large test runner would measure itself.
PEAK_WRAPPER = """
import atexit, runpy, sys
out, how, what, *rest = sys.argv[1:]
def peak():
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    with open(out, "w") as f:
        f.write(line.split()[1])
atexit.register(peak)
sys.argv = [what, *rest]
if how == "-m":
    runpy.run_module(what, run_name="__main__", alter_sys=True)
else:
    exec(compile(what, "<script>", "exec"), {"__name__": "__main__"})
"""


def peak_rss_kb(argv: list[str], tmp_path: Path) -> tuple[int, int, str]:
    """Run `argv` (`python -m MODULE ...` or `python -c SCRIPT`) to its end; (exit status, its peak RSS
    in KiB, its stderr)."""
    assert argv[0] == sys.executable and argv[1] in ("-m", "-c"), argv
    err, out = tmp_path / "stderr.txt", tmp_path / "peak.txt"
    with open(err, "wb") as e:
        r = subprocess.run(
            [sys.executable, "-c", PEAK_WRAPPER, str(out), *argv[1:]],
            env=cli_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=e,
        )  # fmt: skip
    return r.returncode, int(out.read_text()), err.read_text()


def test_a_member_over_max_sample_bytes_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """A .tar.gz of a few hundred KB holding a 300 MB member, produced into a stream whose samples are
    at most 1024 bytes: refused naming the member, and the producer never holds it."""
    shard = tmp_path / "big.tar.gz"
    with tarfile.open(shard, "w:gz") as tar:
        small = tarfile.TarInfo("0000.txt")
        small.size = 5
        tar.addfile(small, io.BytesIO(b"hello"))
        info = tarfile.TarInfo("0001.bin")
        info.size = 300 << 20

        class Zeros(io.RawIOBase):
            left = info.size

            def readable(self) -> bool:
                return True

            def readinto(self, b: Any) -> int:
                n = min(len(b), self.left)
                b[:n] = bytes(n)
                self.left -= n
                return n

        tar.addfile(info, io.BufferedReader(Zeros()))
    assert shard.stat().st_size < 2 << 20
    url = file_url(tmp_path / "stream")
    run_cli("init", url, "--world-size", 1, "--global-batch", 1, "--max-sample-bytes", 1024, check=True)
    argv = [*LAKESTREAM, "produce", url, "--producer-id", "p", "--source", f"wds:{shard}"]
    code, peak, err = peak_rss_kb(argv, tmp_path)
    assert peak < PEAK_LIMIT_KB, f"peak RSS {peak} KiB"
    assert code == 1 and "0001.bin" in err and str(shard) in err and "1024" in err, err


def test_an_hf_arrow_file_is_read_a_record_batch_at_a_time(tmp_path: Path) -> None:
    """A zstd-compressed Arrow stream of 300 record batches of one 1 MB row: reading every row holds
    one batch at a time, not the 300 MB decompressed (and the rows come out right)."""
    d = tmp_path / "ds"
    d.mkdir()
    schema = pa.schema([("id", pa.int64()), ("blob", pa.binary())])
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    with (
        pa.OSFile(str(d / "data-00000-of-00001.arrow"), "wb") as sink,
        pa.ipc.new_stream(sink, schema, options=options) as w,
    ):
        for i in range(300):
            w.write_batch(pa.record_batch([pa.array([i]), pa.array([bytes([i % 256]) * (1 << 20)])], schema=schema))
    (d / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_split": None})
    )
    assert (d / "data-00000-of-00001.arrow").stat().st_size < 2 << 20
    script = (
        "import sys\n"
        "from lakestream.sources import open_source\n"
        "n = 0\n"
        f"for s, c in open_source('hf:{d}', shard=(1, 2)).iterate():\n"
        "    assert s['blob'] == bytes([s['id'] % 256]) * (1 << 20), s['id']\n"
        "    assert s['__key__'] == f\"train-{s['id']:09d}\"\n"
        "    n += 1\n"
        "assert n == 150, n\n"
    )
    code, peak, err = peak_rss_kb([sys.executable, "-c", script], tmp_path)
    assert code == 0, err
    assert peak < PEAK_LIMIT_KB, f"peak RSS {peak} KiB"


def test_hf_resumes_exactly_within_and_across_record_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every cursor resumes with the next row, whatever record batch or unit it falls in (units of 4 rows
    here, so that a shuffled epoch goes back and forth in the file)."""
    monkeypatch.setattr(lakestream.sources, "HF_BLOCK_ROWS", 4)
    d = tmp_path / "ds"
    d.mkdir()
    schema = pa.schema([("n", pa.int64())])
    with pa.OSFile(str(d / "data.arrow"), "wb") as sink, pa.ipc.new_stream(sink, schema) as w:
        first = 0
        for size in [3, 0, 5, 1, 9, 4]:
            w.write_batch(pa.record_batch([pa.array(range(first, first + size))], schema=schema))
            first += size
    (d / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data.arrow"}]}))
    for shard in [(0, 1), (0, 3), (2, 3)]:
        whole = list(open_source(f"hf:{d}", shard=shard, epochs=2, shuffle_seed=5).iterate())
        for k, (_, cursor) in enumerate(whole):
            assert list(open_source(f"hf:{d}", shard=shard, epochs=2, shuffle_seed=5).iterate(cursor)) == whole[k + 1 :]
    assert sorted(s["n"] for s, _ in open_source(f"hf:{d}").iterate()) == list(range(22))


# -- reserved names in the data --------------------------------------------------------------------


@pytest.mark.parametrize("column", ["__key__", "__cost__", "__source__"])
def test_a_parquet_or_hf_column_with_a_reserved_name_is_refused(tmp_path: Path, column: str) -> None:
    table = pa.table({"id": ["a", "b"], column: [1, 2], "x": [1, 2]})
    pq.write_table(table, tmp_path / "t.parquet")
    with pytest.raises(lakestream.InvalidSample, match=rf"t\.parquet.*'{column}'"):
        keys_of(f"parquet:{tmp_path / 't.parquet'}", key_column="id")
    d = tmp_path / "ds"
    d.mkdir()
    with pa.OSFile(str(d / "data.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    (d / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data.arrow"}]}))
    with pytest.raises(lakestream.InvalidSample, match=rf"data\.arrow.*'{column}'"):
        keys_of(f"hf:{d}")
    # the key column itself may have such a name: it is the key, not a field
    pq.write_table(pa.table({column: ["a", "b"], "x": [1, 2]}), tmp_path / "k.parquet")
    assert keys_of(f"parquet:{tmp_path / 'k.parquet'}", key_column=column) == ["a", "b"]


def test_a_parquet_key_column_beside_a_reserved_column_fails_the_cli_in_one_line(tmp_path: Path) -> None:
    pq.write_table(pa.table({"id": ["a", "b"], "__key__": ["x", "y"], "v": [1, 2]}), tmp_path / "t.parquet")
    url = file_url(tmp_path / "stream")
    run_cli("init", url, "--world-size", 1, "--global-batch", 2, check=True)
    r = run_cli("produce", url, "--producer-id", "p", "--source", f"parquet:{tmp_path}", "--key-column", "id")
    one_line_error(r, "t.parquet", "'__key__'", "reserved")
    assert json.loads(run_cli("status", url, "--json", check=True).stdout)["head_step"] == -1


@pytest.mark.parametrize("field", ["__cost__", "__key__", "__source__"])
def test_a_tar_member_or_dir_file_with_a_reserved_field_is_refused(tmp_path: Path, field: str) -> None:
    write_tar(tmp_path / "a.tar", [("0000.txt", b"a"), (f"0001.{field}", b"3"), ("0001.txt", b"b")])
    with pytest.raises(lakestream.InvalidSample, match=rf"a\.tar.*0001\.{field}"):
        keys_of(f"wds:{tmp_path / 'a.tar'}")
    src = tmp_path / "dir"
    src.mkdir()
    (src / "0001.txt").write_bytes(b"b")
    (src / f"0001.{field}").write_bytes(b"3")
    with pytest.raises(lakestream.InvalidSample, match=rf"0001\.{field}"):
        keys_of(f"dir:{src}")


def test_a_tar_member_with_a_reserved_field_fails_the_cli_in_one_line(tmp_path: Path) -> None:
    write_tar(tmp_path / "a.tar", [("0000.txt", b"a"), ("0001.__cost__", b"3"), ("0001.txt", b"b")])
    url = file_url(tmp_path / "stream")
    run_cli("init", url, "--world-size", 1, "--global-batch", 1, check=True)
    r = run_cli("produce", url, "--producer-id", "p", "--source", f"wds:{tmp_path / 'a.tar'}")
    one_line_error(r, "a.tar", "0001.__cost__", "reserved")


# -- files that are not what their kind says ---------------------------------------------------------

TEXTS = [f"text-{i:04d}" for i in range(100)]


def utf8_damaged(data: bytes) -> bytes:
    """`data` with the first byte of the text `text-0042` (stored as it is) made invalid UTF-8."""
    at = data.index(b"text-0042")
    return data[:at] + b"\xff" + data[at + 1 :]


@pytest.mark.parametrize("damage", ["not parquet", "truncated", "page header", "invalid utf-8"])
def test_a_file_that_is_not_readable_parquet_is_invalid_sample_naming_it(tmp_path: Path, damage: str) -> None:
    """pyarrow's own errors (ArrowInvalid, OSError) and text that is not UTF-8 become InvalidSample naming the
    file, and the CLI says so in one line."""
    path = tmp_path / "src" / "t.parquet"
    path.parent.mkdir()
    pq.write_table(pa.table({"txt": TEXTS}), path, compression="none", use_dictionary=False)
    data = path.read_bytes()
    if damage == "not parquet":
        path.write_text("id,txt\n1,a\n")
    elif damage == "truncated":
        path.write_bytes(data[: len(data) - 20])
    elif damage == "page header":  # the first data page's header, just after the magic number
        path.write_bytes(data[:4] + b"\xff" * 8 + data[12:])
    else:
        path.write_bytes(utf8_damaged(data))
    with pytest.raises(lakestream.InvalidSample, match=f"{path}: not a readable Parquet file: "):
        keys_of(f"parquet:{tmp_path / 'src'}")
    url = file_url(tmp_path / "stream")
    run_cli("init", url, "--world-size", 1, "--global-batch", 2, check=True)
    r = run_cli("produce", url, "--producer-id", "p", "--source", f"parquet:{tmp_path / 'src'}")
    one_line_error(r, f"{path}: not a readable Parquet file: ")


@pytest.mark.parametrize("damage", ["not arrow", "truncated", "invalid utf-8"])
def test_an_hf_file_that_is_not_a_readable_arrow_stream_is_invalid_sample_naming_it(
    tmp_path: Path, damage: str
) -> None:
    d = tmp_path / "ds"
    d.mkdir()
    table = pa.table({"txt": TEXTS})
    with pa.OSFile(str(d / "data.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        for batch in table.to_batches(max_chunksize=25):
            w.write_batch(batch)
    (d / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data.arrow"}]}))
    data = (d / "data.arrow").read_bytes()
    if damage == "not arrow":
        (d / "data.arrow").write_text("id,txt\n1,a\n")
    elif damage == "truncated":  # in the last record batch's body
        (d / "data.arrow").write_bytes(data[: data.index(b"text-0080")])
    else:
        (d / "data.arrow").write_bytes(utf8_damaged(data))
    with pytest.raises(lakestream.InvalidSample, match=str(d / "data.arrow")):
        keys_of(f"hf:{d}")
    url = file_url(tmp_path / "stream")
    run_cli("init", url, "--world-size", 1, "--global-batch", 2, check=True)
    r = run_cli("produce", url, "--producer-id", "p", "--source", f"hf:{d}")
    one_line_error(r, str(d / "data.arrow"))


# -- keys: unique by construction, and storable -------------------------------------------------------


def test_parquet_keys_tell_hive_partitions_and_spark_names_apart(tmp_path: Path) -> None:
    """`y=1/part-0.parquet` and `y=2/part-0.parquet` make distinct keys; Spark's dotted names are keys too;
    the CLI produces them, `read --out` writes them, and `verify` finds no key twice."""
    src = tmp_path / "rows"
    for y in (1, 2):
        (src / f"y={y}").mkdir(parents=True)
        pq.write_table(pa.table({"v": [f"{y}-{i}" for i in range(3)]}), src / f"y={y}" / "part-0.parquet")
    pq.write_table(pa.table({"v": ["s-0", "s-1"]}), src / "part-00000-c000.snappy.parquet")
    keys = keys_of(f"parquet:{src}")
    assert keys == [
        "part-00000-c000%2Esnappy-000000000",
        "part-00000-c000%2Esnappy-000000001",
        *[f"y={y}%2Fpart-0-{i:09d}" for y in (1, 2) for i in range(3)],
    ]
    _, files = produced_files(f"parquet:{src}", 4, tmp_path)
    assert files["y=2%2Fpart-0-000000001.v"] == b"2-1"
    assert files["part-00000-c000%2Esnappy-000000001.v"] == b"s-1"
    assert len(files) == 8


def produced_files(spec: str, batch: int, tmp_path: Path) -> tuple[str, dict[str, bytes]]:
    """Produce `spec` into a new 1-rank stream, verify it, and read it back with `read --out`:
    the stream's URL and {file name: bytes}."""
    url = file_url(tmp_path / "stream")
    run_cli("init", url, "--world-size", 1, "--global-batch", batch, check=True)
    run_cli("produce", url, "--producer-id", "p", "--source", spec, check=True)
    run_cli("verify", url, check=True)
    run_cli("read", url, "--rank", 0, "--out", tmp_path / "out", check=True)
    return url, {n: v for step in read_out_dir(tmp_path / "out").values() for n, v in step.items()}


def test_tar_members_in_directories_and_dot_slash_members_are_read(tmp_path: Path) -> None:
    """`./0001.jpg` is key `0001`; `a/0017.seg.png` key `a%2F0017`: produced, verified, and the same
    files through `read --out` and the mount."""
    members = [
        ("./0001.jpg", b"j1"),
        ("./0001.json", b"{}"),
        ("a/0017.seg.png", b"p17"),
        ("a/0017.txt", b"t17"),
        ("b.c/0017.txt", b"t17b"),  # same base name in another directory: another key
        ("./d/%41.txt", b"pct"),
    ]
    write_tar(tmp_path / "a.tar", members)
    samples = [s for s, _ in open_source(f"wds:{tmp_path / 'a.tar'}").iterate()]
    assert samples == [
        {"__key__": "0001", "jpg": b"j1", "json": b"{}"},
        {"__key__": "a%2F0017", "seg.png": b"p17", "txt": b"t17"},
        {"__key__": "b%2Ec%2F0017", "txt": b"t17b"},
        {"__key__": "d%2F%2541", "txt": b"pct"},
    ]
    url, files = produced_files(f"wds:{tmp_path / 'a.tar'}", 2, tmp_path)
    assert files == {
        "0001.jpg": b"j1",
        "0001.json": b"{}",
        "a%2F0017.seg.png": b"p17",
        "a%2F0017.txt": b"t17",
        "b%2Ec%2F0017.txt": b"t17b",
        "d%2F%2541.txt": b"pct",
    }
    m = MountProc(url, tmp_path / "mnt", tmp_path / "mount.log").start()
    try:
        m.wait_ready()
        mounted = {n: v for step in read_tree(str(m.mountpoint), [0], 2).values() for n, v in step.items()}
    finally:
        m.stop()
    assert {n: v for n, v in mounted.items() if n != "_meta.json"} == files


def test_a_key_repeated_apart_in_one_shard_is_refused(tmp_path: Path) -> None:
    write_tar(tmp_path / "a.tar", [("0001.txt", b"a"), ("0002.txt", b"b"), ("0001.jpg", b"c")])
    with pytest.raises(lakestream.InvalidSample, match=r"a\.tar.*'0001'.*twice"):
        keys_of(f"wds:{tmp_path / 'a.tar'}")
