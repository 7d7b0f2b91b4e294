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


def test_pipeline_uses_a_stream_someone_else_created(tmp_path: Path) -> None:
    """Issue 8, item 19: it failed with ConfigMismatch on a stream of another shape."""
    url = f"file://{tmp_path}/stream"
    subprocess.run(
        [sys.executable, "-m", "lakestream._cli", "init", url, "--world-size", "3", "--global-batch", "12"], check=True
    )
    out = run(str(EXAMPLES / "producer_pipeline.py"), url, "--records", "30")
    assert "using " in out and "world size 3, global batch 12" in out and "resumed at 0, put 30" in out
    out = run(str(EXAMPLES / "producer_pipeline.py"), url, "--records", "40", "--world-size", "5")
    assert "resumed at 30, put 10" in out
    totals = [run(str(EXAMPLES / "read_rank.py"), url, "--rank", str(r)).splitlines()[-1] for r in range(3)]
    assert sum(int(line.split()[-2]) for line in totals) == 40


def test_pipeline_docstring_lists_its_options() -> None:
    doc = run(str(EXAMPLES / "producer_pipeline.py"), "--help")
    for option in ("STREAM_URL", "--producer-id", "--records", "--world-size", "--global-batch", "default"):
        assert option in doc.split("positional arguments")[0], option


def test_setup_script_says_what_each_stage_does() -> None:
    """Every command that can take long is announced on its own line first (pip stays quiet)."""
    script = (Path(__file__).parent.parent / "scripts" / "setup.sh").read_text()
    subprocess.run(["bash", "-n", "-c", script], check=True)
    lines = [line.strip() for line in script.splitlines()]
    for i, line in enumerate(lines):
        if line.startswith((".venv/bin/python -m pip", "apt-get update", "python3 -m venv")):
            assert lines[i - 1].startswith("say "), f"no stage message just before {line!r}"
    assert sum(line.startswith('say "installing') for line in lines) >= 3
    assert "a few minutes on a fresh machine" in script
