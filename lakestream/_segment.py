"""The segment codec: samples in, bytes out, and back. No I/O.

A segment holds one TGB: `[rank 0 slice][rank 1 slice]…[rank W-1 slice]`. Each rank slice is
self-describing, so that one range GET of `(offset, length)` from the manifest is all a rank reads.
A slice of format 2 (written by default) is

    b"LSR2"  u32 little-endian header length  header (JSON)  zeros to a multiple of 64
    one array block per array field, each followed by zeros to a multiple of 64  payload

The header is `{"samples": [[key, [[field, tag, length], …]], …], "arrays": [[field, dtype,
shape, count], …]}`. A field that is a numpy array of one dtype and shape in every sample of the
slice is stored as one block: the samples' arrays back to back, C order, which a reader hands out
as one `(count, *shape)` array without decoding anything (tag `a`, its length one sample's bytes).
The payload is every other field's bytes in sample order. `tag` says how to turn the bytes back
into the value that was put: `b` bytes, `s` UTF-8 text, `n` a numpy array stored as `.npy`, `j`
JSON. A slice of format 1 (`b"LSR1"`, as written before) has the header `[[key, [[field, tag,
length], …]], …]` and the payload right after it, and no blocks.

The checksum of each slice (named by its commit record: `crc32`, or `xxh3-64` by default) is kept
in the manifest, so any flipped byte is detected before decoding.
"""

from __future__ import annotations

import functools
import io
import math
import re
import struct
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import orjson
import xxhash

from ._buffers import MIN_POOLED, pool
from ._errors import CorruptData, InvalidSample
from ._layout import KEY_FIELD, RESERVED_KEYS

__all__ = [
    "CHECKSUMS",
    "DEFAULT_CHECKSUM",
    "Block",
    "ChecksumMismatch",
    "EncodedSample",
    "FieldInfo",
    "FieldRef",
    "SliceIndex",
    "check_slice",
    "checksum_of",
    "decode_columns",
    "decode_part",
    "decode_slice",
    "describe_part",
    "dump_json",
    "encode_sample",
    "encode_segment",
    "expand_slice",
    "index_slice",
    "join_samples",
    "npy_header",
    "npy_info",
    "parse_slice",
    "validate_name",
]

MAGIC = b"LSR1"  # format 1: no array blocks
MAGIC2 = b"LSR2"  # format 2: array blocks, 64-byte aligned
ALIGN = 64
_LEN = struct.Struct("<I")
ARRAY_KINDS = frozenset("biufc")  # dtypes stored as blocks: bool, integers, floats, complex
_DTYPE = re.compile(r"[<>|][biufc][0-9]{1,2}")
MAX_NDIM = 32
NPY_MAX_HEADER = 10_000  # bytes of a .npy field's header read, at most


class _Hash(Protocol):
    def update(self, data: Any, /) -> None: ...
    def intdigest(self) -> int: ...


class _Crc32:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)

    def intdigest(self) -> int:
        return self.value


CHECKSUMS: dict[str, Callable[[], _Hash]] = {"crc32": _Crc32, "xxh3-64": xxhash.xxh3_64}
DEFAULT_CHECKSUM = "xxh3-64"  # chosen by measurement: docs/benchmarks.md


def checksum_of(data: Any, checksum: str = "crc32") -> int:
    """The `checksum` (`crc32` or `xxh3-64`) of a bytes-like object."""
    if checksum == "crc32":
        return zlib.crc32(data)
    if checksum == "xxh3-64":
        return xxhash.xxh3_64_intdigest(data)
    raise ValueError(f"unknown checksum {checksum!r}")


@dataclass(frozen=True, slots=True)
class EncodedSample:
    key: str
    fields: tuple[tuple[str, str, Any], ...]  # (field, tag, bytes), or (field, "a", a C-contiguous array)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes if t == "a" else len(b) for _, t, b in self.fields)


@dataclass(frozen=True, slots=True)
class FieldRef:
    """Where one field's bytes are inside a rank slice (tag `a`: one sample's row of an array block)."""

    key: str
    field: str
    tag: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class FieldInfo:
    """One field of a sample as stored (`describe_part`): its kind (`bytes`, `text`, `json`, `npy`:
    a `.npy` file, `array`: a row of an array block), for the last two its dtype and shape, and its
    bytes in the slice (of a row of a block: the array's data, with no `.npy` header)."""

    name: str
    kind: str
    nbytes: int
    dtype: np.dtype[Any] | None = None
    shape: tuple[int, ...] | None = None


KINDS = {"b": "bytes", "s": "text", "j": "json", "n": "npy", "a": "array"}


@dataclass(frozen=True, slots=True)
class Block:
    """One array field of every sample of a slice, stored back to back at `offset`."""

    field: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    count: int
    offset: int

    @property
    def row_bytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n

    def array(self, data: Any) -> np.ndarray[Any, Any]:
        """The block as one `(count, *shape)` array: a view of `data`, never a copy."""
        return np.ndarray((self.count, *self.shape), self.dtype, buffer=data, offset=self.offset)


class SliceIndex:
    """A slice's fields, in order (each sample's adjacent), and its array blocks by field.

    `fields`: each field as a `(key, field, tag, offset, length)` tuple; `refs`: the same as
    FieldRefs, made on first use (a frozen dataclass costs a microsecond or so to make, a fifth
    of a sample's parse, and reading columns needs none). `keys`: the samples' keys where every
    sample's fields are the blocks' rows and nothing else (`fields` is then made on first use
    too: reading columns needs only the keys), else None."""

    __slots__ = ("_fields", "_refs", "blocks", "keys")

    def __init__(
        self,
        fields: list[tuple[str, str, str, int, int]] | None,
        blocks: dict[str, Block],
        keys: list[str] | None = None,
    ) -> None:
        assert fields is not None or keys is not None
        self._fields = fields
        self.blocks = blocks
        self.keys = keys
        self._refs: list[FieldRef] | None = None

    @property
    def fields(self) -> list[tuple[str, str, str, int, int]]:
        if self._fields is None:
            assert self.keys is not None
            rows = [(name, b.offset, b.row_bytes) for name, b in self.blocks.items()]
            self._fields = [(k, name, "a", at + i * n, n) for i, k in enumerate(self.keys) for name, at, n in rows]
        return self._fields

    @property
    def refs(self) -> list[FieldRef]:
        if self._refs is None:
            self._refs = [FieldRef(*f) for f in self.fields]
        return self._refs


def _plain_name(name: object, allow_dot: bool) -> bool:
    """True for the common name that `validate_name` passes: ASCII, 1-255 bytes, no '/' or NUL,
    not '.' or '..' (and no '.' at all unless `allow_dot`). Checked first: a slice's header is
    checked name by name on every read."""
    return (
        type(name) is str and name.isascii() and 0 < len(name) <= 255 and "/" not in name and "\0" not in name
        and name not in (".", "..") and (allow_dot or "." not in name)
    )  # fmt: skip


def _plain_keys(keys: list[object]) -> bool:
    """True if every one of `keys` is plain as `_plain_name(key, allow_dot=False)` says, none is
    reserved and none appears twice: all at once, in C (one join and a few scans, not a call a
    key), for the keys of a slice's header."""
    if not all(type(k) is str for k in keys):
        return False
    joined = "\0".join(keys)  # type: ignore[arg-type]  # all str: checked above
    return (
        joined.isascii() and joined.count("\0") == len(keys) - 1 and "/" not in joined and "." not in joined
        and (not keys or (min(map(len, keys)) > 0 and max(map(len, keys)) <= 255))  # type: ignore[arg-type]
        and RESERVED_KEYS.isdisjoint(keys) and len(set(keys)) == len(keys)
    )  # fmt: skip


def validate_name(name: object, what: str | Callable[[], str], *, allow_dot: bool) -> str:
    """A key or field name that is safe as part of a file name, or InvalidSample naming `what`
    (or what it returns: wording built only for an error)."""
    if _plain_name(name, allow_dot):
        return name  # type: ignore[return-value]  # a str: checked there
    if not isinstance(name, str):
        raise InvalidSample(f"{_said(what)} must be a string, got {type(name).__name__}")
    try:
        raw = name.encode()
    except UnicodeEncodeError:
        raise InvalidSample(f"{_said(what)} {name!r} is not valid UTF-8 text") from None
    problem = None
    if not name:
        problem = "is empty"
    elif len(raw) > 255:
        problem = f"is {len(raw)} bytes long (at most 255)"
    elif "/" in name or "\0" in name:
        problem = "contains '/' or NUL"
    elif name in (".", "..") or ".." in name.split("."):
        problem = "contains '..'"
    elif not allow_dot and "." in name:
        problem = "contains '.'"
    if problem:
        raise InvalidSample(f"{_said(what)} {name!r} {problem}")
    return name


def _finite(value: Any) -> bool:
    """False if a JSON-able value holds NaN or an infinity anywhere (JSON has no way to say them)."""
    if isinstance(value, (float, np.floating)):
        return bool(np.isfinite(value))
    if isinstance(value, np.ndarray):
        return value.dtype.kind not in "fc" or bool(np.isfinite(value).all())
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_finite(v) for v in value)
    return True


def dump_json(value: Any, what: str | Callable[[], str]) -> bytes:
    """`value` as JSON, or InvalidSample naming `what` (or what it returns: wording built only
    for an error, as a put checks every cursor). NaN and infinities are refused, never rewritten
    to null (a NaN cursor read back as null would restart a source from zero)."""
    try:
        data = orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)
    except TypeError as e:
        raise InvalidSample(f"{_said(what)}: cannot store {type(value).__name__} as JSON: {e}") from None
    if b"null" in data and not _finite(value):  # orjson writes NaN and infinities as null
        raise InvalidSample(f"{_said(what)}: NaN and infinities cannot be stored as JSON")
    return data


def _said(what: str | Callable[[], str]) -> str:
    return what if isinstance(what, str) else what()


def _npy(value: np.ndarray[Any, Any], what: str) -> bytes:
    buf = io.BytesIO()
    try:
        np.lib.format.write_array(buf, value, allow_pickle=False)
    except ValueError as e:
        raise InvalidSample(f"{what}: cannot store the numpy array: {e}") from None
    return buf.getvalue()


def _encode_value(key: str, name: str, value: Any) -> tuple[str, Any]:
    def what() -> str:  # only for an error: a put encodes every field
        return f"sample {key!r} field {name!r}"

    if isinstance(value, (bytes, bytearray, memoryview)):
        return "b", bytes(value)
    if isinstance(value, str):
        try:
            return "s", value.encode()
        except UnicodeEncodeError as e:
            raise InvalidSample(f"{what()}: text is not valid UTF-8 ({e.reason} at {e.start})") from None
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise InvalidSample(f"{what()}: numpy arrays of Python objects cannot be stored (dtype {value.dtype})")
        dt = value.dtype
        if type(value) is np.ndarray and dt.kind in ARRAY_KINDS and value.ndim <= MAX_NDIM and _DTYPE.fullmatch(dt.str):
            return "a", _copy_array(value)  # a copy: the caller may reuse its array after put
        return "n", _npy(value, what())
    return "j", dump_json(value, what)


def _copy_array(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """A C-order copy of `a`, a large one in pooled memory (_buffers.py: fresh memory costs a
    page fault a page, more than the copy), which returns to the pool once its segment is encoded."""
    if a.nbytes < MIN_POOLED:
        return np.array(a, order="C")
    out = np.frombuffer(pool.take(a.nbytes), a.dtype).reshape(a.shape)
    np.copyto(out, a)
    return out


def encode_sample(sample: Mapping[str, Any], default_key: str, *, max_bytes: int) -> EncodedSample:
    """Validate and encode one sample. Raises InvalidSample naming the key and field.

    A numpy array of a plain dtype is kept as an array (tag `a`) until its slice is encoded:
    a block there if the field is one in every sample of the slice, else a `.npy` file."""
    if not isinstance(sample, Mapping):
        raise InvalidSample(f"a sample must be a mapping of field name to value, got {type(sample).__name__}")
    key = sample.get(KEY_FIELD, default_key)
    _check_key(key)
    fields = []
    total = 0
    for name, value in sample.items():
        if name == KEY_FIELD:
            continue
        _check_field(key, name)
        tag, data = _encode_value(key, name, value)
        total += data.nbytes if tag == "a" else len(data)
        fields.append((name, tag, data))
    if not fields:
        raise InvalidSample(f"sample {key!r} has no fields")
    if total > max_bytes:
        raise InvalidSample(f"sample {key!r} is {total} bytes, over the stream's maximum of {max_bytes}")
    return EncodedSample(key, tuple(fields))


def _blocks(samples: list[EncodedSample]) -> list[tuple[str, np.dtype[Any], tuple[int, ...]]]:
    """The fields of a slice stored as array blocks: an array of one dtype and shape in every sample."""
    if not samples:
        return []
    out = []
    for name, tag, first in samples[0].fields:
        if tag != "a":
            continue
        dt, shape = first.dtype, first.shape
        for s in samples[1:]:
            v = next((v for f, t, v in s.fields if f == name and t == "a"), None)
            if v is None or v.dtype != dt or v.shape != shape:
                break
        else:
            out.append((name, dt, shape))
    return out


def _pad(n: int) -> bytes:
    return bytes(-n % ALIGN)


def encode_segment(
    ranks: list[list[EncodedSample]], checksum: str = DEFAULT_CHECKSUM, *, version: int = 2
) -> tuple[memoryview, list[list[int]]]:
    """One segment for a TGB, and each rank's `[offset, length, checksum, samples]`.

    The segment is one writable buffer in pooled memory (_buffers.py), its bytes copied once.
    `checksum`: `xxh3-64` or `crc32` (what the commit record names). `version`: the slice format,
    2 (array blocks) or 1 (every array a `.npy` file, as written before format 2)."""
    if checksum not in CHECKSUMS:
        raise ValueError(f"unknown checksum {checksum!r}: one of {', '.join(CHECKSUMS)}")
    parts: list[Any] = []
    slices = []
    offset = 0
    for samples in ranks:
        blocks = _blocks(samples) if version == 2 else []
        in_block = {name for name, _, _ in blocks}
        entries = []
        payload: list[Any] = []
        for s in samples:
            fields = []
            for f, t, b in s.fields:
                if f in in_block:
                    fields.append([f, "a", b.nbytes])
                    continue
                if t == "a":
                    t, b = "n", _npy(b, f"sample {s.key!r} field {f!r}")
                fields.append([f, t, len(b)])
                payload.append(b)
            entries.append([s.key, fields])
        if version == 1:
            header = orjson.dumps(entries)
            body = [MAGIC + _LEN.pack(len(header)) + header]
        else:
            arrays = [[name, dt.str, list(shape), len(samples)] for name, dt, shape in blocks]
            header = orjson.dumps({"samples": entries, "arrays": arrays})
            head = MAGIC2 + _LEN.pack(len(header)) + header
            body = [head + _pad(len(head))]
            pos = len(body[0])
            for name, _, _ in blocks:
                for s in samples:
                    a = next(v for f, t, v in s.fields if f == name)
                    body.append(a.reshape(-1).view(np.uint8))
                    pos += a.nbytes
                if pos % ALIGN:
                    body.append(_pad(pos))
                    pos += len(body[-1])
        body += payload
        length = sum(len(b) for b in body)
        parts += body
        slices.append([offset, length, 0, len(samples)])
        offset += length
    out = pool.take(offset)
    pos = 0
    for b in parts:
        n = len(b)
        out[pos : pos + n] = b
        pos += n
    for sl in slices:  # over the copy, each slice in one call
        sl[2] = checksum_of(out[sl[0] : sl[0] + sl[1]], checksum)
    return out, slices


class ChecksumMismatch(CorruptData):
    """A slice's bytes do not have the checksum its commit record holds (a CorruptData)."""


def check_slice(data: Any, expected: int, where: str, checksum: str = "crc32") -> None:
    """Raise ChecksumMismatch (naming `where`) unless `data` has the expected `checksum`."""
    got = checksum_of(data, checksum)
    if got != expected:
        width = 10 if checksum == "crc32" else 18
        raise ChecksumMismatch(
            f"{where}: checksum mismatch ({checksum} {got:#0{width}x}, expected {expected:#0{width}x})"
        )


TAGS = frozenset("bsnj")


def index_slice(data: Any, where: str = "rank slice") -> list[FieldRef]:
    """Every field of a slice with its (offset, length) in the slice (see `parse_slice`)."""
    return parse_slice(data, where).refs


def parse_slice(data: Any, where: str = "rank slice") -> SliceIndex:
    """Every field of a slice with its (offset, length) in the slice, and its array blocks.
    Raises CorruptData.

    The header is untrusted: every key and field name passes the same rules as on put (so a name
    can never become a path outside a directory), keys are unique in the slice and fields in
    their sample, tags are known, blocks hold one row per sample inside the slice, and the
    lengths add up to the payload exactly.
    """
    try:
        magic = bytes(data[:4])
        if len(data) < 8 or magic not in (MAGIC, MAGIC2):
            raise ValueError("bad magic")
        (hlen,) = _LEN.unpack_from(data, 4)
        if 8 + hlen > len(data):
            raise ValueError(f"header of {hlen} bytes runs past the slice's {len(data)} bytes")
        header = orjson.loads(bytes(data[8 : 8 + hlen]))
        pos = 8 + hlen
        blocks: dict[str, Block] = {}
        if magic == MAGIC2:
            if not (isinstance(header, dict) and header.keys() == {"samples", "arrays"}):
                raise ValueError("header is not an object of samples and arrays")
            entries, arrays = header["samples"], header["arrays"]
            if not (isinstance(entries, list) and isinstance(arrays, list)):
                raise ValueError("header samples or arrays is not a list")
            for a in arrays:
                pos = _skip_pad(data, pos)
                b = _block(a, len(entries), pos)
                if b.field in blocks:
                    raise ValueError(f"array field {b.field!r} appears twice")
                pos += b.count * b.row_bytes
                if pos > len(data):
                    raise ValueError(f"array field {b.field!r} runs past the slice's {len(data)} bytes")
                blocks[b.field] = b
            pos = _skip_pad(data, pos)
        else:
            entries = header
            if not isinstance(entries, list):
                raise ValueError("header is not a list")
        bad = next((e for e in entries if not (type(e) is list and len(e) == 2 and type(e[1]) is list and e[1])), None)
        if bad is not None:
            raise ValueError(f"bad sample entry {bad!r:.80}")
        # Any other slice's keys get the full check, and its wording, name by name (`_fields`).
        keys = [e[0] for e in entries]
        plain_keys = _plain_keys(keys)
        if plain_keys and blocks and pos == len(data) and _only_blocks(entries, keys, blocks):
            return SliceIndex(None, blocks, keys)
        return SliceIndex(_fields(entries, blocks, pos, len(data), plain_keys), blocks)
    except (ValueError, TypeError, struct.error, InvalidSample) as e:
        raise CorruptData(f"{where}: malformed slice: {e}") from None


def _fields(
    entries: list[Any], blocks: dict[str, Block], pos: int, size: int, plain_keys: bool
) -> list[tuple[str, str, str, int, int]]:
    """A slice header's sample entries (each a list of a key and a non-empty list), every key and
    field checked, as `(key, field, tag, offset, length)`, the first field not in a block at
    `pos`, all within `size` bytes (see `parse_slice`); ValueError or InvalidSample if any is not.
    `plain_keys`: every key passes `_plain_keys`."""
    start = pos
    refs: list[tuple[str, str, str, int, int]] = []
    rows = {name: b.row_bytes for name, b in blocks.items()}
    block_names = blocks.keys()
    seen: set[str] = set()
    plain_names: set[str] = set()  # field names found plain in this slice (most recur in every sample)
    for i, (key, fields) in enumerate(entries):
        if not plain_keys:
            _check_key(key)
            if key in seen:
                raise ValueError(f"sample key {key!r} appears twice")
            seen.add(key)
        names: set[str] = set()
        for f in fields:
            if not (type(f) is list and len(f) == 3):
                raise ValueError(f"sample {key!r}: bad field entry {f!r:.80}")
            name, tag, length = f
            plain = type(name) is str and name in plain_names
            if not plain and plain_keys and _plain_name(name, True):
                plain = True
                plain_names.add(name)
            # Both plain, so ASCII: '<key>.<field>' is within 255 bytes if within 255 characters.
            if not (plain and len(key) + len(name) < 255):
                _check_field(key, name)
            if name in names:
                raise ValueError(f"sample {key!r}: field {name!r} appears twice")
            names.add(name)
            blk = blocks.get(name)
            if tag == "a" and blk is not None and type(length) is int and length == rows[name]:
                refs.append((key, name, tag, blk.offset + i * length, length))
                continue
            if tag not in TAGS or blk is not None or type(length) is not int or not 0 <= length <= size - pos:
                raise ValueError(f"sample {key!r} field {name!r}: bad tag {tag!r} or length {length!r}")
            refs.append((key, name, tag, pos, length))
            pos += length
        if blocks and not block_names <= names:
            raise ValueError(f"sample {key!r} lacks array field(s) {sorted(block_names - names)!r:.80}")
    if pos != size:
        raise ValueError(f"payload is {size - start} bytes, header says {pos - start}")
    return refs


def _only_blocks(entries: list[list[Any]], keys: list[str], blocks: dict[str, Block]) -> bool:
    """Whether every sample's field entries (each a list of two, the second a list) are the
    blocks' rows and nothing else, `[name, "a", row bytes]` in the blocks' order, with names that
    pass the rules for each of `keys` (plain, checked by `_plain_keys`): what the check of each
    field would find (`_fields`), at a compare a sample (the parse of a slice of 16 same-shape
    arrays: 20 -> 16 µs). The lengths must be ints: `==` takes 1.0 or true for 1."""
    rows = [[name, "a", b.row_bytes] for name, b in blocks.items()]
    if not all(e[1] == rows for e in entries) or not _int_lengths(entries):  # the latter on entries so formed
        return False
    longest = max(map(len, keys))  # ASCII: '<key>.<field>' is within 255 bytes if within 255 characters
    return all(_plain_name(name, True) and longest + len(name) < 255 for name in blocks)


def _int_lengths(entries: list[list[Any]]) -> bool:
    """Whether every field entry (a list of three) of every sample (a list of two, the second a
    list of them) ends in an int, not a float or bool (which `==` takes for an equal int)."""
    return {type(f[2]) for e in entries for f in e[1]} == {int}


def _skip_pad(data: Any, pos: int) -> int:
    end = pos + (-pos % ALIGN)
    if end > len(data) or any(data[pos:end]):
        raise ValueError(f"no zero padding to a multiple of {ALIGN} at {pos}")
    return end


def _block(a: Any, count: int, offset: int) -> Block:
    if not (isinstance(a, list) and len(a) == 4):
        raise ValueError(f"bad array entry {a!r:.80}")
    name, dtype, shape, n = a
    if not (isinstance(name, str) and isinstance(dtype, str)):
        raise ValueError(f"bad array entry {a!r:.80}")
    dt = _block_dtype(dtype)
    if dt is None:
        if not _DTYPE.fullmatch(dtype):
            raise ValueError(f"bad array entry {a!r:.80}")
        raise ValueError(f"array field {name!r}: bad dtype {dtype!r}")
    if not (
        isinstance(shape, list) and len(shape) <= MAX_NDIM and all(type(d) is int and 0 <= d < 2**63 for d in shape)
    ):
        raise ValueError(f"array field {name!r}: bad shape {shape!r:.80}")
    if n != count or type(n) is not int:
        raise ValueError(f"array field {name!r}: {n!r:.20} rows for {count} samples")
    return Block(name, dt, tuple(shape), count, offset)


@functools.lru_cache(maxsize=64)
def _block_dtype(dtype: str) -> np.dtype[Any] | None:
    """The dtype a block's header names (`<f4`, `|u1`…), or None if it names none a block may have.
    Cached: a stream's slices name the same few, and parsing one is a third of a slice's parse."""
    if not _DTYPE.fullmatch(dtype):
        return None
    try:
        dt = np.dtype(dtype)
    except TypeError:
        return None
    return dt if dt.str == dtype and dt.kind in ARRAY_KINDS else None


def _check_key(key: object) -> None:
    validate_name(key, "sample key", allow_dot=False)
    if key in RESERVED_KEYS:
        raise InvalidSample(f"sample key {key!r} is reserved")


def _check_field(key: str, name: object) -> None:
    validate_name(name, lambda: f"sample {key!r}: field name", allow_dot=True)
    assert isinstance(name, str)
    ascii = key.isascii() and name.isascii()
    if (len(key) + 1 + len(name) if ascii else len(key.encode()) + 1 + len(name.encode())) > 255:
        raise InvalidSample(f"sample {key!r} field {name!r}: '<key>.<field>' is over 255 bytes")


def decode_value(tag: str, raw: bytes) -> Any:
    if tag == "b":
        return raw
    if tag == "s":
        return raw.decode()
    if tag == "n":
        return _read_npy(raw)
    if tag == "j":
        return orjson.loads(raw)
    raise ValueError(f"unknown field tag {tag!r}")


def _read_npy(raw: bytes) -> np.ndarray[Any, Any]:
    """A `.npy` field (untrusted), decoded (see `npy_info`). ValueError for anything else."""
    dtype, shape, fortran, start = npy_info(raw)
    body = memoryview(raw)[start:]
    return np.frombuffer(body, dtype=dtype).reshape(shape, order="F" if fortran else "C").copy(order="K")


def npy_info(raw: Any) -> tuple[np.dtype[Any], tuple[int, ...], bool, int]:
    """(dtype, shape, Fortran order, where the data starts) of a `.npy` field (untrusted): its
    header parsed, its shape checked against the bytes that are really there, nothing allocated
    (numpy's `read_array` allocates what the header says). ValueError for anything else."""
    f = io.BytesIO(bytes(raw[: 12 + NPY_MAX_HEADER]))  # magic, version, length, header: no more is read
    fmt = np.lib.format
    try:
        version = fmt.read_magic(f)
        read_header = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
        shape, fortran, dtype = read_header(f, max_header_size=NPY_MAX_HEADER)
    except Exception as e:  # numpy parses the header with ast: SyntaxError, tokenize errors, ...
        raise ValueError(f"not a .npy field ({type(e).__name__}: {e})") from None
    if dtype.hasobject:
        raise ValueError("a .npy field of Python objects")
    start = f.tell()
    if len(raw) - start != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"a .npy field of shape {shape} and dtype {dtype} in {len(raw) - start} bytes")
    return dtype, shape, fortran, start


def npy_header(dtype: np.dtype[Any], shape: tuple[int, ...]) -> bytes:
    """The header `np.save` writes before a C-order array of this dtype and shape."""
    d = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    buf = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(buf, d)
    except ValueError:  # too long for a version 1.0 header
        buf = io.BytesIO()
        np.lib.format.write_array_header_2_0(buf, d)
    return buf.getvalue()


def decode_slice(
    data: Any, checksum: int | None = None, where: str = "rank slice", *, raw: bool = False, kind: str = "crc32"
) -> list[dict[str, Any]]:
    """The samples of one rank slice, each a dict with `__key__` and its fields as put
    (with `raw`, each field's bytes as the mount shows them as a file: an array of a block as
    a `.npy` file).

    `checksum` (None: not checked) is the slice's checksum of `kind`. Raises CorruptData naming
    `where` (and the sample key, when one is at fault).
    """
    return decode_part(data, checksum, where, raw=raw, kind=kind)[1]


def decode_part(
    data: Any,
    checksum: int | None = None,
    where: str = "rank slice",
    lo: int = 0,
    hi: int | None = None,
    *,
    raw: bool = False,
    kind: str = "crc32",
) -> tuple[int, list[dict[str, Any]]]:
    """(the number of samples in the slice, its samples lo..hi decoded as by `decode_slice`).

    The whole slice is checked (checksum, header, names) and counted; only the samples kept are
    copied and decoded, which is what a rank reading part of a re-sliced TGB needs. An array of
    a block is a copy of its row (writable, independent of `data`).
    """  # fmt: skip
    if checksum is not None:
        check_slice(data, checksum, where, kind)
    view = memoryview(data)
    index = parse_slice(view, where)
    arrays = {name: b.array(view) for name, b in index.blocks.items()}
    headers = {name: npy_header(b.dtype, b.shape) for name, b in index.blocks.items()} if raw else {}
    samples: list[dict[str, Any]] = []
    n, current = 0, None
    sample: dict[str, Any] | None = None
    for key, name, tag, offset, length in index.fields:  # a sample's fields are adjacent and keys unique
        if key != current:
            current, n = key, n + 1
            sample = {KEY_FIELD: key} if lo < n and (hi is None or n <= hi) else None
            if sample is not None:
                samples.append(sample)
        if sample is None:
            continue
        if tag == "a":
            row = view[offset : offset + length]
            sample[name] = headers[name] + row if raw else arrays[name][n - 1, ...].copy()
            continue
        try:
            value = bytes(view[offset : offset + length])
            sample[name] = value if raw else decode_value(tag, value)
        except (ValueError, TypeError) as e:
            raise CorruptData(f"{where} key {key!r} field {name!r}: {e}") from None
    return n, samples


def describe_part(
    data: Any, where: str = "rank slice", lo: int = 0, hi: int | None = None
) -> tuple[int, list[tuple[str, list[FieldInfo]]]]:
    """(the number of samples in the slice, samples lo..hi each as its key and its fields described).

    Nothing is decoded but the header of each `.npy` field, checked against the field's length.
    The checksum is not checked here (see `check_slice`). Raises CorruptData naming `where` (and
    the sample key and field, when one is at fault).
    """
    view = memoryview(data)
    index = parse_slice(view, where)
    samples: list[tuple[str, list[FieldInfo]]] = []
    n, current, keep = 0, None, False
    for ref in index.refs:  # a sample's fields are adjacent and keys unique
        if ref.key != current:
            current, n = ref.key, n + 1
            keep = lo < n and (hi is None or n <= hi)
            if keep:
                samples.append((ref.key, []))
        if not keep:
            continue
        dtype: np.dtype[Any] | None = None
        shape: tuple[int, ...] | None = None
        if ref.tag == "a":
            dtype, shape = index.blocks[ref.field].dtype, index.blocks[ref.field].shape
        elif ref.tag == "n":
            try:
                dtype, shape, _, _ = npy_info(view[ref.offset : ref.offset + ref.length])
            except ValueError as e:
                raise CorruptData(f"{where} key {ref.key!r} field {ref.field!r}: {e}") from None
        samples[-1][1].append(FieldInfo(ref.field, KINDS[ref.tag], ref.length, dtype, shape))
    return n, samples


def decode_columns(
    data: Any, where: str = "rank slice", lo: int = 0, hi: int | None = None, index: SliceIndex | None = None
) -> tuple[int, list[str], dict[str, Any]]:
    """(the number of samples in the slice, the keys of samples lo..hi, their fields as columns).

    A field stored as an array block is one `(hi - lo, *shape)` array, a view of `data` (writable
    if `data` is); any other field is a list with each sample's value (None where a sample has
    no such field). Columns are in the order fields first appear. The checksum is not checked
    here (see `check_slice`). `index`: `parse_slice(data)`, if the caller has it. Raises
    CorruptData naming `where`.
    """
    view = memoryview(data)
    if index is None:
        index = parse_slice(view, where)
    if index.keys is not None:  # every field a block's row
        keys = index.keys[lo:hi]
        return len(index.keys), keys, {name: b.array(view)[lo : lo + len(keys)] for name, b in index.blocks.items()}
    keys = []
    values: dict[str, dict[int, Any]] = {}  # field -> {position in keys: value}
    n, current, keep = 0, None, False
    for key, name, tag, offset, length in index.fields:
        if key != current:
            current, n = key, n + 1
            keep = lo < n and (hi is None or n <= hi)
            if keep:
                keys.append(key)
        if not keep or tag == "a":
            continue
        try:
            value = decode_value(tag, bytes(view[offset : offset + length]))
        except (ValueError, TypeError) as e:
            raise CorruptData(f"{where} key {key!r} field {name!r}: {e}") from None
        values.setdefault(name, {})[len(keys) - 1] = value
    columns: dict[str, Any] = {}
    for name in dict.fromkeys(f[1] for f in index.fields):
        if name in index.blocks:
            columns[name] = index.blocks[name].array(view)[lo : lo + len(keys)]
        elif name in values:
            columns[name] = [values[name].get(i) for i in range(len(keys))]
    return n, keys, columns


def expand_slice(data: Any, index: SliceIndex) -> tuple[bytes, list[FieldRef]]:
    """A slice with array blocks as one buffer of per-sample files (what the mount serves): each
    row of a block becomes a `.npy` file (tag `n`), every other field's bytes are kept as they are."""
    view = memoryview(data)
    headers = {name: npy_header(b.dtype, b.shape) for name, b in index.blocks.items()}
    parts: list[Any] = []
    refs = []
    pos = 0
    for ref in index.refs:
        row = view[ref.offset : ref.offset + ref.length]
        if ref.tag == "a":
            parts.append(headers[ref.field])
            refs.append(FieldRef(ref.key, ref.field, "n", pos, len(headers[ref.field]) + ref.length))
            pos += len(headers[ref.field])
        else:
            refs.append(FieldRef(ref.key, ref.field, ref.tag, pos, ref.length))
        parts.append(row)
        pos += ref.length
    return b"".join(parts), refs


def join_samples(
    parts: list[tuple[Any, list[list[FieldRef]], dict[str, Block]]],
) -> tuple[bytes, list[FieldRef], dict[str, Block]]:
    """Samples of several slices as one buffer, with their fields and blocks (a rank of a step
    read as another world size than it was sealed for). `parts`: (a slice's data, the samples
    kept, each its field refs, the slice's blocks). A block field of one dtype and shape in every
    part with samples stays one block (its rows copied once, in order); a block field that is not
    becomes a `.npy` file per sample (tag `n`); every other field's bytes are kept as they are."""
    parts = [p for p in parts if p[1]]
    merged: dict[str, tuple[np.dtype[Any], tuple[int, ...]]] = {}
    if parts:
        first = parts[0][2]
        for name, b in first.items():
            if all(
                (o := blocks.get(name)) is not None and (o.dtype, o.shape) == (b.dtype, b.shape)
                for _, _, blocks in parts
            ):
                merged[name] = (b.dtype, b.shape)
    count = sum(len(groups) for _, groups, _ in parts)
    out: list[Any] = []
    pos = 0
    blocks: dict[str, Block] = {}
    for name, (dtype, shape) in merged.items():
        blocks[name] = block = Block(name, dtype, shape, count, pos)
        for data, groups, _ in parts:
            rows = [f for f in groups[0] + groups[-1] if f.field == name]
            start, end = rows[0].offset, rows[-1].offset + rows[-1].length  # rows of a block lie in order
            out.append(memoryview(data)[start:end])
            pos += end - start
        assert pos == block.offset + count * block.row_bytes
    refs: list[FieldRef] = []
    row = 0
    for data, groups, old in parts:
        view = memoryview(data)
        headers = {name: npy_header(b.dtype, b.shape) for name, b in old.items() if name not in merged}
        for group in groups:
            for f in group:
                if f.tag == "a" and f.field in blocks:
                    b = blocks[f.field]
                    refs.append(FieldRef(f.key, f.field, "a", b.offset + row * b.row_bytes, b.row_bytes))
                    continue
                if f.tag == "a":
                    out.append(headers[f.field])
                    refs.append(FieldRef(f.key, f.field, "n", pos, len(headers[f.field]) + f.length))
                    pos += len(headers[f.field])
                else:
                    refs.append(FieldRef(f.key, f.field, f.tag, pos, f.length))
                out.append(view[f.offset : f.offset + f.length])
                pos += f.length
            row += 1
    return b"".join(out), refs, blocks
