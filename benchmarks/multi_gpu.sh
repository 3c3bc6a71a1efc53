#!/usr/bin/env bash
# hpdl.comm on 4 and 8 GPUs of one host (device kinds nvidia-h200-x4 / -x8) against NCCL: benchmarks/gpu_comm.sh
# with a window sweep of the peer kernels and sizes to 8 GiB. A device call is capped at 10 minutes, so run the
# parts separately:   PART=allreduce bash benchmarks/multi_gpu.sh ; PART=alltoall bash benchmarks/multi_gpu.sh
# Afterwards the auto table (hpdl.comm.tuning's DEFAULT_RULES, all_reduce and all_to_all rules, or a file from
# `hpdl bench allreduce --tune`) is rewritten from these tables and docs/benchmarks/comm.md gets the rows it cites.
set -uo pipefail
export PART=${PART:-allreduce} MAX=${MAX:-8G} WINDOWS=${WINDOWS:-1 2 4}
exec bash "$(dirname "$0")/gpu_comm.sh"
