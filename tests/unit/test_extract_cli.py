"""`capsteer extract` takes vLLM's engine flags with vLLM's meanings (`--dtype` is the
model's dtype) and stores activations in `--capture-dtype`."""

from __future__ import annotations

import pytest

from capsteer import cli
from capsteer.extract import build_parser, engine_args

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

    from capsteer.extract import _warn_if_narrower

    with caplog.at_level("WARNING", logger="capsteer.extract"):
        _warn_if_narrower("float32", torch.float32)
        _warn_if_narrower("auto", torch.float32)
        _warn_if_narrower("float32", torch.bfloat16)  # wider: nothing to say
        assert not caplog.records
        _warn_if_narrower("bfloat16", torch.float32)
    assert len(caplog.records) == 1
    assert "stored as bfloat16" in caplog.records[0].getMessage()
