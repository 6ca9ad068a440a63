"""A worker's mapping of the host pool is populated when it is mapped
(``blockd_client.pool.PoolView``: ``MAP_POPULATE``): every page of the pool is in this process's
page tables before the first copy, so no save or load pays a page fault per 4 KiB on a block
it touches for the first time. Against a real daemon and its memfd, read from the kernel's own
accounting of the mapping (``/proc/self/smaps``)."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import pytest
from daemon_proc import TOKENS, start

from blockd_client import Client
from blockd_gpu import KvLayout

#: daemon_proc's pool layout.
LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")


def mapping_kib(address: int) -> tuple[int, int]:
    """(Size, Rss) in KiB of this process's mapping that holds ``address``."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" not in head or ":" in head:
            continue
        lo, hi = (int(x, 16) for x in head.split("-"))
        if lo <= address < hi:
            fields = {}
            for row in lines[i + 1:]:
                key, _, rest = row.partition(":")
                if not rest or "-" in key:
                    break
                fields[key] = rest.split()[0]
            return int(fields["Size"]), int(fields["Rss"])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(mmap, "MAP_POPULATE"),
                    reason="MAP_POPULATE is Linux's")
def test_the_pool_is_in_the_page_tables_before_the_first_copy(tmp_path: Path) -> None:
    d = start(tmp_path / "blockd", num_blocks=1024)
    try:
        with Client(f"unix:{d.endpoints['unix']}", token=TOKENS["alice"]) as c:
            s = c.attach("acme", LAYOUT)
            kv = s.pool.kv_pool(0)
            size, rss = mapping_kib(kv.data_ptr())
            # 1024 blocks x 2 layers x K,V x 4 tokens x 2 heads x 8 x 2 bytes = 512 KiB, all
            # mapped though this process has not touched a byte of it.
            assert size >= kv.numel() * kv.element_size() // 1024 == 512
            assert rss == size
            s.detach()
    finally:
        d.stop()
