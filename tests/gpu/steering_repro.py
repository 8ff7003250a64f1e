"""Steering through the chat endpoint vs an HF forward hook, greedy and teacher-forced.

The case reported in issue 11: a 3-layer, hidden-192 Llama (untied embeddings), chat
endpoint, `add` of a unit vector x 8 at resid_post layer 1, positions all, 12 greedy
tokens, against an HF forward hook on `model.layers[1]`. Runs the real server once per
`--dtype` (vLLM's `auto` serves a float32 checkpoint in bfloat16) and, for the plain
and the steered request, reports where greedy tokens diverge, the log-prob of each
HF-greedy token when fed back teacher-forced (completions + prompt_logprobs), and HF's
smallest top-2 margin (a near tie).

    python tests/gpu/steering_repro.py [--dtypes auto,float32] [--out /tmp/capsteer-gpu-checks]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import torch

STEPS, SCALE, LAYER, PORT = 12, 8.0, 1, 8123
MESSAGES = [{"role": "user", "content": "what is a residual stream"}]


def wait_ready(proc: subprocess.Popen, url: str) -> None:
    for _ in range(300):
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise SystemExit("server not ready after 600 s")


def hf_greedy(hf, ids: list[int], vector: np.ndarray | None) -> tuple[list[int], list]:
    handle = None
    if vector is not None:  # the user's hook: add to the output of model.layers[LAYER]
        add = torch.tensor(SCALE * vector, dtype=torch.float32)
        handle = hf.model.layers[LAYER].register_forward_hook(lambda m, a, o: o + add)
    seq, steps = list(ids), []
    with torch.no_grad():
        for _ in range(STEPS):
            lp = torch.log_softmax(hf(torch.tensor([seq])).logits[0, -1].float(), -1)
            steps.append(lp)
            seq.append(int(lp.argmax()))
    if handle is not None:
        handle.remove()
    return seq[len(ids):], steps


def run(model: str, dtype: str, hf, ids: list[int], vector: np.ndarray) -> dict:
    from openai import OpenAI

    url = f"http://127.0.0.1:{PORT}"
    cmd = [sys.executable, "-m", "capsteer.cli", "serve", model, "--cpu-defaults",
           "--port", str(PORT), "--dtype", dtype]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_ready(proc, url)
        client = OpenAI(base_url=url + "/v1", api_key="none")
        steering = {"vectors": [{"hook": "resid_post", "layer": LAYER,
                                 "vector": vector.tolist(), "scale": SCALE}]}
        out = {"served_dtype": httpx.get(url + "/v1/capsteer/hooks").json()["dtype"]}
        for name, extra in (("plain", {}), ("steered", {"steering": steering})):
            chat = client.chat.completions.create(
                model=model, messages=MESSAGES, max_tokens=STEPS, temperature=0, logprobs=True,
                extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True, **extra})
            got = [int(t.token.split(":", 1)[1]) for t in chat.choices[0].logprobs.content]
            ref, steps = hf_greedy(hf, ids, vector if extra else None)
            forced = httpx.post(url + "/v1/completions", timeout=120, json={
                "model": model, "prompt": ids + ref, "max_tokens": 1, "temperature": 0,
                "prompt_logprobs": 0, **extra}).json()["choices"][0]["prompt_logprobs"]
            diffs = [abs(forced[len(ids) + i][str(t)]["logprob"] - float(steps[i][t]))
                     for i, t in enumerate(ref)]
            margins = [float(lp.topk(2).values[0] - lp.topk(2).values[1]) for lp in steps]
            out[name] = {"server_tokens": got, "hf_tokens": ref,
                         "diverged_at": [i for i, (a, b) in enumerate(zip(got, ref, strict=True)) if a != b],
                         "teacher_forced_max_logprob_diff": max(diffs),
                         "hf_min_top2_margin": min(margins)}
        return out
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    from capsteer.demo_model import DemoShape, write_demo_model
    from capsteer.reference import load_hf

    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="auto,float32")
    ap.add_argument("--model-dir", default="/tmp/capsteer-repro-llama3l")
    ap.add_argument("--out", default="/tmp/capsteer-gpu-checks")
    args = ap.parse_args()
    shape = DemoShape(hidden_size=192, num_layers=3, num_heads=6, num_kv_heads=2, head_dim=32,
                      intermediate_size=384)
    model = str(write_demo_model(args.model_dir, "llama", seed=5, shape=shape))
    hf = load_hf(model)
    from transformers import AutoTokenizer

    ids = list(AutoTokenizer.from_pretrained(model).apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    vector = np.random.default_rng(0).standard_normal(shape.hidden_size)
    vector /= np.linalg.norm(vector)
    report = {"case": "llama 3 layers, hidden 192, chat, add unit*8 at resid_post 1",
              "runs": {d: run(model, d, hf, ids, vector) for d in args.dtypes.split(",")}}
    print(json.dumps(report, indent=1))
    path = Path(args.out) / "cpu-2026-11-23-steering-repro.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
