"""blockd's worker-side client library (import name ``blockd_client``).

It depends only on the generated API stubs (``blockd.api.v1``) and ``blockd_gpu``.
"""
