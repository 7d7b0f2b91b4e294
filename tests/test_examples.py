"""The examples run, resume, and read back every record."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).parent.parent / "examples"


def run(*args: str) -> str:
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_pipeline_resumes_and_ranks_read_everything(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/stream"
    first = run(str(EXAMPLES / "producer_pipeline.py"), url, "--records", "300")
    assert "resumed at 0, put 300" in first
    second = run(str(EXAMPLES / "producer_pipeline.py"), url, "--records", "450")
    assert "resumed at 300, put 150" in second
    totals = [run(str(EXAMPLES / "read_rank.py"), url, "--rank", str(r)).splitlines()[-1] for r in range(2)]
    counts = [int(line.split()[-2]) for line in totals]
    assert sum(counts) == 450 and abs(counts[0] - counts[1]) <= 16
