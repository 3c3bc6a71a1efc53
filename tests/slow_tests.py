"""Write tests/slow_tests.json, the tests the fast tier (`pytest -m "not slow"`) leaves out, from a measured run.

    python3 -m pytest -q -n 2 tests --durations=0 > durations.txt
    python3 tests/slow_tests.py durations.txt [--seconds 2.0]

A test is slow when its setup + call + teardown took at least ``--seconds`` (summed over the phases pytest
reports). Parametrised cases are listed one by one, as pytest names them.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(\S.*?)\s*$")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("durations", type=Path, help="output of pytest --durations=0")
    p.add_argument("--seconds", type=float, default=2.0, help="a test at or above this is slow (default 2.0)")
    args = p.parse_args()
    took: dict[str, float] = defaultdict(float)
    for line in args.durations.read_text().splitlines():
        m = LINE.match(line)
        if m:
            took[m.group(3)] += float(m.group(1))
    if not took:
        p.error(f"{args.durations}: no '--durations' lines found")
    slow = {k: round(v, 2) for k, v in sorted(took.items()) if v >= args.seconds}
    out = Path(__file__).with_name("slow_tests.json")
    out.write_text(json.dumps({"seconds": args.seconds, "source": "pytest --durations=0 -n 2, 2 cores",
                               "tests": slow}, indent=0) + "\n")
    print(f"{len(slow)} of {len(took)} timed tests are slow ({sum(slow.values()):.0f} of "
          f"{sum(took.values()):.0f} s); wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
