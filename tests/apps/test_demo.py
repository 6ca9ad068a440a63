"""``blockd demo`` says what it serves: a TinyLlama-shaped model with seeded random weights,
in the printed summary, the plot's title and the JSON beside the plot (a short real run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

RANDOM = "TinyLlama-shaped model with seeded random weights"


def test_the_demo_says_its_weights_are_random(tmp_path: Path) -> None:
    png = tmp_path / "demo.png"
    out = subprocess.run([sys.executable, "-m", "blockd_apps", "demo", "--requests", "3",
                          "--new-tokens", "2", "3", "--no-progress", "--no-check", "--seed", "7",
                          "--out", str(png)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[1].split(None, 1) == ["model", f"4-layer {RANDOM} (seed 7)"]
    data = json.loads(png.with_suffix(".json").read_text())
    assert data["summary"]["model"] == f"4-layer {RANDOM} (seed 7)"
    assert f", 4-layer {RANDOM} (seed 7), pool 144 x 16 tokens" in data["title"]
    assert png.stat().st_size > 0
    # Nowhere the bare name, as if these were TinyLlama's trained weights.
    for text in (out.stdout, data["title"]):
        assert text.replace("TinyLlama-shaped", "").count("TinyLlama") == 0
