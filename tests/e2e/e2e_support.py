"""Shared pieces of the end-to-end tests: the model, a daemon configured for it, workloads and
the comparison with the contiguous reference.

Tolerance: the paged path and the reference compute in fp32 from the same weights, so they
differ only by summation order (observed ~2e-6 on logits of magnitude ~1-10). ``ATOL`` = 1e-4
against the reference; ``SAME_ATOL`` = 1e-5 between two paged runs of the same request, which
differ only in what else was batched with it.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from daemon_proc import TENANTS, TOKENS, Daemon, start

from blockd_apps.reference import (
    Engine,
    EngineConfig,
    ModelConfig,
    Request,
    RequestState,
    Sample,
    TinyLlama,
)
from blockd_client import Client

MODEL_CONFIG = ModelConfig(vocab_size=256, d_model=64, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=16, ffn_dim=128, seed=0)
BLOCK_SIZE = 4
ATOL = 1e-4
SAME_ATOL = 1e-5
#: Tenant -> the worker credential that acts for it (tests/server/daemon_proc.TENANTS).
WHO = {"acme": "alice", "globex": "bob", "initech": "carol", "umbrella": "dave"}


def start_daemon(workdir: Path, num_blocks: int, *, quota: int | None = None,
                 extra: dict[str, dict[str, Any]] | None = None) -> Daemon:
    """A daemon whose pool has the model's layout (fp32, block size 4). ``quota``: every
    tenant's quota in blocks (default: the whole pool). Use it in a ``with`` block: leaving it
    stops the daemon."""
    tenants = copy.deepcopy(TENANTS)
    for t in tenants["tenants"]:
        t["quota_blocks"] = num_blocks if quota is None else quota
    cfg = {"pool": MODEL_CONFIG.pool_config(BLOCK_SIZE, num_blocks)}
    for section, values in (extra or {}).items():
        cfg.setdefault(section, {}).update(values)
    return start(workdir, num_blocks=num_blocks, extra=cfg, tenants=tenants)


def client(d: Daemon, tenant: str) -> Client:
    return Client(f"unix:{d.endpoints['unix']}", token=TOKENS[WHO[tenant]])


def engine(c: Client, tenant: str, model: TinyLlama, **config: Any) -> Engine:
    config.setdefault("check_tables", True)
    return Engine.attach(c, tenant, model, BLOCK_SIZE, config=EngineConfig(**config))


def run_engine(d: Daemon, tenant: str, model: TinyLlama, requests: Iterable[Request],
               on_step: Callable[[Engine], None] | None = None, **config: Any
               ) -> tuple[Engine, list[RequestState], Any]:
    """Attach, run ``requests`` to completion, read the daemon's Stats, detach.

    Returns (engine, request states, Stats as an admin sees them: a tenant's own credential
    gets no pool-wide counters). Detaching matters: a daemon stopping with sessions attached
    waits its drain grace period for them."""
    with client(d, tenant) as c:
        e = engine(c, tenant, model, **config)
        e.on_step = on_step
        try:
            states = e.run(requests)
            return e, states, admin_stats(d)
        finally:
            e.close()


def admin_stats(d: Daemon) -> Any:
    """The daemon's pool-wide Stats (the admin credential of tests/server/daemon_proc.py)."""
    with Client(f"unix:{d.endpoints['unix']}", token=TOKENS["admin"]) as admin:
        return admin.stats()


def shared_prompt_workload(seed: int = 0, num_requests: int = 10, *, forks: bool = True,
                           cache: bool = True) -> list[Request]:
    """Requests on two system prompts (lengths not multiples of the block size, so forks
    share a partly filled block), unique user suffixes, staggered arrivals, n in 1..3."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 256) for _ in range(n)] for n in (14, 19)]
    out = []
    for i in range(num_requests):
        user = [rng.randrange(1, 256) for _ in range(rng.randint(2, 9))]
        out.append(Request(systems[i % 2] + user, max_new_tokens=rng.randint(4, 9),
                           n=(1 + i % 3) if forks else 1, request_id=f"req{i}", cache=cache,
                           arrival=1 + 2 * i))
    return out


def samples(states: Iterable[RequestState]) -> list[Sample]:
    return [s for st in states for s in st.samples]


def reference_logits(model: TinyLlama, s: Sample) -> torch.Tensor:
    """Logits a contiguous, no-cache forward gives at each of ``s``'s generated positions, on
    the sample's own token history: ``[num_generated, V]``."""
    prompt_len = len(s.request.prompt)
    return model(s.tokens[:-1])[prompt_len - 1:].cpu()


def assert_matches_reference(model: TinyLlama, states: Iterable[RequestState],
                             atol: float = ATOL) -> int:
    """Every generated position of every sample against the contiguous reference; returns
    how many positions were compared."""
    n = 0
    for s in samples(states):
        assert s.state == "done" and len(s.generated) == s.request.max_new_tokens
        assert len(s.logits) == len(s.generated)
        got = torch.stack(s.logits)
        torch.testing.assert_close(got, reference_logits(model, s), atol=atol, rtol=0,
                                   msg=lambda m, s=s: f"{s.request.request_id}[{s.index}]: {m}")
        n += got.shape[0]
    return n


def assert_same_outputs(a: Sample, b: Sample) -> None:
    """``b`` generated the tokens ``a`` did, with the same logits up to summation order
    (``SAME_ATOL``): one request served in other company (batching, block placement, the
    prefix cache off, preemption)."""
    assert a.tokens == b.tokens, f"{a.request.request_id}[{a.index}]"
    torch.testing.assert_close(torch.stack(b.logits), torch.stack(a.logits), atol=SAME_ATOL,
                               rtol=0, msg=lambda m: f"{a.request.request_id}[{a.index}]: {m}")


def assert_same_runs(a: Iterable[RequestState], b: Iterable[RequestState]) -> None:
    """Two runs of one workload: every sample pairwise as in ``assert_same_outputs``."""
    for x, y in zip(samples(a), samples(b), strict=True):
        assert_same_outputs(x, y)


def run_together(engines: list[Engine], on_step: Callable[[], None] | None = None) -> None:
    """Step several engines (one per tenant) in lockstep until all are done. After each step
    the engine reports its completed fence over RPC, so what one engine committed is visible
    to the next engine's admissions in the same round."""
    while any(e.busy for e in engines):
        for e in engines:
            if e.busy:
                e.step()
                e.sync()
        if on_step is not None:
            on_step()
