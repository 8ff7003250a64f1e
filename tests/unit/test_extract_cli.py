"""`capsteer extract` takes vLLM's engine flags with vLLM's meanings (`--dtype` is the
model's dtype) and stores activations in `--capture-dtype`."""

from __future__ import annotations

import pytest

from capsteer import cli
from capsteer.extraction.cli import build_parser, engine_args

JOB = ["--input", "prompts.jsonl", "--output", "job"]


def parse(*flags: str):
    parser = build_parser()
    args = parser.parse_args(["some/model", *JOB, *flags])
    return args, engine_args(args, parser)


def test_dtype_is_the_models_and_capture_dtype_is_separate():
    args, kwargs = parse("--dtype", "float32", "--capture-dtype", "bfloat16")
    assert kwargs["dtype"] == "float32"
    assert args.capture_dtype == "bfloat16"


def test_vllm_engine_flags_pass_through_with_their_types():
    _, kwargs = parse("--max-num-seqs", "8", "--max-num-batched-tokens", "512",
                      "--tensor-parallel-size", "2", "--enforce-eager", "--trust-remote-code",
                      "--quantization", "fp8")
    assert kwargs == {"max_num_seqs": 8, "max_num_batched_tokens": 512,
                      "tensor_parallel_size": 2, "enforce_eager": True,
                      "trust_remote_code": True, "quantization": "fp8"}


def test_defaults_leave_vllm_alone():
    args, kwargs = parse()
    assert kwargs == {}
    assert args.capture_dtype == "auto"


def test_unknown_flag_is_an_error_naming_it(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["extract", "some/model", *JOB, "--model-dtype", "float32"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --model-dtype" in capsys.readouterr().err


def test_help_shows_both_dtypes(capsys):
    with pytest.raises(SystemExit):
        cli.main(["extract", "--help"])
    assert "--dtype is the MODEL's dtype" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):  # vLLM's keyword help: the two side by side
        cli.main(["extract", "--help=dtype"])
    text = capsys.readouterr().out
    assert "--capture-dtype {auto,float32,bfloat16,float16}" in text
    assert "--dtype {auto," in text


def test_narrower_capture_dtype_is_logged(caplog):
    import torch

    from capsteer.extraction.job import warn_if_narrower

    with caplog.at_level("WARNING", logger="capsteer.extract"):
        warn_if_narrower("float32", torch.float32)
        warn_if_narrower("auto", torch.float32)
        warn_if_narrower("float32", torch.bfloat16)  # wider: nothing to say
        assert not caplog.records
        warn_if_narrower("bfloat16", torch.float32)
    assert len(caplog.records) == 1
    assert "stored as bfloat16" in caplog.records[0].getMessage()


@pytest.mark.parametrize(("hooks", "layers", "stop"), [
    (["resid_post"], [5], 6),          # site 12: read where layer 6 starts, i.e. after layer 5
    (["resid_pre"], [5], 5),           # site 10: the stream entering layer 5
    (["attn_out", "resid_mid"], [5], 6),  # site 11: inside layer 5
    (["resid_pre"], [0], 1),           # the embedding: one layer still runs (the final norm's residual)
    (["resid_post"], [2, 7], 8),       # the deepest captured layer decides
    (["resid_post"], [11], None),      # the last layer: every layer runs
    (["resid_pre"], [11], 11),
])
def test_the_forward_stops_after_the_deepest_captured_layer(tmp_path, hooks, layers, stop):
    from capsteer.capture.spec import parse_capture_spec
    from capsteer.extraction.job import job_config

    spec = parse_capture_spec({"hooks": hooks, "layers": layers, "positions": "prompt"},
                              num_layers=12)
    config = job_config(tmp_path, spec, 1 << 20, {}, num_layers=12)
    assert config.get("stop_at_layer") == stop
    assert "stop_at_layer" not in job_config(tmp_path, spec, 1 << 20, {}, num_layers=12,
                                             full_forward=True)


@pytest.mark.parametrize(("positions", "max_tokens", "stops"), [
    ("prompt", 8, True), ("last_prompt", 8, True),
    ("all", 1, True), ("last", 1, True),        # one generated token is never fed back
    ("all", 8, False), ("generated", 8, False), ("last", 8, False), ([3, 40], 8, False),
])
def test_the_forward_runs_every_layer_when_generated_positions_are_kept(
        tmp_path, positions, max_tokens, stops):
    """A generated token comes from the last layer's logits, so a job keeping generated
    positions needs the whole forward; prompt positions never depend on later tokens."""
    from capsteer.capture.spec import parse_capture_spec
    from capsteer.extraction.job import job_config

    spec = parse_capture_spec({"hooks": ["resid_post"], "layers": [1], "positions": positions},
                              num_layers=12)
    config = job_config(tmp_path, spec, 1 << 20, {}, num_layers=12, max_tokens=max_tokens)
    assert ("stop_at_layer" in config) == stops


def test_full_forward_flag():
    assert parse("--full-forward")[0].full_forward is True
    assert parse()[0].full_forward is False


def test_default_ids_are_the_lines_numbers(tmp_path):
    """api.md: `id` defaults to the line number, as an editor counts lines (blank ones too)."""
    from capsteer.extraction.job import read_records

    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n{"id": "x", "prompt": "c"}\n  \n'
                    '{"prompt": "d"}\n')
    assert [r.id for r in read_records(path)] == ["1", "3", "x", "6"]


def test_a_resumed_job_must_ask_for_the_rows_it_holds(tmp_path):
    """Resuming with other hooks, positions or stored dtype would mix two kinds of rows
    under one manifest: refused by flag name; the same request (or "auto" again) resumes."""
    import json

    from capsteer.capture.spec import parse_capture_spec
    from capsteer.extraction.job import check_job

    def spec(**kw):
        return parse_capture_spec({"hooks": ["resid_post"], "layers": [1],
                                   "positions": "prompt", "layout": "packed", **kw},
                                  num_layers=4)

    held = spec(dtype="auto")
    (tmp_path / "manifest.json").write_text(json.dumps({"spec": held.to_dict(),
                                                        "dtype": "bfloat16"}))
    check_job(tmp_path, spec(dtype="auto"))
    check_job(tmp_path, spec(dtype="bf16"))  # what "auto" stored
    for other, flag in ((spec(layers=[2]), "--hooks/--layers"),
                        (spec(positions="all"), "--positions"),
                        (spec(dtype="float32"), "--capture-dtype float32")):
        with pytest.raises(ValueError, match=flag):
            check_job(tmp_path, other)
    (tmp_path / "manifest.json").write_text(json.dumps({"spec": spec(dtype="bf16").to_dict(),
                                                        "dtype": "bfloat16"}))
    with pytest.raises(ValueError, match="--capture-dtype auto"):
        check_job(tmp_path, spec(dtype="auto"))


@pytest.mark.parametrize(("flags", "named"), [
    (["--input", "missing.jsonl"], "--input missing.jsonl: no such file"),
    (["--input", "in.jsonl", "--worker-cls", "my.Worker"], "--worker-cls"),
])
def test_extract_refuses_plain_mistakes_by_name(tmp_path, monkeypatch, capsys, flags, named):
    """A usage error (exit status 2) naming the flag, before any engine starts."""
    from capsteer.extraction.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text('{"prompt": "a"}\n')
    with pytest.raises(SystemExit) as info:
        main(["some/model", "--output", "job", *flags])
    assert info.value.code == 2
    assert named in capsys.readouterr().err


def test_a_resumed_job_must_hold_only_this_inputs_ids(tmp_path):
    """Done ids the input does not have mean another input (or rows numbered otherwise):
    resuming would store the same rows again under new ids."""
    from capsteer.extraction.job import check_resumed_ids

    check_resumed_ids(tmp_path, {"1", "3"}, {"1", "3", "4"})
    with pytest.raises(ValueError, match=r"1 request id\(s\) this input does not have \(e.g. '2'\)"):
        check_resumed_ids(tmp_path, {"1", "2"}, {"1", "3"})


def test_a_job_asking_for_a_hook_the_model_lacks_is_refused_before_any_engine(tmp_path):
    """Cohere's parallel block has no resid_mid: the job stops at its spec, naming the
    hook and why, before an engine (and its start-up) is made."""
    from capsteer.capture.spec import SpecError
    from capsteer.demo_model import DemoShape, write_demo_model
    from capsteer.extraction.local import extract

    shape = DemoShape(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                      intermediate_size=96, vocab_size=300)
    model = write_demo_model(tmp_path / "cohere", "cohere", seed=1, shape=shape)
    (tmp_path / "in.jsonl").write_text('{"id": "a", "prompt": "hello"}\n')
    with pytest.raises(SpecError, match="parallel block") as info:
        extract(str(model), tmp_path / "in.jsonl", tmp_path / "job",
                hooks=["resid_pre", "resid_mid"], progress=False)
    assert info.value.field == "capture.hooks.resid_mid"
    assert not (tmp_path / "job").exists()
