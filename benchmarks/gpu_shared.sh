#!/usr/bin/env bash
# The gpu-marked suite on one GPU, with 2, 4 and 8 ranks sharing it (issue: every multi-GPU code path runs at
# 2/4/8 ranks on the one GPU we have). Writes pytest logs and a junit XML per stage to $OUT and prints the
# summary last. Stages: all (default) = the gpu suite without MPS, then the 8-rank comm matrix under MPS.
#   bash benchmarks/gpu_shared.sh            # 1 x H200: about 5-6 minutes
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out/gpu_shared}
mkdir -p "$OUT"
FILES="tests/comm/test_comm_shared_gpu.py tests/comm/test_comm_gpu.py tests/serve/test_tp_shared_gpu.py
       tests/moe/test_moe_gpu.py tests/offload/test_offload_gpu.py tests/bench/test_bench_cli.py"
{ date -u +"%Y-%m-%d %H:%M UTC"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl',
  '.'.join(map(str, torch.cuda.nccl.version())), 'triton', triton.__version__)"; nproc; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
export HPDL_TEST_RESULTS="$OUT"
t0=$(date +%s)
timeout ${GPU_SUITE_S:-400} python3 -m pytest -m gpu $FILES -n 0 -p no:cacheprovider -q -rfEs --durations=25 \
  --junitxml "$OUT/gpu_suite.xml" 2>&1 | tee "$OUT/gpu_suite.log" | grep -v "^\s*$" | tail -60
echo "gpu suite wall: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu_suite.log"
if [ "${MPS_STAGE:-1}" = 1 ]; then
  t0=$(date +%s)
  HPDL_TEST_MPS=1 timeout ${MPS_S:-150} python3 -m pytest -m gpu tests/comm/test_comm_shared_gpu.py -k "np8" -n 0 \
    -p no:cacheprovider -q -rfEs --junitxml "$OUT/gpu_mps.xml" 2>&1 | tee "$OUT/gpu_mps.log" | tail -15
  echo "mps stage wall: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu_mps.log"
fi
python3 - "$OUT" <<'PY'
# passed/skipped/failed per rank count (the [npN] ids; other tests by file) from the junit files
import collections, re, sys, xml.etree.ElementTree as ET
from pathlib import Path
for xml in sorted(Path(sys.argv[1]).glob("gpu_*.xml")):
    rows = collections.defaultdict(collections.Counter)
    for case in ET.parse(xml).iter("testcase"):
        m = re.search(r"\[(np\d+)\]", case.get("name", ""))
        key = m.group(1) if m else case.get("classname", "").split(".")[-1]
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        rows[key][kind] += 1
    print(f"== {xml.name}")
    for key, c in sorted(rows.items()):
        print(f"{key:28s} passed {c['passed']:3d}  skipped {c['skipped']:2d}  failed {c['failure'] + c['error']:2d}")
PY
