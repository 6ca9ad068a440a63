"""The pools of a daemon: one per partition of ``blockd.core.coordinator`` (the shared one, and
one per dedicated partition), each its own memfd, state-dir file or VMM allocation.

Block ids are partition-local: a session's worker receives only its partition's pool
(``PoolHandles.lookup``), whose block ``b`` is the coordinator's block ``b`` of that partition.
"""

from __future__ import annotations

from pathlib import Path

from blockd.core.spec import PoolSpec
from blockd.core.tenants import SHARED_PARTITION
from blockd.pools.base import Pool

__all__ = ["build_pools", "close_pools", "partition_path"]


def partition_path(state_dir: Path, name: str, shared_path: str) -> str:
    """Where a partition's pool file lives in ``state.dir`` (the shared one: ``pool``)."""
    return shared_path if name == SHARED_PARTITION else str(state_dir / f"pool.{name}")


def build_pools(specs: dict[str, PoolSpec], backend: str, *, prefault: bool = False,
                state_dir: Path | None = None, shared_path: str = "", reuse: bool = False
                ) -> dict[str, Pool]:
    """One pool per partition (the host pool's files in ``state_dir``, reused after a crash).
    A partial failure closes what was made before it."""
    from blockd.pools.host import HostPool

    pools: dict[str, Pool] = {}
    try:
        if state_dir is not None and not reuse:
            for stale in state_dir.glob("pool.*"):  # partitions of an earlier layout
                stale.unlink(missing_ok=True)
        for name, spec in specs.items():
            if backend == "cuda":
                # Imported here: CPU installs never load cuda-python. CudaPool refuses with
                # the reason (no driver, no device, no VMM) as FAILED_PRECONDITION.
                from blockd.pools.cuda import CudaPool

                pools[name] = CudaPool(spec, prefault=prefault)
            else:
                path = (partition_path(state_dir, name, shared_path)
                        if state_dir is not None else None)
                pools[name] = HostPool(spec, prefault=prefault, path=path, reuse=reuse)
    except BaseException:
        close_pools(pools)
        raise
    return pools


def close_pools(pools: dict[str, Pool]) -> None:
    for pool in pools.values():
        pool.close()


