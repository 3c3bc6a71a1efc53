#!/usr/bin/env bash
# The serve benchmark recipes, each in its smallest real mode, in one command: a check that they still run on the
# device after a change to them (1 x H200, under 3 minutes; llama-tiny shapes, so no number here is a result).
#
#   OUT=$OUT bash benchmarks/serve_check.sh          # device (CUDA): every recipe with --tiny / --smoke --device cuda:0
#   OUT=/tmp/sc bash benchmarks/serve_check.sh --cpu # here: the same on the CPU (--smoke)
#
# Runs `hpdl serve bench` (the harness plug-in), serve_fused_bench.py, serve_ttft.py, serve_decode_kernels.py,
# serve_bench.py's flover and hf phases (on one GPU; the tp phases need two) and its report, each under its own time
# limit inside one 170 s budget. Writes $OUT/serve_check.tgz (every recipe's JSON, PNG and log), $OUT/status.txt
# and $OUT/summary.txt, and prints the summary last: per recipe its exit status, seconds and the parts that
# recorded an error (an `*_error` key in its JSON).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
OUT=${OUT:-/tmp/serve_check}
mkdir -p "$OUT"
W=$(mktemp -d)
if [ "${1:-}" = "--cpu" ]; then DEV=cpu; MODE=--smoke; else DEV=cuda:0; MODE=--tiny; fi
GRAPH=$([ "$DEV" = cpu ] || echo --cuda-graph)
END=$(( $(date +%s) + 170 ))

run() {  # name limit_s command...: the command under min(limit, what is left of the budget)
    local name=$1 limit=$2 left t0 rc
    shift 2
    left=$(( END - $(date +%s) ))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 5 ]; then echo "$name skipped 0" >> "$W/status"; return; fi
    t0=$(date +%s)
    timeout --kill-after=5 "$limit" "$@" > "$W/$name.log" 2>&1
    rc=$?
    echo "$name $rc $(( $(date +%s) - t0 ))" >> "$W/status"
    tail -n 3 "$W/$name.log"
}

run hpdl_serve_bench 35 python3 -m hpdl.cli serve bench --config llama-tiny --device "${DEV%%:*}" $GRAPH \
    --num-requests 12 --prompt-len 8:32 --output-len 4:24 --max-seq-len 64 --num-slots 8 --static-batch-size 4 \
    --out "$W/hpdl_serve_bench"
run serve_fused_bench 35 python3 benchmarks/serve_fused_bench.py $MODE --out "$W/serve_fused_bench"
run serve_ttft 35 python3 benchmarks/serve_ttft.py $MODE --out "$W/serve_ttft"
run serve_decode_kernels 70 python3 benchmarks/serve_decode_kernels.py $MODE --out "$W/serve_decode_kernels"
run serve_bench_flover 30 python3 benchmarks/serve_bench.py --phase flover --smoke --device "$DEV" \
    --out "$W/serve_bench"
run serve_bench_hf 25 python3 benchmarks/serve_bench.py --phase hf --smoke --device "$DEV" --out "$W/serve_bench"
run serve_report 30 python3 benchmarks/serve_bench.py --phase report --smoke --out "$W/serve_bench" \
    --docs "$W/serve_bench/report"

cp "$W/status" "$OUT/status.txt"
python3 - "$W" > "$OUT/summary.txt" <<'EOF'
import json, sys
from pathlib import Path

w = Path(sys.argv[1])
print(f"{'recipe':22s} {'rc':>4s} {'s':>4s}  errors recorded in its JSON")
for line in (w / "status").read_text().splitlines():
    name, rc, sec = line.split()
    errors = []
    for p in sorted((w / name.replace("_flover", "").replace("_hf", "")).rglob("*.json")) if name != "serve_report" else []:
        try:
            doc = json.loads(p.read_text())
        except ValueError:
            errors.append(f"{p.name}: unreadable")
            continue
        errors += [f"{p.name}:{k}" for k in doc if k.endswith("_error")] if isinstance(doc, dict) else []
    if name == "serve_report" and not (w / "serve_bench" / "report" / "tables.md").exists():
        errors.append("no tables.md")
    print(f"{name:22s} {rc:>4s} {sec:>4s}  {', '.join(sorted(set(errors))) or '-'}")
EOF
tar czf "$OUT/serve_check.tgz" -C "$W" .
rm -rf "$W"
cat "$OUT/summary.txt"
