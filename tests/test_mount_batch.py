"""`lakestream mount`'s `_batch/<field>.npy` files, mounted for real: an array field the producer
stored as one block (one dtype and shape in every sample of a rank slice) is one `.npy` of shape
(n, ...) per step, and `MountDataset(collate=True)` reads it with one open and one read."""

from __future__ import annotations

import errno
import io
import json
import os
import re
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from mountutil import MountProc, step_name
from test_mount import _produce, create, errno_of, file_url, forge_crc, produce

import lakestream
import lakestream.torch as lstorch
from lakestream._segment import FieldRef, join_samples, parse_slice
from lakestream.torch import MountDataset, StreamDataset

if not os.path.exists("/dev/fuse") or not os.access("/dev/fuse", os.R_OK | os.W_OK):
    pytest.skip("needs /dev/fuse", allow_module_level=True)  # pragma: no cover


@pytest.fixture
def mounts(tmp_path: Path) -> Iterator[Callable[..., MountProc]]:
    """`mounts(url, *args)` starts `lakestream mount url tmp/mnt args...` and waits until it serves;
    teardown unmounts it and asserts its process exited."""
    started: list[MountProc] = []

    def start(url: str, *args: Any) -> MountProc:
        m = MountProc(url, tmp_path / "mnt", tmp_path / "mnt.log", *args).start()
        started.append(m)
        return m.wait_ready()

    yield start
    for m in started:
        m.stop()


def sample(i: int) -> dict[str, Any]:
    rng = np.random.default_rng(i)
    return {
        "__key__": f"k{i:03d}",
        "img": rng.integers(0, 255, (4, 5, 3), dtype=np.uint8),  # a block
        "lbl": np.array(i, dtype=np.int64),  # a block of 0-d arrays
        "emb": rng.standard_normal(3).astype(">f4"),  # a block, big-endian
        "vec": np.arange(i % 3 + 1, dtype=np.float32),  # shapes differ: not a block
        "txt": f"sample {i}",
        "cls": i % 7,  # JSON
    }


def npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


def per_sample(d: Path, meta: dict[str, Any], field: str) -> np.ndarray:
    """The field of every sample of a step read the existing way (its `<key>.<field>` files), stacked."""
    return np.stack([np.load(io.BytesIO((d / f"{key}.{field}").read_bytes())) for key in meta["keys"]])


def test_each_block_field_of_a_step_is_one_npy_file(stream_url: str, mounts) -> None:
    url = stream_url
    create(url, 2, 8)
    samples = [sample(i) for i in range(24)]  # steps 0-2
    produce(url, "p", samples)
    produce(url, "q", [{"__key__": f"b{i}", "bin": b"x" * i} for i in range(8)])  # step 3: no arrays
    by_key = {s["__key__"]: s for s in samples}
    m = mounts(url, "--prefetch", 0)
    for rank in (0, 1):
        for step in range(3):
            d = m.mountpoint / f"rank-{rank}" / step_name(step)
            assert "_batch" in os.listdir(d) and os.path.isdir(d / "_batch")
            assert sorted(os.listdir(d / "_batch")) == ["emb.npy", "img.npy", "lbl.npy"]  # not vec, not txt
            meta = json.loads((d / "_meta.json").read_bytes())
            assert meta["types"][f"{meta['keys'][0]}.img"] == "n"
            for field in ("img", "lbl", "emb"):
                path = d / "_batch" / f"{field}.npy"
                stacked = per_sample(d, meta, field)
                dtype = by_key[meta["keys"][0]][field].dtype  # np.stack makes >f4 native: keep it as put
                want = np.stack([by_key[k][field] for k in meta["keys"]]).astype(dtype)
                assert np.array_equal(stacked, want)
                got = np.load(path, mmap_mode="r")
                assert isinstance(got, np.memmap) and got.shape == (len(meta["keys"]), *want.shape[1:])
                assert got.dtype == want.dtype and np.array_equal(got, want)
                assert os.stat(path).st_size == len(npy_bytes(want)) == meta["batch"][f"{field}.npy"]
                assert path.read_bytes() == npy_bytes(want)  # the plain format np.save writes
                with open(path, "rb", buffering=0) as f:  # reads at any offset, across the header too
                    f.seek(100)
                    assert f.read(50) == npy_bytes(want)[100:150]
            assert errno_of(lambda d=d: os.stat(d / "_batch" / "vec.npy")) == errno.ENOENT
            assert errno_of(lambda d=d: os.open(d / "_batch" / "img.npy", os.O_WRONLY)) == errno.EROFS
    d3 = m.mountpoint / "rank-0" / step_name(3)
    assert "_batch" not in os.listdir(d3) and errno_of(lambda: os.stat(d3 / "_batch")) == errno.ENOENT
    assert "batch" not in json.loads((d3 / "_meta.json").read_bytes())
    assert "Traceback" not in m.log()


def test_status_counts_the_requests_a_collated_step_costs(stream_url: str, mounts) -> None:
    """`_status.json`'s "requests" counts the FUSE requests served, by operation: a step of one
    array field read as MountDataset reads it costs a lookup of its directory, `_meta.json`,
    `_batch` and `_batch/img.npy`, an open and a read of each file (one read: they are small),
    their releases, and no getattr (the lookups answer it)."""
    url = stream_url
    create(url, 1, 8)
    rng = np.random.default_rng(0)
    produce(
        url, "p", [{"__key__": f"k{i:03d}", "img": rng.integers(0, 255, (4, 5, 3), dtype=np.uint8)} for i in range(24)]
    )
    m = mounts(url, "--prefetch", 0)

    def requests() -> dict[str, int]:
        return json.loads((m.mountpoint / "_status.json").read_bytes())["requests"]

    def since(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
        return {op: n - before.get(op, 0) for op, n in after.items() if n != before.get(op, 0)}

    it = iter(MountDataset(m.mountpoint, 0, 1, stop=3, collate=True, timeout=30))
    assert next(it)["step"] == 0
    looking = since(requests(), requests())  # what a read of `_status.json` costs
    assert looking["open"] == 1 and looking["read"] >= 1, looking
    before = requests()
    item = next(it)
    assert item["step"] == 1 and item["img"].shape == (8, 4, 5, 3)
    step = since(looking, since(before, requests()))
    release = step.pop("release", 0)
    assert step == {"lookup": 4, "open": 2, "read": 2}, step
    assert 1 <= release <= 2, release  # a release reaches the mount after the close returned
    before = requests()
    os.statvfs(m.mountpoint)
    assert since(looking, since(before, requests())) == {"statfs": 1}


def test_a_resliced_step_joins_the_blocks_of_its_pieces(tmp_path: Path, mounts) -> None:
    """Steps sealed for 2 ranks read as 1 (a reshape): rank 0's `_batch/img.npy` holds the rows of
    both stored slices, and the samples' files still read."""
    url = file_url(tmp_path / "stream")
    create(url, 2, 8)
    samples = [sample(i) for i in range(16)]
    produce(url, "p", samples)
    anyio.run(lambda: lakestream.reshape(url, 1, from_step=0))
    by_key = {s["__key__"]: s for s in samples}
    m = mounts(url, "--prefetch", 0)
    for step in (0, 1):
        d = m.mountpoint / "rank-0" / step_name(step)
        meta = json.loads((d / "_meta.json").read_bytes())
        assert meta["stored_world_size"] == 2 and len(meta["keys"]) == 8
        for field in ("img", "lbl", "emb"):
            want = np.stack([by_key[k][field] for k in meta["keys"]])
            assert np.array_equal(np.load(d / "_batch" / f"{field}.npy", mmap_mode="r"), want)
            assert np.array_equal(per_sample(d, meta, field), want)
        for key in meta["keys"]:
            assert np.array_equal(np.load(io.BytesIO((d / f"{key}.vec").read_bytes())), by_key[key]["vec"])


def test_join_samples_keeps_one_block_only_where_every_piece_has_it() -> None:
    """A block field whose row shape differs between pieces becomes a `.npy` per sample."""
    a = lakestream._segment.encode_segment(
        [
            [
                lakestream._segment.encode_sample(
                    {"__key__": f"a{i}", "x": np.full(2, i), "y": np.zeros(2)}, "", max_bytes=1 << 20
                )
                for i in range(3)
            ]
        ]
    )[0]
    b = lakestream._segment.encode_segment(
        [
            [
                lakestream._segment.encode_sample(
                    {"__key__": f"b{i}", "x": np.full(2, i), "y": np.zeros(3)}, "", max_bytes=1 << 20
                )
                for i in range(2)
            ]
        ]
    )[0]
    ia, ib = parse_slice(a), parse_slice(b)

    def groups(refs: list[FieldRef]) -> list[list[FieldRef]]:
        return [[f for f in refs if f.key == k] for k in dict.fromkeys(f.key for f in refs)]

    data, refs, blocks = join_samples([(a, groups(ia.refs)[1:], ia.blocks), (b, groups(ib.refs)[:1], ib.blocks)])
    assert list(blocks) == ["x"] and np.array_equal(blocks["x"].array(data), [[1, 1], [2, 2], [0, 0]])
    ys = [f for f in refs if f.field == "y"]
    assert [f.tag for f in ys] == ["n", "n", "n"]
    assert [np.load(io.BytesIO(data[f.offset : f.offset + f.length])).shape for f in ys] == [(2,), (2,), (3,)]
    assert [f.key for f in refs if f.field == "x"] == ["a1", "a2", "b0"]


def test_a_block_that_runs_past_its_slice_reads_as_eio_naming_the_step(tmp_path: Path, mounts) -> None:
    url = file_url(tmp_path / "stream")
    create(url, 1, 2)
    anyio.run(lambda: _produce(url, "p", [sample(i) for i in range(4)], checksum="crc32"))
    entry = anyio.run(lakestream.load_state, url).step(1)
    assert entry is not None
    r = entry.ranks[0]
    segment = tmp_path / "stream" / entry.segment
    raw = bytearray(segment.read_bytes())
    sl = raw[r.offset : r.offset + r.length]
    (hlen,) = struct.unpack_from("<I", sl, 4)
    header = sl[8 : 8 + hlen]
    new = header.replace(b'"|u1",[4,5,3]', b'"|u1",[4,5,9]')  # rows three times as long as stored
    assert new != header and len(new) == len(header)
    sl[8 : 8 + hlen] = new
    forge_crc(sl, len(sl) - 4, r.digest)  # the last payload bytes: the text of the last sample
    raw[r.offset : r.offset + r.length] = sl
    segment.write_bytes(bytes(raw))
    m = mounts(url, "--prefetch", 0)
    good, bad = m.mountpoint / "rank-0" / step_name(0), m.mountpoint / "rank-0" / step_name(1)
    assert np.load(good / "_batch" / "img.npy").shape == (2, 4, 5, 3)
    assert errno_of(lambda: os.listdir(bad)) == errno.EIO
    assert errno_of(lambda: (bad / "_batch" / "img.npy").read_bytes()) == errno.EIO
    assert m.proc is not None and m.proc.poll() is None
    log = m.log()
    assert re.search(rf"step 1 rank 0 object {re.escape(entry.segment)}: malformed slice", log), log
    assert "Traceback" not in log


def test_mount_dataset_collate_reads_each_block_field_with_one_open(stream_url: str, mounts, monkeypatch) -> None:
    url = stream_url
    create(url, 2, 8)
    produce(url, "p", [sample(i) for i in range(24)])
    m = mounts(url, "--prefetch", 0)
    opened: list[str] = []
    real_open = open

    def counting_open(path: Any, *args: Any, **kwargs: Any) -> Any:
        opened.append(os.path.relpath(path, m.mountpoint))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(lstorch, "open", counting_open, raising=False)
    for rank in (0, 1):
        via_mount = list(MountDataset(m.mountpoint, rank, 2, stop=3, collate=True))
        direct = list(StreamDataset(url, rank, 2, stop=3, collate=True))
        assert len(via_mount) == len(direct) == 3
        for got, want in zip(via_mount, direct):
            assert list(got) == list(want)  # step, keys, then the fields in put order
            assert got["step"] == want["step"] and got["keys"] == want["keys"]
            for field in ("img", "lbl", "emb"):
                assert isinstance(got[field], torch.Tensor) and got[field].dtype == want[field].dtype
                assert torch.equal(got[field], want[field])
            assert all(torch.equal(x, y) for x, y in zip(got["vec"], want["vec"]))
            assert got["txt"] == want["txt"] and got["cls"] == want["cls"]
            got["img"][0, 0, 0, 0] += 1  # writable, like StreamDataset's
        steps = {p for p in opened if "_batch" in p}
        assert len(steps) == 9 and all(
            re.fullmatch(rf"rank-{rank}/\d{{12}}/_batch/(img|lbl|emb)\.npy", p) for p in steps
        )
        assert not [p for p in opened if re.search(r"\.(img|lbl|emb)$", p)]  # no sample's file of a block field
        assert not [p for p in opened if re.search(r"\.(txt|cls)$", p)]  # short text and JSON: in _meta.json
        opened.clear()
    # without `_batch` (collate=False) the items are as before, short text and JSON from _meta.json too
    items = list(MountDataset(m.mountpoint, 0, 2, stop=1))
    assert len(items) == 1 and len(items[0]["samples"]) == 4 and "img" in items[0]["samples"][0]
    direct = list(StreamDataset(url, 0, 2, stop=1))
    assert [(s["txt"], s["cls"]) for s in items[0]["samples"]] == [(s["txt"], s["cls"]) for s in direct[0]["samples"]]
    assert not [p for p in opened if re.search(r"\.(txt|cls)$", p)]
