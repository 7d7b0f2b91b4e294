"""Text read from a store or a source, made safe to show on a terminal."""

from __future__ import annotations

__all__ = ["safe"]


def safe(text: str, escape: str = "") -> str:
    """`text` with what a terminal would interpret (control, format and other non-printable characters) and
    the characters in `escape` written as Python escapes: safe to print, one line."""
    out = []
    for c in text:
        if c.isprintable() and c not in escape:
            out.append(c)
        elif c == "\\":
            out.append("\\\\")
        else:
            n = ord(c)
            out.append(f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}")
    return "".join(out)
