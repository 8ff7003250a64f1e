#!/usr/bin/env bash
# Two benchmark commands side by side on a 2-GPU machine, one per GPU, each with its own
# compile cache and its own results folder ($OUT/gpu0, $OUT/gpu1), so one device call does
# the work of two. Output lines are prefixed with the GPU; each side's log is kept.
#   bash bench/gpu_pair.sh "bash bench/gpu_perf.sh --parts p1p2p3 --slots 1-6" \
#                          "bash bench/gpu_perf.sh --parts p1p2p3 --slots 7-12 --no-p3all"
# Inside each command $OUT is that side's folder, $CAPSTEER_WORK its work folder.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
pids=()
for gpu in 0 1; do
  cmd=${1:-true}; shift || true
  side="$OUT/gpu$gpu"; mkdir -p "$side"
  (
    export CUDA_VISIBLE_DEVICES=$gpu OUT="$side" CAPSTEER_WORK="/tmp/capsteer-perf-$gpu"
    export VLLM_CACHE_ROOT="/tmp/vllm-cache-$gpu"
    echo "gpu$gpu: $cmd"
    bash -c "$cmd" 2>&1 | tee "$side/pair.log" | sed -u "s/^/[gpu$gpu] /"
    st=${PIPESTATUS[0]}
    echo "[gpu$gpu] exit $st"
    exit "$st"
  ) &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
exit $rc
