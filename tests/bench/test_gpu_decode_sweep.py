"""bench/gpu_decode.py's split sweep, planned without a GPU: the plans a GPU run times (the
timing itself needs a device; ``scripts/gpu_check.sh`` runs it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]


def _bench():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gpu_decode", REPO / "bench" / "gpu_decode.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_sweep_covers_the_planners_choice_with_distinct_launches() -> None:
    gd = _bench()
    splits = [1, 4, 8, 16, 24, 32, 48, 64, 96, 128]
    # Batch 1 at 8k on an H200 (132 SMs): the planner picks 32 splits of 256 tokens.
    chosen = gd.bg.plan_decode(1, 8192, gd.NUM_QO_HEADS, gd.NUM_KV_HEADS, gd.HEAD_DIM,
                               dtype=gd.DTYPE, num_sms=132)
    plans = gd.sweep_plans(1, 8192, splits, num_sms=132)
    sizes = [p.partition_size for p in plans]
    assert len(sizes) == len(set(sizes))  # no launch timed twice
    assert (chosen.num_splits, chosen.partition_size) in {
        (p.num_splits, p.partition_size) for p in plans}
    for p in plans:
        assert p.partition_size % p.tile == 0  # no tile straddles two splits
        assert p.num_splits * p.partition_size >= 8192  # every token is in a split
    assert {p.num_splits for p in plans} >= {1, 32, 128}


def test_the_sweep_skips_counts_a_short_context_cannot_split_into() -> None:
    gd = _bench()
    plans = gd.sweep_plans(1, 256, [1, 8, 16, 32, 64], num_sms=132)
    assert all(p.num_splits <= 256 // 16 for p in plans)
    assert [p.num_splits for p in plans][0] == 1
