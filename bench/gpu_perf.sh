#!/usr/bin/env bash
# Issue 12 benchmarks on the lent GPU machine, one device call per invocation (see
# bench/README.md and bench/gpu_perf.py --help). Needs vLLM 0.26 installed under /tmp/site
# (../shared/gpu/README.md) and $OUT; run from anywhere in the checkout:
#   bash bench/gpu_perf.sh --parts p1p2p3 --slots 1-5
set -euo pipefail
cd "$(dirname "$0")/.."
if ! PYTHONPATH=/tmp/site python3 -c "import vllm" 2>/dev/null; then
  echo "gpu_perf.sh: vLLM is not installed in /tmp/site (carry .gpu/c0..c3 and run install.sh first)" >&2
  exit 2
fi
source bench/gpu_env.sh
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv || true
df -h /tmp | tail -1
exec python3 bench/gpu_perf.py --device cuda --out "${OUT:?set OUT}" "$@"
