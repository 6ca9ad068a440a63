"""Where the scheduler side's own threads run on a CPU engine: off the workers' cores.

vLLM's CPU build binds each worker's OpenMP threads to cores of its own and keeps the rest
(``VLLM_CPU_NUM_OF_RESERVED_CPU``; ``OMPProcessManager.reserved_cpu_list``) for the other
processes, the engine core among them, but it binds no thread of the engine core: the kernel
runs them on any CPU, the workers' included. The threads this connector adds to the engine
core (the outbox's, which makes the Steps and applies their answers; the heartbeat's; those
gRPC starts for the channel) wake many times per call, and one woken on a worker's core
preempts the worker in the middle of its forward. So they are started bound to the CPUs vLLM
keeps for the other processes, computed by vLLM's own ``OMPProcessManager`` from the engine's
config, as the workers' copy thread is bound to the cores the workers leave free
(``blockd_vllm.copier``). vLLM's own threads are left as vLLM made them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger("blockd_vllm")


def engine_side_cpus(vllm_config: Any) -> set[int] | None:
    """The CPUs, of those this process may use, that vLLM keeps for the processes other than
    its CPU workers: the reserved ones when it binds the workers itself (``auto``), the ones
    no rank's list names when ``VLLM_CPU_OMP_THREADS_BIND`` lists them. None when the workers
    are not CPU workers, are not bound (``nobind``), or leave no CPU over."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    quiet = logging.getLogger("vllm.utils.ompmultiprocessing")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # vLLM logs the same binding when it starts the workers
    try:
        manager = OMPProcessManager(vllm_config)
    except (AssertionError, RuntimeError, ValueError) as err:
        log.debug("blockd_vllm: vLLM's CPU binding could not be computed: %s", err)
        return None
    finally:
        quiet.setLevel(level)
    if manager.skip_setup:
        return None
    allowed = os.sched_getaffinity(0)
    if manager.auto_setup:
        spare = set(manager.reserved_cpu_list)
    else:
        spare = allowed - {cpu for ids in manager.cpu_lists for cpu in ids}
    return (spare & allowed) or None


@contextmanager
def bound(cpus: set[int] | None) -> Iterator[None]:
    """Run the block with the calling thread bound to ``cpus`` (None: as it is): the threads it
    starts meanwhile inherit the binding; the caller's own comes back after."""
    if not cpus:
        yield
        return
    own = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as err:  # a cpuset narrower than vLLM saw: stay where we are
        log.debug("blockd_vllm: threads not bound to %s: %s", sorted(cpus), err)
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)
