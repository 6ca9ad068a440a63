"""blockd_gpu: paged-attention and KV-cache kernels (Triton) with pure-torch twins.

The KV layout contract is documented once, in ``blockd_gpu.layout``. Every public function takes
``backend="auto" | "triton" | "torch"``: Triton for CUDA tensors, the torch twin (also the CPU
execution path) otherwise. This package knows layouts and tensors, never tenants or hashes, and
never imports the daemon (``blockd``) or the client (``blockd_client``).
"""

from .cache_ops import copy_blocks, reshape_and_cache
from .decode import DecodePlan, DecodeWorkspace, paged_decode_attention, plan_decode
from .layout import PAD_SLOT_ID, KvLayout
from .prefill import paged_prefill_attention

__all__ = [
    "KvLayout",
    "PAD_SLOT_ID",
    "DecodePlan",
    "DecodeWorkspace",
    "plan_decode",
    "paged_decode_attention",
    "paged_prefill_attention",
    "reshape_and_cache",
    "copy_blocks",
]
