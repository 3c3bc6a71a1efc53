"""The test tree imports by basename (pytest's rootdir "prepend" mode, no packages), so two test modules with the
same file name collide: under xdist a spawned rank unpickles a task from the wrong module and dies."""
from collections import Counter
from pathlib import Path


def test_test_module_basenames_are_unique():
    root = Path(__file__).parent
    names = Counter(p.name for p in root.rglob("*.py") if p.name != "conftest.py")
    assert not [n for n, c in names.items() if c > 1]
