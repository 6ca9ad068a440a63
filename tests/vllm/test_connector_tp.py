"""Tensor parallel (issue 27, item 5): a real vLLM engine with ``tensor_parallel_size=2``.

vLLM's CPU build runs two worker processes, one per rank, each holding one of the tiny model's
two KV heads (``VLLM_CPU_OMP_THREADS_BIND="0|1"``: one core each). blockd's pool has two shards
(``pool.tp_size: 2``, ``num_kv_heads: 1`` per shard): the scheduler side attaches one session
with ``tp_size=2``, each rank saves and loads its own shard, a commit waits for every rank's
save report (vLLM aggregates them) and a fence for every rank's slot of the fence page. Shown
with tokens: the second round is served from blockd and gives the tokens the engine computed
for each prompt alone (under a salt of its own, which no other prompt shares), which a rank
reading the other rank's heads would not. The engine's clean exit (vLLM's three kinds of
processes, as ``LLM`` runs them) detaches its session: the last rank to exit does it (issue 27,
item 3; ``vllm serve``'s in test_serve.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_support import (
    Engine,
    connector_config,
    connector_figures,
    hits,
    retired,
    session_closed_lines,
    session_lines,
    shared_prefix_workload,
    start_daemon,
    stats,
    undegraded,
)

TP = 2
#: One core per rank; the engine core shares them (vLLM's CPU build reserves a core for NIXL
#: with a kv_transfer_config otherwise: docs/vllm.md, "On CPU").
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    d = start_daemon(tmp_path_factory.mktemp("blockd_tp"), num_blocks=256, lease_ms=60_000,
                     pool={"tp_size": TP, "num_kv_heads": 1})
    yield d
    d.stop()


def test_two_ranks_save_and_load_their_shards_with_the_tokens_of_computing(
        daemon, model_dir: Path) -> None:
    work = shared_prefix_workload(seed=23)
    with Engine(model_dir, connector_config(daemon, "acme", "alice", worker_name="tp"),
                env=ENV, tensor_parallel_size=TP, one_process=False) as e:
        in_our_session(e, daemon)
        # Each prompt computed alone: a salt of its own shares nothing with any other request.
        computed = [e.generate([p], cache_salt=f"alone-{i}")["tokens"][0]
                    for i, p in enumerate(work)]
        first = undegraded(e, lambda: e.generate(work))  # saves skipped while degraded
        assert first["tokens"] == computed
        retired(daemon)
        again = undegraded(e, lambda: e.generate(work))
        assert again["num_cached"] == hits(work), connector_figures(again, e)
        assert again["tokens"] == computed
        assert again["metrics"]["vllm:blockd_loaded_blocks"] > 0
        assert again["metrics"].get("vllm:blockd_load_failures", 0) == 0
        assert again["metrics"].get("vllm:blockd_save_failures", 0) == 0
        retired(daemon)
    # A clean exit: the engine's process ended by itself, the last rank to retire detached
    # the one session before (blockd's lease is a minute: nothing expired), and each rank's
    # start-up probe (the layout checked before the model load) detached too.
    assert e.proc.returncode == 0, e.log()[-3000:]
    assert stats(daemon).num_sessions == 0
    closed = session_closed_lines(daemon, "tp")
    assert len(closed) == 1 and "reason=detach" in closed[0], daemon.log_text()[-3000:]
    probes = session_lines(daemon, "tp-preflight")  # one attach and one close per rank
    assert sorted(("attached" in p, "reason=detach" in p) for p in probes) == \
        [(False, True)] * TP + [(True, False)] * TP, probes


def in_our_session(engine: Engine, daemon) -> None:  # type: ignore[no-untyped-def]
    """Every process of the engine (its own, vLLM's engine core, one worker per rank) is in
    the engine's process group (what ``kill`` ends) and in this test's session, as the daemon
    is. The kernel's autogroup shares the CPU between sessions first: with the engine in a
    session of its own, its two workers spinning on their pinned cores left the daemon no CPU
    for seconds at a time, and this test's rounds degraded on CI."""
    group = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.getpgid(int(entry)) == engine.proc.pid:
                group.append(int(entry))
        except OSError:
            continue  # a process that just ended
    assert len(group) >= 2 + TP, group  # the engine, its engine core, a worker per rank
    assert {os.getsid(pid) for pid in group} == {os.getsid(0)} == {os.getsid(daemon.proc.pid)}
