"""blockd v1 API stubs, generated from proto/blockd/v1/blockd.proto by `make proto`.

The modules below are generated: never edit them by hand.
"""

from blockd.api.v1 import blockd_pb2, blockd_pb2_grpc

__all__ = ["blockd_pb2", "blockd_pb2_grpc"]
