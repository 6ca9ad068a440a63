"""The tests' one-process engines are forks of a process that imported vLLM once
(``tests/vllm/engine_fork.py``): each must still be an engine of its own, as a fresh process
would be: the tokens a fresh engine process computes, its own process group, the environment
its test gave it, its real exit status, its error in its log."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from vllm_support import Engine, EngineFailed, ProcessEngine, shared_prefix_workload

REPO = Path(__file__).resolve().parents[2]


def group_members(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == pgid:
                    members.append(int(entry))
            except ProcessLookupError:
                pass
    return members


def test_a_forked_engine_computes_the_tokens_of_a_fresh_engine_process(model_dir: Path,
                                                                      alone: Engine) -> None:
    prompts = shared_prefix_workload(seed=11)
    with ProcessEngine(model_dir, one_process=True) as fresh:  # python -m, no fork
        assert fresh.generate(prompts)["tokens"] == alone.generate(prompts)["tokens"]


def test_a_forked_engine_is_a_group_of_its_own_with_its_env_and_exit_status(
        model_dir: Path, alone: Engine) -> None:
    assert " INFO " not in alone.log(), alone.log()[-2000:]
    # The do-nothing connector of bench/: importable only through the PYTHONPATH given here.
    noop = {"kv_connector": "NoopConnector", "kv_connector_module_path": "noop_connector",
            "kv_role": "kv_both"}
    env = {"PYTHONPATH": str(REPO / "bench"), "VLLM_LOGGING_LEVEL": "INFO"}
    with Engine(model_dir, noop, env=env) as e:
        pid = e.proc.pid
        out = e.generate([[1, 2, 3] * 20], max_tokens=2)
        assert len(out["tokens"][0]) == 2
        # vLLM logs at the level of the engine's environment (the forker imported it at
        # WARNING, the engines' default, at which the forked `alone` logs no INFO line).
        assert " INFO " in e.log(), e.log()[-2000:]
        # One process: vLLM's multiprocessing is off (VLLM_ENABLE_V1_MULTIPROCESSING=0 came
        # with the environment the engine was given), in a group of its own, in this session.
        assert group_members(pid) == [pid]
        assert os.getsid(pid) == os.getsid(0)
        e.kill()
        assert e.proc.returncode == -9
        assert group_members(pid) == []


def test_a_forked_engine_that_fails_to_start_ends_with_its_error(tmp_path: Path) -> None:
    e = Engine(tmp_path / "no-such-model", wait=False)
    with pytest.raises(EngineFailed, match="no-such-model"):
        e.ready()
    assert e.proc.returncode == 1
