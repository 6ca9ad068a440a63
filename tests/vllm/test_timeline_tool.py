"""bench/vllm_timeline.py's clocked connectors in a real engine: vLLM loads ``TimedBlockd`` by
name like BlockdConnector, the tokens are the engine's without a clock, and every hook it
clocks, BlockdConnector's Steps to the daemon included, is in the engine's timeline file, which
the bench's attribution reads (bench/timed_connectors.py; tests/bench/test_vllm_timeline.py
checks the attribution on events it knows)."""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path

from vllm_support import Engine, connector_config, shared_prefix_workload, start_daemon

REPO = Path(__file__).resolve().parents[2]
sys.path.append(str(REPO / "bench"))
from vllm_timeline import attribute, read_events  # noqa: E402


def test_the_clocked_connector_times_a_real_engine(model_dir: Path, alone: Engine,
                                                  tmp_path: Path) -> None:
    d = start_daemon(tmp_path / "d")
    try:
        kv = connector_config(d, "acme", "alice")
        kv.update(kv_connector="TimedBlockd", kv_connector_module_path="timed_connectors")
        prefix = tmp_path / "timeline" / "blockd"
        prefix.parent.mkdir()
        env = {"PYTHONPATH": str(REPO / "bench"), "BLOCKD_TIMELINE": str(prefix)}
        prompts = shared_prefix_workload(seed=5, n=4)
        with Engine(model_dir, kv, env=env) as e:
            t0 = time.monotonic_ns()
            out = e.generate(prompts, max_tokens=4)
            t1 = time.monotonic_ns()
        assert out["tokens"] == alone.generate(prompts, max_tokens=4)["tokens"]
    finally:
        d.stop()
    events = read_events(prefix)  # written at the engine's clean exit
    names = {n.split(":")[0] for _, n in events}
    assert {"new", "ask", "meta", "out", "fin", "pre", "load", "save", "done",
            "step"} <= names, names
    # vLLM's own model runner calls handle_preemptions at the start of every step that saves:
    # where BlockdConnector lets its copy thread run the saves of the steps before.
    count = Counter(n for _, n in events)
    assert count["pre"] == count["save"] > 0, count
    assert all(f"{n}_end" in names for n in ("ask", "meta", "save", "step"))
    f = attribute(events, t0, t1)
    # 4 prompts of 108-140 tokens: their prefill, then a decode step per token after the first.
    assert f["steps"] >= 4 and f["prefill_ms"] > 0 and f["decode_ms"] > 0
    assert 0 < f["save_ms"] < f["hooks_ms"] < f["wall_ms"]  # the prompts' full blocks saved
    assert f["daemon_steps"] >= 1  # the admits at least
    assert f["first_prefill_ms"] <= f["prefill_ms"]
