"""The segment codec and rank assignment: round trips, corruption detection, name rules."""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lakestream import CorruptData, InvalidSample
from lakestream._batching import assign_ranks
from lakestream._buffers import MIN_POOLED
from lakestream._segment import (
    ALIGN,
    DEFAULT_CHECKSUM,
    Block,
    SliceIndex,
    _fields,
    _only_blocks,
    _plain_keys,
    checksum_of,
    decode_columns,
    decode_part,
    decode_slice,
    decode_value,
    describe_part,
    encode_sample,
    encode_segment,
    expand_slice,
    index_slice,
    parse_slice,
)

names = st.text(st.characters(codec="utf-8", exclude_characters="/\0."), min_size=1, max_size=20).filter(
    lambda n: n != "__key__"  # the key's own field, not a field name
)
values = st.one_of(
    st.binary(max_size=200),
    st.text(max_size=50),
    st.lists(st.integers(-(2**40), 2**40), max_size=5),
    st.dictionaries(st.text(max_size=5), st.integers(-(2**62), 2**62), max_size=3),
)
samples = st.lists(st.dictionaries(names, values, min_size=1, max_size=4), max_size=12)
layouts = st.sampled_from([("xxh3-64", 2), ("crc32", 2), ("crc32", 1), ("xxh3-64", 1)])

# numpy arrays of every dtype a block holds (both byte orders), of a few shapes
dtypes = st.one_of(hnp.boolean_dtypes(), hnp.integer_dtypes(), hnp.unsigned_integer_dtypes(), hnp.floating_dtypes(),
                   hnp.complex_number_dtypes())  # fmt: skip
shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3)


@st.composite
def array_batches(draw: st.DrawFn) -> list[dict]:
    """Samples mixing array and other fields: some arrays of one dtype and shape in every sample
    (blocks in format 2), some that differ between samples, some fields only in some samples."""
    n = draw(st.integers(1, 8))
    same = {f: (draw(dtypes), draw(shapes)) for f in draw(st.lists(names, max_size=3, unique=True))}
    batch = []
    for _ in range(n):
        sample = {f: draw(hnp.arrays(dt, shape)) for f, (dt, shape) in same.items()}
        for f, v in draw(st.dictionaries(names, st.one_of(values, hnp.arrays(dtypes, shapes)), max_size=3)).items():
            sample.setdefault(f, v)
        if sample:
            batch.append(sample)
    return batch


def segment_bytes(*args: Any, **kwargs: Any) -> tuple[bytes, list[list[int]]]:
    """`encode_segment` with the segment as bytes (it is a view of pooled memory)."""
    data, slices = encode_segment(*args, **kwargs)
    return bytes(data), slices


def test_a_segment_is_one_buffer_of_pooled_memory_its_bytes_copied_once() -> None:
    a = np.arange(MIN_POOLED, dtype=np.uint8)
    enc = encode_sample({"x": a, "t": "hi"}, "k", max_bytes=1 << 30)
    x = enc.fields[0][2]
    assert not np.shares_memory(x, a) and np.array_equal(x, a)  # put's copy: the caller may reuse `a`
    data, [[off, length, digest, count]] = encode_segment([[enc]])
    assert isinstance(data, memoryview) and len(data) == off + length and count == 1
    assert digest == checksum_of(data, DEFAULT_CHECKSUM)
    _, _, columns = decode_columns(data)
    assert np.array_equal(columns["x"][0], a) and columns["t"] == ["hi"]


def encode_all(
    batch: list[dict], world: int, checksum: str = "xxh3-64", version: int = 2
) -> tuple[bytes, list[list[int]], list[list[int]]]:
    enc = [encode_sample(s, f"k{i}", max_bytes=1 << 20) for i, s in enumerate(batch)]
    ranks = assign_ranks(None, len(enc), world)
    data, slices = segment_bytes([[enc[i] for i in r] for r in ranks], checksum, version=version)
    return data, slices, ranks


def same_value(got: object, want: object) -> bool:
    """Equal, and for arrays: the same dtype (byte order included), shape and bytes."""
    if isinstance(want, np.ndarray):
        return (
            isinstance(got, np.ndarray) and got.dtype.str == want.dtype.str and got.shape == want.shape
            and got.tobytes() == want.tobytes()
        )  # fmt: skip
    return got == want


@given(samples, st.integers(1, 5), layouts)
def test_round_trip(batch: list[dict], world: int, layout: tuple[str, int]) -> None:
    checksum, version = layout
    data, slices, ranks = encode_all(batch, world, checksum, version)
    assert slices[0][0] == 0 and sum(s[1] for s in slices) == len(data)
    for (off, length, digest, count), idx in zip(slices, ranks):
        assert digest == checksum_of(data[off : off + length], checksum)
        got = decode_slice(data[off : off + length], digest, kind=checksum)
        assert count == len(idx) == len(got)
        for i, sample in zip(idx, got):
            assert sample.pop("__key__") == f"k{i}"
            assert sample == batch[i]


@settings(max_examples=60, deadline=None)
@given(array_batches(), st.integers(1, 3), layouts)
def test_any_mix_of_array_fields_round_trips_exactly(batch: list[dict], world: int, layout: tuple[str, int]) -> None:
    checksum, version = layout
    data, slices, ranks = encode_all(batch, world, checksum, version)
    for off, length, digest, count in slices:
        sl = data[off : off + length]
        blocks = parse_slice(sl).blocks
        assert bool(blocks) <= (version == 2)
        assert all(b.offset % ALIGN == 0 for b in blocks.values())
        got = decode_slice(sl, digest, kind=checksum)
        want = [batch[i] for i in ranks[slices.index([off, length, digest, count])]]
        assert len(got) == count == len(want)
        for g, w in zip(got, want):
            g.pop("__key__")
            assert list(g) == list(w)  # the fields in put order
            assert all(same_value(g[f], w[f]) for f in w), (g, w)
            assert all(g[f].flags.writeable for f in g if isinstance(g[f], np.ndarray))
        # the same samples as columns: one array per block field, a view of the slice's bytes
        buf = bytearray(sl)
        n, keys, columns = decode_columns(buf)
        assert n == count and keys == [f"k{i}" for i in ranks[slices.index([off, length, digest, count])]]
        for f, column in columns.items():
            if f in blocks:
                assert np.shares_memory(column, np.frombuffer(buf, np.uint8)) or column.nbytes == 0
                assert column.shape == (n, *blocks[f].shape) and column.flags.writeable
                assert all(same_value(column[j, ...], w[f]) for j, w in enumerate(want))
            else:
                assert all(same_value(c, w.get(f)) for c, w in zip(column, want))
        # and as the mount's per-sample files: a block's rows are .npy files as np.save writes them
        expanded, refs = expand_slice(sl, parse_slice(sl))
        raw = {r["__key__"]: r for r in decode_slice(sl, raw=True)}
        for ref in refs:
            file = expanded[ref.offset : ref.offset + ref.length]
            assert raw[ref.key][ref.field] == file
            if ref.field in blocks:
                assert ref.tag == "n"
                assert file == npy_bytes(batch[int(ref.key[1:])][ref.field])


def npy_bytes(a: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


@given(samples, st.integers(0, 13), st.integers(0, 13), st.booleans())
def test_a_part_decodes_as_the_whole_slice_cut(batch: list[dict], lo: int, hi: int, raw: bool) -> None:
    data, slices, _ = encode_all(batch, 1)
    off, length, digest, count = slices[0]
    sl = data[off : off + length]
    whole = decode_slice(sl, digest, raw=raw, kind="xxh3-64")
    assert decode_part(sl, digest, "s", lo, hi, raw=raw, kind="xxh3-64") == (count, whole[lo:hi])
    assert decode_part(sl, digest, "s", lo, raw=raw, kind="xxh3-64") == (count, whole[lo:])


@settings(max_examples=30, deadline=None)
@given(array_batches(), st.integers(0, 9), st.integers(0, 9))
def test_a_part_of_a_slice_with_blocks_decodes_as_the_whole_cut(batch: list[dict], lo: int, hi: int) -> None:
    data, slices, _ = encode_all(batch, 1)
    off, length, digest, count = slices[0]
    sl = data[off : off + length]
    whole = decode_slice(sl, digest, kind="xxh3-64")
    n, part = decode_part(sl, digest, "s", lo, hi, kind="xxh3-64")
    assert n == count and len(part) == len(whole[lo:hi])
    for g, w in zip(part, whole[lo:hi]):
        assert g.keys() == w.keys() and all(same_value(g[f], w[f]) for f in w)
    n, keys, columns = decode_columns(sl, "s", lo, hi)
    assert keys == [w["__key__"] for w in whole[lo:hi]]
    for f, column in columns.items():
        assert len(column) == len(keys)
        assert all(same_value(column[j] if isinstance(column, list) else column[j, ...], w.get(f))
                   for j, w in enumerate(whole[lo:hi]))  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(array_batches(), st.integers(1, 3), layouts, st.integers(0, 9), st.integers(0, 9))
def test_a_description_says_what_decoding_gives(
    batch: list[dict], world: int, layout: tuple[str, int], lo: int, hi: int
) -> None:
    data, slices, _ = encode_all(batch, world, *layout)
    for off, length, digest, count in slices:
        sl = data[off : off + length]
        blocks = parse_slice(sl).blocks
        whole = decode_slice(sl, digest, kind=layout[0])[lo:hi]
        raw = decode_slice(sl, digest, raw=True, kind=layout[0])[lo:hi]
        n, described = describe_part(sl, "s", lo, hi)
        assert n == count and [key for key, _ in described] == [w["__key__"] for w in whole]
        for (_, fields), w, r in zip(described, whole, raw):
            assert [f.name for f in fields] == [f for f in w if f != "__key__"]
            for f in fields:
                value = w[f.name]
                if isinstance(value, np.ndarray):
                    assert f.kind == ("array" if f.name in blocks else "npy")
                    assert f.dtype == value.dtype and f.dtype.str == value.dtype.str and f.shape == value.shape
                    assert f.nbytes == (value.nbytes if f.name in blocks else len(r[f.name]))
                    continue
                kind = "bytes" if isinstance(value, bytes) else "text" if isinstance(value, str) else "json"
                assert (f.kind, f.dtype, f.shape, f.nbytes) == (kind, None, None, len(r[f.name]))


@settings(max_examples=80, deadline=None)
@given(st.one_of(samples.filter(bool), array_batches()), layouts, st.data())
def test_any_flipped_byte_is_detected(batch: list[dict], layout: tuple[str, int], data: st.DataObject) -> None:
    checksum, version = layout
    seg, slices, _ = encode_all(batch, 2, checksum, version)
    off, length, digest, _ = slices[0]
    raw = bytearray(seg[off : off + length])
    i = data.draw(st.integers(0, len(raw) - 1))
    raw[i] ^= data.draw(st.integers(1, 255))
    with pytest.raises(CorruptData, match="rank 0 step 3: checksum mismatch"):
        decode_slice(bytes(raw), digest, "rank 0 step 3", kind=checksum)


@settings(max_examples=80, deadline=None)
@given(array_batches(), st.data())
def test_a_damaged_slice_unchecked_is_corrupt_data_or_decodes(batch: list[dict], data: st.DataObject) -> None:
    """Without its checksum, a slice with any byte changed raises CorruptData or decodes: nothing else."""
    seg, slices, _ = encode_all(batch, 1)
    raw = bytearray(seg[: slices[0][1]])
    i = data.draw(st.integers(0, len(raw) - 1))
    raw[i] ^= data.draw(st.integers(1, 255))
    try:
        decode_slice(bytes(raw))
        decode_columns(bytes(raw))
    except CorruptData:
        pass


def test_a_npy_field_whose_header_claims_more_than_is_there_is_refused_before_any_allocation() -> None:
    import io

    f = io.BytesIO()
    np.lib.format.write_array_header_1_0(f, {"descr": "<f8", "fortran_order": False, "shape": (10**12,)})
    forged = f.getvalue() + bytes(32)  # 8 TB claimed, 32 bytes there
    with pytest.raises(ValueError, match=r"shape \(1000000000000,\)"):
        decode_value("n", forged)
    with pytest.raises(ValueError, match=r"not a \.npy field"):
        decode_value("n", b"\x93NUMPY\x01\x00\x10\x00{'descr': '<f8',}}  \n")


def test_numpy_arrays_round_trip_as_npy_in_format_1() -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    data, slices = segment_bytes([[encode_sample({"x": a}, "k", max_bytes=1 << 20)]], "crc32", version=1)
    (ref,) = index_slice(data)
    assert data[ref.offset : ref.offset + 6] == b"\x93NUMPY"  # the field is a plain .npy file
    (got,) = decode_slice(data, slices[0][2])
    assert got["x"].dtype == a.dtype and (got["x"] == a).all()


def test_a_format_2_slice_is_laid_out_as_documented() -> None:
    """docs/format.md, byte for byte: header, zeros to 64, each block then zeros to 64, payload."""
    a = [np.arange(3, dtype="<u2") + i for i in range(2)]
    enc = [
        encode_sample({"img": a[i], "txt": f"t{i}", "n": np.arange(i + 1)}, f"k{i}", max_bytes=1 << 20)
        for i in range(2)
    ]
    data, [[off, length, digest, count]] = segment_bytes([enc])
    assert (off, length, count) == (0, len(data), 2) and digest == checksum_of(data, "xxh3-64")
    assert data[:4] == b"LSR2"
    (hlen,) = struct.unpack_from("<I", data, 4)
    header = json.loads(data[8 : 8 + hlen])
    assert header["arrays"] == [["img", "<u2", [3], 2]]
    assert header["samples"][0] == ["k0", [["img", "a", 6], ["txt", "s", 2], ["n", "n", len(npy_bytes(np.arange(1)))]]]
    start = 8 + hlen + (-(8 + hlen) % 64)
    assert not any(data[8 + hlen : start])
    assert data[start : start + 12] == a[0].tobytes() + a[1].tobytes()
    payload = start + 12 + (-(start + 12) % 64)
    assert not any(data[start + 12 : payload])
    assert data[payload:] == b"t0" + npy_bytes(np.arange(1)) + b"t1" + npy_bytes(np.arange(2))


def test_old_format_segments_still_decode() -> None:
    """A format 1 slice built by hand as docs/format.md describes it, with the CRC-32 of old records."""
    npy = npy_bytes(np.array([[1.5, -2.0]], dtype=">f8"))
    header = json.dumps([["k0", [["txt", "s", 5], ["x", "n", len(npy)]]], ["k1", [["bin", "b", 2]]]]).encode()
    sl = b"LSR1" + struct.pack("<I", len(header)) + header + b"hello" + npy + b"\x00\x01"
    got = decode_slice(sl, zlib.crc32(sl))
    assert got[0]["txt"] == "hello" and got[0]["x"].dtype.str == ">f8" and got[0]["x"].tolist() == [[1.5, -2.0]]
    assert got[1] == {"__key__": "k1", "bin": b"\x00\x01"}
    n, keys, columns = decode_columns(sl)
    assert (n, keys, columns["txt"], columns["bin"]) == (2, ["k0", "k1"], ["hello", None], [None, b"\x00\x01"])
    with pytest.raises(CorruptData, match="checksum mismatch"):
        decode_slice(sl, zlib.crc32(sl), kind="xxh3-64")


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda h: h.update(arrays=[["img", "<u2", [3], 3]]), "3 rows for 2 samples"),
        (lambda h: h.update(arrays=[["img", "<u2", [4], 2]]), "bad tag 'a'"),
        (lambda h: h.update(arrays=[["img", "<O8", [3], 2]]), "bad array entry"),
        (lambda h: h.update(arrays=[["img", "<u2", [1 << 40], 2]]), "runs past"),
        (lambda h: h.update(arrays=[["img", "<u2", [3], 2], ["img", "<u2", [3], 2]]), "appears twice"),
        (lambda h: h.update(arrays=[]), "bad tag 'a'"),
        (lambda h: h.update(samples=[h["samples"][0], ["k1", [["txt", "s", 2]]]]), "lacks array field"),
        (lambda h: h.pop("arrays"), "not an object"),
    ],
)
def test_a_malformed_format_2_header_is_corrupt_data(edit, match: str) -> None:
    enc = [encode_sample({"img": np.arange(3, dtype="<u2"), "txt": f"t{i}"}, f"k{i}", max_bytes=100) for i in range(2)]
    data, _ = segment_bytes([enc])
    (hlen,) = struct.unpack_from("<I", data, 4)
    header = json.loads(data[8 : 8 + hlen])
    edit(header)
    new = json.dumps(header).encode()
    forged = b"LSR2" + struct.pack("<I", len(new)) + new
    forged += bytes(-len(forged) % 64) + data[8 + hlen + (-(8 + hlen) % 64) :]
    with pytest.raises(CorruptData, match=match):
        decode_slice(forged)


@pytest.mark.parametrize(
    ("key", "field", "match"),
    [
        ("é" * 100, "f" * 60, "over 255 bytes"),  # 161 characters, 261 bytes: counted in bytes
        ("k" * 200, "f" * 55, "over 255 bytes"),
        ("k" * 199, "f" * 55, None),  # 255 bytes exactly
        ("_meta", "txt", "reserved"),
        ("k.x", "txt", "contains '.'"),
        ("k", "a/b", "contains '/'"),
        ("k", "..", "'..'"),
        ("ké", "é" * 127, "over 255 bytes"),
    ],
)
def test_names_read_from_a_slice_pass_the_rules_of_put(key: str, field: str, match: str | None) -> None:
    """A forged header's names get the checks `encode_sample` makes, whatever path the parse
    takes for them (the fast one for plain ASCII names, the full one for the rest)."""
    header = json.dumps([[key, [[field, "b", 1]]]]).encode()
    sl = b"LSR1" + struct.pack("<I", len(header)) + header + b"x"
    if match is None:
        assert [(r.key, r.field) for r in index_slice(sl)] == [(key, field)]
        return
    with pytest.raises(CorruptData, match=match):
        index_slice(sl)


@settings(max_examples=500)
@given(st.integers(1, 3), st.integers(1, 6), st.data())
def test_a_slice_of_array_rows_only_is_indexed_as_the_full_check_would(
    nblocks: int, n: int, data: st.DataObject
) -> None:
    """parse_slice takes a slice whose every sample's fields are the blocks' rows, in order, at a
    compare a sample (`_only_blocks`, the fields made only when asked for). Forged headers (a
    row's length as a float or another int, a tag or name changed, a field added or
    missing, keys that make '<key>.<field>' too long) are taken so only where the full check
    (`_fields`) passes them, with the same fields."""
    names = data.draw(st.lists(st.sampled_from(["img", "f" * 200, "f" * 200, "é" * 10, "a/b", ".."]), min_size=nblocks,
                               max_size=nblocks, unique=True))  # fmt: skip
    blocks = {name: Block(name, np.dtype("u1"), (5 + j,), n, 64 + 64 * j * n) for j, name in enumerate(names)}
    entries = []
    for i in range(n):
        key = data.draw(st.sampled_from([f"k{i}"] * 3 + [f"{'k' * 53}{i}", f"{'k' * 54}{i}"]))
        fields = [[name, "a", b.row_bytes] for name, b in blocks.items()]
        change = data.draw(st.sampled_from(["none"] * 4 + ["length"] * 4 + ["tag", "name", "more", "fewer", "order"]))
        j = data.draw(st.integers(0, len(fields) - 1))
        if change == "length":  # a float (`==` it) or another length
            fields[j][2] = data.draw(st.sampled_from([float(fields[j][2])] * 3 + [fields[j][2] + 1]))
        elif change == "tag":
            fields[j][1] = "b"
        elif change == "name":
            fields[j][0] = data.draw(st.sampled_from(["txt", "g" * 201, "a/b"]))
        elif change == "more":
            fields.append(["txt", "b", 0])
        elif change == "fewer" and len(fields) > 1:
            del fields[j]
        elif change == "order":
            fields.reverse()
        entries.append([key, fields])
    keys = [e[0] for e in entries]
    plain = _plain_keys(keys)
    if not (plain and _only_blocks(entries, keys, blocks)):
        return  # the full check reads it
    assert _fields(entries, blocks, 1 << 20, 1 << 20, plain) == SliceIndex(None, blocks, keys).fields


def test_nonzero_padding_is_corrupt_data() -> None:
    data, _ = segment_bytes([[encode_sample({"img": np.arange(3, dtype="<u2")}, "k", max_bytes=100)]])
    (hlen,) = struct.unpack_from("<I", data, 4)
    bad = bytearray(data)
    bad[8 + hlen] = 1
    with pytest.raises(CorruptData, match="zero padding"):
        index_slice(bytes(bad))


def test_truncated_slice_is_corrupt() -> None:
    data, _ = segment_bytes([[encode_sample({"txt": "hello"}, "k", max_bytes=100)]])
    with pytest.raises(CorruptData, match="malformed"):
        index_slice(data[:-1])


@pytest.mark.parametrize(
    ("sample", "match"),
    [
        ({"a/b": b""}, "contains '/'"),
        ({"..": b""}, "'..'"),
        ({"a\0": b""}, "NUL"),
        ({"": b""}, "empty"),
        ({"x" * 256: b""}, "255"),
        ({"__key__": "a.b", "txt": b""}, "contains '.'"),
        ({"__key__": "_meta", "json": b""}, "reserved"),
        ({"__key__": 7, "txt": b""}, "must be a string"),
        ({}, "no fields"),
        ({"x": object()}, "cannot store object"),
        ({"x": b"0" * 101}, "over the stream's maximum of 100"),
    ],
)
def test_bad_samples_are_refused_by_name(sample: dict, match: str) -> None:
    with pytest.raises(InvalidSample, match=match):
        encode_sample(sample, "k", max_bytes=100)


@given(st.lists(st.floats(0, 1000), max_size=64), st.integers(1, 8))
def test_balanced_assignment_is_a_fair_partition(costs: list[float], world: int) -> None:
    ranks = assign_ranks(costs, len(costs), world)
    flat = sorted(i for r in ranks for i in r)
    assert flat == list(range(len(costs)))
    sizes = [len(r) for r in ranks]
    assert max(sizes) - min(sizes) <= 1
    assert all(r == sorted(r) for r in ranks)
    # LPT bound: no rank carries more than the mean plus the largest single cost.
    if costs:
        loads = [sum(costs[i] for i in r) for r in ranks]
        assert max(loads) <= sum(costs) / world + max(costs) + 1e-6


def test_balanced_beats_round_robin_on_skewed_costs() -> None:
    costs = [100.0, 1, 100, 1, 100, 1, 100, 1]
    rr = [sum(costs[i] for i in r) for r in assign_ranks(None, 8, 2)]
    bal = [sum(costs[i] for i in r) for r in assign_ranks(costs, 8, 2)]
    assert max(rr) == 400 and max(bal) == 202
