"""The v1 API contract: committed stubs are fresh, buf lint is clean, everything is documented."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from google.protobuf import descriptor_pb2

REPO_ROOT = Path(__file__).resolve().parent.parent
GEN_PROTO = REPO_ROOT / "tools" / "gen_proto.py"
BUF_LINT = REPO_ROOT / "tools" / "buf_lint.sh"
BUF_UNAVAILABLE = 3  # tools/buf_lint.sh's exit status when buf cannot be found or installed


def _load_gen_proto() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_proto", GEN_PROTO)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen_proto = _load_gen_proto()


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(GEN_PROTO), "--out", str(tmp_path)], check=True)
    for name in gen_proto.GENERATED_FILES:
        committed = gen_proto.DEFAULT_OUT / name
        assert committed.is_file(), f"{committed} is missing: run `make proto`"
        assert committed.read_bytes() == (tmp_path / name).read_bytes(), (
            f"{committed.relative_to(REPO_ROOT)} is stale: run `make proto`"
        )


def test_buf_lint_is_clean() -> None:
    in_ci = os.environ.get("CI") == "true"
    have_buf = (
        bool(os.environ.get("BUF"))
        or (REPO_ROOT / ".tools" / "node_modules" / ".bin" / "buf").exists()
    )
    if not have_buf and not (shutil.which("npm") and shutil.which("node")) and not in_ci:
        pytest.skip("buf lint needs buf ($BUF or .tools/) or node+npm to install it")
    result = subprocess.run(
        ["bash", str(BUF_LINT)], capture_output=True, text=True, timeout=240, check=False
    )
    output = result.stdout + result.stderr
    if result.returncode == BUF_UNAVAILABLE and not in_ci:
        pytest.skip(f"buf could not be installed (offline?):\n{output}")
    assert result.returncode == 0, f"buf lint failed:\n{output}"


def _undocumented(fds: descriptor_pb2.FileDescriptorSet) -> list[str]:
    """Names of services, rpcs, messages, fields, oneofs, enums and values lacking a comment."""
    (file,) = [f for f in fds.file if f.name == gen_proto.PROTO_FILE]
    documented = {
        tuple(loc.path) for loc in file.source_code_info.location if loc.leading_comments.strip()
    }
    required: list[tuple[tuple[int, ...], str]] = []
    fdp = descriptor_pb2.FileDescriptorProto
    dp = descriptor_pb2.DescriptorProto
    edp = descriptor_pb2.EnumDescriptorProto
    sdp = descriptor_pb2.ServiceDescriptorProto

    def add_enum(path: tuple[int, ...], enum: descriptor_pb2.EnumDescriptorProto) -> None:
        required.append((path, f"enum {enum.name}"))
        for i, value in enumerate(enum.value):
            required.append(((*path, edp.VALUE_FIELD_NUMBER, i), f"enum value {value.name}"))

    def add_message(path: tuple[int, ...], msg: descriptor_pb2.DescriptorProto) -> None:
        required.append((path, f"message {msg.name}"))
        for i, field in enumerate(msg.field):
            required.append(((*path, dp.FIELD_FIELD_NUMBER, i), f"field {msg.name}.{field.name}"))
        # proto3 `optional` fields live in synthetic oneofs that have no source of their own.
        synthetic = {f.oneof_index for f in msg.field if f.proto3_optional}
        for i, oneof in enumerate(msg.oneof_decl):
            if i in synthetic:
                continue
            required.append(
                ((*path, dp.ONEOF_DECL_FIELD_NUMBER, i), f"oneof {msg.name}.{oneof.name}")
            )
        for i, nested in enumerate(msg.nested_type):
            add_message((*path, dp.NESTED_TYPE_FIELD_NUMBER, i), nested)
        for i, enum in enumerate(msg.enum_type):
            add_enum((*path, dp.ENUM_TYPE_FIELD_NUMBER, i), enum)

    for i, msg in enumerate(file.message_type):
        add_message((fdp.MESSAGE_TYPE_FIELD_NUMBER, i), msg)
    for i, enum in enumerate(file.enum_type):
        add_enum((fdp.ENUM_TYPE_FIELD_NUMBER, i), enum)
    for i, service in enumerate(file.service):
        path = (fdp.SERVICE_FIELD_NUMBER, i)
        required.append((path, f"service {service.name}"))
        for j, method in enumerate(service.method):
            required.append(((*path, sdp.METHOD_FIELD_NUMBER, j), f"rpc {method.name}"))
    assert len(required) > 100  # the walk really covered the file
    return [name for path, name in required if path not in documented]


def test_every_element_has_a_leading_comment(tmp_path: Path) -> None:
    descriptor_set = tmp_path / "blockd.pb"
    gen_proto.build_descriptor_set(descriptor_set)
    fds = descriptor_pb2.FileDescriptorSet.FromString(descriptor_set.read_bytes())
    missing = _undocumented(fds)
    assert not missing, "missing leading comments in blockd.proto: " + ", ".join(missing)


def test_generated_module_round_trips() -> None:
    from blockd.api.v1 import blockd_pb2, blockd_pb2_grpc

    request = blockd_pb2.StepRequest(
        session_id="s",
        epoch=1,
        step_id=7,
        fence=7,
        operations=[blockd_pb2.Operation(admit=blockd_pb2.AdmitOp(token_ids=[1, 2, 3]))],
    )
    decoded = blockd_pb2.StepRequest.FromString(request.SerializeToString())
    assert decoded == request
    assert decoded.operations[0].WhichOneof("op") == "admit"
    assert list(decoded.operations[0].admit.token_ids) == [1, 2, 3]
    # The module-name rewrite in tools/gen_proto.py makes classes importable (pickle, repr).
    assert type(request).__module__ == "blockd.api.v1.blockd_pb2"
    assert hasattr(blockd_pb2_grpc, "BlockdServiceStub")
    assert hasattr(blockd_pb2_grpc, "BlockdServiceServicer")


def test_operation_and_result_oneofs_correspond() -> None:
    from blockd.api.v1 import blockd_pb2

    ops = blockd_pb2.Operation.DESCRIPTOR.oneofs_by_name["op"].fields
    results = blockd_pb2.OperationResult.DESCRIPTOR.oneofs_by_name["result"].fields
    assert [f.name for f in ops] == [f.name for f in results]
    for op, result in zip(ops, results, strict=True):
        assert op.message_type.name.removesuffix("Op") == result.message_type.name.removesuffix(
            "Result"
        )
