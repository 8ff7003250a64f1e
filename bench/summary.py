"""bench/results/summary.json: the issue-12 and issue-63 figures, each with where it came from.

One number (or null) per key, `commands` (key -> its command) and `provenance` (key -> date,
device, source, target, verdict, spread); an update replaces only the keys it measured, so
an older figure keeps its own date and device. `update` reads the result files of
perf_method, extract_bench, storage, throughput --p6 and serve_bench, and refuses CPU ones
(the summary holds GPU figures) unless --allow-cpu.

    python bench/summary.py show
    python bench/summary.py update --from RESULT.json [RESULT.json ...] [--write PATH]
    python bench/summary.py apply UPDATE.json      # key -> {"value", "command", ...}
    python bench/summary.py plot [--png PATH]      # every key against its target, one PNG
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as `python bench/summary.py`
import perf_models

# Issue 63's serve_* keys: through HTTP with `vllm bench serve` (serve_bench.py); ratios to
# vanilla `vllm serve` unless said (distinct_256: to the one-config run; short: requests/s).
TARGETS = {"p1_plain": ">= 0.99", "p2_steer_prefill": ">= 0.95", "p2_steer_decode": ">= 0.95",
           "p3_capture_one_layer": ">= 0.90", "p3_capture_all_vs_disk": ">= 0.80",
           "p4_extract_one_layer_vs_vllm": ">= 0.90", "p4_extract_vs_hf_8b": ">= 10",
           "p5_write_vs_disk": ">= 0.80", "p6_seconds": "<= 2.5",
           "plain_identity": ">= vanilla vs vanilla",
           "serve_plain": ">= 0.98", "serve_steer_all": ">= 0.95", "serve_distinct_256": ">= 0.90",
           "serve_capture_one_layer": ">= 0.90", "serve_capture_one_layer_wait": ">= 0.90",
           "serve_short_rps": ">= 0.95", "serve_ttft_p99_plain": "<= 1.05",
           "serve_tpot_p99_plain": "<= 1.05", "readout_probe": ">= 0.97",
           "readout_sae16k": ">= 0.90", "steer_conditional": ">= 0.95"}
KEYS = tuple(TARGETS)
SERVE_TARGETS = {k: v for k, v in TARGETS.items()  # serve_bench.py measures these
                 if k.startswith(("serve_", "readout_", "steer_conditional"))}
DEFAULT = perf_models.RESULTS / "summary.json"

Update = dict[str, dict[str, Any]]  # key -> {"value", "command", "date", "device", ...}


def updates_from(path: Path) -> Update:
    """The summary keys one result file measured."""
    doc = json.loads(path.read_text())
    base = {k: doc.get(k) for k in ("date", "device", "command")} | {"source": path.name}
    if "keys" in doc.get("summary", {}):  # perf_method
        return {key: {**base, **v} for key, v in doc["summary"]["keys"].items()}
    if doc.get("kind") == "serve-bench":  # serve_bench.py: keys ready-made
        return {key: {**base, **v} for key, v in doc["keys"].items()}
    if "p4_vs_vllm" in doc or "p4_vs_hf" in doc:  # extract_bench
        out: Update = {}
        if "p4_vs_vllm" in doc:
            out["p4_extract_one_layer_vs_vllm"] = {**base, **doc["p4_vs_vllm"],
                                                   "model": doc.get("model")}
        if "p4_vs_hf" in doc:
            out["p4_extract_vs_hf_8b"] = {**base, **doc["p4_vs_hf"], "model": doc.get("model"),
                                          "hf_batch": doc.get("hf_batch")}
        return out
    if doc.get("kind") == "storage":  # storage.py --out: paired rounds
        r = doc["result"]
        return {"p5_write_vs_disk": {**base, "value": r["ratio"], "lo": r["lo"], "hi": r["hi"],
                                     "target": 0.8, "verdict": r["verdict"],
                                     "method": "paired rounds",
                                     "rounds": [e["ratio"] for e in r["rounds"]]}}
    if doc.get("p6"):  # throughput.py --p6: a ceiling, so the verdict's sides swap
        rows = [r for r in doc["rows"] if r["config"] == "capture"]
        times = [t for r in rows for t in r["times_s"]]
        return {"p6_seconds": {**base, "value": statistics.median(r["wall_s"] for r in rows),
                               "min": min(times), "max": max(times), "target": 2.5,
                               "verdict": perf_models.verdict(-max(times), -min(times), -2.5),
                               "workload": doc.get("workload")}}
    raise SystemExit(f"{path}: not a result file this script knows")


def merge(summary: dict[str, Any], update: Update) -> dict[str, Any]:
    """`summary` with the keys of `update` replaced; the others kept with their provenance."""
    merged: dict[str, Any] = {"device": summary.get("device"), "date": summary.get("date"),
                              **{key: summary.get(key) for key in KEYS},
                              "commands": dict(summary.get("commands") or {}),
                              "provenance": dict(summary.get("provenance") or {}),
                              "targets": TARGETS}
    for key, v in update.items():
        if key in KEYS:
            merged[key] = v["value"]
            merged["commands"][key] = v.get("command")
            merged["provenance"][key] = {k: x for k, x in v.items() if k not in ("value", "command")}
    dates = [v["date"] for v in update.values() if v.get("date")]
    if dates:
        merged["date"] = max(dates)
        merged["device"] = next(v["device"] for v in update.values() if v.get("date") == max(dates))
    return merged


def show(summary: dict[str, Any]) -> None:
    prov = summary.get("provenance", {})
    print(f"summary: device {summary.get('device')}, updated {summary.get('date')}")
    print(f"{'key':32}{'value':>10}  {'target':22}{'verdict':25}{'date':12}device")
    for key in KEYS:
        v, p = summary.get(key), prov.get(key, {})
        val = "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)
        print(f"{key:32}{val:>10}  {TARGETS[key]:22}{p.get('verdict') or '-':25}"
              f"{p.get('date') or '-':12}{p.get('device') or '-'}")


def against_target(key: str, value: float, prov: dict[str, Any]) -> float | None:
    """A figure over its target (above 1 meets it; a ceiling inverted; plain identity over
    vanilla's agreement with itself)."""
    if key == "plain_identity":
        base = prov.get("vanilla_vs_vanilla")
        return value / base if base else None
    target = prov.get("target") if prov.get("target") is not None else TARGETS[key].split()[-1]
    return float(target) / value if TARGETS[key].startswith("<=") else value / float(target)


VERDICT_COLORS = {"met": "#2e7d32", "missed": "#c62828"}  # anything else: unresolved


def plot(summary: dict[str, Any], png: Path) -> None:
    """One horizontal bar per key: the figure over its target (1 = the target), the
    spread behind it where the provenance has one, coloured by verdict."""
    plt = perf_models.pyplot()
    if plt is None:
        return
    from matplotlib.patches import Patch  # matplotlib: present, as pyplot() said

    prov, rows = summary.get("provenance", {}), []
    for key in KEYS:
        value, p = summary.get(key), prov.get(key, {})
        x = against_target(key, float(value), p) if isinstance(value, (int, float)) else None
        if x is None:
            continue
        lo, hi = p.get("lo", p.get("min")), p.get("hi", p.get("max"))
        ends = [against_target(key, float(v), p) for v in (lo, hi) if isinstance(v, (int, float))]
        rows.append((key, x, (min(ends), max(ends)) if len(ends) == 2 else None,
                     f"{value:.3g} (target {TARGETS[key]})", str(p.get("verdict") or "-")))
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(rows) + 1.4))
    for i, (_key, x, spread, label, verdict) in enumerate(rows):
        err = None if spread is None else [[max(x - spread[0], 0)], [max(spread[1] - x, 0)]]
        ax.barh(i, x, color=VERDICT_COLORS.get(verdict, "#f9a825"), xerr=err, capsize=3)
        ax.text((x if spread is None else max(x, spread[1])) + 0.03, i, f"{label}, {verdict}",
                va="center", fontsize=8)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, max(2.6, max(r[1] for r in rows) + 1.2))
    ax.set_xlabel("figure over its target (1 = the target; right of it meets it); bars: the "
                  "spread behind the figure")
    ax.legend(handles=[Patch(color=c, label=v) for v, c in
                       [*VERDICT_COLORS.items(), ("unresolved", "#f9a825")]],
              loc="lower right", fontsize=8)
    ax.set_title(f"issues 12 and 63 on GPU, bench/results/summary.json of {summary.get('date')} "
                 "(each key's device and date: its provenance)", fontsize=9)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=("show", "update", "apply", "plot"))
    ap.add_argument("files", nargs="*", type=Path, help="apply: update files")
    ap.add_argument("--from", dest="sources", nargs="+", type=Path, default=[])
    ap.add_argument("--summary", type=Path, default=DEFAULT, help="the summary read")
    ap.add_argument("--write", type=Path, default=None, help="where to write (default: --summary)")
    ap.add_argument("--allow-cpu", action="store_true")
    ap.add_argument("--png", type=Path, default=None,
                    help="plot: where to write (default: summary.png beside --summary)")
    a = ap.parse_args(argv)
    summary = json.loads(a.summary.read_text()) if a.summary.exists() else {}
    if a.action == "show":
        show(summary)
        return 0
    if a.action == "plot":
        plot(summary, a.png or a.summary.with_suffix(".png"))
        return 0
    update: Update = {}
    for f in a.sources if a.action == "update" else a.files:
        update.update(updates_from(f) if a.action == "update" else json.loads(f.read_text()))
    if not update:
        raise SystemExit("nothing to merge")
    if any(str(v.get("device", "")).lower() == "cpu" for v in update.values()) and not a.allow_cpu:
        raise SystemExit("CPU figures do not go into the summary (GPU only); --allow-cpu to force")
    merged = merge(summary, update)
    target = a.write or a.summary
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(merged, indent=2) + "\n")
    show(merged)
    print(f"wrote {target} ({', '.join(sorted(update))} updated, "
          f"{dt.date.today().isoformat()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
