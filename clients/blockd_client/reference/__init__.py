"""A reference worker: a tiny Llama-style decoder served through blockd.

- ``model``: ``TinyLlama`` (RMSNorm, RoPE, GQA, SwiGLU; seeded random weights) with a
  contiguous no-cache ``forward`` and a paged ``forward_paged`` over the daemon's pool;
- ``batch``: one step's kernel metadata (slot mapping, block-table rows, lengths) from the
  session's block tables;
- ``worker``: ``Engine``, continuous batching against the daemon (prefix hits, chunked prefill,
  decode, forks with copy-on-write, fenced releases, preemption and re-admission).

CPU tensors run the kernels' torch twins; CUDA tensors (a CUDA pool) run the Triton kernels.
"""

from blockd_client.reference.batch import StepBatch, Work
from blockd_client.reference.model import ModelConfig, TinyLlama
from blockd_client.reference.worker import (
    Engine,
    EngineConfig,
    EngineStats,
    Request,
    RequestState,
    Sample,
    default_namespace,
)

__all__ = ["Engine", "EngineConfig", "EngineStats", "ModelConfig", "Request", "RequestState",
           "Sample", "StepBatch", "TinyLlama", "Work", "default_namespace"]
