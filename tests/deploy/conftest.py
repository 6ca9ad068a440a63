"""Fixtures for the deployment tests: rendered overlays and a live daemon."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
# The daemon launcher is shared with the server tests; the helpers of this directory.
sys.path.insert(0, str(HERE.parent / "server"))
sys.path.insert(0, str(HERE))

from daemon_proc import Daemon, start  # noqa: E402
from deploy_support import KUSTOMIZATIONS, render  # noqa: E402

_rendered: dict[str, list[dict[str, Any]]] = {}


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict[str, Any]]]:
    """name -> the rendered manifests of that kustomization (rendered once per session)."""
    for name in KUSTOMIZATIONS:
        if name not in _rendered:
            _rendered[name] = render(name)
    return _rendered


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = start(tmp_path_factory.mktemp("blockd"))
    yield d
    d.stop()
