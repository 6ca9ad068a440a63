"""blockd.core imports no grpc, torch or cuda (design.md section 1; style habit 2)."""

import subprocess
import sys

FORBIDDEN = ("grpc", "torch", "triton", "cuda", "google.protobuf", "blockd.api", "blockd.server",
             "blockd.pools", "blockd_gpu", "blockd_client")


def test_core_imports_no_grpc_torch_or_cuda() -> None:
    code = (
        "import sys, pkgutil, importlib, blockd.core as c\n"
        "for m in pkgutil.iter_modules(c.__path__):\n"
        "    importlib.import_module('blockd.core.' + m.name)\n"
        "print('\\n'.join(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout.split()
    bad = [m for m in out if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]
    assert bad == []
    assert "blockd.core.manager" in out
