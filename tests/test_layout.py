"""The test tree imports by basename (pytest's rootdir "prepend" mode, no packages), so two test modules with the
same file name collide: under xdist a spawned rank unpickles a task from the wrong module and dies."""
from collections import Counter
from pathlib import Path


def test_test_module_basenames_are_unique():
    root = Path(__file__).parent
    names = Counter(p.name for p in root.rglob("*.py") if p.name != "conftest.py")
    assert not [n for n, c in names.items() if c > 1]


def test_no_library_module_imports_the_cli():
    """Library code raises hpdl.runtime.errors.CLIUsageError; only hpdl/cli.py itself names hpdl.cli (issue 40)."""
    import ast

    src = Path(__file__).resolve().parents[1] / "src" / "hpdl"
    offenders = []
    for path in sorted(src.rglob("*.py")):
        if path == src / "cli.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if any(n == "hpdl.cli" or n.startswith("hpdl.cli.") for n in names):
                offenders.append(f"{path.relative_to(src)}:{node.lineno}")
    assert not offenders, f"library modules import the CLI: {offenders}"
