"""The tiers on the cuda pool, against the in-memory stand-in of the driver (``FakeDriver`` of
test_cuda_pool.py; real enums and structs, bytearray device memory, every copy bounds-checked and
required to run on a stream of the current device's context).

A spill copies a block's runs from every shard's allocation into a host slot on that shard's own
daemon stream and waits for those streams only; a load copies a checked slot back. The host
tier's memory is pinned (``cuMemHostRegister``) for the devices' DMA, and unpinned before it is
unmapped; where the runtime cannot pin it, the copies still work. On a real GPU these paths run in
``scripts/gpu_check.sh``'s pool tests.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

import pytest
from test_cuda_pool import FakeDriver

from blockd.core.spec import PoolSpec
from blockd.pools import cuda as cuda_pool
from blockd.pools.cuda import CudaPool
from blockd.runtime.tier_io import PoolTierIO, TierIOStats
from blockd.tiers.disk import DiskTierStore
from blockd.tiers.host import HostTierStore

SPEC = PoolSpec(block_size=4, num_blocks=8, num_layers=2, num_kv_heads=1, head_dim=8,
                dtype="float16", tp_size=2)
KEY = bytes(range(16))


class TierDriver(FakeDriver):
    """The driver calls the tiers add: host-to-device copies and host-memory registration."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.registered: dict[int, int] = {}

    def cuMemcpyHtoDAsync(self, dst: int, src: int, n: int, stream: int) -> tuple[Any, ...]:
        assert self.streams[stream][0] == self._current_device()
        buf, off = self.locate(dst, n)
        buf[off:off + n] = ctypes.string_at(src, n)
        self.log.append(("cuMemcpyHtoDAsync", (dst, n, stream)))
        return self._ok("cuMemcpyHtoDAsync")

    def cuMemHostRegister(self, ptr: int, n: int, flags: int) -> tuple[Any, ...]:
        assert flags == self.CU_MEMHOSTREGISTER_PORTABLE
        out = self._ok("cuMemHostRegister")
        if out[0] == self.R.CUDA_SUCCESS:
            self.registered[ptr] = n
        return out

    def cuMemHostUnregister(self, ptr: int) -> tuple[Any, ...]:
        del self.registered[ptr]
        return self._ok("cuMemHostUnregister")


@pytest.fixture
def drv(monkeypatch: pytest.MonkeyPatch) -> TierDriver:
    d = TierDriver()
    monkeypatch.setattr(cuda_pool, "_driver", lambda: d)
    return d


def fill_block(drv: TierDriver, pool: CudaPool, block: int, seed: int) -> bytes:
    """Random bytes into ``block`` on every shard, as a worker's kernels would write them;
    returns them in the host layout (shard by shard, planes in order)."""
    want = b""
    for shard in pool._shards:
        drv.stack.append(f"ctx{shard.device}")
        try:
            for off, n in pool.block_runs(block):
                data = os.urandom(n)
                buf, at = drv.locate(shard.ptr + off, n)
                buf[at:at + n] = data
                want += data
        finally:
            drv.stack.pop()
    return want


def test_a_block_goes_to_host_and_disk_slots_and_back_on_every_shard(
        drv: TierDriver, tmp_path: Path) -> None:
    pool = CudaPool(SPEC)
    host = HostTierStore(4, SPEC.slot_bytes)
    disk = DiskTierStore(str(tmp_path), "shared", 4, SPEC.slot_bytes)
    try:
        assert pool.register_host(host.host_region())  # type: ignore[arg-type]
        assert list(drv.registered.values()) == [host.size]
        io = PoolTierIO(pool, {"host": host, "disk": disk}, TierIOStats(), "shared")
        want = fill_block(drv, pool, 3, 1)
        assert len(want) == SPEC.slot_bytes  # both shards' runs
        drv.log.clear()
        assert io.spill(3, "host", 1, 9, KEY)
        # Copies on each shard's own stream, then those streams waited for, never the device.
        syncs = {args for name, args in drv.log if name == "cuStreamSynchronize"}
        assert syncs == set(drv.streams)
        assert not any(name == "cuCtxSynchronize" for name, _ in drv.log)
        assert bytes(host.checked_view(1, 9, KEY) or b"") == want
        assert io.move("host", 1, "disk", 2, 9, KEY)
        pool.zero_blocks([5])
        assert io.load("disk", 2, 5, 9, KEY)
        for s in (0, 1):
            assert pool.read_block(5, shard=s) == want[s * SPEC.slot_bytes // 2:
                                                       (s + 1) * SPEC.slot_bytes // 2]
        assert not io.load("host", 1, 6, 8, KEY)  # another entry's slot: a miss, 6 untouched
        assert pool.read_block(6) == bytes(SPEC.slot_bytes // 2)
    finally:
        pool.unregister_host(host.host_region())  # type: ignore[arg-type]
        assert not drv.registered
        host.close()
        disk.close()
        pool.close()
    drv.assert_all_released()


def test_a_tier_the_runtime_cannot_pin_still_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    d = TierDriver(fail={"cuMemHostRegister": (0, "CUDA_ERROR_NOT_SUPPORTED")})
    monkeypatch.setattr(cuda_pool, "_driver", lambda: d)
    pool = CudaPool(SPEC)
    host = HostTierStore(2, SPEC.slot_bytes)
    try:
        assert not pool.register_host(host.host_region())  # type: ignore[arg-type]
        io = PoolTierIO(pool, {"host": host}, TierIOStats(), "shared")
        want = fill_block(d, pool, 0, 2)
        assert io.spill(0, "host", 0, 3, KEY) and io.load("host", 0, 7, 3, KEY)
        assert pool.read_block(7, shard=1) == want[SPEC.slot_bytes // 2:]
    finally:
        host.close()
        pool.close()


def test_a_failed_device_copy_is_a_counted_failure_not_an_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    d = TierDriver(fail={"cuMemcpyHtoDAsync": (0, "CUDA_ERROR_ILLEGAL_ADDRESS")})
    monkeypatch.setattr(cuda_pool, "_driver", lambda: d)
    pool = CudaPool(SPEC)
    host = HostTierStore(2, SPEC.slot_bytes)
    stats = TierIOStats()
    try:
        io = PoolTierIO(pool, {"host": host}, stats, "shared")
        fill_block(d, pool, 0, 3)
        assert io.spill(0, "host", 0, 3, KEY)
        assert not io.load("host", 0, 4, 3, KEY)  # the block is computed instead
        assert stats.errors == {"host_read": 1}
    finally:
        host.close()
        pool.close()


@pytest.fixture
def real_cuda() -> None:
    reason = cuda_pool.cuda_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.gpu
@pytest.mark.usefixtures("real_cuda")
def test_gpu_a_block_goes_down_the_tiers_and_back_through_pinned_memory(tmp_path: Path) -> None:
    """The real driver: a block written on the device spills to a pinned host slot, demotes to
    a disk slot and loads back into another block, byte for byte, on one shard."""
    spec = PoolSpec(block_size=16, num_blocks=64, num_layers=2, num_kv_heads=2, head_dim=64,
                    dtype="float16")
    pool = CudaPool(spec)
    host = HostTierStore(4, spec.slot_bytes)
    disk = DiskTierStore(str(tmp_path), "shared", 4, spec.slot_bytes)
    pinned = pool.register_host(host.host_region())  # type: ignore[arg-type]
    try:
        io = PoolTierIO(pool, {"host": host, "disk": disk}, TierIOStats(), "shared")
        data = os.urandom(spec.slot_bytes)
        pool.copy_in(7, memoryview(bytearray(data)))
        assert pool.read_block(7) == data
        assert io.spill(7, "host", 0, 1, KEY) and bytes(host.checked_view(0, 1, KEY) or b"") == data
        assert io.move("host", 0, "disk", 3, 1, KEY)
        assert io.load("disk", 3, 20, 1, KEY) and pool.read_block(20) == data
        assert io.load("host", 0, 21, 1, KEY) and pool.read_block(21) == data
        print(f"host tier pinned: {pinned}")
    finally:
        if pinned:
            pool.unregister_host(host.host_region())  # type: ignore[arg-type]
        host.close()
        disk.close()
        pool.close()
