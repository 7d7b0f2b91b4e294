"""The mount table (/proc/self/mountinfo), read without touching the mounts themselves: a FUSE
mount whose daemon is gone or stuck would not answer a stat."""

from __future__ import annotations

import os
import re
from typing import NamedTuple


class MountEntry(NamedTuple):
    device: str  # "major:minor"; for FUSE the minor is the connection number in fusectl
    fstype: str  # e.g. "fuse.lakestream"


def mounts_at(mountpoint: str) -> list[MountEntry]:
    """Every mount exactly at `mountpoint`, bottom to top (empty if none or unreadable)."""
    target = os.path.abspath(mountpoint)
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            table = f.read()
    except OSError:
        return []
    out = []
    for line in table.splitlines():
        # id parent major:minor root mountpoint options [optional...] - fstype source superoptions
        fields = line.split(b" ")
        if len(fields) > 4 and b"-" in fields and _unescape(fields[4]) == target:
            out.append(MountEntry(fields[2].decode(), fields[fields.index(b"-") + 1].decode()))
    return out


def _unescape(field: bytes) -> str:
    """A path in the mount table: space, tab, newline and backslash are octal escapes there."""
    return os.fsdecode(re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), field))
