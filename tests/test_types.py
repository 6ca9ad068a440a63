"""``mypy --strict`` over blockd/core, blockd/runtime and blockd/server (pyproject.toml's
``[tool.mypy]``): the block manager's contract (``blockd.core.contract.KVManager``) is checked
at every call above the core, so a caller using a method outside it fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_mypy_strict_passes_on_core_runtime_and_server() -> None:
    out = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental"], cwd=REPO,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "blockd/runtime" in " ".join(_files()) and "blockd/server" in " ".join(_files())


def _files() -> list[str]:
    import tomllib

    return list(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]["files"])
