"""bench/peers_replay.py and bench/scaling.py run end to end on a tiny trace.

No timings are asserted (performance lives in the scripts' output): these check that the
scripts run the peers' real code, write the JSON the docs are built from, and that the three
managers were held to the same trace and the same counting rule.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
sys.path.append(str(BENCH))  # appended: bench/trace.py must not shadow the stdlib's

from peers import sglang_loader  # noqa: E402

ENGINES = {"blockd append", "blockd append_batch", "vLLM", "SGLang"}


@pytest.fixture(scope="module")
def peers_result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    if not sglang_loader.available():
        pytest.skip("the sglang 0.5.23 wheel is not under bench/peers/.cache: "
                    "run bench/peers/fetch_sglang.sh")
    out = tmp_path_factory.mktemp("peers") / "peers_replay.json"
    # A subprocess: the SGLang loader installs import stubs that must not leak into the suite.
    proc = subprocess.run(
        [sys.executable, str(BENCH / "peers_replay.py"), "--requests", "40", "--repeats", "2",
         "--num-blocks", "3000", "--max-running", "16", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert out.with_suffix(".png").stat().st_size > 0
    return json.loads(out.read_text())


def test_every_manager_ran_every_repetition(peers_result: dict) -> None:
    assert set(peers_result["engines"]) == ENGINES
    runs = peers_result["runs"]
    assert sorted((r["repetition"], r["engine"]) for r in runs) == sorted(
        (rep, e) for rep in range(2) for e in ENGINES)
    # Interleaved: the order rotates between repetitions.
    assert [r["engine"] for r in runs[:4]] != [r["engine"] for r in runs[4:]]
    assert peers_result["versions"]["vllm"] and peers_result["versions"]["sglang"] == "0.5.23"


def test_the_managers_saw_the_same_trace(peers_result: dict) -> None:
    trace = peers_result["trace"]
    for name, e in peers_result["engines"].items():
        assert e["requests"] == trace["requests"] == 40, name
        assert e["stalls"] == 0, name
        # One KV slot per prompt token and per output token, for every manager.
        expected = round(trace["requests"] * (trace["mean_prompt_tokens"]
                                              + trace["mean_output_tokens"]))
        assert e["tokens"] == expected, name
        assert e["queried_tokens"] == round(trace["requests"] * trace["mean_prompt_tokens"])
    steps = {e["steps"] for e in peers_result["engines"].values()}
    assert len(steps) == 1


def test_one_counting_rule(peers_result: dict) -> None:
    for name, e in peers_result["engines"].items():
        assert e["ops"] == e["allocated"] + e["released"], name
        # Every reference a sequence took (allocated or hit) is released when it ends.
        assert e["released"] == e["allocated"] + e["hit_blocks"], name
        assert e["hit_tokens"] == e["hit_blocks"] * peers_result["config"]["block_size"], name
        assert 0 < e["hit_rate_tokens"] < 1, name
    blockd = peers_result["engines"]["blockd append"]
    assert peers_result["engines"]["blockd append_batch"]["ops"] == blockd["ops"]


def test_ratios_are_per_repetition_with_spread(peers_result: dict) -> None:
    ratios = peers_result["ratios"]
    assert set(ratios) == {"blockd append / vLLM", "blockd append / SGLang",
                           "blockd append_batch / vLLM", "blockd append_batch / SGLang"}
    for r in ratios.values():
        samples = r["ops_per_s"]["samples"]
        assert len(samples) == 2
        assert r["ops_per_s"]["min"] <= r["ops_per_s"]["median"] <= r["ops_per_s"]["max"]
        assert r["goal"] > 0 and isinstance(r["meets_goal"], bool)


def test_scaling_table_runs(tmp_path: Path) -> None:
    import scaling

    out = tmp_path / "scaling.json"
    result = scaling.main(["--requests", "30", "60", "--pools", "2000", "20000",
                           "--out", str(out)])
    cells = json.loads(out.read_text())["cells"]
    assert cells == result["cells"]
    assert sorted((c["requests"], c["num_blocks"]) for c in cells) == [
        (30, 2000), (30, 20000), (60, 2000), (60, 20000)]
    by = {(c["requests"], c["num_blocks"]): c for c in cells}
    for n in (30, 60):
        # The same trace whatever the pool: same tokens, same operations.
        assert by[(n, 2000)]["tokens"] == by[(n, 20000)]["tokens"]
        assert by[(n, 2000)]["block_ops"] == by[(n, 20000)]["block_ops"]
