"""The applications package's commands are wired (``apps/blockd_apps``). That it sits above
every library is checked with the rest of the layout in ``tests/test_architecture.py``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_python_m_blockd_apps_is_the_blockd_command() -> None:
    out = subprocess.run([sys.executable, "-m", "blockd_apps", "--help"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert out.startswith("usage: blockd ")
    for command in ("serve", "demo", "demo-core", "load"):
        assert command in out


@pytest.mark.parametrize("script", ["blockd", "blockctl"])
def test_console_scripts_run(script: str) -> None:
    exe = Path(sys.executable).parent / script
    if not exe.exists():
        pytest.skip(f"{script}: not installed next to {sys.executable}")
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    assert out.startswith(f"usage: {script} ")


def test_demo_core_walks_the_lifecycle_through_the_public_api() -> None:
    from blockd_apps import core_demo

    lines: list[str] = []
    core_demo.run(say=lines.append)
    assert any("now have refcount 2" in line for line in lines)  # the prefix hit shares
    assert "copy-on-write CopyOp" in "\n".join(lines)
    assert lines[-1] == "invariants hold"
