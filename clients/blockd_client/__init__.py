"""blockd's worker-side client library (import name ``blockd_client``).

Of the daemon's package it depends only on the generated API stubs (``blockd.api.v1``), the
wire contract (``blockd.wire``: layout names, the handle header, the fence page) and the
cuda-python checks (``blockd.cudadrv``, for the CUDA pool only); and on ``blockd_gpu``:

- ``Client`` / ``AsyncClient``: a channel with deadlines and retries on UNAVAILABLE (one call
  loop, ``retry``);
- ``Client.attach(tenant, layout)`` -> ``Session``: the pool mapped zero-copy (``PoolView``),
  local block tables (``BlockTables``), ``step(ops)``, ``complete_on_stream(fence)`` (the
  fence written in the worker's CUDA stream order, ``fences``; at once on CPU tensors) or
  ``complete(fence)`` (now: the host knows the work is done);
- ``requests``: builders for operations and namespaces;
- ``BlockdError`` / ``EpochChanged``.
"""

from blockd_client.aio import AsyncClient, AsyncSession
from blockd_client.client import Client, Session
from blockd_client.errors import BlockdError, EpochChanged
from blockd_client.session import StepOutcome

__all__ = ["AsyncClient", "AsyncSession", "BlockdError", "Client", "EpochChanged", "Session",
           "StepOutcome"]
