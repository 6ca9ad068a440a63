"""The invariant check itself: it catches corruption, raises the core's ``Internal`` (never
``AssertionError``), and works the same under ``python -O`` (asserts stripped), since the daemon
runs it periodically in production (``server.invariant_check_interval_ms``)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import SCOPE, manager

from blockd.core import BlockManager, Internal


def _busy() -> tuple[BlockManager, str, str]:
    m = manager(block_size=4, num_blocks=8)
    s = m.open_session("acme")
    a = m.admit(s, SCOPE, list(range(10)))
    m.commit(s, a.seq_id)  # type: ignore[union-attr]
    m.check_invariants()
    return m, s, a.seq_id  # type: ignore[union-attr]


def _extra_ref(m: BlockManager) -> None:
    m.blocks.ref[0] += 1


def _lost_free_block(m: BlockManager) -> None:
    m.blocks.num_free -= 1


def _stray_pend(m: BlockManager) -> None:
    m.blocks.pend[7] += 1


def _usage_drift(m: BlockManager) -> None:
    m.blocks.usage[0] += 1


@pytest.mark.parametrize("corrupt", [_extra_ref, _lost_free_block, _stray_pend, _usage_drift])
def test_each_corruption_is_an_internal_error(corrupt) -> None:  # type: ignore[no-untyped-def]
    m, _, _ = _busy()
    corrupt(m)
    with pytest.raises(Internal, match="invariant violated"):
        m.check_invariants()


PROBE = """
import sys
sys.path.insert(0, {tests!r})
from test_invariants import _busy
from blockd.core import Internal
assert False, "asserts are on"  # stripped by -O: proves the run is optimized
m, _, _ = _busy()
m.blocks.ref[0] += 1
try:
    m.check_invariants()
except Internal as err:
    print("caught:", err.message)
else:
    print("missed")
"""


def test_the_check_works_under_python_dash_O() -> None:
    tests = str(__import__("pathlib").Path(__file__).parent)
    out = subprocess.run([sys.executable, "-O", "-c", PROBE.format(tests=tests)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("caught: invariant violated: block 0: ref")
