"""Versioned wire API of blockd: generated protobuf/gRPC stubs (see proto/ and tools/gen_proto.py)."""
