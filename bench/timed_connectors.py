"""BlockdConnector and the do-nothing connector with a clock on every hook vLLM calls, for
bench/vllm_timeline.py: where the time a call takes more with BlockdConnector goes.

vLLM loads them by name like any connector (``"kv_connector": "TimedBlockd"`` or
``"TimedNoop"``, ``"kv_connector_module_path": "timed_connectors"``, ``bench/`` on the engine's
``PYTHONPATH``). Each process of the engine (the engine core with the scheduler role, each
worker) appends ``name<TAB>monotonic ns`` lines to ``$BLOCKD_TIMELINE-<pid>.tsv`` (written every
half second and at shutdown; the clock is the machine's, so the processes' lines order on one
axis). Both connectors pay the same clock: two ``time.monotonic_ns()`` per hook.

Names: ``new`` (``on_new_request``), ``ask`` (``get_num_new_matched_tokens``),
``meta:<tokens>:<requests>`` (``build_connector_meta``, with the step's scheduled tokens and
requests), ``out`` (``update_connector_output``), ``fin`` (``request_finished``) on the
scheduler's side;
``pre`` (``handle_preemptions``, the first hook of every step: BlockdConnector lets its copy
thread run the earlier steps' saves there), ``load`` (``start_load_kv``, which vLLM calls after
the forward when no load must precede it),
``save`` (``wait_for_save``: the forward is done), ``done`` (``get_finished``) on the worker's;
each followed by its ``_end`` (one worker: ``bench/vllm_timeline.py`` pairs an entry with the
next exit of the same name, which two tensor-parallel workers' lines would interleave).
BlockdConnector's Steps to the daemon (on its outbox thread) are
``step:<operations>`` / ``step_end``: this wraps ``blockd_vllm.outbox.Steps.call``, the one
place every Step goes through, for the process's lifetime (a benchmark's engine, never a
served one).
"""

from __future__ import annotations

import os
import time
from typing import Any

from blockd_vllm import BlockdConnector, outbox
from noop_connector import NoopConnector

ENV = "BLOCKD_TIMELINE"
FLUSH_S = 0.5


class Recorder:
    def __init__(self) -> None:
        self.prefix = os.environ.get(ENV)
        self.lines: list[str] = []
        self.flushed = time.monotonic()

    def mark(self, name: str) -> None:
        self.lines.append(f"{name}\t{time.monotonic_ns()}\n")

    def maybe_flush(self) -> None:
        if time.monotonic() - self.flushed >= FLUSH_S:
            self.flush()

    def flush(self) -> None:
        self.flushed = time.monotonic()
        if not self.prefix or not self.lines:
            return
        lines, self.lines = self.lines, []
        with open(f"{self.prefix}-{os.getpid()}.tsv", "a") as f:
            f.writelines(lines)


RECORDER = Recorder()
_step_call = outbox.Steps.call


def _timed_step(self: outbox.Steps, ops: list[Any]) -> tuple[Any, bool]:
    RECORDER.mark(f"step:{len(ops)}")
    try:
        return _step_call(self, ops)
    finally:
        RECORDER.mark("step_end")


def timed(base: type) -> type:
    """``base`` with every hook's entry and exit marked."""

    def clocked(name: str, method: Any) -> Any:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            RECORDER.mark(name)
            try:
                return method(self, *args, **kwargs)
            finally:
                RECORDER.mark(f"{name}_end")
        return run

    class Timed(base):  # type: ignore[misc,valid-type]
        handle_preemptions = clocked("pre", base.handle_preemptions)
        start_load_kv = clocked("load", base.start_load_kv)
        get_finished = clocked("done", base.get_finished)
        on_new_request = clocked("new", base.on_new_request)
        get_num_new_matched_tokens = clocked("ask", base.get_num_new_matched_tokens)
        update_connector_output = clocked("out", base.update_connector_output)
        request_finished = clocked("fin", base.request_finished)

        def wait_for_save(self) -> None:
            RECORDER.mark("save")
            try:
                base.wait_for_save(self)
            finally:
                RECORDER.mark("save_end")
                RECORDER.maybe_flush()

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            so = scheduler_output
            RECORDER.mark(f"meta:{so.total_num_scheduled_tokens}:"
                          f"{len(so.num_scheduled_tokens)}")
            try:
                return base.build_connector_meta(self, so)
            finally:
                RECORDER.mark("meta_end")
                RECORDER.maybe_flush()

        def shutdown(self) -> None:
            RECORDER.flush()
            base.shutdown(self)

    Timed.__name__ = Timed.__qualname__ = f"Timed{base.__name__}"
    return Timed


TimedBlockd = timed(BlockdConnector)
TimedNoop = timed(NoopConnector)
if os.environ.get(ENV):
    outbox.Steps.call = _timed_step  # type: ignore[method-assign]
