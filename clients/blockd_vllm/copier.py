"""A CPU worker's copy thread: a step's saves into blockd's pool run after the step returns.

On CUDA a save is already off the critical path (enqueued on the compute stream, the fence
published by the GPU after it). On CPU tensors ``wait_for_save`` used to copy every block
before vLLM got the step's output back, so the next step waited for the copies. Here they run
on one thread, in the order the steps handed them out, while the engine core takes the output,
schedules and sends the next step (and, where the machine has a core the workers are not bound
to, during the next forward too). Each job ends by publishing its step's fence and filing its
report, so blockd sees a block saved, and vLLM gets a held request's blocks back, only once the
bytes are in. The thread is bound to the CPUs the workers are not (``cpus``), or left on the
worker's when there are none.

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


def spare_cpus() -> set[int]:
    """The CPUs this process may use that no worker is bound to: the calling thread's (vLLM
    binds a CPU worker's threads to its cores) and the cores ``VLLM_CPU_OMP_THREADS_BIND``
    lists for every rank (``"0-3|4-7"``), taken out; the calling thread's own when that leaves
    none."""
    own = os.sched_getaffinity(0)
    bound = set(own)
    binding = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if binding not in ("auto", "nobind", "all"):
        try:
            bound |= set(_cpu_list(binding.replace("|", ",")))
        except ValueError:
            return own
    try:
        allowed = set(_cpu_list(_cgroup_cpus()))
    except (OSError, ValueError):
        allowed = set(range(os.cpu_count() or 1))
    return (allowed - bound) or own


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


def _cpu_list(text: str) -> list[int]:
    """``"0-3,6"`` -> ``[0, 1, 2, 3, 6]``."""
    cpus: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


class Copier:
    def __init__(self, cpus: set[int]) -> None:
        self.cpus = cpus
        self._jobs: deque[Callable[[], None]] = deque()
        #: Jobs submitted and not finished (queued or running).
        self._open = 0
        self._stop = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="blockd-vllm-copies",
                                        daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """A job is queued or running (only the submitting thread adds any)."""
        return self._open > 0

    def submit(self, job: Callable[[], None]) -> None:
        with self._cv:
            self._jobs.append(job)
            self._open += 1
            self._cv.notify_all()

    def drain(self) -> None:
        """Wait until every job submitted so far has run."""
        with self._cv:
            self._cv.wait_for(lambda: self._open == 0)

    def close(self) -> None:
        """Run what is queued, then end the thread."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join()

    def _run(self) -> None:
        try:
            os.sched_setaffinity(0, self.cpus)
        except OSError as err:  # (a cpuset narrower than the cgroup said: stay where we are)
            log.debug("blockd_vllm: copy thread not bound to %s: %s", sorted(self.cpus), err)
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._jobs or self._stop)
                if not self._jobs:
                    return
                job = self._jobs.popleft()
            try:
                job()
            except Exception:  # a job files its own failure; never lose the thread
                log.exception("blockd_vllm: a save job failed")
            finally:
                with self._cv:
                    self._open -= 1
                    self._cv.notify_all()
