"""Multi-turn (issue 27, item 4): the full blocks of generated tokens are saved and committed
like prompt blocks, so turn n+1 of a conversation (previous prompt + answer + new text) hits
turn n's answer, and the tokens stay those of vLLM alone.

Two levels. The connector's roles driven step by step with vLLM's own ``Request`` and
``SchedulerOutput`` on a real daemon pin down the exact rule: a block is appended in the step that
computes the K/V of its last token and saved, from the request's own vLLM block, in the step
after (the append's Step is answered off the scheduler thread), also when that step comes after
the request's end (vLLM keeps the blocks: ``finished_sending``); the block holding the last
sampled token (which has no K/V) is not saved. Then real engines: a 3-turn conversation on one
engine, a fresh engine on the same daemon continuing it, each turn compared token for token with
vLLM alone; with ``save_generated`` off the same conversation hits only the previous prompts.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from connector_driver import Blocks, ask, kv_blocks, request, run_worker, step
from test_connector_faults import _connector
from vllm_support import (
    Engine,
    Prestarted,
    connector_config,
    retired,
    start_daemon,
    stats,
    undegraded,
)

B = 32


def decode_step(req, computed: int):  # type: ignore[no-untyped-def]
    """A SchedulerOutput scheduling one token of a running request (a decode step)."""
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    cached = CachedRequestData(req_ids=[req.request_id], resumed_req_ids=set(),
                               new_token_ids=[], all_token_ids={}, new_block_ids=[None],
                               num_computed_tokens=[computed], num_output_tokens=[0])
    return SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=cached,
                           num_scheduled_tokens={req.request_id: 1},
                           total_num_scheduled_tokens=1, scheduled_spec_decode_tokens={},
                           scheduled_encoder_inputs={}, finished_req_ids=set(),
                           free_encoder_mm_hashes=[])


def converse(sched, worker, req, vblocks: list[int], total: int,  # type: ignore[no-untyped-def]
             held: bool = False) -> list[list[int]]:
    """Prefill ``req``'s prompt, then decode until it holds ``total`` tokens (the last one
    sampled, never fed back), as vLLM's scheduler and model runner would, each step's Step
    answered before the next step (as while a step runs); then it finishes (``held``: vLLM
    keeps its blocks for a save still to come, reported in ``finished_sending``). Returns each
    step's saved vLLM blocks, the step after the end included."""
    n = len(req.prompt_token_ids)
    sched.update_state_after_alloc(req, kv_blocks(vblocks), 0)
    saved = []
    meta = sched.build_connector_meta(step([(req, vblocks, 0, n)]))
    saved.append(list(meta.save_vllm))
    assert sched.scheduler.settle()
    sched.update_connector_output(run_worker(worker, meta))
    req.append_output_token_ids(500)
    while len(req.all_token_ids) < total:
        meta = sched.build_connector_meta(decode_step(req, len(req.all_token_ids) - 1))
        saved.append(list(meta.save_vllm))
        assert sched.scheduler.settle()
        sched.update_connector_output(run_worker(worker, meta))
        req.append_output_token_ids(500 + len(req.all_token_ids) % 400)
    req.num_computed_tokens = len(req.all_token_ids) - 1  # what vLLM's scheduler keeps
    assert sched.request_finished(req, vblocks) == (held, None)
    meta = sched.build_connector_meta(step([]))  # the held save (if any), and its sending
    saved.append(list(meta.save_vllm))
    out = run_worker(worker, meta)
    assert out.finished_sending == ({req.request_id} if held else set())
    sched.update_connector_output(out)
    sched.build_connector_meta(step([]))  # the commit and release, behind this step's fence
    assert sched.scheduler.settle()
    time.sleep(0.3)  # the idle scheduler reports its fences (the heartbeat thread)
    return saved


@pytest.mark.parametrize("save_generated", [True, False])
def test_generated_blocks_are_saved_in_the_step_after_their_append(
        tmp_path: Path, model_dir: Path, save_generated: bool) -> None:
    d = start_daemon(tmp_path / "blockd")
    # commit_interval_s 0: every step sends what it has, so the step each save lands in is
    # exact (the prompt's commit, which an append waits for, goes at once).
    extra = connector_config(d, "acme", "alice", save_generated=save_generated,
                             commit_interval_s=0)["kv_connector_extra_config"]
    sched = _connector(model_dir, extra, "SCHEDULER")
    worker = _connector(model_dir, extra, "WORKER")
    kv = Blocks()
    worker.register_kv_caches(kv.caches)
    vblocks = {"a": [0, 1, 2, 3, 4], "b": [5, 6, 7, 8, 9], "next": [10, 11, 12, 13, 14, 15]}
    owner = {"a": "a", "b": "b", "next-a": "next", "next-b": "next"}
    sched.scheduler.block_ids_of = lambda rid: (vblocks[owner[rid]],)
    try:
        # a: 80 prompt tokens, generates until 128 tokens: token 127 is sampled last and has no
        # K/V, so block 3 (tokens 96..127) is not saved; blocks 2 and the prompt's are.
        # Block 2 is appended in the step computing token 95's K/V and saved in the next.
        a = request("a", list(range(1, 81)))
        assert ask(sched, a) == (0, False)
        saved = converse(sched, worker, a, vblocks["a"], 128)
        want = [[0, 1]] + [[2] if save_generated and i == 96 - 80 + 1 else []
                           for i in range(1, 128 - 80 + 1)]
        assert saved == want
        # b: the same prompt length, one token more: block 3's last token now has K/V, in
        # the request's last step: vLLM keeps its blocks for the step that saves block 3.
        b = request("b", list(range(201, 281)))
        assert ask(sched, b) == (0, False)
        saved = converse(sched, worker, b, vblocks["b"], 129, held=save_generated)
        assert [s for s in saved if s] == ([[5, 6], [7], [8]] if save_generated else [[5, 6]])
        assert saved[-1] == ([8] if save_generated else [])  # after the end, held
        # The next turns: previous prompt + answer + new text.
        for prev, hit_on, hit_off, vb in ((a, 96, 64, vblocks["a"]),
                                          (b, 128, 64, vblocks["b"])):
            nxt = request(f"next-{prev.request_id}", list(prev.all_token_ids) + [7] * 20)
            hit = hit_on if save_generated else hit_off
            assert ask(sched, nxt) == (hit, False)
            sched.update_state_after_alloc(nxt, kv_blocks(vblocks["next"]), hit)
            meta = sched.build_connector_meta(step([(nxt, vblocks["next"], hit, 20)]))
            assert meta.load_vllm == vblocks["next"][:hit // B]
            for t in kv.caches.values():
                t[10:16].zero_()
            run_worker(worker, meta)
            # The bytes of the previous turn's own vLLM blocks, block for block.
            assert all(kv.same(10 + j, vb[j]) for j in range(hit // B))
            sched.request_finished(nxt, vblocks["next"])
            sched.build_connector_meta(step([]))
        counters = sched.scheduler.counters
        assert counters["generated_blocks"] == (3 if save_generated else 0)
    finally:
        worker.shutdown()
        sched.shutdown()
        d.stop()


def test_blocks_completed_while_an_append_is_in_flight_are_saved_after_the_end(
        tmp_path: Path, model_dir: Path) -> None:
    """blockd answers slowly (frozen, SIGSTOP): the append of block 2 is in flight while the
    request computes block 3's K/V and ends. vLLM keeps its blocks; once blockd answers, the
    empty steps after the end save block 2, append block 3 and save it, then let the blocks go
    (``finished_sending``): the next turn hits all four blocks, as when blockd is fast."""
    import signal

    d = start_daemon(tmp_path / "blockd")
    extra = connector_config(d, "acme", "alice", rpc_timeout_s=30.0, commit_interval_s=0)[
        "kv_connector_extra_config"]
    sched = _connector(model_dir, extra, "SCHEDULER")
    worker = _connector(model_dir, extra, "WORKER")
    worker.register_kv_caches(Blocks().caches)
    vblocks = [0, 1, 2, 3, 4]
    sched.scheduler.block_ids_of = lambda rid: (vblocks,)
    try:
        req = request("slow", list(range(1, 81)))
        assert ask(sched, req) == (0, False)
        sched.update_state_after_alloc(req, kv_blocks(vblocks), 0)
        meta = sched.build_connector_meta(step([(req, vblocks, 0, 80)]))
        assert sched.scheduler.settle()
        sched.update_connector_output(run_worker(worker, meta))
        req.append_output_token_ids(500)
        frozen = False
        try:
            while len(req.all_token_ids) < 129:  # token 128 is sampled last: no K/V
                computed = len(req.all_token_ids) - 1
                if computed == 95:  # this step appends block 2; blockd answers later
                    d.signal(signal.SIGSTOP)
                    frozen = True
                meta = sched.build_connector_meta(decode_step(req, computed))
                if not frozen:
                    assert sched.scheduler.settle()
                sched.update_connector_output(run_worker(worker, meta))
                req.append_output_token_ids(500 + len(req.all_token_ids) % 400)
            req.num_computed_tokens = len(req.all_token_ids) - 1
            assert sched.request_finished(req, vblocks) == (True, None)  # held
        finally:
            d.signal(signal.SIGCONT)
        for _ in range(10):  # the empty steps vLLM runs while it keeps a request's blocks
            assert sched.scheduler.settle(40.0)
            out = run_worker(worker, sched.build_connector_meta(step([])))
            sched.update_connector_output(out)
            if out.finished_sending:
                break
        assert out.finished_sending == {"slow"}
        sched.build_connector_meta(step([]))  # the commit and release
        assert sched.scheduler.settle()
        time.sleep(0.3)  # the idle scheduler reports its fences (the heartbeat thread)
        assert sched.scheduler.counters["generated_blocks"] == 2
        nxt = request("next", list(req.all_token_ids) + [7] * 20)
        assert ask(sched, nxt) == (128, False)
    finally:
        worker.shutdown()
        sched.shutdown()
        d.stop()


# -- real engines -------------------------------------------------------------------------------

TURNS = 3
MAX_TOKENS = 80
CONVERSATIONS = 2


def conversations(seed: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Per conversation a first prompt and the user's text of each later turn."""
    rng = random.Random(seed)
    first = [[rng.randrange(1, 1000) for _ in range(rng.randrange(60, 110))]
             for _ in range(CONVERSATIONS)]
    users = [[[rng.randrange(1, 1000) for _ in range(rng.randrange(8, 30))]
              for _ in range(TURNS)] for _ in range(CONVERSATIONS)]
    return first, users


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator:
    with start_daemon(tmp_path_factory.mktemp("blockd")) as d:
        yield d


@pytest.fixture(scope="module")
def engines(daemon, model_dir: Path) -> Iterator[Prestarted]:
    def engine(who: str, **extra: object):  # type: ignore[no-untyped-def]
        return lambda: Engine(model_dir, connector_config(daemon, "acme", who, **extra),
                              wait=False)

    started = Prestarted({"first": engine("alice"), "second": engine("alice2"),
                          "prompts_only": engine("alice", save_generated=False)})
    yield started
    started.close()


def run_turns(engine: Engine, alone: Engine, seed: int, turns: int
              ) -> tuple[list[list[list[int]]], list[list[int]]]:
    """``turns`` turns of the conversations on ``engine``, each turn's tokens checked against
    vLLM alone; returns each turn's prompts and what each request got from blockd."""
    first, users = conversations(seed)
    prompts, cached = [], []
    current = first
    for turn in range(turns):
        out = undegraded(engine, lambda: engine.generate(current,  # noqa: B023 (called now)
                                                         max_tokens=MAX_TOKENS))
        assert out["tokens"] == alone.generate(current, max_tokens=MAX_TOKENS)["tokens"], turn
        prompts.append(current)
        cached.append(out["num_cached"])
        current = [p + answer + users[c][turn]
                   for c, (p, answer) in enumerate(zip(current, out["tokens"], strict=True))]
    prompts.append(current)  # the next turn's prompts
    return prompts, cached


def test_next_turn_hits_the_previous_answer(daemon, alone: Engine, engines: Prestarted) -> None:
    with engines.take("first") as e1:
        prompts, cached = run_turns(e1, alone, seed=5, turns=TURNS)
        retired(daemon)  # before another engine continues the conversations
    # Turn n+1 on the same engine: every full block of turn n's prompt + answer whose K/V
    # was computed (the last answer token has none) came from blockd.
    for turn in range(1, TURNS):
        prev = prompts[turn - 1]
        assert cached[turn] == [(len(p) + MAX_TOKENS - 1) // B * B for p in prev], turn
        # (more than the previous prompt's own blocks: the answer's are hits too)
        assert all(c > len(p) // B * B for c, p in zip(cached[turn], prev, strict=True))
    # A fresh engine on the same daemon continues each turn: its prompts' blocks that cover
    # turn n's answer come from blockd (counted by vLLM per request and by blockd).
    with engines.take("second") as e2:
        before = stats(daemon).prefix_hit_tokens_total
        for turn in range(1, TURNS + 1):
            out = undegraded(e2, lambda: e2.generate(prompts[turn],  # noqa: B023 (called now)
                                                     max_tokens=MAX_TOKENS))
            want = alone.generate(prompts[turn], max_tokens=MAX_TOKENS)["tokens"]
            assert out["tokens"] == want, turn
            if turn < TURNS:  # turn `turn` itself ran on engine 1: its whole prompt is in
                expected = [(len(p) - 1) // B * B for p in prompts[turn]]
            else:  # the new turn: what turn 3's prompt and answer left
                expected = [(len(p) + MAX_TOKENS - 1) // B * B for p in prompts[turn - 1]]
            assert out["num_cached"] == expected, turn
            assert out["metrics"]["vllm:external_prefix_cache_hits"] >= sum(expected)
        served = stats(daemon).prefix_hit_tokens_total - before
    assert served >= sum(expected)


def test_without_saving_answers_only_previous_prompts_hit(alone: Engine,
                                                          engines: Prestarted) -> None:
    with engines.take("prompts_only") as e:
        prompts, cached = run_turns(e, alone, seed=9, turns=TURNS)
    for turn in range(1, TURNS):  # every full block of the previous prompt, no more
        assert cached[turn] == [len(p) // B * B for p in prompts[turn - 1]], turn
