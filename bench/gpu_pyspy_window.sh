#!/usr/bin/env bash
# py-spy of one steer_ab request kind while its batches run (engine start-up excluded):
# steer_ab keeps running batches of KIND; once the engine is up and warm, py-spy samples
# every process of it (front end, engine core, writer children) for SECS, then the run
# is stopped. Compare two kinds' summaries (e.g. plain vs steer_one).
#
#   bash bench/gpu_pyspy_window.sh OUT KIND [SECS] [STEP_TOKENS]
# IDLE=1 samples waiting threads too (py-spy --idle). PYSPY: the py-spy binary (default /tmp/pyspy/bin/py-spy, see bench/pyspy_summary.py).
set -u
out=$1; kind=$2; secs=${3:-15}; step=${4:-8192}; pyspy=${PYSPY:-/tmp/pyspy/bin/py-spy}
mkdir -p "$out"
log="$out/log-$kind.txt"
# its own session: stopping it must reach vLLM's engine core too (it holds the GPU memory)
setsid python bench/steer_ab.py --out "$out" --step-tokens "$step" --rounds 200 \
    --workloads prefill --kinds "$kind" --tag "win-$kind" > "$log" 2>&1 &
pid=$!
for _ in $(seq 900); do grep -q "init engine" "$log" && break; sleep 1; done
sleep 25  # the warm-up batch and a few timed ones
"$pyspy" record --pid "$pid" --subprocesses --threads ${IDLE:+--idle} -r 200 -d "$secs" -f raw \
    -o "$out/spy-$kind.txt" > "$out/pyspy-$kind.log" 2>&1
kill -- "-$pid" 2>/dev/null
wait "$pid" 2>/dev/null
for _ in $(seq 60); do pgrep -s "$pid" > /dev/null || break; sleep 1; done
pkill -9 -s "$pid" 2>/dev/null
python3 bench/pyspy_summary.py "$out/spy-$kind.txt" --top 30 > "$out/summary-$kind.txt" 2>&1
gzip -f "$out/spy-$kind.txt"
