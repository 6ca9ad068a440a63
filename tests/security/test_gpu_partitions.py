"""Dedicated partitions on the cuda pool: each its own VMM allocation, exported as its own fd.

Needs a GPU (``scripts/gpu_check.sh`` runs it with ``-m gpu``; it skips with the reason
elsewhere). A worker's view of a dedicated partition is written with a marker; the shared
region's allocation, read block by block through the daemon's side, holds none of it, and
the two handles name different allocations of different sizes.
"""

from __future__ import annotations

import os

import pytest

from blockd.core.spec import PoolSpec
from blockd.pools.fences import FencePage
from blockd.runtime.pool_set import build_pools, close_pools

SPEC = PoolSpec(block_size=16, num_blocks=64, num_layers=2, num_kv_heads=2, head_dim=64)


@pytest.fixture
def gpu() -> None:
    try:
        import torch
    except ImportError:
        pytest.skip("torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip(f"torch {torch.__version__} cannot use CUDA (a CPU-only build or no device)")
    try:
        from blockd.pools.cuda import CudaPool

        CudaPool(PoolSpec(block_size=16, num_blocks=1)).close()
    except Exception as exc:  # no driver, no VMM: the reason is the skip
        pytest.skip(f"cuda pool unavailable: {exc}")


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
def test_gpu_a_dedicated_partition_is_its_own_allocation_and_fd() -> None:
    import torch

    from blockd_client.cuda_view import CudaPoolView

    specs = {"shared": SPEC, "tenant-acme": PoolSpec(block_size=16, num_blocks=8, num_layers=2,
                                                     num_kv_heads=2, head_dim=64)}
    pools = build_pools(specs, "cuda")
    page = FencePage(None)
    try:
        headers = {}
        for name, pool in pools.items():
            header, fds = pool.handle(1, page.fd)
            headers[name] = (header, [os.dup(fd) for fd in fds])
        shared_h, acme_h = headers["shared"][0], headers["tenant-acme"][0]
        assert (shared_h.num_blocks, acme_h.num_blocks) == (64, 8)
        view = CudaPoolView(*headers["tenant-acme"])
        kv = view.kv_pool(0)
        assert kv.shape[2] == 8
        kv.fill_(3.0)  # every byte of the dedicated partition
        torch.cuda.synchronize()
        marker = pools["tenant-acme"].read_block(0)
        assert marker != bytes(len(marker))
        shared = pools["shared"]
        for b in range(SPEC.num_blocks):
            assert shared.read_block(b) == bytes(len(shared.read_block(0)))
        view.close()
        other = CudaPoolView(*headers["shared"])
        assert other.kv_pool(0).shape[2] == 64
        assert not bool((other.kv_pool(0) == 3.0).any())  # none of it in the shared region
        other.close()
    finally:
        page.close()
        close_pools(pools)
