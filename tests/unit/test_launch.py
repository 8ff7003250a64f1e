"""`capsteer serve`'s command line reaches `vllm serve` as vLLM reads it: vLLM's flags in
every spelling keep their meaning, `--additional-config` keeps the user's keys beside
capsteer's section, and the capsteer worker is never silently replaced (vLLM's real
parser, no server started)."""

from __future__ import annotations

import json
import os
import re

import pytest
import yaml

from capsteer.config.cli import load_from_args
from capsteer.config.server import split_config_file
from capsteer.engine_ext.vllm.serve import vllm_serve_args
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
    (["--port", "9", "--model", "m", "--model=n"], ["m", "--port", "9", "--model=n"]),
    (["--port", "9", "--model", "-m"], ["-m", "--port", "9"]),  # a value may start with "-"
])
def test_the_model_comes_first(argv, want):
    assert launch.model_first(argv) == want


@pytest.mark.parametrize("argv", [["--max-model-len", "2048", "m"], ["--port", "9", "--model"]])
def test_a_flag_before_the_model_is_refused_not_misread(argv):
    with pytest.raises(SystemExit, match="give the model first"):
        launch.model_first(argv)


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


# ---- the flag readers: every spelling and edge of `--flag value` / `--flag=value` ----
PORT, HOST, DP = ("--port",), ("--host",), ("--data-parallel-size", "-dp")


@pytest.mark.parametrize(("argv", "names", "want"), [
    (["--port", "9"], PORT, "9"),
    (["--port=9"], PORT, "9"),
    (["--max_model_len", "9"], ("--max-model-len",), "9"),  # vLLM's underscore spelling
    (["-dp", "2"], DP, "2"),
    (["-dp=2"], DP, "2"),
    (["--data_parallel_size", "1", "-dp", "2"], DP, "2"),
    (["--port", "1", "--port=2"], PORT, "2"),  # the last one given, as vLLM reads it
    (["--port", "1", "--port"], PORT, None),  # the last one has no value: none
    (["--port="], PORT, ""),
    (["--host", "-x"], HOST, "-x"),  # a value may start with "-"
    (["--port=a=b"], PORT, "a=b"),
    (["--port.x", "1"], PORT, None),  # a dotted key is another flag
    (["--other", "1"], PORT, None),
    ([], PORT, None),
    # every token is looked at, a watched flag's value too (argparse would refuse these)
    (["--host", "--host", "x"], HOST, "x"),
])
def test_a_flags_value_is_read_as_vllm_reads_it(argv, names, want):
    assert launch._flag_value(argv, names) == want


@pytest.mark.parametrize(("argv", "rest", "value"), [
    (["--vllm-config", "f", "--port", "9"], ["--port", "9"], "f"),
    (["--port", "9", "--vllm-config=f"], ["--port", "9"], "f"),
    (["--vllm_config", "f"], [], "f"),
    (["--vllm-config", "a", "--x", "--vllm-config=b", "--y"], ["--x", "--y"], "b"),
    (["--vllm-config="], [], ""),
    (["--vllm-config", "-f"], [], "-f"),  # a value may start with "-"
    (["--vllm-config.x", "f"], ["--vllm-config.x", "f"], None),
    (["--port", "9"], ["--port", "9"], None),
    # a value is taken with its flag and not read again as a flag
    (["--vllm-config", "--vllm-config", "x"], ["x"], "--vllm-config"),
])
def test_take_flag_removes_the_flag_and_its_value(argv, rest, value):
    given = list(argv)
    assert launch._take_flag(argv, "--vllm-config") == (rest, value)
    assert argv == given  # a new list


def test_take_flag_without_a_value_is_refused():
    with pytest.raises(SystemExit, match="--vllm-config needs a value"):
        launch._take_flag(["--port", "9", "--vllm_config"], "--vllm-config")


@pytest.mark.parametrize(("argv", "rest", "extra"), [
    (["--port", "9"], ["--port", "9"], {}),
    (["--a", "--additional-config", '{"x": 1}', "--b"], ["--a", "--b"], {"x": 1}),
    (["--additional_config={\"x\": 1}", '--additional-config={"y": 2}'], [], {"y": 2}),
    # dotted keys: merged, deep, replace the whole value wherever it stands; the key after
    # the dot is kept as given; values read as JSON, "1k" as 1000, else text
    (["--additional-config.a", "1", '--additional-config={"x": 1}',
      "--additional_config.deep.my_key=2k", "--additional-config.s", "text"],
     [], {"a": 1, "deep": {"my_key": 2000}, "s": "text"}),
    (["--additional-config.a", "1", "--additional-config.a", "2"], [], {"a": 2}),
    (["--additional-config.a", "-1"], [], {"a": -1}),  # a value may start with "-"
    (["--additional-config.a="], [], {"a": ""}),
    (["--additional-configx", "1"], ["--additional-configx", "1"], {}),
    # a value is taken with its flag and not read again as a flag
    (["--additional-config.a", "--additional-config.b", "1"], ["1"],
     {"a": "--additional-config.b"}),
])
def test_take_additional_config(argv, rest, extra):
    assert launch.take_additional_config(argv) == (rest, extra)


@pytest.mark.parametrize(("argv", "match"), [
    (["--port", "9", "--additional_config"], "--additional_config needs a value"),
    (["--additional-config.a"], "--additional-config.a needs a value"),
    (["--additional-config="], "not JSON"),
    (["--additional-config", "[1]"], "must be a JSON object"),
    (["--additional-config.a", "1", "--additional-config.a.b", "2"], "a is not an object"),
])
def test_take_additional_config_refuses(argv, match):
    with pytest.raises(SystemExit, match=match):
        launch.take_additional_config(argv)


@pytest.mark.parametrize(("argv", "named"), [
    (["--data-parallel-rank", "0"], "--data-parallel-rank is not supported"),
    (["--data_parallel_rank=0"], "--data-parallel-rank is not supported"),
    (["-dpe"], "--data-parallel-external-lb is not supported"),
    (["-dpm"], "--data-parallel-multi-port-external-lb is not supported"),
    (["--data-parallel-hybrid-lb"], "--data-parallel-hybrid-lb is not supported"),
    (["-dpr=2"], "--data-parallel-start-rank is not supported"),
    (["--headless"], "--headless is not supported"),
    (["-dpb", "ray"], "--data-parallel-backend ray is not"),
    (["--data_parallel_backend=ray"], "--data-parallel-backend ray is not"),
    (["-dpb=ray"], "--data-parallel-backend ray is not"),
    # every occurrence is judged, not only the last one vLLM reads
    (["-dpb", "ray", "--data-parallel-backend", "mp"], "--data-parallel-backend ray is not"),
    (["-dpb", "mp", "--data-parallel-backend=ray"], "--data-parallel-backend ray is not"),
    (["--port", "9", "-dpb"], "--data-parallel-backend  is not"),  # no value: not mp
    (["--data-parallel-backend="], "--data-parallel-backend  is not"),
    (["-dpb", "-x"], "--data-parallel-backend -x is not"),
    # the first one in the command line is named
    (["--headless", "-dpb", "ray"], "--headless is not"),
    (["-dpb", "ray", "--headless"], "--data-parallel-backend ray is not"),
    # every token is looked at, another flag's value too
    (["--served-model-name", "--headless"], "--headless is not"),
    (["-dp", "2", "--data-parallel-size-local", "1"],
     "--data-parallel-size-local 1 below --data-parallel-size 2"),
    (["--data_parallel_size=4", "-dpl=2"],
     "--data-parallel-size-local 2 below --data-parallel-size 4"),
    (["-dp", "1", "-dp", "4", "-dpl", "2"],
     "--data-parallel-size-local 2 below --data-parallel-size 4"),
])
def test_unsupported_dp_flags_are_refused_by_name(argv, named):
    with pytest.raises(SystemExit, match=re.escape(named)):
        launch.refuse_unsupported_dp(argv)


@pytest.mark.parametrize("argv", [
    [], ["--data-parallel-size", "2"], ["-dpb", "mp"], ["--data-parallel-backend=mp"],
    ["--data_parallel_backend", "mp", "-dpb=mp"],
    ["-dp", "2", "-dpl", "2"], ["-dpl", "1"], ["-dpl", "4"],  # no size: 1
    ["-dp=", "-dpl", "1"], ["-dp", "4", "-dp", "2", "-dpl", "2"],  # the last size
    ["-dp", "2", "-dpl", "x"], ["-dp", "2", "-dpl"],  # not a number: vLLM's to refuse
])
def test_supported_dp_flags_pass(argv):
    launch.refuse_unsupported_dp(argv)


# ---- `_run`: what reaches `vllm serve` (no server started) ----
@pytest.fixture
def serve(monkeypatch: pytest.MonkeyPatch):
    """`capsteer serve ARGV` up to `vllm serve`: returns vLLM's argv and capsteer's settings
    (the process env it sets is put back afterwards)."""
    from capsteer import cli
    from capsteer.config.server import ENV_VAR
    from capsteer.engine_ext.lifeline import LAUNCHER_ENV
    from capsteer.engine_ext.payload import PAYLOAD_KEY_ENV
    from capsteer.engine_ext.vllm import serve
    from capsteer.server.peers import RUNTIME_ENV

    for name in list(os.environ):
        if name.upper().startswith("CAPSTEER_"):
            monkeypatch.delenv(name)
    for name in (ENV_VAR, PAYLOAD_KEY_ENV, LAUNCHER_ENV, RUNTIME_ENV):
        monkeypatch.setenv(name, "placeholder")  # restored after the test
    calls: list[list[str]] = []
    monkeypatch.setattr(serve, "run_vllm_serve", calls.append)

    def run(*argv: str) -> tuple[list[str], dict]:
        assert cli.main(["serve", *argv]) == 0
        return calls[-1], json.loads(os.environ[ENV_VAR])

    return run


def test_serve_gives_vllm_its_share_of_the_config_file(tmp_path, serve):
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"max-model-len": 300, "capture_dir": "/from-file",
                                    "additional-config": {"mine": 5}}))
    for flag in ("--config", "--vllm-config"):  # and its older spelling
        argv, settings = serve("some/model", flag, str(path), "--port", "9")
        assert settings["capture_dir"] == "/from-file"
        args, _ = vllm_serve_args(argv)
        assert args.max_model_len == 300 and args.port == 9
        assert args.additional_config["mine"] == 5
        assert args.additional_config["capsteer"]["capture_dir"] == "/from-file"
    with pytest.raises(SystemExit, match="give one config file"):
        serve("some/model", "--config", str(path), "--vllm-config", str(path))


def test_serve_refuses_a_bad_config_file(tmp_path, serve):
    with pytest.raises(SystemExit, match="config file not found"):
        serve("some/model", "--config", str(tmp_path / "none.yaml"))
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"worker-cls": "my.Worker"}))
    with pytest.raises(SystemExit, match="worker-cls is not supported"):
        serve("some/model", "--config", str(path))


def test_serve_reads_the_config_file_once(tmp_path, serve, monkeypatch):
    """capsteer's settings, their sources and vLLM's keys come from one read of the file
    (one version of it, should it change during start-up)."""
    from capsteer.config import server

    reads: list[object] = []
    load_yaml = server._load_yaml
    monkeypatch.setattr(server, "_load_yaml", lambda path: reads.append(path) or load_yaml(path))
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"max-model-len": 300, "capture_dir": "/from-file"}))
    argv, settings = serve("some/model", "--config", str(path))
    assert len(reads) == 1 and settings["capture_dir"] == "/from-file"
    assert vllm_serve_args(argv)[0].max_model_len == 300
