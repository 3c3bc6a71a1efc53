#!/usr/bin/env bash
# hpdl.comm on the GPUs of one host against NCCL, eager and CUDA-graph timing, all through `hpdl bench`
# (the tables of docs/benchmarks/comm.md). Run with the device tool from the repository root; results under $OUT.
#   bash benchmarks/gpu_comm.sh                 # all-reduce and all-to-all, eager + graph
#   PART=allreduce WINDOWS="1 2 4" bash benchmarks/gpu_comm.sh   # plus a window sweep of the peer kernels
# Correctness on GPUs is `pytest -m gpu`; every row here is also checked exactly (#wrong, graph replays too).
set -uo pipefail
export PYTHONPATH=src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
W=$(python3 -c "import torch; print(torch.cuda.device_count())")
MAX=${MAX:-1G}
python3 -c "import torch; print(torch.__version__, 'NCCL', torch.cuda.nccl.version(), torch.cuda.get_device_name(0))"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1 || true
run() {  # name, then hpdl bench arguments
  local name=$1; shift
  timeout "${STEP_S:-280}" python3 -m hpdl.cli bench "$@" --device cuda --np "$W" --json "$OUT/$name.json" \
    --plot "$OUT/$name.png" > "$OUT/$name.txt" 2> "$OUT/$name.log"
  echo "$name rc=$?"; tail -3 "$OUT/$name.txt"
}
case "${PART:-all}" in
  all|allreduce)
    for mode in eager graph; do
      run "gpu_allreduce_${mode}" allreduce --dtype bfloat16 --algorithms native,auto,one_shot,two_shot -b 8 -e "$MAX" \
        --iters 600 $([ $mode = graph ] && echo --graph)
    done
    for k in ${WINDOWS:-}; do
      run "gpu_allreduce_graph_k$k" allreduce --dtype bfloat16 --algorithms native,one_shot,two_shot --window "$k" \
        -b 8 -e "$MAX" --iters 600 --graph
    done ;;&
  all|alltoall)
    for mode in eager graph; do
      run "gpu_alltoall_${mode}" alltoall --algorithms native,auto,push,pull -b 1K -e "$MAX" -f 4 --iters 300 \
        $([ $mode = graph ] && echo --graph)
    done ;;
  allreduce) ;;
  *) echo "PART must be all, allreduce or alltoall" >&2; exit 2 ;;
esac
