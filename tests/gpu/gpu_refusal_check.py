"""What `capsteer serve` refuses at vLLM's config step, checked on the vLLM it runs on.

The config-step refusal reads vLLM's own config objects (`ModelConfig.is_moe`, the
architecture markers), so each vLLM version needs its own check. Runs `capsteer serve`
on demo models of several families and flags, and reports per case: the exit status, the
line it printed, whether an engine-core process started, and whether the "once ready"
hint appeared (printed only after the config step accepted). Accepted cases are stopped
as soon as the hint appears, so nothing loads beyond the config step's own work.

    python tests/gpu/gpu_refusal_check.py [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# (family, flags, expected, words): "refuse" with words the refusal must contain, or
# "accept" (words unused).
CASES: list[tuple[str, list[str], str, str]] = [
    ("qwen3_moe", ["--data-parallel-size", "2"], "refuse",
     "--data-parallel-size with a mixture-of-experts model"),
    ("mixtral", ["--data-parallel-size", "2"], "refuse",
     "--data-parallel-size with a mixture-of-experts model"),
    ("jamba", [], "refuse", "capsteer cannot hook architecture JambaForCausalLM"),
    ("qwen3_moe", [], "accept", ""),
    ("qwen3", ["--data-parallel-size", "2"], "accept", ""),
]


def run_case(model: Path, flags: list[str], timeout_s: float) -> dict:
    """Start `capsteer serve`; stop it at the hint (accepted) or let it exit (refused).
    It runs in the model's folder: `-m` puts the working directory first on sys.path, and
    a checkout's root holds a `capsteer/` folder that is not the installed package."""
    cmd = [sys.executable, "-m", "capsteer.cli", "serve", str(model), "--port", "0",
           "--max-model-len", "256", "--gpu-memory-utilization", "0.3", *flags]
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=model.parent, start_new_session=True)
    lines: list[str] = []
    hinted = False
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if "once ready" in line:
            hinted = True
            break
        if time.time() - t0 > timeout_s:
            break
    seconds = round(time.time() - t0, 1)
    # The whole group, at once: nothing a case started outlives it, and at the config step
    # there is nothing to shut down gracefully (a graceful SIGINT waited 90 s there)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    text = "\n".join(lines)
    # vLLM 0.26 prefixes the API server's lines with "(APIServer pid=N) "
    said = [ln[ln.index("capsteer serve:"):] for ln in lines if "capsteer serve:" in ln]
    return {"cmd": " ".join(cmd[2:]), "returncode": proc.returncode, "hint": hinted,
            "line": said[-1] if said else None, "traceback": "Traceback" in text,
            "engine_process_started": "(EngineCore" in text,
            "seconds": seconds, "tail": lines[-12:]}


def main() -> None:
    from capsteer.demo_model import write_demo_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/capsteer-gpu-checks"))
    ap.add_argument("--work", default="/tmp/refusal-models")
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--only", default="", help="comma-separated families to run (default: all)")
    args = ap.parse_args()
    import vllm

    report: dict = {"vllm": vllm.__version__, "cases": []}
    only = {f for f in args.only.split(",") if f}
    for family, flags, expected, words in CASES:
        if only and family not in only:
            continue
        model = Path(args.work) / family
        if not (model / "config.json").is_file():
            write_demo_model(model, family, seed=1)
        got = run_case(model, flags, args.timeout)
        if expected == "refuse":
            ok = (got["returncode"] not in (0, None) and not got["hint"]
                  and not got["engine_process_started"] and not got["traceback"]
                  and bool(got["line"]) and words in got["line"])
        else:
            ok = got["hint"] and got["line"] is None
        got.update(family=family, flags=flags, expected=expected, ok=bool(ok))
        report["cases"].append(got)
        print(f"{'ok ' if ok else 'BAD'} {family:10s} {' '.join(flags):26s} {expected:6s} "
              f"rc={got['returncode']} hint={got['hint']} engine={got['engine_process_started']} "
              f"{got['seconds']} s  {got['line'] or ''}", flush=True)
        if not ok:
            print("    " + "\n    ".join(got["tail"]), flush=True)
    report["all_ok"] = all(c["ok"] for c in report["cases"])
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "refusal_check.json").write_text(json.dumps(report, indent=1))
    print("all ok" if report["all_ok"] else "NOT all ok")


if __name__ == "__main__":
    main()
