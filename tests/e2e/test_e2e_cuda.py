"""On a GPU: the same engine with the Triton kernels over the daemon's CUDA pool.

The model lives on the GPU, the daemon's pool is CUDA VMM memory mapped into this process, the
block tables are on the device, and ``backend="auto"`` picks the Triton kernels. Every generated
position is compared with the contiguous reference (SDPA on the GPU), fp32, atol 1e-4 (the
kernels use IEEE fp32 dots for an fp32 cache, never tf32). Skipped without a usable device;
``scripts/gpu_check.sh`` runs it with the other ``gpu`` tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from e2e_support import (
    MODEL_CONFIG,
    assert_matches_reference,
    run_engine,
    shared_prompt_workload,
    start_daemon,
)

from blockd_apps.reference import TinyLlama

pytestmark = pytest.mark.gpu


def cuda_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    from blockd.pools.cuda import cuda_unavailable_reason

    return cuda_unavailable_reason()


@pytest.mark.skipif(cuda_reason() is not None, reason=str(cuda_reason()))
@pytest.mark.parametrize("num_blocks", [128, 24], ids=["roomy", "tight"])
def test_triton_kernels_on_the_cuda_pool_match_the_reference(num_blocks: int,
                                                             tmp_path: Path) -> None:
    model = TinyLlama(MODEL_CONFIG, device="cuda")
    with start_daemon(tmp_path, num_blocks, extra={"pool": {"backend": "cuda"}}) as d:
        e, states, stats = run_engine(d, "acme", model, shared_prompt_workload(),
                                      max_prefill_tokens=8)
    assert e.kv_caches[0][0].is_cuda
    assert_matches_reference(model, states)
    assert e.stats.hit_tokens > 0 and stats.cow_copies_total > 0
    if num_blocks == 24:
        assert e.stats.preemptions > 0

