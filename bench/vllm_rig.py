"""What the vLLM benchmarks share: the models, blockd daemons with the pool a model needs, the
connector configurations (BlockdConnector, the do-nothing one), and reading the daemon's and the
engine's counters around a call.

The engines themselves are ``blockd_apps.vllm_engine.Engine`` (one process each, the tests' own);
the tiny Llama is ``blockd_apps.vllm_engine.tiny_model`` (the tests'). ``prefill_model`` is a
Llama whose prefill costs real time on a CPU (8 layers, hidden 1024), random weights as every
model here (no trained weights are reachable).
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
sys.path.insert(0, str(ROOT / "apps"))

from blockd_apps.launch import Launched, spawn  # noqa: E402

#: The tests' tiny Llama (``tiny_model``) as blockd's pool holds it.
POOL = {"block_size": 32, "num_layers": 2, "num_kv_heads": 2, "head_dim": 32,
        "dtype": "float32", "num_blocks": 4096}

#: ``prefill_model``'s shape: 16 query heads and 4 KV heads of 64 (the CPU attention backend
#: takes head sizes 32, 64, 80, 96, 112, 128, 256), a small vocabulary (its embedding and
#: output layer would otherwise dominate), ~71 M parameters.
PREFILL = {"vocab_size": 1024, "hidden_size": 1024, "intermediate_size": 2048,
           "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4,
           "max_position_embeddings": 4096}
#: 512 KiB a block (8 layers x K,V x 32 tokens x 4 heads x 64 x 4 bytes).
PREFILL_POOL = {"block_size": 32, "num_layers": 8, "num_kv_heads": 4, "head_dim": 64,
                "dtype": "float32", "num_blocks": 768}

#: The variable that gives an engine with a ``kv_transfer_config`` vLLM's usual CPU binding
#: (docs/vllm.md): vLLM 0.32's CPU build otherwise reserves one more core for NIXL, which on a
#: 2-core machine leaves the worker's OpenMP threads spinning against the engine core.
RESERVED_CPU = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def reserve_one_cpu() -> str:
    """Set ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` for every engine started from here (the value
    given by the caller's environment wins); the value in force."""
    os.environ.setdefault(RESERVED_CPU, "1")
    return os.environ[RESERVED_CPU]


def run_record(what: str, args: Any) -> dict[str, Any]:
    """The head of a vLLM benchmark's JSON: what it measures, the CPU binding in force (set
    here, ``reserve_one_cpu``), the machine and its load at the start, when, the arguments."""
    return {
        "what": what,
        "env": {RESERVED_CPU: reserve_one_cpu()},
        "machine": {"cpus": os.cpu_count(), "load_at_start": list(os.getloadavg()),
                    "platform": platform.platform()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }


def write_run(result: dict[str, Any], out: Path, summary_line: str,
              plot: Any) -> None:
    """``result`` with its ``summary_line`` to ``out`` (JSON), ``plot(result, png)`` beside it,
    the line printed last (the tests read it)."""
    result["summary_line"] = summary_line
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(summary_line, flush=True)


def prefill_model(path: Path, seed: int = 0) -> Path:
    """A random float32 Llama of ``PREFILL``'s shape, saved with transformers."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**PREFILL)).save_pretrained(path)
    return path


def start_blockd(work: Path, pool: dict[str, Any] | None = None) -> Launched:
    """``blockd serve`` in ``work`` (its sockets there, tenant ``default``), the pool ``pool``
    (the tiny model's by default); metrics rendered on every scrape (``cache_ms: 0``), so a
    counter read right after a call includes it."""
    work.mkdir(parents=True, exist_ok=True)
    cfg = {"server": {"unix_socket": str(work / "blockd.sock"), "tcp_address": "127.0.0.1:0",
                      "handle_socket": str(work / "pool.sock")},
           "metrics": {"address": "127.0.0.1:0", "cache_ms": 0}, "pool": pool or POOL}
    path = work / "blockd.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return spawn(path, work)


#: The connector's call deadline in these benchmarks (2 s by default): on a loaded 2-core
#: machine running three engines a call can take longer, and a connector that degrades
#: computes without the cache: a fault, not what the overhead and hit figures measure. Every
#: repetition's connector counters (degraded episodes among them) are in the JSON
#: (``connector_counters``).
RPC_TIMEOUT_S = 10.0


#: The session lease of a benchmark's engine: the engines not measured are stopped (SIGSTOP)
#: during a call (``vllm_measured.alone``), up to three 4-s prompts of the TTFT phase in a row,
#: and a session must not be reaped meanwhile (blockd's default lease is 10 s).
LEASE_MS = 120_000


def connector(work: Path) -> dict[str, Any]:
    """BlockdConnector on the daemon ``start_blockd(work)`` started."""
    return {"kv_connector": "BlockdConnector", "kv_connector_module_path": "blockd_vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"target": f"unix:{work / 'blockd.sock'}",
                                          "tenant": "default",
                                          "rpc_timeout_s": RPC_TIMEOUT_S,
                                          "lease_ms": LEASE_MS}}


def noop_connector() -> dict[str, Any]:
    """``bench/noop_connector.py``: a real connector that answers 0 hits and saves nothing
    (the engine needs ``noop_env()``)."""
    return {"kv_connector": "NoopConnector", "kv_connector_module_path": "noop_connector",
            "kv_role": "kv_both"}


def noop_env() -> dict[str, str]:
    """An engine's environment with ``bench/`` importable (vLLM imports the connector module
    in the engine core and in every worker process)."""
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": f"{BENCH}{os.pathsep}{path}" if path else str(BENCH)}


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([-+0-9.eEinfNa]+)$")


def daemon_counter(daemon: Launched, name: str) -> float:
    """The sum over labels of metric ``name`` in the daemon's ``/metrics`` exposition."""
    with urllib.request.urlopen(f"http://{daemon.endpoints['metrics']}/metrics",
                                timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) == name:
            total += float(m.group(3))
    return total


def retired(daemon: Launched, timeout: float = 60.0) -> None:
    """Wait (untimed) until ``daemon`` holds no sequence and no block waits for a fence: the
    requests engines ran are committed there. A connector commits behind vLLM's answer (a few
    round trips), so an engine meant to hit what another just computed is called after this."""
    deadline = time.monotonic() + timeout
    while (daemon_counter(daemon, "blockd_sequences")
           or daemon_counter(daemon, "blockd_pending_blocks")):
        if time.monotonic() > deadline:
            raise SystemExit(f"blockd still holds the engines' requests after {timeout} s")
        time.sleep(0.05)


def keep_off(daemon: Launched, cpus: set[int]) -> list[int]:
    """Bind every thread of ``daemon`` to the CPUs outside ``cpus`` (the threads it starts later
    inherit it), as a sidecar is kept off a CPU node's worker cores; the CPUs it may use now
    (all of them when ``cpus`` leaves none)."""
    allowed = set(os.sched_getaffinity(daemon.proc.pid)) - cpus
    if not allowed:
        return sorted(os.sched_getaffinity(daemon.proc.pid))
    for task in Path(f"/proc/{daemon.proc.pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), allowed)
        except OSError:
            continue  # a thread that just ended
    return sorted(allowed)


#: vLLM's stat logger prints a connector's ``KVConnectorStats.reduce()`` on this line, every
#: ``VLLM_LOG_STATS_INTERVAL`` seconds, when vLLM logs at INFO (``stats_env``).
KV_LINE = "KV Transfer metrics:"
_PAIR = re.compile(r"(\w+)=(-?[0-9.]+(?:e-?[0-9]+)?)")


def stats_env() -> dict[str, str]:
    """An engine environment in which vLLM logs its stats (the connector's figures included)
    every second: give it to every engine compared, so all pay the same logging."""
    return {"VLLM_LOGGING_LEVEL": "INFO", "VLLM_LOG_STATS_INTERVAL": "1"}


def take_connector_lines(lines: Any) -> list[dict[str, float]]:
    """Remove the connector-stats lines from an engine's output buffer (``Engine.lines``), each
    as ``{name: value}`` of whatever the connector reports (none is required)."""
    out = []
    for line in [ln for ln in list(lines) if KV_LINE in ln]:
        lines.remove(line)
        out.append({k: float(v) for k, v in _PAIR.findall(line.split(KV_LINE, 1)[1])})
    return out
