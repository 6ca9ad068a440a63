"""The journal's record format and the state directory, without a daemon."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from blockd.core.errors import FailedPrecondition
from blockd.runtime import journal
from blockd.runtime.state_store import StateStore


def test_records_round_trip_in_order(tmp_path: Path) -> None:
    j = journal.Journal(str(tmp_path / "journal.1"))
    records = [["attach", "s1", "acme", "alice", "w", 1000], ["step", "s1", b"\x00\xff" * 40,
               ["id1", "id2"]], ["fence", "s1", 7], ["flush", {"model_id": "m", "lora_id": None}]]
    for r in records:
        j.append(r)
    j.close()
    assert list(journal.read(str(tmp_path / "journal.1"))) == records
    assert j.records == 4 and j.size == os.path.getsize(tmp_path / "journal.1")
    assert stat.S_IMODE(os.stat(tmp_path / "journal.1").st_mode) == 0o600


@pytest.mark.parametrize("cut", [1, 4, 8, 9, 20])
def test_a_torn_last_record_ends_the_replay(tmp_path: Path, cut: int) -> None:
    """A kill in the middle of write(): the intact records replay, the torn one does not."""
    path = tmp_path / "journal.1"
    j = journal.Journal(str(path))
    j.append(["fence", "s", 1])
    size = j.size
    j.append(["step", "s", b"x" * 30, []])
    j.close()
    data = path.read_bytes()
    path.write_bytes(data[: size + cut])
    assert list(journal.read(str(path))) == [["fence", "s", 1]]


def test_a_corrupt_record_ends_the_replay(tmp_path: Path) -> None:
    path = tmp_path / "journal.1"
    j = journal.Journal(str(path))
    for i in range(3):
        j.append(["fence", "s", i])
    j.close()
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # the last record's payload: its CRC no longer matches
    path.write_bytes(bytes(data))
    assert list(journal.read(str(path))) == [["fence", "s", 0], ["fence", "s", 1]]
    assert list(journal.read(str(tmp_path / "missing"))) == []


def test_state_dir_is_created_private_and_foreign_ones_are_refused(tmp_path: Path) -> None:
    store = StateStore(str(tmp_path / "a" / "state"))
    assert stat.S_IMODE((tmp_path / "a" / "state").stat().st_mode) == 0o700
    assert store.read_snapshot() is None
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o750)
    with pytest.raises(FailedPrecondition) as err:
        StateStore(str(shared))
    assert err.value.field == "state.dir" and "0700" in err.value.message
    (tmp_path / "file").write_text("x")
    with pytest.raises(FailedPrecondition):
        StateStore(str(tmp_path / "file"))


def test_snapshots_replace_atomically_and_wipe_keeps_the_pool(tmp_path: Path) -> None:
    store = StateStore(str(tmp_path / "state"))
    store.write_snapshot({"generation": 1, "x": [1, 2]})
    store.write_snapshot({"generation": 2, "x": [3]})
    assert store.read_snapshot() == {"generation": 2, "x": [3]}
    assert not (tmp_path / "state" / "snapshot.tmp").exists()
    for g in (1, 2, 3):
        Path(store.journal_path(g)).write_bytes(b"")
    store.remove_journals(keep=2)
    assert sorted(p.name for p in (tmp_path / "state").glob("journal.*")) == ["journal.2"]
    Path(store.pool_path).write_bytes(b"pool")
    Path(store.fence_path("abc")).write_bytes(b"\0" * 8)
    store.wipe()
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["lock", "pool"]
    (tmp_path / "state" / "snapshot").write_bytes(b"not a snapshot")
    with pytest.raises(ValueError, match="not a blockd snapshot"):
        store.read_snapshot()


def test_a_damaged_length_is_corrupt_not_torn(tmp_path: Path) -> None:
    """A flipped length byte in the middle would otherwise read as a torn tail (the record
    seems to run past the end) and silently drop acknowledged records."""
    path = tmp_path / "journal.1"
    j = journal.Journal(str(path))
    for i in range(3):
        j.append(["fence", "s", i])
    first = os.path.getsize(path) // 3  # three records of one size
    j.close()
    data = bytearray(path.read_bytes())
    data[first + 1] ^= 0x40  # the second record's length
    path.write_bytes(bytes(data))
    found = journal.scan(str(path))
    assert found.records == [["fence", "s", 0]]
    assert found.damage is not None and found.damage.kind == "corrupt"
    assert found.damage.offset == first and found.damage.bytes_lost == len(data) - first


def test_a_corrupt_payload_names_what_was_lost_after_it(tmp_path: Path) -> None:
    path = tmp_path / "journal.1"
    j = journal.Journal(str(path))
    j.append(["attach", "s", "acme", "a", "w", 1000])
    mark = j.size
    j.append(["step", "s", b"x" * 20, [], []])
    j.append(["step", "s", b"y" * 20, [], []])
    j.append(["fence", "s", 2])
    j.close()
    data = bytearray(path.read_bytes())
    data[mark + journal.OVERHEAD + 2] ^= 0x01
    path.write_bytes(bytes(data))
    found = journal.scan(str(path))
    assert len(found.records) == 1 and found.damage is not None
    assert found.damage.kind == "corrupt"
    assert dict(found.damage.lost_kinds) == {"step": 1, "fence": 1}
    assert "1 fence, 1 step" in found.damage.describe()


def test_a_failed_write_leaves_no_torn_record(tmp_path: Path) -> None:
    """ENOSPC/EFBIG in the middle of a record: the file is cut back, so the next record (after
    the daemon's restart) never follows garbage."""
    import resource
    import subprocess
    import sys

    path = tmp_path / "journal.1"
    code = (
        "import resource, sys\n"
        "from blockd.runtime import journal\n"
        "j = journal.Journal(sys.argv[1])\n"
        "j.append(['fence', 's', 1])\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (j.size + 20, j.size + 20))\n"
        "try:\n"
        "    j.append(['step', 's', b'x' * 100, [], []])\n"
        "except OSError as e:\n"
        "    print(e.errno)\n"
    )
    del resource
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "27"  # EFBIG
    found = journal.scan(str(path))
    assert found.records == [["fence", "s", 1]] and found.damage is None
