"""Front-end host cost of a request's hooks, per request, without an engine.

vLLM deep-copies every request's SamplingParams on the front end's thread
(`InputProcessor.process_inputs` -> `params.clone()`), so what `extra_args` holds is
copied once per request. This times what `Engine.generate` does per request (build the
payload, construct SamplingParams, then the clone vLLM makes) for plain, steered (all
layers) and capturing requests, and for steering in the text wire form against the
nested mapping form it replaced (`dict`).

    python bench/payload_cost.py [--hidden 1024] [--layers 28] [--n 2000]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from vllm import SamplingParams

from capsteer.capture.spec import parse_capture_spec
from capsteer.engine import build_payload
from capsteer.engine_ext.plan import EXTRA_ARGS_KEY
from capsteer.steering.spec import parse_steering_spec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from perf_method import as_dict_wire


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--n", type=int, default=2000)
    a = ap.parse_args()
    steering = parse_steering_spec(
        {"vectors": [{"hook": "resid_post", "layers": "all", "vector": [0.01] * a.hidden}]},
        num_layers=a.layers, hidden_size=a.hidden)
    capture = parse_capture_spec({"hooks": ["resid_post"], "layers": [a.layers // 2],
                                  "positions": "prompt"}, num_layers=a.layers)
    sampling = {"max_tokens": 64, "temperature": 0.0, "ignore_eos": True}

    def steer_dict() -> dict | None:
        extra = build_payload(None, steering).extra_args
        as_dict_wire(extra[EXTRA_ARGS_KEY], steering)
        return extra

    kinds = {
        "plain": lambda: None,
        "steer": lambda: build_payload(None, steering).extra_args,
        "steer_dict": steer_dict,
        "capture": lambda: build_payload(capture, None, durable=True).extra_args,
    }
    res = {}
    for name, extra in kinds.items():
        def one(extra=extra) -> None:
            SamplingParams(**sampling, extra_args=extra()).clone()

        for _ in range(min(200, a.n)):
            one()
        t = time.perf_counter()
        for _ in range(a.n):
            one()
        res[name] = round((time.perf_counter() - t) / a.n * 1e6, 1)
    print(json.dumps({"us_per_request": res, "n": a.n, "hidden": a.hidden,
                      "layers": a.layers}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
