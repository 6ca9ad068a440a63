"""The reference worker: a tiny Llama-style decoder served through blockd.

An application of the client library (``blockd_client``) and the kernels (``blockd_gpu``); it
lives with the other applications so that no library imports it.

- ``model``: ``TinyLlama`` (RMSNorm, RoPE, GQA, SwiGLU; seeded random weights) with a
  contiguous no-cache ``forward`` and a paged ``forward_paged`` over the daemon's pool;
- ``request``: ``Request`` (n samples of a prompt), its ``Sample`` streams and their states;
- ``batch``: one step's kernel metadata (slot mapping, block-table rows, lengths) from the
  session's block tables;
- ``worker``: ``Engine``, continuous batching against the daemon (prefix hits, chunked prefill,
  decode, forks with copy-on-write, fenced releases, preemption and re-admission).

CPU tensors run the kernels' torch twins; CUDA tensors (a CUDA pool) run the Triton kernels.
"""

from blockd_apps.reference.batch import StepBatch, Work
from blockd_apps.reference.model import ModelConfig, TinyLlama
from blockd_apps.reference.request import Request, RequestState, Sample
from blockd_apps.reference.worker import Engine, EngineConfig, EngineStats, default_namespace

__all__ = ["Engine", "EngineConfig", "EngineStats", "ModelConfig", "Request", "RequestState",
           "Sample", "StepBatch", "TinyLlama", "Work", "default_namespace"]
