"""Faults never change a token and never fail a request (issue 13, tests 5 and 6).

A daemon killed with SIGKILL mid-run (and restarted on its state dir: same epoch; or without
it: a new epoch), a killed engine, and bad connector settings at start.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_support import (
    Engine,
    connector_config,
    hits,
    retired,
    shared_prefix_workload,
    start_daemon,
    stats,
)


def wait_for(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def test_daemon_killed_mid_run_then_restarted_same_and_new_epoch(tmp_path: Path,
                                                                 model_dir: Path,
                                                                 alone: Engine) -> None:
    """One engine through three daemon lives: SIGKILL mid-round, a restart on the state dir
    (same epoch: the cache is used again), a SIGKILL and a restart without it (a new epoch: the
    session re-attaches, then hits again). Every round's tokens equal vLLM alone's."""
    state = tmp_path / "state"
    work = tmp_path / "blockd"
    d = start_daemon(work, state_dir=state)
    engine = Engine(model_dir, connector_config(d, "acme", "alice", retry_interval_s=0.5))
    try:
        warm = shared_prefix_workload(seed=21)
        want_warm = alone.generate(warm)["tokens"]
        assert engine.generate(warm)["tokens"] == want_warm
        epoch = stats(d).epoch
        # SIGKILL while a round is running: every request still completes, same tokens.
        during = shared_prefix_workload(seed=22, n=12)
        want = alone.generate(during, max_tokens=24)
        box: dict = {}
        t = threading.Thread(target=lambda: box.update(engine.generate(during, max_tokens=24)))
        t.start()
        time.sleep(0.5)
        d.proc.kill()
        d.proc.wait()
        t.join(240)
        assert box["tokens"] == want["tokens"]
        # Down: computed without the cache, same tokens.
        down = shared_prefix_workload(seed=23)
        out = engine.generate(down)
        assert out["tokens"] == alone.generate(down)["tokens"]
        assert out["num_cached"] == [0] * len(down)
        # Back on its state dir: the same epoch, and the connector uses the cache again.
        d = start_daemon(work, state_dir=state)
        assert stats(d).epoch == epoch
        again: list = []
        assert wait_for(lambda: (again.append(engine.generate(warm)) or
                                 again[-1]["num_cached"] == hits(warm)), timeout=60)
        assert all(r["tokens"] == want_warm for r in again)
        # Killed again and restarted without its state: a new pool, a new epoch.
        d.proc.kill()
        d.proc.wait()
        d = start_daemon(work)
        assert stats(d).epoch != epoch
        rounds: list = []
        assert wait_for(lambda: (rounds.append(engine.generate(warm)) or
                                 rounds[-1]["num_cached"] == hits(warm)), timeout=60)
        assert all(r["tokens"] == want_warm for r in rounds)
    finally:
        engine.stop()
        d.stop()


def test_killed_engine_is_reaped_and_others_carry_on(tmp_path: Path, model_dir: Path,
                                                     alone: Engine) -> None:
    with start_daemon(tmp_path / "blockd", lease_ms=1500) as d:
        # Started together: their start-ups overlap.
        a = Engine(model_dir, connector_config(d, "acme", "alice"), wait=False)
        b = Engine(model_dir, connector_config(d, "acme", "alice2"), wait=False)
        try:
            a.ready()
            b.ready()
            prompts = shared_prefix_workload(seed=41)
            b.generate(prompts)
            assert stats(d).num_sessions == 2
            retired(d)  # b's requests committed (a kill -9 cannot report a fence any more)
            b.kill()
            assert wait_for(lambda: stats(d).num_sessions == 1, timeout=20)
            out = a.generate(prompts)
            assert out["tokens"] == alone.generate(prompts)["tokens"]
            assert out["num_cached"] == hits(prompts)  # what b saved survived b
        finally:
            a.stop()
            b.stop()


def test_block_size_mismatch_is_refused_at_start(tmp_path: Path, model_dir: Path) -> None:
    """A pool of blocks of 16 for an engine of 32: the message names both block sizes
    (test_connector_start.py shows a refusal of this constructor ending a real engine)."""
    from vllm_support import daemon_proc

    with daemon_proc.start(tmp_path / "blockd", num_blocks=64,
                           tenants=__import__("vllm_support").TENANTS,
                           extra={"pool": {"block_size": 16, "num_layers": 2,
                                           "num_kv_heads": 2, "head_dim": 32,
                                           "dtype": "float32"}}) as d:
        (d.workdir / "alice.token").write_text("tok-alice\n")
        # The worker's preflight (blockd's Stats) and the scheduler side's Attach.
        for role, says in (("WORKER", "vLLM's block_size is 32"),
                           ("SCHEDULER", "the pool has block_size=16, the worker expects 32")):
            with pytest.raises(RuntimeError) as err:
                _connector(model_dir, connector_config(d, "acme", "alice")
                           ["kv_connector_extra_config"], role)
            assert "block_size=16" in str(err.value) and says in str(err.value), role


def _connector(model_dir: Path, extra: dict, role: str = "WORKER"):
    """vLLM's own factory builds the connector from the module path, as an engine does."""
    from vllm.config import KVTransferConfig, ModelConfig, VllmConfig
    from vllm.config.cache import CacheConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    cfg = VllmConfig(model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True,
                                              dtype="float32"),
                     cache_config=CacheConfig(block_size=32),
                     kv_transfer_config=KVTransferConfig(
                         kv_connector="BlockdConnector", kv_connector_module_path="blockd_vllm",
                         kv_role="kv_both", kv_connector_extra_config=extra))
    return KVConnectorFactory.create_connector(cfg, getattr(KVConnectorRole, role), None)


@pytest.fixture(scope="module")
def plain_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    with start_daemon(tmp_path_factory.mktemp("blockd-config")) as d:
        yield d


@pytest.mark.parametrize("case, extra, needle", [
    ("no target", {"tenant": "acme"}, "kv_connector_extra_config.target: required"),
    ("relative unix path", {"target": "unix:blockd.sock", "tenant": "acme"},
     "absolute path"),
    ("no tenant", {"target": "unix:/x.sock"}, "kv_connector_extra_config.tenant: required"),
    ("unknown key", {"target": "unix:/x.sock", "tenant": "acme", "tenat": "x"},
     "unknown key(s) ['tenat']"),
    ("unreadable token file", {"target": "unix:/x.sock", "tenant": "acme",
                               "token_file": "/nonexistent/token"}, "cannot be read"),
    ("negative commit interval", {"target": "unix:/x.sock", "tenant": "acme",
                                  "commit_interval_s": -1},
     "kv_connector_extra_config.commit_interval_s: must be > 0"),
])
def test_bad_settings_are_refused_naming_the_key(model_dir: Path, case: str, extra: dict,
                                                 needle: str) -> None:
    with pytest.raises(ValueError) as err:
        _connector(model_dir, extra)
    assert needle in str(err.value), case


def test_unreachable_target_is_refused_at_start(tmp_path: Path, model_dir: Path) -> None:
    target = f"unix:{tmp_path}/nobody.sock"
    with pytest.raises(RuntimeError) as err:
        _connector(model_dir, {"target": target, "tenant": "acme", "connect_timeout_s": 0.5})
    assert target in str(err.value) and "did not answer" in str(err.value)


def test_wrong_token_and_foreign_tenant_are_refused(plain_daemon, model_dir: Path) -> None:
    bad = plain_daemon.workdir / "bad.token"
    bad.write_text("tok-nobody\n")
    target = f"unix:{plain_daemon.endpoints['unix']}"
    with pytest.raises(RuntimeError) as err:
        _connector(model_dir, {"target": target, "tenant": "acme", "token_file": str(bad)})
    assert "rejected the credential" in str(err.value) and str(bad) in str(err.value)
    alice = str(plain_daemon.workdir / "alice.token")
    for role in ("WORKER", "SCHEDULER"):
        with pytest.raises(RuntimeError) as err:
            _connector(model_dir, {"target": target, "tenant": "globex", "token_file": alice},
                       role)
        assert "globex" in str(err.value), role
    with pytest.raises(RuntimeError) as err:
        _connector(model_dir, {"target": target, "tenant": "nobody", "token_file": alice})
    assert "kv_connector_extra_config.tenant='nobody' is not a tenant" in str(err.value)
    assert "it may act for ['acme']" in str(err.value)
    assert stats(plain_daemon).num_sessions == 0  # nothing was left attached
