"""vLLM on blockd with tiers below the pool: prompts that outgrow the pool come back from host
memory, and from disk across a daemon restart, token for token what vLLM alone computes.

The pool holds 48 blocks of 32 tokens (each of the tiny model's blocks is 32 KiB); engine 1
computes 24 distinct prompts of 6 full blocks (3x what the pool holds), a few at a time; a fresh
engine 2 (another credential of the same tenant, vLLM's own prefix cache off) asks for the same
prompts and must get at least 90% of their full blocks from blockd, which loads them from the
lower tier into the pool before its admit answers.
"""

from __future__ import annotations

import random
from pathlib import Path

from vllm_support import Engine, connector_config, retired, start_daemon, stats

POOL_BLOCKS = 48
SLOT = 32 * 2 * 2 * 2 * 32 * 4  # tokens x K,V x layers x KV heads x head_dim x float32


def prompts(seed: int, n: int = 24) -> list[list[int]]:
    """``n`` distinct prompts of 6 full blocks and a 10-token tail."""
    rng = random.Random(seed)
    return [[rng.randrange(1, 1000) for _ in range(6 * 32 + 10)] for _ in range(n)]


def in_batches(engine: Engine, work: list[list[int]], size: int = 3) -> dict:
    """``work`` a few prompts per call (a batch fits the 48-block pool), results joined (and
    the engine's cumulative metrics after the last call)."""
    out: dict = {"tokens": [], "num_cached": [], "metrics": {}}
    for i in range(0, len(work), size):
        got = engine.generate(work[i:i + size])
        out["tokens"] += got["tokens"]
        out["num_cached"] += got["num_cached"]
        out["metrics"] = got["metrics"]
    return out


def check_second_engine(daemon, second: Engine, want: list[list[int]], work: list[list[int]],
                        tier: str) -> None:  # type: ignore[no-untyped-def]
    """``second``, which has not computed anything yet, gets ``work`` from ``tier``."""
    before = stats(daemon).tiers
    out = in_batches(second, work)
    assert out["tokens"] == want
    full = sum((len(p) - 1) // 32 * 32 for p in work)
    print(f"{tier}: {sum(out['num_cached'])} of {full} full-block tokens from blockd")
    assert sum(out["num_cached"]) >= 0.9 * full, (sum(out["num_cached"]), full)
    after = {t.tier: t for t in stats(daemon).tiers}
    was = {t.tier: t.hit_tokens_total for t in before}
    assert after[tier].hit_tokens_total - was.get(tier, 0) >= 0.8 * full


def test_prompts_3x_the_pool_come_back_from_host_memory(tmp_path: Path, model_dir: Path,
                                                        alone: Engine) -> None:
    work = prompts(seed=31)
    want = in_batches(alone, work)["tokens"]
    d = start_daemon(tmp_path / "blockd", num_blocks=POOL_BLOCKS,
                     tiers={"host_bytes": 64 << 20})
    # Both engines start at once (start-ups are the cost); the second stays idle, with nothing
    # of its own, until the first has computed everything.
    with d, Engine(model_dir, connector_config(d, "acme", "alice2"), wait=False) as second:
        with Engine(model_dir, connector_config(d, "acme", "alice")) as first:
            assert in_batches(first, work)["tokens"] == want
            retired(d)
        assert stats(d).tiers[0].used_slots >= 24 * 6 - POOL_BLOCKS
        check_second_engine(d, second, want, work, "host")


def test_prompts_3x_the_pool_come_back_from_disk_after_a_daemon_restart(
        tmp_path: Path, model_dir: Path, alone: Engine) -> None:
    work = prompts(seed=32)
    disk = tmp_path / "disk"
    disk.mkdir()
    tiers = {"disk_path": str(disk), "disk_bytes": 64 << 20}
    d = start_daemon(tmp_path / "blockd", num_blocks=POOL_BLOCKS, state_dir=tmp_path / "state",
                     tiers=tiers)
    try:
        with Engine(model_dir, connector_config(d, "acme", "alice")) as first:
            in_batches(first, work)
            retired(d)
        d.stop()  # a restart on the same state dir: the disk slots' index is recovered
        d = start_daemon(tmp_path / "blockd", num_blocks=POOL_BLOCKS,
                         state_dir=tmp_path / "state", tiers=tiers)
        with Engine(model_dir, connector_config(d, "acme", "alice2")) as second:
            check_second_engine(d, second, in_batches(alone, work)["tokens"], work, "disk")
    finally:
        d.stop()
