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
    # the stores (obstore: the AWS credential chain); S3 sources (synchronous); the dev server's probe
    "botocore": {
        "lakestream/_store/_s3.py",
        "lakestream/_store/_obstore.py",
        "lakestream/_remote.py",
        "lakestream/_devs3.py",
    },
    "torch": {"lakestream/torch.py"},
    "pyarrow": {"lakestream/sources/_base.py", "lakestream/sources/_hf.py"},
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


# -- import cycles -----------------------------------------------------------------------------------

PACKAGES = [ROOT / "lakestream", ROOT / "mount" / "lakestream_mount"]
KNOWN_CYCLES = [
    # Cycles there are today, each allowed as it is; a module joining one, or a new cycle, fails the test.
    # the pipeline opens its producers through the package's `open_producer`.
    {"lakestream", "lakestream._pipeline"},
]


def module_files() -> dict[str, Path]:
    """Every module of the library and the mount, by dotted name (a package by its own name)."""
    out = {}
    for package in PACKAGES:
        for path in package.rglob("*.py"):
            parts = path.relative_to(package.parent).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Each module's imports of modules of the packages: every import statement, wherever it is (at the
    top, in a function, for type checking only), so that a cycle is found however it is hidden."""
    files = module_files()
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name in files)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package
                    for _ in range(node.level - 1):
                        base = base.rpartition(".")[0]
                    base = f"{base}.{node.module}" if node.module else base
                    assert base in files, f"{path.relative_to(ROOT)}: cannot resolve the import of {base}"
                elif node.module not in files:
                    continue
                else:
                    base = node.module
                found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names)
        graph[name] = found - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while (w := stack.pop()) != v:
                component.add(w)
            if component:
                out.append(component | {v})

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_check_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_new_import_cycles() -> None:
    graph = import_graph()
    assert {"lakestream.sources", "lakestream.sources._base", "lakestream_mount"} <= set(graph)
    assert "lakestream.sources._base" in graph["lakestream.sources._wds"]
    new = [sorted(c) for c in cycles(graph) if c not in KNOWN_CYCLES]
    assert not new, f"modules that import each other: {new}"
