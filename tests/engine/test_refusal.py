"""Start-up is refused, with a message that says why, when hooks cannot work."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

START = textwrap.dedent("""
    from capsteer.engine import Engine
    if __name__ == "__main__":
        Engine({model!r}, dtype="float32", gpu_memory_utilization=0.2, max_model_len=256,
               {kwargs})
        print("ENGINE STARTED")
""")


def start_engine(model_dir: str, env: dict | None = None,
                 kwargs: str = "") -> subprocess.CompletedProcess:
    """`kwargs`: more Engine keyword arguments, as Python source."""
    return subprocess.run([sys.executable, "-c", START.format(model=model_dir, kwargs=kwargs)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


def engine_process_started(proc: subprocess.CompletedProcess) -> bool:
    """vLLM prefixes every log line of its engine-core process with its name."""
    return "(EngineCore" in proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, model_dirs) -> str:
    import transformers

    out = tmp_path_factory.mktemp("gpt2")
    tok = transformers.AutoTokenizer.from_pretrained(model_dirs["qwen3"])
    tok.save_pretrained(out)
    cfg = transformers.GPT2Config(vocab_size=len(tok), n_embd=128, n_layer=2, n_head=4,
                                  n_positions=512, eos_token_id=tok.eos_token_id)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(out)
    return str(out)


def test_unsupported_architecture_is_refused(gpt2_dir):
    proc = start_engine(gpt2_dir)
    assert "ENGINE STARTED" not in proc.stdout
    assert proc.returncode != 0
    assert "capsteer cannot hook architecture GPT2LMHeadModel" in proc.stdout + proc.stderr
    assert not engine_process_started(proc)  # refused at vLLM's config step, no weights loaded


@pytest.mark.parametrize(("family", "architecture", "kind"), [
    ("jamba", "JambaForCausalLM", "hybrid state-space model"),
    ("bert", "BertModel", "encoder model"),
])
def test_hybrid_and_encoder_models_are_refused_by_name(tmp_path, family, architecture, kind):
    from capsteer.demo_model import write_demo_model

    proc = start_engine(str(write_demo_model(tmp_path / family, family, seed=1)))
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


@pytest.mark.parametrize(("family", "flags", "named"), [
    ("jamba", [], "capsteer cannot hook architecture JambaForCausalLM: hybrid state-space "
                  "model"),
    # a mixture-of-experts model's DP engines run coupled; a dense model's DP is served
    ("qwen3_moe", ["--data-parallel-size", "2"],
     "capsteer cannot hook this engine configuration: --data-parallel-size with a "
     "mixture-of-experts model"),
])
def test_serve_refuses_before_its_engine_starts(tmp_path, family, flags, named):
    """`capsteer serve` names what it cannot hook and exits at vLLM's config step, as the
    offline engine does, instead of after its engine process loaded the weights."""
    from capsteer.demo_model import write_demo_model

    model = write_demo_model(tmp_path / family, family, seed=1)
    proc = subprocess.run([sys.executable, "-m", "capsteer.cli", "serve", str(model),
                           "--gpu-memory-utilization", "0.3", "--max-model-len", "256",
                           "--port", "0", *flags],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode != 0
    assert f"capsteer serve: {named}" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr  # one line that says why, not a stack
    assert "once ready" not in proc.stdout  # no "try this" line before a refusal
    assert not engine_process_started(proc)


@pytest.mark.parametrize(("family", "kwargs", "named"), [
    ("olmo2", "pipeline_parallel_size=2",
     "capsteer cannot hook the olmo2 family under pipeline parallelism"),
    ("qwen3", 'speculative_config={"method": "ngram", "num_speculative_tokens": 2, '
              '"prompt_lookup_max": 2}',
     "capsteer cannot hook this engine configuration: speculative decoding"),
])
def test_engine_features_the_hooks_cannot_serve_are_refused_before_start(
        tmp_path, family, kwargs, named):
    """What the workers would refuse after loading the model, read from vLLM's config."""
    from capsteer.demo_model import write_demo_model

    model = write_demo_model(tmp_path / family, family, seed=1)
    proc = start_engine(str(model), kwargs=kwargs)
    assert "ENGINE STARTED" not in proc.stdout
    assert proc.returncode != 0
    assert named in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-2000:]
    assert not engine_process_started(proc)


def test_extract_refuses_an_unhookable_model_in_one_line(tmp_path):
    from capsteer.demo_model import write_demo_model

    model = write_demo_model(tmp_path / "jamba", "jamba", seed=1)
    (tmp_path / "in.jsonl").write_text('{"id": "a", "prompt": "hello"}\n')
    proc = subprocess.run([sys.executable, "-m", "capsteer.cli", "extract", str(model),
                           "--input", "in.jsonl", "--output", "job", "--no-progress",
                           "--gpu-memory-utilization", "0.2", "--max-model-len", "256"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-2000:]
    assert ("capsteer extract: capsteer cannot hook architecture JambaForCausalLM: hybrid "
            "state-space model") in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not engine_process_started(proc)
