"""CPU (gloo) application benchmark, one command: CG on 3-D Poisson, pencil 3-D FFT and nanoGPT training, each
with hpdl.comm against torch.distributed's own collectives, at several process counts. A launch recipe for
``hpdl bench apps`` (hpdl.apps.bench.AppsBenchmark): this script only puts OUT_DIR into ``--out``.

    PYTHONPATH=src python3 benchmarks/apps_cpu.py OUT_DIR                 # 4 and 8 ranks (16-core host, ~2 min)
    PYTHONPATH=src python3 benchmarks/apps_cpu.py OUT_DIR --np 2,4 --small  # 2-core machine (smaller cases)
    PYTHONPATH=src python3 benchmarks/apps_cpu.py OUT_DIR --np 2 --quick    # tiny: checks the logic only

Each process count is one spawned job (intra-op threads = cores / ranks) that runs every case in `--rounds`
interleaved rounds. Writes OUT_DIR/apps_cpu.json (meta, the summary rows, every round's row), OUT_DIR/apps_cpu.png
and prints the summary table last. Exit status 1 if a check failed (FFT output not bit-identical to native's, or
a CG / GPT curve off native's by more than rounding).
"""

import sys

from hpdl.cli import main

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        sys.exit(f"usage: {sys.argv[0]} OUT_DIR [hpdl bench apps options: --np 4,8 --rounds N --small|--quick]")
    sys.exit(main(["bench", "apps", "--out", sys.argv[1], *sys.argv[2:]]))
