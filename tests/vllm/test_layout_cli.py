"""``blockd-vllm layout``: the pool an engine needs, from vLLM's own config classes (issue 27,
item 2), in this process (vLLM's import is paid once; tests/vllm/test_serve.py runs the command
itself, as docs/vllm.md's quick start does).

The tests' tiny Llama is saved in float32; what vLLM runs it as is vLLM's choice (bfloat16 on
CPU with ``--dtype auto``), not the checkpoint's. The printed flags and YAML are read back by
blockd's own configuration loader. Models whose KV cache blockd cannot hold (sliding window,
hybrid) and block sizes vLLM's CPU attention cannot run are refused with the reason.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

import pytest
from vllm_support import POOL

from blockd import config as blockd_config
from blockd_apps.vllm_cli import Refused, compute_layout, render

TINY = {"vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 2048}


def layout(*argv: str) -> dict:
    return compute_layout([*argv, "--skip-tokenizer-init"])


def blockd_pool(argv: list[str]) -> blockd_config.PoolConfig:
    """blockd serve's configuration from ``argv`` (its own flags and loader)."""
    parser = argparse.ArgumentParser()
    blockd_config.add_flags(parser)
    return blockd_config.load(parser.parse_args(argv), environ={}).pool


def test_vllm_chooses_bfloat16_for_the_float32_checkpoint(model_dir: Path) -> None:
    assert json.loads((model_dir / "config.json").read_text())["dtype"] == "float32"
    found = layout(str(model_dir), "--block-size", "32")
    assert found["pool"] == {"block_size": 32, "num_layers": 2, "num_kv_heads": 2,
                             "head_dim": 32, "dtype": "bfloat16", "tp_size": 1}
    assert any("vLLM's choice for --dtype auto (the checkpoint says float32)" in n
               for n in found["notes"]), found["notes"]


def test_the_tests_daemons_have_the_layout_of_the_tests_engines(model_dir: Path) -> None:
    """The engines of tests/vllm run ``--dtype float32`` (``blockd_apps.vllm_engine``): the
    layout for those settings is the pool ``vllm_support.start_daemon`` gives blockd."""
    found = layout("--model", str(model_dir), "--block-size", "32", "--dtype", "float32",
                   "--pool-num-blocks", "1024")
    assert found["pool"] == {**POOL, "tp_size": 1, "num_blocks": 1024}


def test_tensor_parallel_splits_the_kv_heads_into_shards(model_dir: Path) -> None:
    """``--tensor-parallel-size 2``: one KV head per rank, two shards (the pool
    tests/vllm/test_connector_tp.py runs a TP=2 engine on)."""
    found = layout(str(model_dir), "--block-size", "32", "--dtype", "float32",
                   "--tensor-parallel-size", "2")
    assert found["pool"] == {**POOL, "num_kv_heads": 1, "tp_size": 2}
    pool = blockd_pool(shlex.split(render(found["pool"], found["notes"], "flags")))
    assert (pool.tp_size, pool.num_kv_heads) == (2, 1)


def test_flags_and_yaml_are_what_blockd_serve_applies(model_dir: Path, tmp_path: Path) -> None:
    found = layout(str(model_dir), "--block-size", "64", "--pool-num-blocks", "256")
    want = found["pool"]
    flags = render(want, found["notes"], "flags")
    from_flags = blockd_pool(shlex.split(flags))
    pool_yaml = tmp_path / "pool.yaml"
    pool_yaml.write_text(render(want, found["notes"], "yaml") + "\n")
    from_yaml = blockd_pool(["--config", str(pool_yaml)])
    for pool in (from_flags, from_yaml):
        assert {k: getattr(pool, k) for k in want} == want
    assert json.loads(render(want, found["notes"], "json")) == want


def test_a_block_size_vllm_cpu_attention_cannot_run_is_refused(model_dir: Path) -> None:
    with pytest.raises(Refused) as err:
        layout(str(model_dir), "--block-size", "16")
    assert "--block-size 16" in str(err.value) and "CPU_ATTN" in str(err.value)
    assert "MultipleOf(32)" in str(err.value)


def test_a_sliding_window_model_is_refused_with_the_reason(tmp_path: Path) -> None:
    from transformers import MistralConfig

    MistralConfig(**TINY, sliding_window=256).save_pretrained(tmp_path)
    with pytest.raises(Refused) as err:
        layout(str(tmp_path), "--block-size", "32")
    assert "sliding-window attention (sliding_window=256)" in str(err.value)
    assert "--disable-sliding-window" in str(err.value)


def test_a_hybrid_model_is_refused_with_the_reason(tmp_path: Path) -> None:
    from transformers import JambaConfig

    JambaConfig(**TINY, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                num_experts=2, mamba_d_state=8, mamba_expand=2).save_pretrained(tmp_path)
    with pytest.raises(Refused) as err:
        layout(str(tmp_path), "--block-size", "32")
    assert "hybrid model" in str(err.value)
