"""`dir:` and `--from-dir`: the files directly in a directory, grouped into samples by name."""

from __future__ import annotations

import bisect
import hashlib
import io
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from .._errors import ConfigMismatch, InvalidSample
from .._layout import RESERVED_FIELDS
from ._base import reserved_names


def list_dir(root: Path, *, follow_symlinks: bool = False) -> list[str]:
    """The names of the sample files directly in `root`, sorted (by code point, which is UTF-8 byte order).

    Skipped: hidden names (a leading dot), directories and other non-files. A symbolic link is read
    as the file it points to if that file is inside `root`; a link pointing outside `root` (or to
    nothing) is refused with InvalidSample naming it, unless `follow_symlinks`. A name that is not
    UTF-8 is refused with InvalidSample naming the file: keys and field names are UTF-8.
    """
    real_root = os.path.realpath(root)
    names = []
    with os.scandir(root) as it:
        for e in it:
            if e.name.startswith("."):
                continue
            if e.is_symlink():
                target = os.path.realpath(e.path)
                inside = os.path.commonpath([real_root, target]) == real_root
                if not inside and not follow_symlinks:
                    raise InvalidSample(
                        f"--from-dir {root}: {_shown(e.name)} is a symbolic link to {_shown(target)}, outside the "
                        f"directory; refusing to read it (pass --follow-symlinks to read such links)"
                    )
                if not os.path.exists(target):
                    raise InvalidSample(
                        f"--from-dir {root}: {_shown(e.name)} is a symbolic link to nothing ({_shown(target)})"
                    )
                if not os.path.isfile(target):
                    continue
            elif not e.is_file(follow_symlinks=False):
                continue
            try:
                e.name.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidSample(
                    f"--from-dir {root}: file name {_shown(e.name)} is not UTF-8; rename it "
                    "(sample keys and field names are UTF-8 text)"
                ) from None
            names.append(e.name)
    names.sort()
    return names


def _shown(name: str) -> str:
    """A file name as text that is safe to print: undecodable bytes and control characters escaped."""
    return repr(os.fsencode(name))[1:] if _undecodable(name) else repr(name)


def _undecodable(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _read_file(root: Path, name: str, follow_symlinks: bool) -> bytes:
    """The bytes of `root/name`, re-checking what `list_dir` checked: the file may have been replaced by a
    link since it was listed."""
    path = root / name
    if os.path.islink(path):
        target = os.path.realpath(path)
        real_root = os.path.realpath(root)
        if not follow_symlinks and os.path.commonpath([real_root, target]) != real_root:
            raise InvalidSample(f"--from-dir {root}: {_shown(name)} became a symbolic link out of the directory")
        return Path(target).read_bytes()
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with open(fd, "rb") as f:
        return f.read()


def decode_field(field: str, data: bytes, where: str) -> Any:
    """WebDataset-style decoding by the field's last extension: `json` a JSON value, `txt` str,
    `npy` a numpy array, `cls` int; anything else stays bytes. Raises InvalidSample naming `where`."""
    ext = field.rpartition(".")[2]
    decoder = DECODERS.get(ext)
    if decoder is None:
        return data
    try:
        return decoder(data)
    except (ValueError, UnicodeDecodeError, orjson.JSONDecodeError, EOFError, OSError) as e:
        raise InvalidSample(f"{where}: cannot decode as .{ext}: {e}") from None


def _npy(data: bytes) -> np.ndarray:
    return np.lib.format.read_array(io.BytesIO(data), allow_pickle=False)


DECODERS: dict[str, Callable[[bytes], Any]] = {
    "json": orjson.loads,
    "txt": lambda b: b.decode("utf-8"),
    "npy": _npy,
    "cls": lambda b: int(b.decode("ascii").strip()),
}


def _key(name: str) -> str:
    return name.partition(".")[0]


def _names_hash(names: list[str]) -> hashlib._Hash:
    h = hashlib.sha256()
    for n in names:
        h.update(n.encode() + b"\0")
    return h


def _resume_index(root: Path, names: list[str], cursor: Any) -> int:
    """Where to resume in `names` after `cursor`; ConfigMismatch if the consumed files changed."""
    if cursor is None:
        return 0
    if isinstance(cursor, int) and not isinstance(cursor, bool) and cursor >= 0:
        return cursor  # a position in the sorted list (cursors committed before the name-based ones)
    if not (
        isinstance(cursor, dict)
        and isinstance(cursor.get("after"), str)
        and isinstance(cursor.get("files"), int)
        and isinstance(cursor.get("sha256"), str)
    ):
        raise ConfigMismatch(f"--from-dir {root}: the committed cursor {cursor!r} is not a --from-dir cursor")
    after, files = cursor["after"], cursor["files"]
    i = bisect.bisect_right(names, after)
    while i < len(names) and _key(names[i]) == _key(after):  # a field added to the last consumed sample
        i += 1
    if i == files and _names_hash(names[:i]).hexdigest() == cursor["sha256"]:
        return i
    if i > files:
        change = f"{i - files} file(s) were added at or before it"
    elif i < files:
        change = f"{files - i} file(s) were removed at or before it"
    else:
        change = "files at or before it were renamed or replaced"
    gone = "" if after in names else f" (the last consumed file {_shown(after)} is gone)"
    raise ConfigMismatch(
        f"--from-dir {root}: the directory changed under the committed cursor: {files} files up to "
        f"{_shown(after)} were consumed, {i} sort there now: {change}{gone}. Resuming would duplicate or lose "
        "samples; restore those files, or produce the changed directory under a new --producer-id"
    )


def dir_source(
    directory: str | os.PathLike[str], cursor: Any = None, *, decode: bool = False, follow_symlinks: bool = False
) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(sample, cursor) for the files directly in `directory`, sorted by name (see `list_dir`).

    The name up to the first dot is the sample key, the rest the field (`00017.jpg` and
    `00017.json` make one sample); files of one key are adjacent in sorted order. Fields are the
    files' bytes exactly as stored, or with `decode` as `decode_field` turns them.

    The cursor after a sample names what was consumed: `{"after": NAME, "files": N, "sha256": H}`,
    NAME the sorted name of the sample's last file, N the number of files up to it and H the
    SHA-256 of those N names (each followed by a NUL byte). Resuming with it continues strictly
    after NAME in sorted order if the N names there are still exactly the consumed ones, and raises
    ConfigMismatch naming the change otherwise (a file added, removed or renamed at or before
    NAME), so that a changed directory is never duplicated or skipped silently. Files added after
    NAME are produced. An int cursor (committed by earlier versions) is the position in the sorted
    list to resume at, as before. Raises InvalidSample for a file without a field extension, a
    field with a reserved name (`__key__`, `__cost__`, `__source__`), a name that is not UTF-8, a
    link out of the directory, or a file `decode` cannot decode.
    """
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"--from-dir {directory}: not a directory")
    names = list_dir(root, follow_symlinks=follow_symlinks)
    i = _resume_index(root, names, cursor)
    h = _names_hash(names[:i])
    while i < len(names):
        key, dot, _ = names[i].partition(".")
        if not dot:
            raise InvalidSample(f"{root / names[i]}: no field extension (expected <key>.<field>)")
        sample: dict[str, Any] = {"__key__": key}
        while i < len(names) and _key(names[i]) == key and "." in names[i]:
            field = names[i].partition(".")[2]
            if field in RESERVED_FIELDS:
                raise InvalidSample(
                    f"{root / names[i]}: field {field!r} is a reserved name ({reserved_names()} are not data "
                    "fields); rename the file"
                )
            data = _read_file(root, names[i], follow_symlinks)
            sample[field] = decode_field(field, data, str(root / names[i])) if decode else data
            h.update(names[i].encode() + b"\0")
            i += 1
        yield sample, {"after": names[i - 1], "files": i, "sha256": h.hexdigest()}


def describe_cursor(cursor: Any) -> str:
    """A producer's cursor for people: `0` for none, the file count and last file of a directory cursor."""
    if cursor is None:
        return "0"
    if isinstance(cursor, dict) and "files" in cursor and "after" in cursor:
        return f"{cursor['files']} (files up to {_shown(str(cursor['after']))})"
    return repr(cursor)


@dataclass(frozen=True, slots=True)
class DirSource:
    """`dir:PATH`: the files directly in PATH, as `--from-dir` reads them (see `dir_source`)."""

    path: str
    decode: bool = False
    follow_symlinks: bool = False

    def iterate(self, cursor: Any = None) -> Iterator[tuple[dict[str, Any], Any]]:
        return dir_source(self.path, cursor, decode=self.decode, follow_symlinks=self.follow_symlinks)
