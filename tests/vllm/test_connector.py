"""vLLM on blockd through ``BlockdConnector``: same tokens, hits from blockd, across engines,
never across tenants, revisions or salts (issue 13, tests 1-4).

vLLM's own prefix cache is off in these engines, so every cached token a request reports came
from blockd; outputs are greedy and compared token for token with an engine without connector.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from blockd_vllm.asking import IDLE_WAIT_S
from vllm_support import (
    Engine,
    Prestarted,
    connector_config,
    connector_figures,
    hits,
    retired,
    shared_prefix_workload,
    start_daemon,
    stats,
    undegraded,
)

SYSTEM_BLOCKS_TOKENS = 96  # the 100-token system prompt covers 3 full blocks of 32


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator:
    with start_daemon(tmp_path_factory.mktemp("blockd")) as d:
        yield d


@pytest.fixture(scope="module")
def workload() -> list[list[int]]:
    return shared_prefix_workload(seed=7)


@pytest.fixture(scope="module")
def baseline(alone: Engine, workload: list[list[int]]) -> dict:
    return alone.generate(workload)


@pytest.fixture(scope="module", autouse=True)
def later(request: pytest.FixtureRequest, daemon, model_dir: Path, other_weights_dir: Path
          ) -> Iterator[Prestarted]:
    """The engines the tests below start one each, in their order, started ahead (while
    ``alone`` and ``engine_a`` start, then while earlier tests run), for the tests this run
    selected: each is cold until its test sends it the first request (vLLM's own prefix cache
    is off, except where a test turns it on)."""
    def engine(model: Path, tenant: str, who: str, **kw: object) -> Callable[[], Engine]:
        return lambda: Engine(model, connector_config(daemon, tenant, who), wait=False, **kw)

    specs = {  # (the test that takes it, how it starts)
        "second": ("test_second_engine_hits_what_the_first_computed",
                   engine(model_dir, "acme", "alice2")),
        "globex": ("test_other_tenant_never_hits_private_prefixes",
                   engine(model_dir, "globex", "bob")),
        "other_weights": ("test_other_weights_never_hit",
                          engine(other_weights_dir, "acme", "alice2")),
        "chunked": ("test_chunked_prefill_preemption_and_vllms_own_cache",
                    engine(model_dir, "acme", "alice2", prefix_caching=True,
                           max_num_batched_tokens=64, kv_cache_memory_bytes=16 * 32 * 1024,
                           max_model_len=256)),
    }
    selected = {item.name for item in request.session.items}
    engines = Prestarted({name: start for name, (test, start) in specs.items()
                          if test in selected})
    yield engines
    engines.close()


@pytest.fixture(scope="module")
def engine_a(daemon, model_dir: Path) -> Iterator[Engine]:
    with Engine(model_dir, connector_config(daemon, "acme", "alice"), wait=False) as e:
        yield e


def test_first_round_equals_vllm_alone(engine_a: Engine, baseline: dict,
                                       workload: list[list[int]]) -> None:
    out = engine_a.generate(workload)
    assert out["tokens"] == baseline["tokens"]


def test_second_round_is_served_from_blockd(daemon, engine_a: Engine, baseline: dict,
                                            workload: list[list[int]]) -> None:
    engine_a.generate(workload)  # (again) computes and saves whatever is not in blockd yet
    retired(daemon)  # its commits applied (they go a few round trips behind vLLM's answer)
    before = stats(daemon).prefix_hit_tokens_total
    out = undegraded(engine_a, lambda: engine_a.generate(workload))
    assert out["tokens"] == baseline["tokens"]
    # Every prompt's full blocks but the one holding its last token come from blockd.
    expected = hits(workload)
    assert out["num_cached"] == expected, connector_figures(out, engine_a)
    assert stats(daemon).prefix_hit_tokens_total - before >= sum(expected)
    assert out["metrics"]["vllm:external_prefix_cache_hits"] >= sum(expected)


def test_second_engine_hits_what_the_first_computed(daemon, engine_a: Engine, alone: Engine,
                                                    later: Prestarted) -> None:
    fresh = shared_prefix_workload(seed=11)
    engine_a.generate(fresh)
    retired(daemon)
    with later.take("second") as other:
        out = undegraded(other, lambda: other.generate(fresh))
    assert out["tokens"] == alone.generate(fresh)["tokens"]
    assert out["num_cached"] == hits(fresh), connector_figures(out, other)


def test_other_tenant_never_hits_private_prefixes(daemon, engine_a: Engine, baseline: dict,
                                                  workload: list[list[int]],
                                                  later: Prestarted) -> None:
    engine_a.generate(workload)
    retired(daemon)
    acme_cached = stats(daemon, "alice").tenants[0].cached_blocks
    assert acme_cached > 0
    with later.take("globex") as b:
        first = b.generate(workload)
        assert first["tokens"] == baseline["tokens"]
        # acme holds every one of these prefixes: a leak would show as a hit here. (Later
        # requests of the round hit the blocks globex's own first request saved.)
        assert first["num_cached"][0] == 0
        retired(daemon)
        again = undegraded(b, lambda: b.generate(workload))
    assert again["num_cached"] == hits(workload), connector_figures(again, b)
    assert stats(daemon, "bob").tenants[0].cached_blocks > 0


def test_salt_separates_and_matches(daemon, engine_a: Engine, baseline: dict,
                                    workload: list[list[int]]) -> None:
    engine_a.generate(workload)
    retired(daemon)
    salted = engine_a.generate(workload, cache_salt="user-42")
    assert salted["num_cached"][0] == 0  # nothing unsalted is shared with a salted request
    assert salted["tokens"] == baseline["tokens"]
    retired(daemon)
    again = undegraded(engine_a, lambda: engine_a.generate(workload, cache_salt="user-42"))
    assert again["num_cached"] == hits(workload), connector_figures(again, engine_a)
    retired(daemon)  # user-42's commits are in: a leak would show
    other = engine_a.generate(workload, cache_salt="user-43")
    assert other["num_cached"][0] == 0


def test_other_weights_never_hit(daemon, engine_a: Engine, workload: list[list[int]],
                                 later: Prestarted) -> None:
    """Same architecture, same model path layout, no revision given: new weights, new
    namespace (the weights fingerprint), so no hit on K/V the old weights computed."""
    engine_a.generate(workload)
    retired(daemon)  # what it computed is committed: a hit would show
    with later.take("other_weights") as e:
        out = e.generate(workload)
    assert out["num_cached"][0] == 0


def test_chunked_prefill_preemption_and_vllms_own_cache(daemon, engine_a: Engine,
                                                        alone: Engine, later: Prestarted
                                                        ) -> None:
    """vLLM's own prefix cache on, prompts prefilled in 64-token chunks, a KV cache of 16 blocks
    (requests are preempted): same tokens; and what it saved over several steps is correct
    bytes, since another engine loading it produces the same tokens again."""
    prompts = shared_prefix_workload(seed=51, n=8, tail=(8, 40))
    want = alone.generate(prompts, max_tokens=24)["tokens"]
    with later.take("chunked") as e:
        out = e.generate(prompts, max_tokens=24)
        retired(daemon)
    assert out["tokens"] == want
    assert out["metrics"].get("vllm:num_preemptions", 0) > 0, "the test needs preemptions"
    again = undegraded(engine_a, lambda: engine_a.generate(prompts, max_tokens=24))
    assert again["tokens"] == want
    assert again["num_cached"] == hits(prompts), connector_figures(again, engine_a)


def test_an_idle_engine_waits_for_blockd_without_spinning(daemon, engine_a: Engine) -> None:
    """A new request arrives at an engine with nothing else to run, and blockd, frozen
    (SIGSTOP) for 1.5 s, answers its admit only then: the engine waits for the answer
    in slices of ``IDLE_WAIT_S`` instead of stepping as fast as it goes (every empty step runs
    the engine core, the worker and the connector's hooks, the CPU a daemon on the same cores
    needs to answer). Without the wait, such an engine runs thousands of ``schedule()`` a
    second while blockd is slow, and this test fails."""
    frozen_s = 1.5
    warm, prompt = shared_prefix_workload(seed=61, n=2)
    before = engine_a.generate([warm], max_tokens=1)["metrics"]  # the worker maps the pool
    daemon.signal(signal.SIGSTOP)
    thaw = threading.Timer(frozen_s, daemon.signal, (signal.SIGCONT,))
    thaw.start()
    try:
        out = engine_a.generate([prompt], max_tokens=4)
    finally:
        thaw.join()
        daemon.signal(signal.SIGCONT)
    moved = {k.removeprefix("vllm:blockd_"): v - before.get(k, 0.0)
             for k, v in out["metrics"].items() if k.startswith("vllm:blockd_")}
    # At most one schedule() per slice while frozen, and the request's few steps after.
    assert moved["schedules"] <= frozen_s / IDLE_WAIT_S + 20, moved
    # It waited (for most of the freeze: the request reaches the engine within it).
    assert moved["idle_wait_us"] >= (frozen_s - 1.0) * 1e6, moved
    assert moved.get("degraded_episodes", 0) == 0, moved
