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
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Iterator

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
    (scripts/gpu_check.sh) selects every device test and none runs unmarked on a GPU-less CI."""
    unmarked = [item.nodeid for item in items
                if item.name.startswith("test_gpu_") and item.get_closest_marker("gpu") is None]
    if unmarked:
        raise pytest.UsageError("tests named test_gpu_* without the gpu marker: "
                                + ", ".join(unmarked))

