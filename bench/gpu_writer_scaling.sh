#!/usr/bin/env bash
# Does the P3-all writer path scale with independent writers? Runs N writer_process_bench
# instances at once (each its own ring, child process and GIL), each with REQUESTS/N of
# the load, started at the same wall-clock second, and prints their aggregate MB/s:
# total bytes / (last finish - common start). N=1 is the baseline of the same host.
#
#   bash bench/gpu_writer_scaling.sh DIR OUT [REQUESTS] [N ...]
#   e.g. bash bench/gpu_writer_scaling.sh /tmp $OUT/scaling 128 1 2 4
set -euo pipefail
DIR=$1; OUT=$2; REQUESTS=${3:-128}; shift 3 || true
COUNTS=${*:-1 2 4}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
for n in $COUNTS; do
  start=$(( $(date +%s) + 12 ))  # every child started and ready by then
  pids=()
  for i in $(seq 1 "$n"); do
    $PY bench/writer_process_bench.py --dir "$DIR" --requests $(( REQUESTS / n )) --repeat 1 \
      --start-at "$start" --json > "$OUT/n$n-$i.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  $PY - "$OUT" "$n" <<'EOF'
import json, sys
from pathlib import Path
out, n = Path(sys.argv[1]), int(sys.argv[2])
runs = []
for i in range(1, n + 1):
    lines = [l for l in (out / f"n{n}-{i}.log").read_text().splitlines() if l.startswith("{")]
    runs += json.loads(lines[-1])["runs"]
start = min(r["epoch"][0] for r in runs)
end = max(r["epoch"][1] for r in runs)
total = sum(r["bytes"] for r in runs)
print(json.dumps({"writers": n, "gb": round(total / 1e9, 3), "seconds": round(end - start, 3),
                  "mb_s": round(total / (end - start) / 1e6, 1),
                  "each_mb_s": [round(r["mb_s"]) for r in runs],
                  "child_main_cpu_s": [r["child_cpu_s"].get("main") for r in runs]}))
EOF
done
