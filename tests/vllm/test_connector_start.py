"""Engine start and exit with the connector (issue 27, item 3), real engines on real daemons.

A refusal at start (the connector's: a pool of another layout; vLLM's own: a block size its CPU
attention cannot run) ends the engine process by itself with an error naming the key, and
leaves none of its processes behind (the connector's other refusals, from the same constructor,
are checked without an engine in test_connector_faults.py). An engine that exits cleanly
detaches its session (blockd logs ``reason=detach``, not ``lease expired``): checked on the
engines other tests start anyway, the tensor-parallel one (test_connector_tp.py, ``LLM``'s
processes) and the OpenAI server (test_serve.py). The engines'
start-up timeout (``START_TIMEOUT_S``, minutes) is only the hang guard: the tests wait for
the process to end, they time nothing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_support import (
    POOL,
    TENANTS,
    Engine,
    connector_config,
    daemon_proc,
)

from blockd_apps.vllm_engine import START_TIMEOUT_S

#: vLLM's CPU build reserves one more core with a kv_transfer_config; on 2 cores that starves
#: the worker (docs/vllm.md, "On CPU").
ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


def alive_in_group(pgid: int) -> list[int]:
    """Processes of process group ``pgid`` that are still running (zombies excluded)."""
    alive = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(entry))
    return alive


def ended_by_itself(engine: Engine) -> str:
    """Wait for an engine that must refuse to start; its log. Fails (after the hang guard) if
    it did not end by itself, or if any of its processes outlived it."""
    try:
        code = engine.proc.wait(START_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - the hang guard: report what it printed
        engine.kill()
        pytest.fail("the engine neither started nor ended (hung):\n" + engine.log()[-4000:])
    deadline = time.monotonic() + 60  # vLLM's own teardown of its children (a guard only)
    while alive_in_group(engine.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = alive_in_group(engine.proc.pid)
    engine.kill()
    log = engine.log()
    assert code != 0, log[-4000:]  # (a started engine waits for requests: it never ends)
    assert not left, f"processes of the failed engine still running: {left}\n{log[-3000:]}"
    return log


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """A daemon whose pool has 3 layers (the model has 2), one with blocks of 16 (vLLM's CPU
    attention needs multiples of 32); tenants acme and globex."""
    root = tmp_path_factory.mktemp("blockd-start")
    layers = daemon_proc.start(root / "layers", num_blocks=64, tenants=TENANTS,
                               extra={"pool": {**POOL, "num_layers": 3}})
    small = daemon_proc.start(root / "small", num_blocks=64, tenants=TENANTS,
                              extra={"pool": {**POOL, "block_size": 16}})
    for d in (layers, small):
        (d.workdir / "alice.token").write_text("tok-alice\n")
    try:
        yield {"layers": layers, "small": small}
    finally:
        for d in (layers, small):
            d.stop()


@pytest.fixture(scope="module")
def refusals(request: pytest.FixtureRequest, daemons: dict, model_dir: Path
             ) -> Iterator[dict[str, Engine]]:
    """The engines that must refuse to start, started at once (each start-up is half a minute
    of imports that waits on nothing), for the tests this run selected; each test waits for
    its own to end (``ended_by_itself``)."""
    specs: dict[str, tuple[dict, dict]] = {
        "layout": (connector_config(daemons["layers"], "acme", "alice"), {}),
        "block_size": (connector_config(daemons["small"], "acme", "alice"),
                       {"block_size": 16}),
    }
    selected = {item.name for item in request.session.items}
    engines = {name: Engine(model_dir, kv, wait=False, env=ENV, one_process=False, **options)
               for name, (kv, options) in specs.items()
               if any(f"_{name}_" in test for test in selected)}
    try:
        yield engines
    finally:
        for engine in engines.values():
            engine.kill()


def test_layout_mismatch_ends_the_engine_naming_both_layouts(refusals: dict) -> None:
    """The connector's refusal (here a pool of 3 layers for a model of 2) ends the engine.
    The other refusals at start (unknown tenant, bad token, unreachable target, another block
    size) raise the same way from the connector's constructor, which vLLM's own factory builds
    in test_connector_faults.py; their messages are checked there."""
    log = ended_by_itself(refusals["layout"])
    assert "layout mismatch: the pool has num_layers=3, the worker expects 2" in log
    assert "vLLM: num_layers=2 block_size=32" in log


def test_block_size_vllm_cannot_run_ends_the_engine(refusals: dict) -> None:
    """blockd's pool and vLLM agree on 16, but vLLM's CPU attention cannot run it: vLLM's own
    refusal, after the model load, ends the engine too."""
    log = ended_by_itself(refusals["block_size"])
    assert "No common block size for 16" in log
