"""`lakestream inspect`: each sample of a step with its fields' types, dtypes, shapes and sizes, read
from the rank slices alone (checksums checked, nothing decoded but .npy headers)."""

from __future__ import annotations

import io
import json
import struct
import zlib
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import orjson
from cliutil import describe, run_cli

import lakestream
from lakestream._manifest import log_key
from lakestream._records import CommitRecord, TgbRef, encode_record
from lakestream._segment import MAGIC

W, B, N = 2, 4, 8  # two full steps


def sample(i: int) -> dict[str, Any]:
    return {
        "__key__": f"k{i:02d}",
        "bin": bytes(range(i)),
        "txt": f"sample {i} é",
        "meta": {"i": i, "tags": ["a"] * i},
        "img": np.full((3, 4), i, dtype=np.float32),  # one dtype and shape everywhere: an array block
        "ids": np.arange(i + 1, dtype=np.int16),  # a shape of its own: a .npy file
    }


def npy_size(value: np.ndarray) -> int:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, value, allow_pickle=False)
    return len(buf.getvalue())


def expected_fields(s: dict[str, Any]) -> list[dict[str, Any]]:
    """What `inspect --json` says of sample `s`'s fields."""
    return [
        {"name": "bin", "type": "bytes", "bytes": len(s["bin"])},
        {"name": "txt", "type": "text", "bytes": len(s["txt"].encode())},
        {"name": "meta", "type": "json", "bytes": len(orjson.dumps(s["meta"]))},
        {"name": "img", "type": "array", "dtype": "float32", "shape": [3, 4], "bytes": 48},
        {"name": "ids", "type": "npy", "dtype": "int16", "shape": [len(s["ids"])], "bytes": npy_size(s["ids"])},
    ]


def make_stream(root: Path, n: int = N) -> str:
    url = f"file://{root}"

    async def put() -> None:
        await lakestream.create(url, world_size=W, global_batch=B)
        async with lakestream.open_producer(url, "a") as p:
            for i in range(n):
                await p.put(sample(i), cursor=i + 1)

    anyio.run(put)
    return url


def keys_by_rank(url: str, step: int) -> list[list[str]]:
    """Each rank's sample keys of `step`, as a reader reads them."""

    async def read() -> list[list[str]]:
        out = []
        for rank in range(W):
            async with lakestream.open_reader(url, rank, publish_consumed=False) as r:
                out.append([s["__key__"] for s in (await r.read_step(step)).samples])
        return out

    return anyio.run(read)


def one_line_error(r: Any, *needles: str, stdout: str = "") -> None:
    assert r.returncode == 1 and r.stdout == stdout, describe(r)
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, describe(r)
    assert r.stderr.startswith("lakestream inspect: error: "), describe(r)
    for needle in needles:
        assert needle in r.stderr, describe(r)


def test_inspect_json_describes_every_field_of_every_rank_in_order(tmp_path: Path) -> None:
    url = make_stream(tmp_path / "s")
    samples = {s["__key__"]: s for s in map(sample, range(N))}
    for step in range(N // B):
        ranks = keys_by_rank(url, step)
        r = run_cli("inspect", url, "--step", step, "--json", check=True)
        got = [json.loads(line) for line in r.stdout.splitlines()]
        want = [
            {"step": step, "rank": rank, "key": key, "fields": expected_fields(samples[key])}
            for rank, keys in enumerate(ranks)
            for key in keys
        ]
        assert got == want, describe(r)
        assert len(got) == B


def test_inspect_prints_one_line_a_sample_and_rank_selects_one_rank(tmp_path: Path) -> None:
    url = make_stream(tmp_path / "s")
    ranks = keys_by_rank(url, 1)
    r = run_cli("inspect", url, "--step", 1, check=True)
    lines = r.stdout.splitlines()
    assert [line.split()[:3] for line in lines] == [["rank", str(rank), k] for rank in range(W) for k in ranks[rank]]
    key = ranks[1][0]
    s = sample(int(key[1:]))
    line = lines[len(ranks[0])]
    assert line == (
        f"rank 1  {key}  bin:bytes {len(s['bin'])} B, txt:text {len(s['txt'].encode())} B, "
        f"meta:json {len(orjson.dumps(s['meta']))} B, img:array[float32 3x4] 48 B, "
        f"ids:npy[int16 {len(s['ids'])}] {npy_size(s['ids'])} B"
    ), describe(r)
    assert r.stderr == f"step 1: {B} samples of {W} ranks, {sum(map(field_bytes, lines))} bytes of fields\n"

    r = run_cli("inspect", url, "--step", 1, "--rank", 1, check=True)
    assert r.stdout.splitlines() == lines[len(ranks[0]) :], describe(r)
    assert r.stderr.startswith(f"step 1: {len(ranks[1])} samples of rank 1, "), describe(r)


def field_bytes(line: str) -> int:
    return sum(int(part.rsplit(" ", 2)[-2]) for part in line.split("  ", 2)[2].split(", "))


def test_describe_rank_reads_only_that_ranks_slice(tmp_path: Path) -> None:
    url = make_stream(tmp_path / "s")

    async def describe_rank_1() -> list[str]:
        async with lakestream.open_reader(url, None, publish_consumed=False) as r:
            entry = r.state.step(0)
            assert entry is not None
            described = await r.describe_rank(entry, 1)
            assert r.requests == 1 and r.bytes_fetched == entry.ranks[1].length
            return [key for key, _ in described]

    assert anyio.run(describe_rank_1) == keys_by_rank(url, 0)[1]


def test_inspect_a_reshaped_step_reads_its_samples_by_the_new_world_size(tmp_path: Path) -> None:
    url = make_stream(tmp_path / "s")
    keys = sorted(k for ks in keys_by_rank(url, 0) for k in ks)
    run_cli("reshape", url, "--world-size", 4, "--from-step", 0, check=True)
    r = run_cli("inspect", url, "--step", 0, "--json", check=True)
    got = [json.loads(line) for line in r.stdout.splitlines()]
    assert [g["rank"] for g in got] == [0, 1, 2, 3], describe(r)
    assert sorted(g["key"] for g in got) == keys
    for g in got:
        assert g["fields"] == expected_fields(sample(int(g["key"][1:])))


def test_inspect_errors_are_one_line(tmp_path: Path) -> None:
    url = make_stream(tmp_path / "s")
    one_line_error(run_cli("inspect", url, "--step", 2), "step 2 is not committed (steps 0..1)")
    one_line_error(run_cli("inspect", url, "--step", 0, "--rank", 2), "step 0 is read as 2 ranks, so it has no rank 2")
    one_line_error(run_cli("inspect", f"file://{tmp_path}/none", "--step", 0))
    run_cli("checkpoint", url, "--id", "c", "--step", 1, check=True)
    run_cli("gc", url, check=True)
    one_line_error(run_cli("inspect", url, "--step", 0), "step 0 was reclaimed (first readable step 1)")
    r = run_cli("inspect", url, "--step", 0, "--rank", -1)
    assert r.returncode == 2 and "negative" in r.stderr, describe(r)


def test_a_flipped_byte_is_corrupt_data_naming_step_rank_and_object(tmp_path: Path) -> None:
    root = tmp_path / "s"
    url = make_stream(root)
    entry = anyio.run(lakestream.load_state, url).step(0)
    assert entry is not None
    path = root / entry.segment
    data = bytearray(path.read_bytes())
    data[entry.ranks[1].offset + entry.ranks[1].length - 1] ^= 1
    path.write_bytes(bytes(data))
    rank0 = run_cli("inspect", url, "--step", 0, "--rank", 0, check=True).stdout  # only rank 1's slice is damaged
    what = f"step 0 rank 1 object {entry.segment}: checksum mismatch"
    one_line_error(run_cli("inspect", url, "--step", 0, "--rank", 1), what)
    one_line_error(run_cli("inspect", url, "--step", 0), what, stdout=rank0)  # rank 0's samples, then the error


def test_a_hostile_npy_header_is_corrupt_data_naming_step_rank_and_object(tmp_path: Path) -> None:
    root = tmp_path / "s"
    url = make_stream(root)
    bad = b"\x93NUMPY\x01\x00\x10\x00{'descr': '<f8',}}  \n"  # a header numpy cannot parse
    huge = io.BytesIO()  # a header claiming 8 TB, over 32 bytes
    np.lib.format.write_array_header_1_0(huge, {"descr": "<f8", "fortran_order": False, "shape": (10**12,)})
    claims = huge.getvalue() + bytes(32)
    slices = [raw_slice([["h0", [["txt", "s", 2], ["ids", "n", len(bad)]]]], b"hi" + bad),
              raw_slice([["h1", [["ids", "n", len(claims)]]]], claims)]  # fmt: skip
    state = anyio.run(lakestream.load_state, url)
    a = state.producers["a"]
    segment = f"segments/a/{a.epoch}-{a.seq + 1}-hostile.tgb"
    (root / segment).write_bytes(b"".join(slices))
    ranks = ((0, len(slices[0]), zlib.crc32(slices[0]), 1), (len(slices[0]), len(slices[1]), zlib.crc32(slices[1]), 1))
    record = CommitRecord("a", a.epoch, a.seq + 1, (TgbRef(segment, ranks, 9),))
    (root / log_key(state.version + 1)).write_bytes(encode_record(record))
    step = anyio.run(lakestream.load_state, url).head
    assert step == N // B
    r = run_cli("inspect", url, "--step", step, "--rank", 0)
    one_line_error(r, f"step {step} rank 0 object {segment} key 'h0' field 'ids': not a .npy field")
    r = run_cli("inspect", url, "--step", step, "--rank", 1)
    one_line_error(r, f"step {step} rank 1 object {segment} key 'h1' field 'ids': a .npy field of shape (10000")


def raw_slice(header: list[Any], payload: bytes) -> bytes:
    """A rank slice of format 1 with any header at all."""
    head = orjson.dumps(header)
    return MAGIC + struct.pack("<I", len(head)) + head + payload
