"""The gRPC daemon: converts protobuf to core calls and core errors to status codes."""
