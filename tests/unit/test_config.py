"""Server settings: precedence flag > env > file > default, validation naming field and
source, the launcher -> API process hand-off, and `capsteer config show`."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from capsteer.config import cli
from capsteer.config.server import (
    CONFIG_ENV_VAR,
    ENV_VAR,
    OVERLOAD_POLICIES,
    ConfigError,
    ServerSettings,
    load_settings,
    resolve_settings,
)
from capsteer.config.sizes import parse_size


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No CAPSTEER_* from the machine running the tests leaks into them."""
    for name in list(os.environ):
        if name.upper().startswith("CAPSTEER_"):
            monkeypatch.delenv(name)


def write_yaml(tmp_path: Path, data: object, name: str = "capsteer.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="capsteer")
    cli.add_command(p.add_subparsers(dest="command", required=True))
    return p


def show(*argv: str) -> int:
    args = parser().parse_args(["config", "show", *argv])
    return args.func(args)


# ---- defaults and sizes ----
def test_defaults() -> None:
    s = load_settings()
    assert s == ServerSettings()
    assert (s.capture_dir, s.capture_layout, s.capture_overload) == ("captures", "packed", "block")
    assert s.capture_budget == 4 << 30 and s.capture_wait_timeout == 60.0
    assert s.admin_key is None and s.global_capture is None
    assert s.capture_default == {"hooks": ["resid_post"], "layers": "all", "positions": "all"}
    assert OVERLOAD_POLICIES == ("block", "drop", "reject")


def test_default_capture_spec_is_not_shared() -> None:
    a, b = ServerSettings(), ServerSettings()
    a.capture_default["hooks"].append("x")
    assert b.capture_default["hooks"] == ["resid_post"]


@pytest.mark.parametrize(("text", "size"), [
    ("512MiB", 512 << 20), ("2GB", 2 * 10**9), ("2gib", 2 << 30), ("1048576", 1 << 20),
    (" 1.5 KiB ", 1536), ("10B", 10), ("3K", 3000), (4096, 4096), (8.0, 8)])
def test_parse_size(text: str | int, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "abc", "-1MiB", "1XB", "1.5e9", True])
def test_parse_size_rejects(text: object) -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)  # type: ignore[arg-type]


def test_budget_accepts_sizes_from_every_source(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings({"capture_budget": "512MiB"}).capture_budget == 512 << 20
    assert load_settings({"capture_budget": 4096}).capture_budget == 4096
    path = write_yaml(tmp_path, {"capture_budget": "2GB"})
    assert load_settings(config_file=path).capture_budget == 2 * 10**9
    monkeypatch.setenv("CAPSTEER_CAPTURE_BUDGET", "2GiB")
    assert load_settings(config_file=path).capture_budget == 2 << 30


# ---- precedence ----
def test_precedence_flag_env_file_default(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_yaml(tmp_path, {"capture_dir": "from-file", "capture_layout": "per_file",
                                 "capture_overload": "drop", "steering_dir": "sv-file",
                                 "capture_wait_timeout": 5})
    monkeypatch.setenv("CAPSTEER_CAPTURE_DIR", "from-env")
    monkeypatch.setenv("CAPSTEER_CAPTURE_OVERLOAD", "reject")
    monkeypatch.setenv("CAPSTEER_ADMIN_KEY", "env-key")
    overrides = {"capture_dir": "from-flag", "capture_layout": None, "admin_key": None}
    r = resolve_settings(overrides, path)
    s = r.settings
    assert s.capture_dir == "from-flag"  # flag > env > file
    assert s.capture_overload == "reject"  # env > file
    assert s.admin_key == "env-key"  # env, flag None = not given
    assert s.capture_layout == "per_file"  # file, flag None = not given
    assert s.steering_dir == "sv-file" and s.capture_wait_timeout == 5.0  # file > default
    assert s.capture_budget == 4 << 30  # default
    assert r.sources == {"capture_dir": "flag", "capture_layout": "file",
                         "capture_overload": "env", "capture_digest": "default",
                         "capture_writer": "default", "capture_writer_processes": "default",
                         "capture_io": "default", "capture_budget": "default",
                         "capture_ring": "default", "capture_staging_rows": "default",
                         "capture_wait_timeout": "file", "plain_graphs": "default",
                         "stack_room": "default", "steering_dir": "file",
                         "readers_dir": "default", "admin_key": "env", "capture_default": "default",
                         "global_capture": "default"}
    assert r.config_file == path


def test_env_is_case_insensitive_and_empty_is_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("capsteer_capture_layout", "per_file")
    monkeypatch.setenv("CAPSTEER_ADMIN_KEY", "")
    s = load_settings()
    assert s.capture_layout == "per_file" and s.admin_key is None


def test_capture_default_from_env_json(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = {"hooks": ["resid_post", "attn_out"], "layers": [0, 1], "positions": "prompt"}
    monkeypatch.setenv("CAPSTEER_CAPTURE_DEFAULT", json.dumps(spec))
    assert load_settings().capture_default == spec


def test_capture_default_env_not_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAPSTEER_CAPTURE_DEFAULT", "{hooks")
    with pytest.raises(ConfigError, match=r"capture_default .*env CAPSTEER_CAPTURE_DEFAULT"):
        load_settings()


def test_global_capture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_yaml(tmp_path, {"global_capture": "resid_post@all"})
    assert load_settings(config_file=path).global_capture == "resid_post@all"
    monkeypatch.setenv("CAPSTEER_GLOBAL_CAPTURE", "resid_post@0")
    assert load_settings(config_file=path).global_capture == "resid_post@0"
    assert load_settings({"global_capture": "x"}, path).global_capture == "x"
    with pytest.raises(ConfigError, match=r"global_capture \(from flag --global-capture\)"):
        load_settings({"global_capture": "  "})


# ---- the YAML file ----
def test_server_section(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {"server": {"capture_dir": "d", "capture_budget": "1MiB"}})
    s = load_settings(config_file=path)
    assert (s.capture_dir, s.capture_budget) == ("d", 1 << 20)


def test_dashed_keys_and_empty_file(tmp_path: Path) -> None:
    assert load_settings(config_file=write_yaml(tmp_path, {"capture-dir": "d"})).capture_dir == "d"
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_settings(config_file=empty) == ServerSettings()


def test_config_file_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CONFIG_ENV_VAR, str(write_yaml(tmp_path, {"steering_dir": "a"})))
    assert load_settings().steering_dir == "a"
    other = write_yaml(tmp_path, {"steering_dir": "b"}, "other.yaml")
    assert load_settings(config_file=other).steering_dir == "b"  # explicit file wins


@pytest.mark.parametrize("data", [{"capture_dri": "x"}, {"server": {"capture_dri": "x"}}])
def test_unknown_key_in_file(tmp_path: Path, data: dict) -> None:
    with pytest.raises(ConfigError, match="unknown key") as info:
        load_settings(config_file=write_yaml(tmp_path, data))
    assert "capture_dri" in str(info.value)
    assert "valid keys: capture_dir, capture_layout" in str(info.value)


@pytest.mark.parametrize(("text", "match"), [
    ("- a\n- b\n", "expected a mapping"),
    ("server: {capture_dir: a}\nworker: {}\n", "unknown top-level"),
    ("capture_dir: [unclosed\n", "cannot read"),
])
def test_bad_files(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_settings(config_file=path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_settings(config_file=tmp_path / "nope.yaml")


# ---- invalid values name field and source ----
BAD = [("capture_layout", "sideways", "must be one of packed, per_file"),
       ("capture_overload", "explode", "must be one of block, drop, reject"),
       ("capture_budget", "lots", "not a size"),
       ("capture_budget", "0", "must be a positive size"),
       ("capture_wait_timeout", "-1", "positive, finite"),
       ("capture_wait_timeout", "soon", "valid number")]


@pytest.mark.parametrize(("field", "value", "reason"), BAD)
def test_invalid_from_flag(field: str, value: str, reason: str) -> None:
    flag = "--" + field.replace("_", "-")
    with pytest.raises(ConfigError, match=rf"invalid {field} \(from flag {flag}\): .*{reason}"):
        load_settings({field: value})


@pytest.mark.parametrize(("field", "value", "reason"), BAD)
def test_invalid_from_env(field: str, value: str, reason: str,
                          monkeypatch: pytest.MonkeyPatch) -> None:
    var = "CAPSTEER_" + field.upper()
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=rf"invalid {field} \(from env {var}\): .*{reason}"):
        load_settings()


@pytest.mark.parametrize(("field", "value", "reason"), BAD)
def test_invalid_from_file(field: str, value: str, reason: str, tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {field: value})
    where = re.escape(f"(from file {path})")
    with pytest.raises(ConfigError, match=rf"invalid {field} {where}: .*{reason}"):
        load_settings(config_file=path)


def test_valid_flag_hides_invalid_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAPSTEER_CAPTURE_LAYOUT", "sideways")
    assert load_settings({"capture_layout": "per_file"}).capture_layout == "per_file"


def test_several_errors_in_one_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAPSTEER_CAPTURE_OVERLOAD", "explode")
    with pytest.raises(ConfigError) as info:
        load_settings({"capture_layout": "sideways"})
    assert "capture_layout (from flag" in str(info.value)
    assert "capture_overload (from env" in str(info.value)


def test_admin_key_never_echoed() -> None:
    with pytest.raises(ConfigError, match="admin_key") as info:
        load_settings({"admin_key": 12345})
    assert "12345" not in str(info.value)
    with pytest.raises(ConfigError, match="must not be empty"):
        load_settings({"admin_key": ""})


def test_unknown_override() -> None:
    with pytest.raises(ConfigError, match=r"unknown setting.*capture_dri"):
        load_settings({"capture_dri": "x"})


def test_config_error_is_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


def test_frozen() -> None:
    with pytest.raises(ValueError):
        ServerSettings().capture_dir = "x"  # type: ignore[misc]


# ---- launcher -> API process ----
def test_env_round_trip_ignores_api_process_env(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_yaml(tmp_path, {"capture_dir": "file-dir"})
    monkeypatch.setenv("CAPSTEER_CAPTURE_OVERLOAD", "drop")
    launched = load_settings({"capture_budget": "3MiB", "admin_key": "k",
                              "global_capture": "resid_post"}, path)
    monkeypatch.setenv(ENV_VAR, launched.to_env())
    # the API process sees other CAPSTEER_* values and a different file: the blob still wins
    monkeypatch.setenv("CAPSTEER_CAPTURE_OVERLOAD", "reject")
    monkeypatch.setenv("CAPSTEER_CAPTURE_DIR", "elsewhere")
    monkeypatch.setenv("CAPSTEER_CAPTURE_BUDGET", "1")
    monkeypatch.setenv(CONFIG_ENV_VAR, str(write_yaml(tmp_path, {"steering_dir": "z"}, "o.yaml")))
    restored = ServerSettings.from_env()
    assert restored == launched
    assert (restored.capture_dir, restored.capture_overload) == ("file-dir", "drop")
    assert (restored.capture_budget, restored.admin_key) == (3 << 20, "k")


def test_from_env_ignores_unknown_keys_and_validates(monkeypatch: pytest.MonkeyPatch) -> None:
    blob = json.loads(ServerSettings().to_env())
    monkeypatch.setenv(ENV_VAR, json.dumps({**blob, "from_a_newer_launcher": 1,
                                            "capture_layout": "per_file"}))
    assert ServerSettings.from_env().capture_layout == "per_file"
    monkeypatch.setenv(ENV_VAR, json.dumps({**blob, "capture_layout": "sideways"}))
    with pytest.raises(ValueError, match="capture_layout"):
        ServerSettings.from_env()


def test_from_env_without_blob_resolves_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAPSTEER_STEERING_DIR", "sv")
    assert ServerSettings.from_env().steering_dir == "sv"


def test_worker_config() -> None:
    wc = load_settings({"capture_dir": "caps", "capture_budget": "1KiB",
                        "capture_overload": "drop"}).worker_config()
    assert wc == {"capture_dir": os.path.abspath("caps"), "capture_budget": 1024,
                  "capture_overload": "drop", "readers_dir": os.path.abspath("readers"),
                  "readout_dir": os.path.join(os.path.abspath("caps"), ".readouts"),
                  # the workers read the vectors that requests name from the same directory
                  "steering_dir": os.path.abspath("steering-vectors")}
    blake = ServerSettings(capture_digest="blake3").worker_config()
    assert blake["capture_digest"] == "blake3"  # the workers' writer records it
    assert "capture_io" not in wc  # buffered: the workers' default
    assert load_settings({"capture_io": "direct"}).worker_config()["capture_io"] == "direct"
    with pytest.raises(ConfigError, match="capture_io"):
        load_settings({"capture_io": "odirect"})
    threads = ServerSettings(capture_writer="threads").worker_config()
    assert threads["capture_writer"] == "threads"  # the workers publish in-process
    with pytest.raises(ConfigError, match="capture_writer"):
        load_settings({"capture_writer": "fork"})


def test_capture_ring_reaches_the_workers_as_bytes(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from capsteer.capture.writer.budget import DEFAULT_RING_BYTES

    assert ServerSettings().capture_ring == DEFAULT_RING_BYTES
    assert load_settings(config_file=write_yaml(tmp_path, {"capture_ring": "64MiB"})) \
        .capture_ring == 64 << 20
    monkeypatch.setenv("CAPSTEER_CAPTURE_RING", "2GiB")
    assert load_settings().capture_ring == 2 << 30
    monkeypatch.delenv("CAPSTEER_CAPTURE_RING")
    assert "capture_ring_bytes" not in ServerSettings().worker_config()  # the workers' default
    small = load_settings({"capture_ring": "256MiB"}).worker_config()
    assert small["capture_ring_bytes"] == 256 << 20
    with pytest.raises(ConfigError, match=r"capture_ring.*at least 1MiB"):
        load_settings({"capture_ring": "64KiB"})
    with pytest.raises(ConfigError, match="capture_ring"):
        load_settings({"capture_ring": "lots"})
    with pytest.raises(ConfigError, match=r"capture_ring.*writer processes"):
        load_settings({"capture_ring": "256MiB", "capture_writer": "threads"})


def test_writer_processes_reach_the_workers_only_where_they_can_serve() -> None:
    assert "capture_writer_processes" not in ServerSettings().worker_config()  # auto
    two = load_settings({"capture_writer_processes": "2"}).worker_config()
    assert two["capture_writer_processes"] == 2
    one = load_settings({"capture_writer_processes": 1, "capture_overload": "drop"})
    assert one.worker_config()["capture_writer_processes"] == 1
    with pytest.raises(ConfigError, match=r"capture_writer_processes.*at least 1"):
        load_settings({"capture_writer_processes": 0})
    with pytest.raises(ConfigError, match=r"capture_writer_processes.*split the budget"):
        load_settings({"capture_writer_processes": 2, "capture_overload": "reject"})
    with pytest.raises(ConfigError, match=r"capture_writer_processes.*capture_writer process"):
        load_settings({"capture_writer_processes": 2, "capture_writer": "threads"})


# ---- flags and `capsteer config show` ----
def test_capture_staging_rows_reach_the_workers(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """--capture-staging-rows (GPU rows for one step's captures) is sent as the workers'
    `staging_rows` only when given; the workers' default (4 x max_num_batched_tokens)
    stays theirs."""
    assert ServerSettings().capture_staging_rows is None
    assert "staging_rows" not in ServerSettings().worker_config()
    assert load_settings({"capture_staging_rows": 73728}).worker_config()["staging_rows"] == 73728
    assert load_settings(config_file=write_yaml(tmp_path, {"capture_staging_rows": 4096})) \
        .capture_staging_rows == 4096
    monkeypatch.setenv("CAPSTEER_CAPTURE_STAGING_ROWS", "9000")
    assert load_settings().capture_staging_rows == 9000
    for bad in (0, -5, "lots", True):
        with pytest.raises(ConfigError, match="capture_staging_rows"):
            load_settings({"capture_staging_rows": bad})
    p = argparse.ArgumentParser()
    cli.add_server_flags(p)
    args = p.parse_args(["--capture-staging-rows", "50000"])
    assert cli.overrides_from_args(args) == {"capture_staging_rows": 50000}


def test_server_flags_shared_definition() -> None:
    flags = {f.flag: f for f in cli.SERVER_FLAGS}
    assert list(flags) == ["--config", "--capture-dir", "--capture-layout", "--capture-overload",
                           "--capture-digest", "--capture-writer", "--capture-writer-processes",
                           "--capture-io",
                           "--capture-budget", "--capture-ring", "--capture-staging-rows",
                           "--capture-wait-timeout", "--plain-graphs", "--stack-room",
                           "--steering-dir", "--readers-dir",
                           "--admin-key", "--global-capture"]
    assert flags["--capture-layout"].choices == ("packed", "per_file")
    assert flags["--capture-overload"].choices == OVERLOAD_POLICIES
    assert flags["--capture-digest"].choices == ("sha256", "blake3")
    assert flags["--plain-graphs"].choices == ("on", "off")
    assert flags["--config"].field is None
    assert all(f.field in ServerSettings.model_fields for f in cli.SERVER_FLAGS if f.field)
    assert all(f.help for f in cli.SERVER_FLAGS)


@pytest.mark.parametrize("field", ["plain_graphs", "stack_room"])
def test_on_off_flags_reach_the_worker_config(field: str) -> None:
    p = argparse.ArgumentParser()
    cli.add_server_flags(p)
    flag = "--" + field.replace("_", "-")
    off = load_settings(cli.overrides_from_args(p.parse_args([flag, "off"])))
    assert getattr(off, field) is False and off.worker_config()[field] is False
    on = load_settings(cli.overrides_from_args(p.parse_args([flag, "on"])))
    assert getattr(on, field) is True and field not in on.worker_config()  # the default


def test_flags_default_to_none_and_become_overrides() -> None:
    p = argparse.ArgumentParser()
    cli.add_server_flags(p)
    args = p.parse_args([])
    assert all(getattr(args, f.dest) is None for f in cli.SERVER_FLAGS)
    assert cli.overrides_from_args(args) == {}
    args = p.parse_args(["--capture-dir", "d", "--capture-wait-timeout", "2.5",
                         "--capture-layout", "per_file", "--config", "x.yaml"])
    assert cli.overrides_from_args(args) == {"capture_dir": "d", "capture_wait_timeout": 2.5,
                                             "capture_layout": "per_file"}
    with pytest.raises(SystemExit):
        p.parse_args(["--capture-overload", "explode"])


def test_load_from_args(tmp_path: Path) -> None:
    p = argparse.ArgumentParser()
    cli.add_server_flags(p)
    path = write_yaml(tmp_path, {"capture_dir": "file", "steering_dir": "sv"})
    s = cli.load_from_args(p.parse_args(["--config", str(path), "--capture-dir", "flag"]))
    assert (s.capture_dir, s.steering_dir) == ("flag", "sv")


def test_a_shared_file_is_read_once_and_split(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """`--config` (vllm serve's file too): capsteer's keys are settings, the rest is vLLM's,
    from one read; $CAPSTEER_CONFIG is capsteer's alone (no vLLM keys, strays refused)."""
    from capsteer.config import server

    reads: list[object] = []
    load_yaml = server._load_yaml
    monkeypatch.setattr(server, "_load_yaml", lambda path: reads.append(path) or load_yaml(path))
    path = write_yaml(tmp_path, {"capture_dir": "file", "max-model-len": 300})
    r = resolve_settings({"steering_dir": "flag"}, path, shared=True)
    assert len(reads) == 1
    assert (r.settings.capture_dir, r.settings.steering_dir) == ("file", "flag")
    assert r.sources["capture_dir"] == "file" and r.vllm_keys == {"max-model-len": 300}
    own = write_yaml(tmp_path, {"capture_dir": "x"}, name="own.yaml")
    assert resolve_settings(config_file=own).vllm_keys == {}
    monkeypatch.setenv(CONFIG_ENV_VAR, str(path))
    with pytest.raises(ConfigError, match="unknown key"):
        resolve_settings(shared=True)
    with pytest.raises(ConfigError, match="unknown key"):  # constructed directly
        ServerSettings()


def test_config_show_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                          capsys: pytest.CaptureFixture[str]) -> None:
    path = write_yaml(tmp_path, {"server": {"capture_dir": "file-dir", "capture_layout": "per_file"}})
    monkeypatch.setenv("CAPSTEER_ADMIN_KEY", "s3cret")
    monkeypatch.setenv("CAPSTEER_CAPTURE_LAYOUT", "packed")
    assert show("--config", str(path), "--capture-budget", "2MiB") == 0
    out = capsys.readouterr().out
    assert "s3cret" not in out
    lines = out.splitlines()
    assert f"config file: {path}" in lines[0]
    assert "capture_dir: file-dir  # file" in lines
    assert "capture_layout: packed  # env" in lines
    assert "capture_budget: 2097152  # flag" in lines
    assert "capture_wait_timeout: 60.0  # default" in lines
    assert "admin_key: '***'  # env" in lines
    data = yaml.safe_load(out)  # still loads as a config file
    assert data["admin_key"] == "***" and data["capture_default"]["hooks"] == ["resid_post"]
    assert set(data) == set(ServerSettings.model_fields)


def test_config_show_json(monkeypatch: pytest.MonkeyPatch,
                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CAPSTEER_CAPTURE_OVERLOAD", "drop")
    assert show("--format", "json", "--admin-key", "k", "--global-capture", "resid_post") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config_file"] is None
    assert out["settings"]["admin_key"] == "***"
    assert out["settings"]["capture_overload"] == "drop"
    assert out["settings"]["global_capture"] == "resid_post"
    assert out["sources"]["admin_key"] == "flag"
    assert out["sources"]["capture_overload"] == "env"
    assert out["sources"]["capture_dir"] == "default"


def test_config_show_no_admin_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert show("--format", "json") == 0
    assert json.loads(capsys.readouterr().out)["settings"]["admin_key"] is None


def test_config_show_reports_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_yaml(tmp_path, {"capture_overload": "explode"})
    assert show("--config", str(path)) == 2
    err = capsys.readouterr().err
    assert f"invalid capture_overload (from file {path})" in err


def test_sizes_parse_without_pydantic_settings() -> None:
    """`capsteer extract` and bench/storage.py parse sizes on GPU hosts that carry only
    vLLM's dependencies (no pydantic-settings): the parser must not need it."""
    code = ("import sys; sys.modules['pydantic_settings'] = None; "
            "from capsteer.config.sizes import parse_size; print(parse_size('4GiB'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(4 << 30)
