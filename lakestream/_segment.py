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

__all__ = [
    "EncodedSample",
    "FieldRef",
    "decode_slice",
    "encode_sample",
    "encode_segment",
    "index_slice",
    "validate_name",
]

MAGIC = b"LSR1"
_LEN = struct.Struct("<I")
KEY_FIELD = "__key__"
RESERVED_KEYS = frozenset({"_meta", "_status"})


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
    raw = name.encode("utf-8", "surrogatepass")
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


def _encode_value(key: str, name: str, value: Any) -> tuple[str, bytes]:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "b", bytes(value)
    if isinstance(value, str):
        return "s", value.encode()
    if isinstance(value, np.ndarray):
        buf = io.BytesIO()
        np.lib.format.write_array(buf, value, allow_pickle=False)
        return "n", buf.getvalue()
    try:
        return "j", orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)
    except TypeError as e:
        raise InvalidSample(f"sample {key!r} field {name!r}: cannot store {type(value).__name__}: {e}") from None


def encode_sample(sample: Mapping[str, Any], default_key: str, *, max_bytes: int) -> EncodedSample:
    """Validate and encode one sample. Raises InvalidSample naming the key and field."""
    if not isinstance(sample, Mapping):
        raise InvalidSample(f"a sample must be a mapping of field name to value, got {type(sample).__name__}")
    key = sample.get(KEY_FIELD, default_key)
    validate_name(key, "sample key", allow_dot=False)
    if key in RESERVED_KEYS:
        raise InvalidSample(f"sample key {key!r} is reserved")
    fields = []
    total = 0
    for name, value in sample.items():
        if name == KEY_FIELD:
            continue
        validate_name(name, f"sample {key!r}: field name", allow_dot=True)
        if len(key.encode()) + 1 + len(name.encode()) > 255:
            raise InvalidSample(f"sample {key!r} field {name!r}: '<key>.<field>' is over 255 bytes")
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


def check_slice(data: bytes | memoryview, crc32: int, where: str) -> None:
    """Raise CorruptData (naming `where`) unless `data` has the expected CRC-32."""
    got = zlib.crc32(data)
    if got != crc32:
        raise CorruptData(f"{where}: checksum mismatch (crc32 {got:#010x}, expected {crc32:#010x})")


def index_slice(data: bytes | memoryview, where: str = "rank slice") -> list[FieldRef]:
    """Every field of a slice with its (offset, length) in the slice. Raises CorruptData."""
    try:
        if bytes(data[:4]) != MAGIC:
            raise ValueError("bad magic")
        (hlen,) = _LEN.unpack_from(data, 4)
        header = orjson.loads(bytes(data[8 : 8 + hlen]))
        pos = 8 + hlen
        refs = []
        for key, fields in header:
            for name, tag, length in fields:
                refs.append(FieldRef(key, name, tag, pos, length))
                pos += length
        if pos != len(data):
            raise ValueError(f"payload is {len(data) - 8 - hlen} bytes, header says {pos - 8 - hlen}")
        return refs
    except (ValueError, TypeError, struct.error) as e:
        raise CorruptData(f"{where}: malformed slice: {e}") from None


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
    if crc32 is not None:
        check_slice(data, crc32, where)
    view = memoryview(data)
    samples: list[dict[str, Any]] = []
    by_key: dict[str, dict[str, Any]] = {}
    for ref in index_slice(view, where):
        sample = by_key.get(ref.key)
        if sample is None:
            sample = by_key[ref.key] = {KEY_FIELD: ref.key}
            samples.append(sample)
        try:
            value = bytes(view[ref.offset : ref.offset + ref.length])
            sample[ref.field] = value if raw else decode_value(ref.tag, value)
        except (ValueError, TypeError) as e:
            raise CorruptData(f"{where} key {ref.key!r} field {ref.field!r}: {e}") from None
    return samples
