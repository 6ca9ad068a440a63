"""The per-token path (``append`` of tokens that fit the sequence's own last block) keeps the
general path's errors: each names its field and leaves the manager exactly as it was."""

import pytest
from helpers import SCOPE, manager, state_of

from blockd.core import AppendResult
from blockd.core.errors import BlockdError


def _setup():  # type: ignore[no-untyped-def]
    m = manager(num_blocks=8)
    s = m.open_session("acme")
    seq = m.admit(s, SCOPE, [1, 2, 3, 4, 5]).seq_id  # block 1 holds one token of 4
    m.begin_step(s, 5)
    m.complete_fence(s, 3)
    return m, s, seq


@pytest.mark.parametrize("case", [
    ("unknown session", "session_id"),
    ("other session", "sequence_id"),
    ("unknown sequence", "sequence_id"),
    ("fence below an earlier step's", "fence"),
    ("fence already complete", "fence"),
    ("ragged token bytes", "token_ids"),
    ("token id out of range", "token_ids"),
])
def test_errors_name_the_field_and_change_nothing(case) -> None:  # type: ignore[no-untyped-def]
    what, field = case
    m, s, seq = _setup()
    other = m.open_session("acme")
    args = {"session_id": s, "seq_id": seq, "tokens": b"\x07\0\0\0", "fence": 0}
    if what == "unknown session":
        args["session_id"] = "nope"
    elif what == "other session":
        args["session_id"] = other
    elif what == "unknown sequence":
        args["seq_id"] = "nope"
    elif what == "fence below an earlier step's":
        args["fence"] = 4
    elif what == "fence already complete":
        args["fence"] = 3
    elif what == "ragged token bytes":
        args["tokens"] = b"\x07\0\0"
    else:
        args["tokens"] = [2**32]
    before = state_of(m)
    with pytest.raises(BlockdError) as exc:
        m.append(**args)
    assert exc.value.field == field
    assert state_of(m) == before


def test_in_place_append_announces_its_fence_and_adds_no_block() -> None:
    m, s, seq = _setup()
    res = m.append(s, seq, [6], fence=6)
    assert res == AppendResult(2, [], 6)
    assert m.session_view(s).issued_fence == 6
    assert m.append(s, seq, b"\x07\0\0\0\x08\0\0\0") == AppendResult(2, [], 8)  # fills it
    res = m.append(s, seq, [9])  # the next block is a new one: the general path
    assert (res.start_index, len(res.block_ids), res.num_tokens) == (2, 1, 9)
    m.check_invariants()
