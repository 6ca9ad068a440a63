"""The daemon beyond the core: step application, sessions, crash recovery, events, tenants.

Between ``blockd.core`` (pure policy) and ``blockd.server`` (the gRPC transport): it speaks
protobuf messages (``blockd.api.v1.blockd_pb2``) but never imports grpc. ``daemon.Daemon`` is
the composition root; see its module docstring.
"""
