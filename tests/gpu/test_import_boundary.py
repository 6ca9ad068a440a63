"""blockd_gpu imports neither the daemon nor the client (of blockd only the pure contract
``blockd.wire``), and imports cleanly without a GPU, without TRITON_INTERPRET and without
loading Triton (kernels are imported on first use). ``layout`` is pure data: it never imports
``validate`` (which imports it)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GPU_ROOT = REPO / "gpu"
#: The only modules of the blockd distribution's daemon package blockd_gpu may load.
ALLOWED_BLOCKD = {"blockd", "blockd.wire"}

PROBE = """
import json, sys
import blockd_gpu
import blockd_gpu.layout, blockd_gpu.validate, blockd_gpu.reference
print(json.dumps(sorted(sys.modules)))
"""


def run(code: str, **env_overrides: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(GPU_ROOT), str(REPO),
                                                      env.get("PYTHONPATH")]))
    env.update(env_overrides)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)


def test_never_imports_daemon_or_client_and_loads_triton_lazily():
    proc = run(PROBE)
    assert proc.returncode == 0, proc.stderr
    modules = json.loads(proc.stdout.strip().splitlines()[-1])
    forbidden = [m for m in modules if m.split(".")[0] == "blockd_client"
                 or (m.split(".")[0] == "blockd" and m not in ALLOWED_BLOCKD)]
    assert forbidden == []
    assert "blockd.wire" in modules  # the layout vocabulary comes from the one contract
    assert not {"triton", "grpc", "google.protobuf"} & set(modules)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (relative imports resolved in blockd_gpu)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = "blockd_gpu." * bool(node.level) + (node.module or "")
            out |= {base} | {f"{base}.{a.name}".replace("..", ".") for a in node.names}
    return out


def test_layout_is_pure_data_and_never_imports_validate():
    layout = _imports(GPU_ROOT / "blockd_gpu" / "layout.py")
    assert not {m for m in layout if m.startswith("blockd_gpu.validate")}
    assert "blockd_gpu.layout" in _imports(GPU_ROOT / "blockd_gpu" / "validate.py")


def test_triton_backend_on_cpu_without_interpreter_is_a_clear_error():
    code = """
import torch, blockd_gpu as bg
try:
    bg.copy_blocks(torch.zeros(1, 2, 2, 8, 1, 16), torch.tensor([[0, 1]]), backend="triton")
except RuntimeError as e:
    print("ERR", e)
bg.copy_blocks(torch.zeros(1, 2, 2, 8, 1, 16), torch.tensor([[0, 1]]))  # auto: torch twin
print("OK")
"""
    proc = run(code)
    assert proc.returncode == 0, proc.stderr
    assert "ERR backend='triton' on CPU tensors needs Triton's interpreter" in proc.stdout
    assert proc.stdout.strip().endswith("OK")
