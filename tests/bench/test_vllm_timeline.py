"""bench/vllm_timeline.py's attribution on a call whose events are known: each figure is the
sum or the mean it says, and steps that did nothing, prefill and decode steps, and decode steps
overlapping a Step to the daemon are told apart. (tests/vllm/test_timeline_tool.py reads the
events of a real engine.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))
from vllm_timeline import attribute, one_line, read_events, summarize  # noqa: E402

MS = 1_000_000


def call_events(shift: int = 0) -> list[tuple[int, str]]:
    """A call from 0 to 60 ms: two asks, an empty step while the admits' Step is in flight, a
    prefill step of two 300-token prompts, three decode steps (the second overlapped by a
    Step), the requests' ends."""
    ev = [(0, "ask"), (1, "ask_end"), (1, "ask"), (2, "ask_end"),
          (2, "meta:0:0"), (3, "meta_end"), (3, "step:2"), (9, "step_end"),
          (4, "load"), (4, "load_end"), (4, "save"), (4, "save_end"), (4, "done"),
          (4, "done_end"), (5, "out"), (5, "out_end"),
          (10, "meta:600:2"), (11, "meta_end"),  # the prefill step
          (30, "save"), (32, "save_end"), (32, "done"), (32, "done_end"),
          (34, "meta:2:2"), (34, "meta_end"),  # decode 1: 34 -> 40
          (38, "save"), (38, "save_end"),
          (40, "meta:2:2"), (41, "meta_end"),  # decode 2: 40 -> 50, overlaps a Step
          (42, "step:4"), (45, "step_end"),
          (50, "meta:2:2"), (50, "meta_end"),  # decode 3: the last, no next step
          (55, "fin"), (56, "fin_end")]
    return [(t * MS + shift, n) for t, n in ev]


def test_a_call_is_split_into_its_parts() -> None:
    f = attribute(call_events(), 0, 60 * MS)
    assert f["wall_ms"] == pytest.approx(60)
    assert f["first_prefill_ms"] == pytest.approx(10)  # the empty step computed nothing
    assert f["prefill_ms"] == pytest.approx(30)  # to the prefill's forward done (its save)
    assert f["decode_ms"] == pytest.approx(30)
    assert f["steps"] == 4 and f["empty_steps"] == 1
    # asks 1 + 1, metas 1 + 1 + 0 + 1 + 0, saves 2, fin 1 (the Steps are not hooks)
    assert f["hooks_ms"] == pytest.approx(2 + 3 + 2 + 1)
    assert f["save_ms"] == pytest.approx(2)
    assert f["decode_step_ms"] == pytest.approx(6)  # decode 1 alone: 3 has no next step
    assert f["overlapped_steps"] == 1 and f["overlapped_step_ms"] == pytest.approx(10)
    assert f["daemon_steps"] == 2


def test_only_the_calls_window_counts() -> None:
    events = call_events() + call_events(shift=100 * MS)  # the next call
    assert attribute(events, 100 * MS, 160 * MS) == attribute(call_events(), 0, 60 * MS)


def test_a_call_without_prompt_or_daemon_steps() -> None:
    ev = [(0, "meta:1:1"), (0, "meta_end"), (5, "meta:1:1"), (5, "meta_end")]
    f = attribute([(t * MS, n) for t, n in ev], 0, 8 * MS)
    assert f["prefill_ms"] == 0 and f["decode_ms"] == pytest.approx(8)
    assert f["decode_step_ms"] == pytest.approx(5) and f["daemon_steps"] == 0


def test_the_summary_is_per_repetition(tmp_path: Path) -> None:
    a = attribute(call_events(), 0, 60 * MS)
    b = dict(a, wall_ms=50.0)
    s = summarize([{"blockd": a, "noop": b}, {"blockd": a, "noop": a}])
    assert s["time_ratio"] == {"median": pytest.approx(1.1), "min": 1.0,
                               "max": pytest.approx(1.2)}
    assert s["blockd_minus_noop"]["wall_ms"]["max"] == pytest.approx(10)
    assert "blockd/noop time 1.100" in one_line(s)
    # Every process of an engine writes its own file; they are read as one, in time order.
    (tmp_path / "e-1.tsv").write_text("meta_end\t7\nmeta:0:0\t3\n")
    (tmp_path / "e-2.tsv").write_text("save\t5\n")
    (tmp_path / "other-3.tsv").write_text("save\t1\n")
    assert read_events(tmp_path / "e") == [(3, "meta:0:0"), (5, "save"), (7, "meta_end")]
