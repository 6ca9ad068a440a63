"""The scheduler side's own threads stay off the CPU workers' cores (``blockd_vllm.placement``).

vLLM's CPU build binds each worker's OpenMP threads to cores and keeps the others for the rest
(``OMPProcessManager``), but leaves the engine core's threads unbound. The connector's threads
in the engine core (the outbox's, the heartbeat's, and those gRPC starts for the channel) are
started bound to the CPUs vLLM keeps for the rest, computed with vLLM's own manager from the
engine's config; vLLM's own threads, the scheduler thread among them, keep their binding.
Checked on real threads of a real scheduler side attached to a real daemon. (Needs two CPUs:
with one, there is nothing to keep off.)
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from blockd_vllm.placement import bound, engine_side_cpus
from test_connector_faults import _connector  # vLLM's own factory builds the connector
from vllm_support import connector_config, start_daemon

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                                reason="one CPU: no core to keep the threads off")


def vllm_config(model_dir: Path):  # type: ignore[no-untyped-def]
    from vllm.config import KVTransferConfig, ModelConfig, VllmConfig
    from vllm.config.cache import CacheConfig

    return VllmConfig(model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True,
                                               dtype="float32"),
                      cache_config=CacheConfig(block_size=32),
                      kv_transfer_config=KVTransferConfig(
                          kv_connector="BlockdConnector", kv_connector_module_path="blockd_vllm",
                          kv_role="kv_both", kv_connector_extra_config={"target": "unix:/x"}))


def test_the_cpus_are_those_vllm_keeps_off_its_workers(model_dir: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """An explicit binding: every CPU no rank's list names. vLLM's own (``auto``, one CPU
    reserved as the benchmarks run it): the reserved ones, never one of the worker's. Workers
    not bound (``nobind``): none (the threads stay where the engine core runs)."""
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    allowed = os.sched_getaffinity(0)
    first = min(allowed)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", str(first))
    assert engine_side_cpus(vllm_config(model_dir)) == allowed - {first}

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    cfg = vllm_config(model_dir)
    cpus = engine_side_cpus(cfg)
    workers = {c for ids in OMPProcessManager(cfg).cpu_lists for c in ids}
    assert cpus and workers and not cpus & workers and cpus <= allowed

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert engine_side_cpus(vllm_config(model_dir)) is None


def test_threads_started_inside_inherit_the_binding_and_the_caller_gets_its_own_back() -> None:
    own = os.sched_getaffinity(0)
    one = {max(own)}
    seen: list[set[int]] = []
    with bound(one):
        assert os.sched_getaffinity(0) == one
        t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        t.start()
        t.join()
    assert seen == [one]
    assert os.sched_getaffinity(0) == own
    with bound(None):  # nothing to bind to: nothing changes
        assert os.sched_getaffinity(0) == own


def test_the_scheduler_sides_threads_run_off_the_workers_cores(
        tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A scheduler side attached to a real daemon, its engine's worker bound to the first CPU:
    the outbox's and the heartbeat's threads run on the others; the thread that built it (vLLM's
    engine core thread) keeps its own binding."""
    own = os.sched_getaffinity(0)
    first = min(own)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", str(first))
    with start_daemon(tmp_path / "blockd") as d:
        extra = connector_config(d, "acme", "alice")["kv_connector_extra_config"]
        before = {t.ident for t in threading.enumerate()}
        sched = _connector(model_dir, extra, "SCHEDULER")
        try:
            assert sched.scheduler.cpus == own - {first}
            assert os.sched_getaffinity(0) == own
            ours = {t.name: t for t in threading.enumerate()
                    if t.ident not in before and t.native_id is not None}
            assert {"blockd-vllm-outbox", "blockd-vllm-heartbeat"} <= set(ours)
            for name, t in ours.items():
                assert os.sched_getaffinity(t.native_id) == own - {first}, name
        finally:
            sched.shutdown()


@pytest.fixture(autouse=True)
def _vllm(model_dir: Path) -> None:
    """(model_dir skips the module when vLLM is not importable)"""
