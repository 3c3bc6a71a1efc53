#!/usr/bin/env bash
# Issue 6: hpdl.comm on 4 and 8 GPUs of one host (device kinds nvidia-h200-x4 / -x8), against NCCL, one run each.
# Run with the device tool from the repository root; results under $OUT. A device call is capped at 10 minutes,
# so the work is split into parts: PART=allreduce (window sweep of the peer all-reduce, eager + CUDA graph,
# bf16 + fp32, 8 B - 8 GiB) and PART=alltoall (push/pull/direct vs NCCL, 1 KiB - 1 GiB per rank, window sweep).
#   PART=allreduce bash benchmarks/multi_gpu.sh ; PART=alltoall bash benchmarks/multi_gpu.sh
# Afterwards: the auto table (hpdl.comm.tuning.DEFAULT_RULES, all_reduce and all_to_all rules)
# are rewritten from these tables, and docs/benchmarks/ gets the tables, plots, device and versions.
set -uo pipefail
export PYTHONPATH=src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 HPDL_CHECK=0
OUT=${OUT:-out}; mkdir -p "$OUT"
W=$(python3 -c "import torch; print(torch.cuda.device_count())")
python3 -c "import torch; print(torch.__version__, 'NCCL', torch.cuda.nccl.version(), torch.cuda.get_device_name(0))"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1 || true
echo "GPUs: $W"
windows="1 2 4 0"   # 0 = every peer at once
case "${PART:-allreduce}" in
  allreduce)
    for k in $windows; do
      [ "$k" -ge "$W" ] && [ "$k" != 0 ] && continue
      HPDL_DIRECT_WINDOW=$k timeout ${STEP_S:-140} python3 benchmarks/gpu_allreduce.py --out "$OUT/allreduce_k$k" \
        --max-bytes $(( ${MAX_GIB:-8} << 30 )) --budget-s ${SWEEP_S:-110} --check $([ "$k" = 0 ] && echo 1 || echo 0) \
        > "$OUT/allreduce_k$k.log" 2>&1
      echo "window $k rc=$?"; tail -5 "$OUT/allreduce_k$k.log"
    done ;;
  alltoall)
    for k in $windows; do
      [ "$k" -ge "$W" ] && [ "$k" != 0 ] && continue
      timeout ${STEP_S:-140} python3 benchmarks/gpu_alltoall.py --out "$OUT/alltoall_k$k" --window "$k" \
        --direct $([ "$k" = 0 ] && echo 1 || echo 0) > "$OUT/alltoall_k$k.log" 2>&1
      echo "window $k rc=$?"; grep -v "^pass" "$OUT/alltoall_k$k.log" | tail -25
    done ;;
  *) echo "PART must be allreduce or alltoall" >&2; exit 2 ;;
esac
