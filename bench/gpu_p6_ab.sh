#!/usr/bin/env bash
# P6 A/B on one warm GPU host: one `bench/throughput.py --p6` process per variant and
# round, variants interleaved (a, b, a, b, ...), the disk's fsync'd rate (dd) before and
# after, so every variant sees the same minutes of the same disk. Leaves in OUT one log
# and one JSON per process (a call brings back few files).
#
#   bench/gpu_p6_ab.sh OUT ROUNDS "label:throughput args" ["label:throughput args" ...]
#   e.g. bench/gpu_p6_ab.sh $OUT/ring 2 "default:" "128MiB:--capture-ring 128MiB"
#
# Env: P6_TIMEOUT (s a process, default 180), P6_FIRST_TIMEOUT (the first process, which
# may compile on a cold cache; default 300), P6_DEADLINE (epoch s: start no process that
# could run past it), P6_SHAPE (default llama3-8b-36l).
set -uo pipefail
set +m  # no job control: a background job stays in this shell's group, so setsid below
        # makes the process its own group leader (same pid) instead of forking
if [ $# -lt 3 ]; then
    echo "usage: $0 OUT ROUNDS label:args [label:args ...]" >&2
    exit 2
fi
out=$1 rounds=$2
shift 2
for variant in "$@"; do
    if [[ $variant == old* ]] && [ -z "${P6_OLD_PYTHONPATH:-}" ]; then
        echo "$0: variant ${variant%%:*} needs P6_OLD_PYTHONPATH (an older commit's packages)" >&2
        exit 2
    fi
done
mkdir -p "$out"
log="$out/p6-ab.log"
: > "$log"
shape=${P6_SHAPE:-llama3-8b-36l}
disk() {
    dd if=/dev/zero of=/tmp/capsteer-dd.bin bs=16M count=256 conv=fsync 2>&1 | tail -n 1 >> "$log"
    rm -f /tmp/capsteer-dd.bin
}
echo "== dd before $(date +%T)" >> "$log"
disk
n=0
for round in $(seq 1 "$rounds"); do
    for variant in "$@"; do
        label=${variant%%:*} args=""
        [[ $variant == *:* ]] && args=${variant#*:}
        n=$((n + 1))
        limit=${P6_TIMEOUT:-180}
        [ "$n" = 1 ] && limit=${P6_FIRST_TIMEOUT:-300}
        if [ -n "${P6_DEADLINE:-}" ] && [ $(( $(date +%s) + limit )) -gt "$P6_DEADLINE" ]; then
            echo "== stop before process $n: the deadline leaves less than ${limit} s" >> "$log"
            break 2
        fi
        echo "== process $n round $round $label ($args) $(date +%T)" >> "$log"
        work=/tmp/capsteer-p6-ab/$n
        rm -rf "$work"
        mkdir -p "$work"
        pp=${PYTHONPATH:-}
        [[ $label == old* ]] && pp=$P6_OLD_PYTHONPATH  # old packages, this checkout's bench/
        # Its own process group, so a process past its limit goes with its engine and
        # writer children (an orphaned engine would hold the GPU for the next one).
        # shellcheck disable=SC2086  # args are several flags
        PYTHONPATH=$pp setsid python bench/throughput.py --device cuda --p6 --shape "$shape" $args \
            --out "$work" > "$work/log" 2>&1 &
        pid=$!
        (sleep "$limit"; kill -9 -- "-$pid") > /dev/null 2>&1 &
        watchdog=$!
        wait "$pid"
        rc=$?
        pkill -P "$watchdog" sleep 2> /dev/null
        kill "$watchdog" 2> /dev/null
        kill -9 -- "-$pid" 2> /dev/null  # children left behind by a failure
        grep -E "^(capture|  rep)|Error|error|failed" "$work/log" >> "$log"
        if ! cp "$work"/gpu-*-p6-*.json "$out/p$n-$label.json" 2> /dev/null; then
            echo "   (no result: exit $rc, 137 = killed at ${limit} s); its log ends:" >> "$log"
            tail -n 15 "$work/log" | sed 's/^/   | /' >> "$log"
        fi
    done
done
echo "== dd after $(date +%T)" >> "$log"
disk
cat "$log"
