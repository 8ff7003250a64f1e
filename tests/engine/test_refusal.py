"""Start-up is refused, with a message that says why, when hooks cannot work."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

# A fixed 256 MiB KV cache: the canary's engine would zero 0.2 of the host's memory
# (4.7 GiB) before its workers run the canary; the refused starts never get that far.
START = textwrap.dedent("""
    from capsteer.engine import Engine
    if __name__ == "__main__":
        Engine({model!r}, dtype="float32", kv_cache_memory_bytes=256 << 20, max_model_len=256,
               {kwargs})
        print("ENGINE STARTED")
""")


def engine_argv(model_dir: str, kwargs: str = "") -> list[str]:
    """`kwargs`: more Engine keyword arguments, as Python source."""
    return [sys.executable, "-c", START.format(model=model_dir, kwargs=kwargs)]


def start_engine(model_dir: str, env: dict | None = None,
                 kwargs: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(engine_argv(model_dir, kwargs), capture_output=True, text=True,
                          timeout=600, env={**os.environ, **(env or {})})


def engine_process_started(proc: subprocess.CompletedProcess) -> bool:
    """vLLM prefixes every log line of its engine-core process with its name."""
    return "(EngineCore" in proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def unknown_dir(tmp_path_factory, model_dirs) -> str:
    """A GPT-J checkpoint: vLLM serves it natively; capsteer has no family row for it."""
    import transformers

    out = tmp_path_factory.mktemp("gptj")
    tok = transformers.AutoTokenizer.from_pretrained(model_dirs["qwen3"])
    tok.save_pretrained(out)
    cfg = transformers.GPTJConfig(vocab_size=len(tok), n_embd=128, n_layer=2, n_head=4,
                                  rotary_dim=16, n_positions=512, eos_token_id=tok.eos_token_id)
    transformers.GPTJForCausalLM(cfg).save_pretrained(out)
    return str(out)


SERVE_CASES = {
    "jamba": [],
    # a mixture-of-experts model's DP engines run coupled; a dense model's DP is served
    "qwen3_moe": ["--data-parallel-size", "2"],
}
FEATURE_CASES = {
    "olmo2": "pipeline_parallel_size=2",
    "qwen3": 'speculative_config={"method": "ngram", "num_speculative_tokens": 2, '
             '"prompt_lookup_max": 2}',
}


@pytest.fixture(scope="module")
def refused(tmp_path_factory, unknown_dir) -> dict[str, subprocess.CompletedProcess]:
    """Every refused start of this module, run four at a time: each is a Python process
    that imports vLLM and exits at its config step, ~10 s apiece in a row."""
    from capsteer.demo_model import write_demo_model

    root = tmp_path_factory.mktemp("refused")
    models = {family: str(write_demo_model(root / family, family, seed=1))
              for family in ("jamba", "bert", "qwen3_moe", "olmo2", "qwen3")}
    runs: dict[str, tuple[list[str], Path]] = {
        "unknown": (engine_argv(unknown_dir), root),
        "engine-jamba": (engine_argv(models["jamba"]), root),
        "engine-bert": (engine_argv(models["bert"]), root),
    }
    for family, flags in SERVE_CASES.items():
        cwd = root / f"serve-{family}"
        cwd.mkdir()
        runs[f"serve-{family}"] = ([
            sys.executable, "-m", "capsteer.cli", "serve", models[family],
            "--gpu-memory-utilization", "0.3", "--max-model-len", "256", "--port", "0",
            *flags], cwd)
    for family, kwargs in FEATURE_CASES.items():
        runs[f"feature-{family}"] = (engine_argv(models[family], kwargs), root)
    extract_cwd = root / "extract"
    extract_cwd.mkdir()
    (extract_cwd / "in.jsonl").write_text('{"id": "a", "prompt": "hello"}\n')
    runs["extract"] = ([sys.executable, "-m", "capsteer.cli", "extract", models["jamba"],
                        "--input", "in.jsonl", "--output", "job", "--no-progress",
                        "--gpu-memory-utilization", "0.2", "--max-model-len", "256"],
                       extract_cwd)

    def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
        return subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=cwd)

    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {name: pool.submit(run, *args) for name, args in runs.items()}
        return {name: future.result() for name, future in futures.items()}


def test_unsupported_architecture_is_refused(refused):
    proc = refused["unknown"]
    assert "ENGINE STARTED" not in proc.stdout
    assert proc.returncode != 0
    assert "capsteer cannot hook architecture GPTJForCausalLM" in proc.stdout + proc.stderr
    assert not engine_process_started(proc)  # refused at vLLM's config step, no weights loaded


@pytest.mark.parametrize(("family", "architecture", "kind"), [
    ("jamba", "JambaForCausalLM", "hybrid state-space model"),
    ("bert", "BertModel", "encoder model"),
])
def test_hybrid_and_encoder_models_are_refused_by_name(refused, family, architecture, kind):
    proc = refused[f"engine-{family}"]
    assert "ENGINE STARTED" not in proc.stdout
    assert proc.returncode != 0
    assert f"capsteer cannot hook architecture {architecture}: {kind}" in proc.stdout + proc.stderr
    assert not engine_process_started(proc)


@pytest.mark.engine  # loads the model in an engine process before the canary refuses
@pytest.mark.uses_engine("other")
def test_canary_refuses_when_a_hook_does_not_fire(model_dirs):
    proc = start_engine(model_dirs["qwen3"], env={"CAPSTEER_FAULT_INJECT": "skip_site:3"})
    assert "ENGINE STARTED" not in proc.stdout
    assert proc.returncode != 0
    assert "capsteer start-up canary failed, refusing to start" in proc.stdout + proc.stderr
    assert engine_process_started(proc)  # the canary runs in the workers, after the load


@pytest.mark.parametrize(("family", "named"), [
    ("jamba", "capsteer cannot hook architecture JambaForCausalLM: hybrid state-space model"),
    ("qwen3_moe", "capsteer cannot hook this engine configuration: --data-parallel-size with "
                  "a mixture-of-experts model"),
])
def test_serve_refuses_before_its_engine_starts(refused, family, named):
    """`capsteer serve` names what it cannot hook and exits at vLLM's config step, as the
    offline engine does, instead of after its engine process loaded the weights
    (flags: SERVE_CASES)."""
    proc = refused[f"serve-{family}"]
    assert proc.returncode != 0
    assert f"capsteer serve: {named}" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr  # one line that says why, not a stack
    assert "once ready" not in proc.stdout  # no "try this" line before a refusal
    assert not engine_process_started(proc)


@pytest.mark.parametrize(("family", "named"), [
    ("olmo2", "capsteer cannot hook the olmo2 family under pipeline parallelism"),
    ("qwen3", "capsteer cannot hook this engine configuration: speculative decoding"),
])
def test_engine_features_the_hooks_cannot_serve_are_refused_before_start(
        refused, family, named):
    """What the workers would refuse after loading the model, read from vLLM's config
    (Engine arguments: FEATURE_CASES)."""
    proc = refused[f"feature-{family}"]
    assert "ENGINE STARTED" not in proc.stdout
    assert proc.returncode != 0
    assert named in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-2000:]
    assert not engine_process_started(proc)


def test_extract_refuses_an_unhookable_model_in_one_line(refused):
    proc = refused["extract"]
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-2000:]
    assert ("capsteer extract: capsteer cannot hook architecture JambaForCausalLM: hybrid "
            "state-space model") in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not engine_process_started(proc)
