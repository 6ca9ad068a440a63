"""Regenerate the Python stubs of the blockd v1 API from ``proto/`` (``make proto``).

Runs the protoc bundled with the installed grpcio-tools (so the output depends only on that
pinned version) and writes ``blockd_pb2.py``, ``blockd_pb2.pyi`` and ``blockd_pb2_grpc.py``.

protoc names the generated module after the proto's path (``blockd.v1.blockd_pb2``), but the
package lives at ``blockd.api.v1``. Two deterministic rewrites fix that:
- the grpc stub's ``from blockd.v1 import blockd_pb2`` becomes ``from blockd.api.v1 import ...``;
- the module name passed to the descriptor builder in ``blockd_pb2.py`` becomes
  ``blockd.api.v1.blockd_pb2``, so message classes report an importable ``__module__`` (pickling
  and repr depend on it).

Usage: ``python tools/gen_proto.py [--out DIR] [--check]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from importlib import resources
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "proto"
# The proto file, relative to PROTO_ROOT (its path must match its package for buf lint).
PROTO_FILE = "blockd/v1/blockd.proto"
DEFAULT_OUT = REPO_ROOT / "blockd" / "api" / "v1"
GENERATED_FILES = ("blockd_pb2.py", "blockd_pb2.pyi", "blockd_pb2_grpc.py")

_PROTOC_IMPORT = "from blockd.v1 import blockd_pb2 as "
_PACKAGE_IMPORT = "from blockd.api.v1 import blockd_pb2 as "
_PROTOC_MODULE = "'blockd.v1.blockd_pb2'"
_PACKAGE_MODULE = "'blockd.api.v1.blockd_pb2'"


def well_known_types_include() -> Path:
    """The include dir holding google/protobuf/*.proto as bundled with grpcio-tools."""
    return Path(str(resources.files("grpc_tools") / "_proto"))


def run_protoc(args: list[str]) -> None:
    """Run grpcio-tools' protoc with ``-I proto -I <well-known types>`` plus ``args``."""
    from grpc_tools import protoc

    argv = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known_types_include()}",
        *args,
    ]
    rc = protoc.main(argv)
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}: {' '.join(argv[1:])}")


def build_descriptor_set(path: Path) -> None:
    """Write a FileDescriptorSet of the API with source info (comments) to ``path``."""
    run_protoc([f"--descriptor_set_out={path}", "--include_source_info", PROTO_FILE])


def _replace_once(text: str, old: str, new: str, name: str) -> str:
    count = text.count(old)
    if count != 1:
        raise RuntimeError(f"{name}: expected exactly one {old!r} from protoc, found {count}")
    return text.replace(old, new)


def render() -> dict[str, bytes]:
    """Generate the stubs and return ``{file name: final contents}``."""
    with tempfile.TemporaryDirectory(prefix="blockd-proto-") as tmp:
        run_protoc(
            [f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", PROTO_FILE]
        )
        gen_dir = Path(tmp) / Path(PROTO_FILE).parent
        files = {name: (gen_dir / name).read_text(encoding="utf-8") for name in GENERATED_FILES}
    files["blockd_pb2_grpc.py"] = _replace_once(
        files["blockd_pb2_grpc.py"], _PROTOC_IMPORT, _PACKAGE_IMPORT, "blockd_pb2_grpc.py"
    )
    files["blockd_pb2.py"] = _replace_once(
        files["blockd_pb2.py"], _PROTOC_MODULE, _PACKAGE_MODULE, "blockd_pb2.py"
    )
    return {name: text.encode("utf-8") for name, text in files.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help=f"output directory (default: {DEFAULT_OUT.relative_to(REPO_ROOT)})",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if the files in --out differ from a fresh generation",
    )
    args = parser.parse_args(argv)

    files = render()
    if args.check:
        stale = [
            name
            for name, data in files.items()
            if not (args.out / name).is_file() or (args.out / name).read_bytes() != data
        ]
        if stale:
            print(f"stale generated files in {args.out}: {', '.join(stale)}; run `make proto`")
            return 1
        return 0

    args.out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (args.out / name).write_bytes(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
