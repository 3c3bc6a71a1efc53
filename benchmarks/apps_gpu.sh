#!/usr/bin/env bash
# The applications on 2 GPUs of one host, NCCL against hpdl.comm, one command (about 3-4 minutes on 2 x H200):
#
#   OUT=/tmp/apps_gpu bash benchmarks/apps_gpu.sh
#
# Runs CG (float32: hpdl's peer kernels reduce float32, not float64), the pencil 3-D FFT and nanoGPT training
# (GPT-2 small shape, bytes, bf16 autocast) with --comm nccl and --comm hpdl, writes one JSON per run (6) and
# apps_gpu.txt (the table printed last) to $OUT. NVLink SHARP stays off (NCCL_NVLS_ENABLE=0).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/apps_gpu}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=4
# DEVICE=cpu TINY=1 checks this script's logic on a CPU machine in a minute (tiny sizes, float32 everywhere)
DEVICE=${DEVICE:-cuda}
if [ -n "${TINY:-}" ]; then
  CG=(--size 16 --iters 20 --warmup 2); FFT=(--shape 16,16,16 --iters 2 --warmup 1)
  GPT=(--n-layer 1 --n-head 2 --n-embd 32 --block-size 32 --batch-size 2 --steps 4 --warmup-steps 1 --timing-warmup 1)
  GPT+=(--log-interval 2 --dtype float32)
else
  CG=(--size 64 --iters 2000 --warmup 100); FFT=(--shape 256,256,256 --iters 20 --warmup 3)
  GPT=(--n-layer 12 --n-head 12 --n-embd 768 --block-size 1024 --batch-size 8 --steps 40 --warmup-steps 10)
  GPT+=(--timing-warmup 5 --log-interval 10 --dtype bfloat16)
fi
run() { torchrun --standalone --nproc-per-node 2 "$@"; }
for c in nccl hpdl; do
  run examples/cg.py --device "$DEVICE" --dtype float32 --comm "$c" "${CG[@]}" --json "$OUT/cg_$c.json"
  run examples/fft3d.py --device "$DEVICE" --comm "$c" "${FFT[@]}" --json "$OUT/fft3d_$c.json"
  run examples/train_gpt.py --device "$DEVICE" --comm "$c" "${GPT[@]}" --json "$OUT/gpt_$c.json"
done
python3 - "$OUT" <<'PY' | tee "$OUT/apps_gpu.txt"
import json, sys
out = sys.argv[1]
load = lambda n: json.load(open(f"{out}/{n}.json"))
print("app      nccl          hpdl          hpdl/nccl  check")
cg = {c: load(f"cg_{c}") for c in ("nccl", "hpdl")}
same = cg["nccl"]["residuals"][-1] / cg["hpdl"]["residuals"][-1]
print(f"cg       {cg['nccl']['time_s']*1e6:8.1f} us  {cg['hpdl']['time_s']*1e6:8.1f} us  "
      f"{cg['hpdl']['time_s']/cg['nccl']['time_s']:8.2f}x  final |r| ratio {same:.6f}")
ff = {c: load(f"fft3d_{c}") for c in ("nccl", "hpdl")}
print(f"fft3d    {ff['nccl']['time_s']*1e3:8.2f} ms  {ff['hpdl']['time_s']*1e3:8.2f} ms  "
      f"{ff['hpdl']['time_s']/ff['nccl']['time_s']:8.2f}x")
g = {c: load(f"gpt_{c}") for c in ("nccl", "hpdl")}
d = max(abs(a - b) / a for a, b in zip(g["nccl"]["losses"], g["hpdl"]["losses"]))
print(f"gpt      {g['nccl']['median_step_ms']:8.1f} ms  {g['hpdl']['median_step_ms']:8.1f} ms  "
      f"{g['hpdl']['median_step_ms']/g['nccl']['median_step_ms']:8.2f}x  loss max rel diff {d:.1e}, "
      f"tok/s {g['nccl']['tokens_per_s']:.0f} vs {g['hpdl']['tokens_per_s']:.0f}")
PY
