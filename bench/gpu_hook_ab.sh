#!/usr/bin/env bash
# Old vs new hook code on one GPU host, without an engine: the tap kernel's GPU time over
# a step's sites (bench/tap_kernel_time.py, both kernel files in one process, outputs
# compared bitwise) and the hooks' host time per request and step (bench/hook_host_cost.py,
# old and new trees alternating, twice).
#
#   bash bench/gpu_hook_ab.sh OLDTREE OUTDIR
# OLDTREE: the old packages and bench/ (git archive REV capsteer server capture steering
# engine_ext config bench | tar -x -C OLDTREE). Needs torch + triton; vLLM is not used.
set -uo pipefail
OLD=$(realpath "$1")
OUT=$2
mkdir -p "$OUT"
NEW=$PWD
bash -c "source bench/gpu_env.sh && python bench/tap_kernel_time.py \
  --kernels new=engine_ext/tap_kernel.py,old=$OLD/engine_ext/tap_kernel.py" \
  > "$OUT/tap_kernel_time.txt" 2>&1
tail -n 25 "$OUT/tap_kernel_time.txt" | grep -v '^{"device"'
for round in 1 2; do
  for side in new old; do
    tree=$NEW
    [ "$side" = old ] && tree=$OLD
    for kind in steer_one steer_all capture_one; do
      # A new process (and package dir) per tree: bench/gpu_env.sh keys it by $$.
      line=$(bash -c "cd $tree && source bench/gpu_env.sh && \
        python $NEW/bench/hook_host_cost.py --device cuda --kind $kind --json" 2>&1 | tail -n 1)
      echo "{\"round\": $round, \"side\": \"$side\", \"result\": $line}" | tee -a "$OUT/hook_host_cost.jsonl"
    done
  done
done
