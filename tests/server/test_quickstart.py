"""docs/quickstart.md, executed: every `bash` and `python` block runs in order from one
working directory (Python blocks in one shared namespace), against the real server the
page starts, so the page a researcher follows cannot rot."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from capsteer.capture.sharded import read_sharded
from capsteer.server.process import ManagedServer, free_port

pytestmark = [pytest.mark.server, pytest.mark.uses_engine("quickstart")]
QUICKSTART = Path(__file__).resolve().parents[2] / "docs" / "quickstart.md"
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.M | re.S)


def blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of every fenced block, in page order."""
    return [(m.group(1), m.group(2)) for m in BLOCK.finditer(text)]


def test_quickstart_runs_as_written(tmp_path, engine_pool, monkeypatch):
    engine_pool.close()  # the page starts its own server and extraction engine
    port = free_port()
    runnable = [(lang, code.replace("8000", str(port)))
                for lang, code in blocks(QUICKSTART.read_text()) if lang in ("bash", "python")]
    assert [lang for lang, _ in runnable].count("python") >= 5
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("CAPSTEER_CAPTURE_DIR", None)
    monkeypatch.delenv("CAPSTEER_CAPTURE_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "quickstart"}
    outputs: list[str] = []
    server = None
    try:
        for n, (lang, code) in enumerate(runnable):
            if lang == "python":
                exec(compile(code, f"{QUICKSTART}:block{n}", "exec"), namespace)
                continue
            head, serve = _split_serve(code)
            if head.strip():
                run = subprocess.run(["bash", "-euo", "pipefail", "-c", head], cwd=tmp_path,
                                     env=env, capture_output=True, text=True, timeout=600)
                assert run.returncode == 0, f"{head}\n{run.stdout[-2000:]}{run.stderr[-3000:]}"
                outputs.append(run.stdout)
            if serve:
                server = ManagedServer(["bash", "-c", serve], cwd=tmp_path, env=env,
                                       url=f"http://127.0.0.1:{port}",
                                       log_path=tmp_path / "serve.log")
    finally:
        if server is not None:
            server.close()

    # What each step promised, checked on what it left behind.
    assert server is not None, "the page never started the server"
    curl = next(json.loads(o) for o in outputs if '"capture_results"' in o)
    assert curl["capture_results"]["status"] == "ok"
    cap = namespace["cap"]
    assert cap[("resid_post", 2)].shape == (len(cap.positions), 128)
    vector = namespace["vector"]
    assert vector.shape == (128,) and float(vector.norm()) > 0
    assert namespace["plain"] != namespace["steered"], "the steering vector changed nothing"
    job = read_sharded(tmp_path / "runs" / "job")
    assert sorted(job.ids()) == sorted(f"p{i}" for i in range(48))
    assert len(namespace["rows"]) == sum(int(e["row_count"]) for e in job.index)
    assert (tmp_path / "runs" / "job-sae" / "dataset_info.json").exists()
    assert namespace["trainer"].n_training_steps > 0
    assert isinstance(namespace["sae"].W_enc, torch.Tensor)


def _split_serve(code: str) -> tuple[str, str | None]:
    """A block's commands before its `capsteer serve` line, and that line (run in the
    background: it serves until the test ends)."""
    lines = code.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("capsteer serve"):
            assert i == len(lines) - 1, "capsteer serve must end its block"
            return "\n".join(lines[:i]), line
    return code, None
