"""The segment codec and rank assignment: round trips, corruption detection, name rules."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lakestream import CorruptData, InvalidSample
from lakestream._batching import assign_ranks
from lakestream._segment import decode_part, decode_slice, encode_sample, encode_segment, index_slice

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


def encode_all(batch: list[dict], world: int) -> tuple[bytes, list[list[int]], list[list[int]]]:
    enc = [encode_sample(s, f"k{i}", max_bytes=1 << 20) for i, s in enumerate(batch)]
    ranks = assign_ranks(None, len(enc), world)
    data, slices = encode_segment([[enc[i] for i in r] for r in ranks])
    return data, slices, ranks


@given(samples, st.integers(1, 5))
def test_round_trip(batch: list[dict], world: int) -> None:
    data, slices, ranks = encode_all(batch, world)
    assert slices[0][0] == 0 and sum(s[1] for s in slices) == len(data)
    for (off, length, crc, count), idx in zip(slices, ranks):
        got = decode_slice(data[off : off + length], crc)
        assert count == len(idx) == len(got)
        for i, sample in zip(idx, got):
            assert sample.pop("__key__") == f"k{i}"
            assert sample == batch[i]


@given(samples, st.integers(0, 13), st.integers(0, 13), st.booleans())
def test_a_part_decodes_as_the_whole_slice_cut(batch: list[dict], lo: int, hi: int, raw: bool) -> None:
    data, slices, _ = encode_all(batch, 1)
    off, length, crc, count = slices[0]
    whole = decode_slice(data[off : off + length], crc, raw=raw)
    assert decode_part(data[off : off + length], crc, "s", lo, hi, raw=raw) == (count, whole[lo:hi])
    assert decode_part(data[off : off + length], crc, "s", lo, raw=raw) == (count, whole[lo:])


@settings(max_examples=50)
@given(samples.filter(bool), st.data())
def test_any_flipped_byte_is_detected(batch: list[dict], data: st.DataObject) -> None:
    seg, slices, _ = encode_all(batch, 2)
    off, length, crc, _ = slices[0]
    raw = bytearray(seg[off : off + length])
    i = data.draw(st.integers(0, len(raw) - 1))
    raw[i] ^= data.draw(st.integers(1, 255))
    with pytest.raises(CorruptData, match="rank 0 step 3"):
        decode_slice(bytes(raw), crc, "rank 0 step 3")


def test_numpy_arrays_round_trip_as_npy() -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    data, slices = encode_segment([[encode_sample({"x": a}, "k", max_bytes=1 << 20)]])
    (ref,) = index_slice(data)
    assert data[ref.offset : ref.offset + 6] == b"\x93NUMPY"  # the field is a plain .npy file
    (got,) = decode_slice(data, slices[0][2])
    assert got["x"].dtype == a.dtype and (got["x"] == a).all()


def test_truncated_slice_is_corrupt() -> None:
    data, _ = encode_segment([[encode_sample({"txt": "hello"}, "k", max_bytes=100)]])
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
