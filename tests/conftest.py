"""Suite-wide settings: hypothesis profiles, and no daemon left behind.

``ci`` (used by ``make test``) is derandomised so a run is reproducible and bounded in time;
``fuzz`` (``make fuzz``) runs many more, random examples.

Every daemon a test starts must be stopped by the time the session ends: a daemon left running
holds its sockets, its pool memory and a core of a small machine after pytest has exited (and
the next run's daemons compete with it). ``no_daemon_outlives_the_session`` fails the run if one
is still alive after every fixture was torn down, names it, and kills it.

NOTE: it looks for daemons among this process's descendants (``psutil``), not in a registry of
what the launcher started: that also finds a daemon started some other way (a test's own
``Popen``, a subprocess such as ``blockd demo`` that starts one itself). So that a daemon whose
parent subprocess died is still found, this process is made a child subreaper (Linux): orphans
of its subtree are re-parented to it instead of to init.

Under pytest-xdist each worker is its own pytest session, so the check holds per worker: each
one is a subreaper and checks its own descendants at the end of its session. ``make test`` runs
the suite in two parts: every module but the engine tests (``ENGINE_PATHS``) on 3 workers
(``-n 3 --dist loadfile``), then the engine tests alone, without xdist: an engine with the
connector needs both cores of a small machine, and beside other workers its calls to blockd ran
past their deadlines. ``pytest_xdist_make_scheduler`` makes each test module one unit of work
(its module-scoped daemon starts once) and, for a run over the whole tree on workers
(``pytest -n 3 --dist loadfile``), every test that starts vLLM engines one unit, run first, by
one worker, one test after another (the session-scoped engine, ``alone``, starts once). xdist's
own ``--dist loadgroup`` cannot do this here: it renames node ids through ``item._nodeid``,
which pytest 9 no longer reads, so its ``xdist_group`` marks have no effect.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import psutil
import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=60,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.register_profile(
    "fuzz", max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

#: Names that start the daemon when followed by ``serve``: ``python -m blockd_apps serve`` (the
#: launcher), ``.venv/bin/blockd serve`` (the console script), ``python -m blockd_apps.cli serve``.
DAEMON_COMMANDS = {"blockd", "blockd_apps", "blockd_apps.cli"}
#: The daemon's own entry point, ``python -m blockd.server`` (no ``serve`` word).
DAEMON_MODULE = "blockd.server"
PR_SET_CHILD_SUBREAPER = 36
TESTS = Path(__file__).resolve().parent
#: Under pytest-xdist (``--dist loadfile``): the tests that start vLLM engines (these
#: directories and modules, relative to the root directory as in node ids) are one unit of
#: work, ``ENGINE_UNIT``, handed out first and so run on one worker, one test after another;
#: every other test module is a unit of its own. A new module that starts engines goes under
#: tests/vllm/ (``make test`` runs that directory apart, after the rest).
ENGINE_PATHS = ("tests/vllm/",)
ENGINE_UNIT = "vLLM engines"
#: Long modules handed out first after ``ENGINE_UNIT``, so that the run does not end with one
#: of them alone. The vLLM connector bench starts its engines in its own subprocesses, one at
#: a time, beside the other workers' modules: its figures are not asserted (a bench measures
#: on a quiet machine), only their presence.
EARLY_MODULES = ("tests/bench/test_vllm_connector_bench.py",)


def pytest_configure(config: pytest.Config) -> None:
    if sys.platform.startswith("linux"):  # best effort elsewhere: direct children only
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def is_daemon(argv: list[str]) -> bool:
    """``argv`` runs the daemon: ``python -m blockd.server``, or ``blockd serve`` in any of its
    spellings (one of ``DAEMON_COMMANDS``, then ``serve``)."""
    if any(a == "-m" and b == DAEMON_MODULE for a, b in zip(argv, argv[1:], strict=False)):
        return True
    if "serve" not in argv:
        return False
    before = argv[:argv.index("serve")]
    return any(os.path.basename(a) in DAEMON_COMMANDS for a in before)


def running_daemons() -> list[tuple[psutil.Process, list[str]]]:
    """Daemons among this process's descendants that have not exited (zombies excluded)."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            argv = p.cmdline()
        except psutil.Error:  # exited meanwhile
            continue
        if is_daemon(argv):
            found.append((p, argv))
    return found


@pytest.fixture(scope="session", autouse=True)
def no_daemon_outlives_the_session() -> Iterator[None]:
    """Set up first, so torn down last: after every module's and session's fixtures stopped
    their daemons. A daemon still running then was leaked by a test or a fixture."""
    yield
    leaked = running_daemons()
    if not leaked:
        return
    for p, _ in leaked:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs([p for p, _ in leaked], timeout=10)
    lines = "\n".join(f"  pid {p.pid}: {' '.join(argv)}" for p, argv in leaked)
    pytest.fail(f"{len(leaked)} daemon(s) outlived the test session (now killed); every test "
                f"and fixture must stop the daemons it starts:\n{lines}", pytrace=False)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test named ``test_gpu_*`` carries the ``gpu`` marker, so that ``pytest -m gpu``
    (scripts/gpu_check.sh) selects every device test and none runs unmarked on a GPU-less CI.

    On an xdist worker, the tests of ``ENGINE_UNIT`` come first, then ``EARLY_MODULES``' (every
    worker collects, and sorts, the same way: the controller checks that their collections
    agree), so that ``ModuleScheduling`` hands those units out first."""
    unmarked = [item.nodeid for item in items
                if item.name.startswith("test_gpu_") and item.get_closest_marker("gpu") is None]
    if unmarked:
        raise pytest.UsageError("tests named test_gpu_* without the gpu marker: "
                                + ", ".join(unmarked))
    if hasattr(config, "workerinput"):
        items.sort(key=hand_out_order)  # stable


def hand_out_order(item: pytest.Item) -> int:
    unit = unit_of(item.nodeid)
    return 0 if unit == ENGINE_UNIT else 1 if unit in EARLY_MODULES else 2


def unit_of(nodeid: str) -> str:
    """The unit of work (``ModuleScheduling``) of a test: ``ENGINE_UNIT`` for one under
    ``ENGINE_PATHS``, else its module."""
    module = nodeid.split("::", 1)[0]
    return ENGINE_UNIT if module.startswith(ENGINE_PATHS) else module


@pytest.hookimpl(optionalhook=True)  # an xdist hook: only called when xdist runs the suite
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` with ``unit_of``'s units, handed out in collection order."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ModuleScheduling(LoadFileScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    config.option.loadscopereorder = False  # not by test count: ENGINE_UNIT first
    return ModuleScheduling(config, log)


def _fuzz_report() -> ModuleType:
    """tests/fuzz/fuzz_report.py (no grpc, no daemon), loaded now so that its wall time is the
    run's, as the module ``fuzz_report`` that tests/fuzz/conftest.py imports (tests/fuzz is not
    put on sys.path here: its module names would shadow others')."""
    spec = importlib.util.spec_from_file_location("fuzz_report", TESTS / "fuzz" / "fuzz_report.py")
    assert spec is not None and spec.loader is not None
    module = sys.modules["fuzz_report"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fuzz_report = _fuzz_report()
#: xdist's controller: the fuzz suite's input counts, summed over the workers.
_worker_fuzz_counts: Counter[str] = Counter()


@pytest.hookimpl(optionalhook=True)  # an xdist hook: only called when xdist runs the suite
def pytest_testnodedown(node: object, error: object) -> None:
    _worker_fuzz_counts.update(getattr(node, "workeroutput", {}).get(fuzz_report.WORKER_KEY, {}))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int) -> None:
    if _worker_fuzz_counts:  # a serial run's report is tests/fuzz/conftest.py's
        fuzz_report.write(terminalreporter, _worker_fuzz_counts, exitstatus)
