"""The gRPC transport of the daemon: authenticate, one ``blockd.runtime`` call, convert."""
