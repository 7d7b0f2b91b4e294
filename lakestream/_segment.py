"""The segment codec: samples in, bytes out, and back. No I/O.

A segment holds one TGB: `[rank 0 slice][rank 1 slice]…[rank W-1 slice]`. Each rank slice is
self-describing, so that one range GET of `(offset, length)` from the manifest is all a rank reads:

    b"LSR1"  u32 little-endian header length  header (JSON)  payload

The header is `[[key, [[field, tag, length], …]], …]`, one entry per sample in order; the payload
is every field's bytes in the same order. `tag` says how to turn the bytes back into the value
that was put: `b` bytes, `s` UTF-8 text, `n` a numpy array stored as `.npy`, `j` JSON. The CRC-32
of the whole slice is kept in the manifest, so any flipped byte is detected before decoding.
"""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from ._errors import CorruptData, InvalidSample
from ._layout import KEY_FIELD, RESERVED_KEYS

__all__ = [
    "ChecksumMismatch",
    "EncodedSample",
    "FieldRef",
    "decode_part",
    "decode_slice",
    "dump_json",
    "encode_sample",
    "encode_segment",
    "index_slice",
    "validate_name",
]

MAGIC = b"LSR1"
_LEN = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class EncodedSample:
    key: str
    fields: tuple[tuple[str, str, bytes], ...]  # (field, tag, bytes)

    @property
    def nbytes(self) -> int:
        return sum(len(b) for _, _, b in self.fields)


@dataclass(frozen=True, slots=True)
class FieldRef:
    """Where one field's bytes are inside a rank slice."""

    key: str
    field: str
    tag: str
    offset: int
    length: int


def validate_name(name: object, what: str, *, allow_dot: bool) -> str:
    """A key or field name that is safe as part of a file name, or InvalidSample."""
    if not isinstance(name, str):
        raise InvalidSample(f"{what} must be a string, got {type(name).__name__}")
    try:
        raw = name.encode()
    except UnicodeEncodeError:
        raise InvalidSample(f"{what} {name!r} is not valid UTF-8 text") from None
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
        raise InvalidSample(f"{what} {name!r} {problem}")
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


def dump_json(value: Any, what: str) -> bytes:
    """`value` as JSON, or InvalidSample naming `what`. NaN and infinities are refused, never
    rewritten to null (a NaN cursor read back as null would restart a source from zero)."""
    try:
        data = orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)
    except TypeError as e:
        raise InvalidSample(f"{what}: cannot store {type(value).__name__} as JSON: {e}") from None
    if b"null" in data and not _finite(value):  # orjson writes NaN and infinities as null
        raise InvalidSample(f"{what}: NaN and infinities cannot be stored as JSON")
    return data


def _encode_value(key: str, name: str, value: Any) -> tuple[str, bytes]:
    what = f"sample {key!r} field {name!r}"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "b", bytes(value)
    if isinstance(value, str):
        try:
            return "s", value.encode()
        except UnicodeEncodeError as e:
            raise InvalidSample(f"{what}: text is not valid UTF-8 ({e.reason} at {e.start})") from None
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise InvalidSample(f"{what}: numpy arrays of Python objects cannot be stored (dtype {value.dtype})")
        buf = io.BytesIO()
        try:
            np.lib.format.write_array(buf, value, allow_pickle=False)
        except ValueError as e:
            raise InvalidSample(f"{what}: cannot store the numpy array: {e}") from None
        return "n", buf.getvalue()
    return "j", dump_json(value, what)


def encode_sample(sample: Mapping[str, Any], default_key: str, *, max_bytes: int) -> EncodedSample:
    """Validate and encode one sample. Raises InvalidSample naming the key and field."""
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
        total += len(data)
        fields.append((name, tag, data))
    if not fields:
        raise InvalidSample(f"sample {key!r} has no fields")
    if total > max_bytes:
        raise InvalidSample(f"sample {key!r} is {total} bytes, over the stream's maximum of {max_bytes}")
    return EncodedSample(key, tuple(fields))


def encode_segment(ranks: list[list[EncodedSample]]) -> tuple[bytes, list[list[int]]]:
    """One segment for a TGB, and each rank's `[offset, length, crc32, samples]`."""
    parts: list[bytes] = []
    slices = []
    offset = 0
    for samples in ranks:
        header = orjson.dumps([[s.key, [[f, t, len(b)] for f, t, b in s.fields]] for s in samples])
        head = MAGIC + _LEN.pack(len(header)) + header
        crc = zlib.crc32(head)
        length = len(head)
        parts.append(head)
        for s in samples:
            for _, _, b in s.fields:
                crc = zlib.crc32(b, crc)
                length += len(b)
                parts.append(b)
        slices.append([offset, length, crc, len(samples)])
        offset += length
    return b"".join(parts), slices


class ChecksumMismatch(CorruptData):
    """A slice's bytes do not have the CRC-32 its commit record holds (a CorruptData)."""


def check_slice(data: bytes | memoryview, crc32: int, where: str) -> None:
    """Raise ChecksumMismatch (naming `where`) unless `data` has the expected CRC-32."""
    got = zlib.crc32(data)
    if got != crc32:
        raise ChecksumMismatch(f"{where}: checksum mismatch (crc32 {got:#010x}, expected {crc32:#010x})")


TAGS = frozenset("bsnj")


def index_slice(data: bytes | memoryview, where: str = "rank slice") -> list[FieldRef]:
    """Every field of a slice with its (offset, length) in the slice. Raises CorruptData.

    The header is untrusted: every key and field name passes the same rules as on put (so a name
    can never become a path outside a directory), keys are unique in the slice and fields in
    their sample, tags are known, and the lengths add up to the payload exactly.
    """
    try:
        if len(data) < 8 or bytes(data[:4]) != MAGIC:
            raise ValueError("bad magic")
        (hlen,) = _LEN.unpack_from(data, 4)
        if 8 + hlen > len(data):
            raise ValueError(f"header of {hlen} bytes runs past the slice's {len(data)} bytes")
        header = orjson.loads(bytes(data[8 : 8 + hlen]))
        if not isinstance(header, list):
            raise ValueError("header is not a list")
        pos = 8 + hlen
        refs = []
        keys: set[str] = set()
        for entry in header:
            if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], list) and entry[1]):
                raise ValueError(f"bad sample entry {entry!r:.80}")
            key, fields = entry
            _check_key(key)
            if key in keys:
                raise ValueError(f"sample key {key!r} appears twice")
            keys.add(key)
            names: set[str] = set()
            for f in fields:
                if not (isinstance(f, list) and len(f) == 3):
                    raise ValueError(f"sample {key!r}: bad field entry {f!r:.80}")
                name, tag, length = f
                _check_field(key, name)
                if name in names:
                    raise ValueError(f"sample {key!r}: field {name!r} appears twice")
                names.add(name)
                if tag not in TAGS or type(length) is not int or not 0 <= length <= len(data) - pos:
                    raise ValueError(f"sample {key!r} field {name!r}: bad tag {tag!r} or length {length!r}")
                refs.append(FieldRef(key, name, tag, pos, length))
                pos += length
        if pos != len(data):
            raise ValueError(f"payload is {len(data) - 8 - hlen} bytes, header says {pos - 8 - hlen}")
        return refs
    except (ValueError, TypeError, struct.error, InvalidSample) as e:
        raise CorruptData(f"{where}: malformed slice: {e}") from None


def _check_key(key: object) -> None:
    validate_name(key, "sample key", allow_dot=False)
    if key in RESERVED_KEYS:
        raise InvalidSample(f"sample key {key!r} is reserved")


def _check_field(key: str, name: object) -> None:
    validate_name(name, f"sample {key!r}: field name", allow_dot=True)
    assert isinstance(name, str)
    if len(key.encode()) + 1 + len(name.encode()) > 255:
        raise InvalidSample(f"sample {key!r} field {name!r}: '<key>.<field>' is over 255 bytes")


def decode_value(tag: str, raw: bytes) -> Any:
    if tag == "b":
        return raw
    if tag == "s":
        return raw.decode()
    if tag == "n":
        return np.lib.format.read_array(io.BytesIO(raw), allow_pickle=False)
    if tag == "j":
        return orjson.loads(raw)
    raise ValueError(f"unknown field tag {tag!r}")


def decode_slice(
    data: bytes, crc32: int | None = None, where: str = "rank slice", *, raw: bool = False
) -> list[dict[str, Any]]:
    """The samples of one rank slice, each a dict with `__key__` and its fields as put
    (with `raw`, each field's stored bytes: what the mount shows as a file).

    Raises CorruptData naming `where` (and the sample key, when one is at fault).
    """
    return decode_part(data, crc32, where, raw=raw)[1]


def decode_part(
    data: bytes,
    crc32: int | None = None,
    where: str = "rank slice",
    lo: int = 0,
    hi: int | None = None,
    *,
    raw: bool = False,
) -> tuple[int, list[dict[str, Any]]]:
    """(the number of samples in the slice, its samples lo..hi decoded as by `decode_slice`).

    The whole slice is checked (checksum, header, names) and counted; only the samples kept are
    copied and decoded, which is what a rank reading part of a re-sliced TGB needs.
    """  # fmt: skip
    if crc32 is not None:
        check_slice(data, crc32, where)
    view = memoryview(data)
    samples: list[dict[str, Any]] = []
    n, current = 0, None
    sample: dict[str, Any] | None = None
    for ref in index_slice(view, where):  # a sample's fields are adjacent and keys unique
        if ref.key != current:
            current, n = ref.key, n + 1
            sample = {KEY_FIELD: ref.key} if lo < n and (hi is None or n <= hi) else None
            if sample is not None:
                samples.append(sample)
        if sample is None:
            continue
        try:
            value = bytes(view[ref.offset : ref.offset + ref.length])
            sample[ref.field] = value if raw else decode_value(ref.tag, value)
        except (ValueError, TypeError) as e:
            raise CorruptData(f"{where} key {ref.key!r} field {ref.field!r}: {e}") from None
    return n, samples
