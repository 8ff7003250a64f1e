"""What the writer child's row copies cost with glibc's default heap and with the heap it
keeps (capture/writer_process.py `_keep_freed_heap`): microseconds per 1 MiB clone out of
a ring, over bursts of `--rows-mib` clones held until the burst ends, in a fresh process
per setting (the heap's history is the point).

    .venv/bin/python bench/heap_reuse.py [--bursts 3] [--rows-mib 1152]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

_CHILD = r"""
import json, sys, time, torch
torch.set_num_threads(1)
if sys.argv[1] == "kept":
    from capsteer.capture.writer.glibc import keep_freed_heap as _keep_freed_heap
    assert _keep_freed_heap(), "no glibc mallopt here"
bursts, n = int(sys.argv[2]), int(sys.argv[3])
ring = torch.empty(1 << 30, dtype=torch.uint8)
ring.fill_(1)
out = []
for _ in range(bursts):
    held, t = [], time.perf_counter()
    for i in range(n):
        off = (i << 20) % (1 << 30)
        held.append(ring[off:off + (1 << 20)].view(torch.bfloat16).view(128, 4096).clone())
    out.append((time.perf_counter() - t) / n * 1e6)
    del held
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bursts", type=int, default=3)
    ap.add_argument("--rows-mib", type=int, default=1152, help="1 MiB clones held per burst "
                    "(1,152: one request's 36 layers x 32 requests of P6's shape)")
    args = ap.parse_args()
    result = {}
    for setting in ("default", "kept"):
        t = time.perf_counter()
        got = subprocess.run([sys.executable, "-c", _CHILD, setting, str(args.bursts),
                              str(args.rows_mib)], check=True, capture_output=True, text=True)
        result[setting] = [round(us) for us in json.loads(got.stdout)]
        print(f"{setting:<8} us a 1 MiB clone, burst by burst: {result[setting]} "
              f"({time.perf_counter() - t:.1f} s)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
