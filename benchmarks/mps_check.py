"""Device check of hpdl.hpo.mps: start a private MPS daemon, run client processes on it, stop it, and time
each phase (the stop used to wait 10 s for a control pipe the daemon leaves behind).

    PYTHONPATH=src python3 benchmarks/mps_check.py [--clients 4]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import time


def client(env: dict, q) -> None:
    os.environ.update(env)
    import torch

    x = torch.randn(1024, 1024, device="cuda")
    for _ in range(50):
        x = torch.tanh(x @ x)
    torch.cuda.synchronize()
    q.put(float(x.abs().mean()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=4)
    args = ap.parse_args()
    from hpdl.hpo.mps import MpsDaemon

    root = tempfile.mkdtemp(prefix="mpsck-")
    d = MpsDaemon(root)
    t = time.monotonic()
    d.start()
    print(f"start {time.monotonic() - t:.2f} s, pipe folder: {sorted(os.listdir(d.pipe_dir))}")
    ctx, q = mp.get_context("spawn"), mp.get_context("spawn").Queue()
    try:  # a failing client must not leave the daemon running on the device
        t = time.monotonic()
        procs = [ctx.Process(target=client, args=(d.env, q)) for _ in range(args.clients)]
        for p in procs:
            p.start()
        vals = [q.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(30)
        print(f"{args.clients} clients ran in {time.monotonic() - t:.2f} s, exit codes {[p.exitcode for p in procs]}, "
              f"results finite: {all(v == v for v in vals)}")
    except BaseException:
        d.stop()
        raise
    t = time.monotonic()
    d.stop()
    print(f"stop {time.monotonic() - t:.2f} s, pipe folder after: {sorted(os.listdir(d.pipe_dir))}")
    print("server log tail:", open(os.path.join(d.log_dir, "control.log")).read().strip().splitlines()[-3:])


if __name__ == "__main__":
    main()
