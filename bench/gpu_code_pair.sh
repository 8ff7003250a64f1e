#!/usr/bin/env bash
# Old code vs new code on one GPU host, process by process: one steer_ab process with this
# checkout, then one with an older commit's packages (taken with
# `git archive REV capsteer server capture steering engine_ext config | tar -x -C oldsrc`
# into an untracked folder that travels to the GPU machine), prefill workload.
#
#   bash bench/gpu_code_pair.sh OLDSRC TAG [KINDS]     (results: $OUT/pair-TAG.tgz)
set -u
old=$1; tag=$2; kinds=${3:-plain,steer_one,steer_all}
source bench/gpu_env.sh
export PYTHONUNBUFFERED=1
rm -rf /tmp/old && mkdir -p /tmp/old/capsteer && cp -r "$old"/capsteer/* /tmp/old/capsteer/
for d in server capture steering engine_ext config; do cp -r "$old/$d" /tmp/old/capsteer/$d; done
new_pp=$PYTHONPATH
mkdir -p "$OUT/pair-$tag"
for v in new old; do
  # the script's folder (bench/) heads sys.path, not the checkout: PYTHONPATH picks the code
  if [ $v = old ]; then export PYTHONPATH=/tmp/old:/tmp/site; else export PYTHONPATH=$new_pp; fi
  timeout 280 python bench/steer_ab.py --out "$OUT/pair-$tag" --step-tokens 8192 --rounds 6 \
     --workloads prefill --kinds "$kinds" --tag "$v-$tag" > "$OUT/pair-$tag/log-$v.txt" 2>&1
  echo "$v rc $?"; grep "\] prefill:" "$OUT/pair-$tag/log-$v.txt"
done
cd "$OUT" && tar czf "pair-$tag.tgz" "pair-$tag" && rm -rf "pair-$tag"
