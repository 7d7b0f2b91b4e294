#!/usr/bin/env python3
"""Torture test: everything at once, against a real S3 server (SeaweedFS), then check the result.

    .venv/bin/python tests/torture.py --minutes 10 [--seed N] [--replay] [--fork] [--keep] [--json FILE]
    .venv/bin/python -m pytest tests/test_torture.py        # the short version (about a minute)

The harness is the package `tests/torture/` (its docstring says what runs and what is checked;
`driver.py`, `roles.py`, `children.py`, `checker.py`). This script is its command line, and the
command its child processes run: `torture.py cli ARGS...`, `torture.py pyreader ...`,
`torture.py mntreader ...`.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torture  # noqa: E402  (the package tests/torture/, after the path)

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in torture.CHILD_MODES:
        sys.exit(torture.child_main(sys.argv[1:]))
    sys.exit(torture.main(description=(__doc__ or "").split("\n\n")[0]))
