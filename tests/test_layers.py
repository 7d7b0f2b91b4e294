"""The layering: the core does no I/O, and only the integrations import their heavy dependencies."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parent.parent
PURE = [
    "_state.py",
    "_records.py",
    "_decisions.py",
    "_config.py",
    "_segment.py",
    "_batching.py",
    "_pacing.py",
    "_errors.py",
]
ALLOWED = {
    "aiobotocore": {"lakestream/_store/_s3.py"},
    # the store; S3 sources (synchronous); the throwaway test server's readiness probe and bucket creation
    "botocore": {"lakestream/_store/_s3.py", "lakestream/_remote.py", "lakestream/_devs3.py"},
    "torch": {"lakestream/torch.py"},
    "pyarrow": {"lakestream/sources.py"},
    "pyfuse3": {"mount/lakestream_mount/_fs.py", "mount/lakestream_mount/__init__.py"},
}
IO_MODULES = {"anyio", "asyncio", "os", "socket", "subprocess", "pathlib", "time", "aiobotocore", "lakestream._store"}


def imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = "lakestream." if node.level else ""
            out.add(base + (node.module or "").lstrip("."))
    return out


def test_pure_core_imports_no_io() -> None:
    for name in PURE:
        found = {m for m in imports(ROOT / "lakestream" / name) if m.split(".")[0] in IO_MODULES or m in IO_MODULES}
        found |= {m for m in imports(ROOT / "lakestream" / name) if m.startswith("lakestream._store")}
        assert not found, f"{name} is pure but imports {found}"


def test_heavy_dependencies_stay_in_their_modules() -> None:
    for path in [*ROOT.glob("lakestream/**/*.py"), *ROOT.glob("mount/**/*.py")]:
        rel = str(path.relative_to(ROOT))
        for mod in imports(path):
            top = mod.split(".")[0]
            if top in ALLOWED:
                assert rel in ALLOWED[top], f"{rel} imports {mod}; only {ALLOWED[top]} may"


def test_core_does_not_import_the_mount() -> None:
    for path in ROOT.glob("lakestream/**/*.py"):
        assert not any(m.startswith("lakestream_mount") for m in imports(path) if path.name != "_cli.py"), path


def test_the_library_never_imports_its_test_support() -> None:
    for path in ROOT.glob("lakestream/**/*.py"):
        if "testing" in path.relative_to(ROOT / "lakestream").parts:
            continue
        found = {m for m in imports(path) if m.startswith("lakestream.testing")}
        assert not found, f"{path.relative_to(ROOT)} imports {found}: test support stays out of the library"
