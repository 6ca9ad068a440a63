"""blockd's applications, above every library.

The ``blockd`` command (``cli``: serve, demo, demo-core, load), ``blockctl`` (``ctl``), the
demo, the in-process core walk-through, the load generator, the daemon launcher, and the
reference engine (``reference``: a tiny Llama served through the client library). They may
import ``blockd``, ``blockd_client`` and ``blockd_gpu``; none of those may import this package.
"""
