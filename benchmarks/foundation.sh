#!/usr/bin/env bash
# Foundation benchmarks on the device machine (run with the device tool from the repo root):
#   CPU (gloo) all-reduce with 4 and 8 processes on the host's CPUs (skip with CPU=0), then the public API's
#   CUDA paths with 2 GPUs: exactness + async + eager latency, and the bench table.
set -uo pipefail
export PYTHONPATH=src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
nproc; python3 -c "import torch; print(torch.__version__, torch.cuda.device_count(), torch.cuda.nccl.version())"
if [ "${CPU:-1}" = 1 ]; then
for np in 4 8; do
  python3 -m hpdl.cli bench allreduce --np $np --algorithms native,auto,direct,ring,recursive_doubling \
    --json "$OUT/cpu_np$np.json" --plot "$OUT/cpu_np$np.png" --time-per-point 0.2 | tee "$OUT/cpu_np$np.txt"
done
fi
python3 -m pytest -m gpu tests/comm/test_comm_gpu.py -p no:cacheprovider -n 0 2>&1 | tee "$OUT/comm_gpu_tests.txt"
python3 -m hpdl.cli bench allreduce --device cuda --np 2 \
  --algorithms native,auto,one_shot,two_shot,direct,ring,recursive_doubling,staged \
  --max 256M --dtype bfloat16 --json "$OUT/cuda_np2.json" --plot "$OUT/cuda_np2.png" > "$OUT/cuda_np2.txt" 2>&1
awk '$5=="native" || /auto/ || $5=="one_shot" || $5=="two_shot" || $5=="direct" || $5=="staged" || /^#/' "$OUT/cuda_np2.txt" | tail -80
