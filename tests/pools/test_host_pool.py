"""The host pool itself: reservation, layout, scrubbing, and pools beyond 4 GiB."""

import os
import subprocess
import sys

import pytest
import torch

from blockd.core import PoolSpec
from blockd.core.errors import ResourceExhausted
from blockd.pools.host import HostPool
from blockd_gpu import KvLayout


def test_block_runs_follow_the_kernel_layout() -> None:
    spec = PoolSpec(block_size=4, num_blocks=8, num_layers=3, num_kv_heads=2, head_dim=8,
                    dtype="float16")
    pool = HostPool(spec)
    try:
        layout = KvLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4,
                          dtype="float16")
        kv = torch.frombuffer(pool.map, dtype=torch.float16).view(layout.pool_shape(8))
        kv[:, :, 5] = 1.0
        raw = pool.read_block(5)
        assert len(raw) == spec.block_bytes and raw == torch.ones(
            3 * 2 * 4 * 2 * 8, dtype=torch.float16).numpy().tobytes()
        assert pool.read_block(4).count(0) == spec.block_bytes
        pool.zero_blocks([5])
        assert torch.count_nonzero(kv) == 0
        del kv
    finally:
        pool.close()


def test_reservation_failure_is_resource_exhausted(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(ResourceExhausted) as info:
        HostPool(PoolSpec(block_size=4, num_blocks=8))
    assert info.value.field == "pool.num_blocks" and info.value.reason == "shm"


@pytest.mark.slow
def test_pool_larger_than_4_gib_maps_in_another_process() -> None:
    """4.5 GiB: offsets past 2^32 bytes reach the right bytes through a second mapping."""
    spec = PoolSpec(block_size=16, num_blocks=18432, num_layers=4, num_kv_heads=8,
                    head_dim=128, dtype="float16")
    assert spec.pool_bytes > 4 * 2**30
    pool = HostPool(spec)
    try:
        last = spec.num_blocks - 1
        runs = pool.block_runs(last)
        assert runs[-1][0] > 2**32
        layout = KvLayout(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16,
                          dtype="float16")
        kv = torch.frombuffer(pool.map, dtype=torch.float16).view(layout.pool_shape(18432))
        kv[3, 1, last, 15, 7, 127] = 2.5  # the very last element of the pool
        code = (
            "import mmap, os, sys, torch\n"
            "fd = int(sys.argv[1]); size = int(sys.argv[2])\n"
            "m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)\n"
            "t = torch.frombuffer(m, dtype=torch.float16)\n"
            "assert t[-1].item() == 2.5, t[-1]\n"
            "t[-2] = 7.0\n"
        )
        subprocess.run([sys.executable, "-c", code, str(pool.fd), str(pool.size)],
                       pass_fds=(pool.fd,), check=True, timeout=120)
        assert kv[3, 1, last, 15, 7, 126].item() == 7.0
        pool.zero_blocks([last])
        assert kv[3, 1, last].abs().sum().item() == 0
        del kv
    finally:
        pool.close()
