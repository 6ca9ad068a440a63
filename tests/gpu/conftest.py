"""Test setup for blockd_gpu.

Without a CUDA device the Triton kernels can only run in Triton's interpreter, and Triton reads
TRITON_INTERPRET when a kernel is decorated, so it is set here, at import time, before any test
module imports blockd_gpu's kernels. The Hopper compile test runs in a subprocess without it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Until the package is installed, import it from the source tree (gpu/ is its package root).
_GPU_ROOT = Path(__file__).resolve().parents[2] / "gpu"
try:
    import blockd_gpu  # noqa: F401
except ImportError:
    sys.path.insert(0, str(_GPU_ROOT))

# Helpers shared by the test modules (a plain module next to them, see _kvtest.py).
sys.path.insert(0, str(Path(__file__).resolve().parent))
