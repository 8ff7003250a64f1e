"""`capsteer serve`'s command line reaches `vllm serve` as vLLM reads it: vLLM's flags in
every spelling keep their meaning, `--additional-config` keeps the user's keys beside
capsteer's section, and the capsteer worker is never silently replaced (vLLM's real
parser, no server started)."""

from __future__ import annotations

import pytest
import yaml

from capsteer.config.cli import load_from_args
from capsteer.config.server import split_config_file
from capsteer.engine_ext.adapter import vllm_serve_args
from capsteer.server import launch


def served(argv: list[str], file_tokens: list[str] | None = None):
    """What vLLM's serve parser makes of capsteer's argv for `argv`."""
    args, _ = vllm_serve_args(launch.vllm_argv("some/model", argv, {"capture_dir": "/c"},
                                               file_tokens))
    return args


def vllms_own(argv: list[str]) -> dict:
    """The additional-config stock `vllm serve` reads from the same flags."""
    args, _ = vllm_serve_args(["some/model", *argv])
    return args.additional_config


@pytest.mark.parametrize("flags", [
    ["--additional-config", '{"mine": 1}'],
    ['--additional-config={"mine": 1}'],
    ["--additional_config", '{"mine": 1}'],
    ["--additional-config.mine", "1"],
    ["--additional-config", '{"mine": 0}', "--additional-config.mine=1"],
    # vLLM's own rules, kept: dotted keys replace a whole value wherever they stand, and
    # read "1k" as 1000; the last whole value wins
    ["--additional-config.mine", "1", "--additional-config", '{"other": 2}'],
    ["--additional-config.mine", "1k", "--additional-config.deep.x", "y"],
    ['--additional-config={"other": 2}', '--additional-config={"mine": 1}'],
])
def test_the_users_additional_config_is_what_vllm_reads_beside_capsteers(flags):
    args = served(["--max-model-len", "256", *flags])
    section = args.additional_config.pop("capsteer")
    assert args.additional_config == vllms_own(flags) and "mine" in args.additional_config
    assert section["capture_dir"] == "/c" and section["frontend"] == "server"
    assert args.worker_cls == launch.WORKER_CLS and args.max_model_len == 256


def test_a_config_files_additional_config_comes_before_the_command_lines():
    file_tokens = launch.file_additional_config({"additional-config": {"a": 1, "b": 2},
                                                  "max-model-len": 300})
    assert served([], file_tokens).additional_config["a"] == 1
    args = served(['--additional-config={"c": 4}'], file_tokens)  # the last whole value
    assert "a" not in args.additional_config and args.additional_config["c"] == 4
    keys = {"additional_config.b": 3, "additional-config": '{"a": 1}'}  # dotted, JSON text
    args = served([], launch.file_additional_config(keys))
    assert keys == {} and args.additional_config["b"] == 3 and "a" not in args.additional_config


@pytest.mark.parametrize("flags", [["--worker-cls", "my.Worker"], ["--worker_cls=my.Worker"]])
def test_another_worker_class_is_refused_in_every_spelling(flags):
    with pytest.raises(SystemExit, match=r"--worker-cls my\.Worker is not supported"):
        launch.vllm_argv("m", flags)
    assert served(["--worker-cls", launch.WORKER_CLS]).worker_cls == launch.WORKER_CLS


@pytest.mark.parametrize(("argv", "want"), [
    (["m", "--port", "9"], ["m", "--port", "9"]),
    (["--cpu-defaults", "--capture-dir", "d", "m", "--port", "9"],
     ["m", "--cpu-defaults", "--capture-dir", "d", "--port", "9"]),
    (["--config=f.yaml", "m"], ["m", "--config=f.yaml"]),
    (["--model", "m", "--port", "9"], ["m", "--port", "9"]),
    (["--port", "9", "--model=m"], ["m", "--port", "9"]),
])
def test_the_model_comes_first(argv, want):
    assert launch.model_first(argv) == want


def test_a_flag_before_the_model_is_refused_not_misread():
    with pytest.raises(SystemExit, match="give the model first"):
        launch.model_first(["--max-model-len", "2048", "m"])


def test_one_config_file_holds_vllms_flags_and_capsteers_settings(tmp_path):
    """`--config` is vllm serve's file; capsteer reads its own keys from it and vLLM gets
    the rest, parsed as vLLM parses its own config file."""
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"max-model-len": 300, "enforce-eager": True,
                                    "capture_dir": "/from-file", "capture-budget": "2MiB",
                                    "additional-config": {"mine": 5}}))
    parser = launch.argparse.ArgumentParser()
    launch._add_serve_flags(parser)
    settings = load_from_args(parser.parse_args(["--config", str(path)]))
    assert settings.capture_dir == "/from-file" and settings.capture_budget == 2 << 20
    rest = split_config_file(path)[1]
    tokens = launch.file_additional_config(rest)
    args = served(["--config", launch._vllm_config_file(rest)], tokens)
    assert args.max_model_len == 300 and args.enforce_eager
    assert args.additional_config["mine"] == 5 and "capsteer" in args.additional_config
    # capsteer's keys under `server:` as well; both places at once is ambiguous
    path.write_text(yaml.safe_dump({"server": {"capture_dir": "/s"}, "max-model-len": 300}))
    assert split_config_file(path) == ({"capture_dir": "/s"}, {"max-model-len": 300})
    path.write_text(yaml.safe_dump({"server": {"capture_dir": "/s"}, "capture_dir": "/t"}))
    with pytest.raises(Exception, match="in one place"):
        split_config_file(path)


def test_serve_help_lists_capsteers_flags(capsys):
    from capsteer.cli import main

    assert main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--capture-dir" in out and "--help=GROUP" in out
