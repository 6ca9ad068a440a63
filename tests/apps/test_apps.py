"""The applications package (``apps/blockd_apps``) sits above every library, and its commands
are wired.

The layering is read from the sources with ``ast``, so an import inside a function (the CLI's
lazy ones, say) counts as much as one at the top of a module.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def imported_packages(path: Path) -> set[str]:
    """Top-level package of every absolute import in ``path``."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize(("library", "forbidden"), [
    ("blockd", {"blockd_client", "blockd_apps"}),
    ("clients/blockd_client", {"blockd_apps"}),
    ("gpu/blockd_gpu", {"blockd_apps"}),
], ids=["daemon", "client", "kernels"])
def test_no_library_imports_an_application(library: str, forbidden: set[str]) -> None:
    """The daemon also never imports the client library: the demo and the load generator,
    which need both, are applications."""
    files = sorted((ROOT / library).rglob("*.py"))
    assert files
    bad = [f"{p.relative_to(ROOT)}: {sorted(hits)}" for p in files
           if (hits := imported_packages(p) & forbidden)]
    assert not bad, "\n".join(bad)


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
