"""blockd_gpu imports neither the daemon nor the client, and imports cleanly without a GPU,
without TRITON_INTERPRET and without loading Triton (kernels are imported on first use)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

GPU_ROOT = Path(__file__).resolve().parents[2] / "gpu"

PROBE = """
import json, sys
import blockd_gpu
import blockd_gpu.layout, blockd_gpu.validate, blockd_gpu.reference
print(json.dumps(sorted(sys.modules)))
"""


def run(code: str, **env_overrides: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(GPU_ROOT), env.get("PYTHONPATH")]))
    env.update(env_overrides)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)


def test_never_imports_daemon_or_client_and_loads_triton_lazily():
    proc = run(PROBE)
    assert proc.returncode == 0, proc.stderr
    modules = json.loads(proc.stdout.strip().splitlines()[-1])
    forbidden = [m for m in modules if m.split(".")[0] in ("blockd", "blockd_client")]
    assert forbidden == []
    assert "triton" not in modules


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
