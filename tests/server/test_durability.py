"""Durability that tells the truth (issue 15), against a real daemon process.

A full state directory (a real, tiny tmpfs) refuses new work before anything is applied, and
the retry gets the same refusal (never an unjournalled OK); a restart on a full disk refuses to
start and keeps the state; a corrupt journal record in the middle starts a new epoch, counted
and logged with what was lost; a journal holds what was applied, not the raw request.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from daemon_proc import Worker, admit, md, start
from test_crash_recovery import kill9, restart, stats

from blockd.api.v1 import blockd_pb2 as pb
from blockd.runtime import journal

FS_BYTES = 4 * 1024 * 1024
RESERVE = 512 * 1024


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs (the sandbox runs as root); skipped where mounting is not allowed."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES},mode=0700", "tmpfs",
                           str(mnt)], capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(fs: Path) -> Path:
    """Fill the file system to the last byte (ENOSPC ends it)."""
    filler = fs / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for chunk in (65536, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * chunk)
    finally:
        os.close(fd)
    return filler


def test_a_full_state_dir_refuses_new_work_and_the_retry_too(small_fs: Path) -> None:
    state = small_fs / "state"
    d = start(small_fs.parent / "work", num_blocks=64, lease_ms=30_000, extra={
        "state": {"dir": str(state), "reserve_bytes": RESERVE}})
    try:
        w = Worker(d.stub(), "alice", "acme")
        kept = w.admit(list(range(8)))
        free = d.metric("blockd_state_dir_free_bytes")
        assert 0 < free <= FS_BYTES and d.metric("blockd_state_dir_reserve_bytes") >= RESERVE
        before = stats(d)
        filler = fill(small_fs)
        assert d.metric("blockd_state_dir_free_bytes") < RESERVE
        for attempt in range(2):  # the Step, then its retry (same step_id)
            if attempt:
                w.step_id -= 1
            with pytest.raises(grpc.RpcError) as err:
                w.step(admit(list(range(100, 108))), fence=0)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "state dir full" in (err.value.details() or "")
            assert stats(d) == before  # nothing applied
        # A new session is new work too.
        with pytest.raises(grpc.RpcError) as err:
            Worker(d.stub(), "alice", "acme")
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert d.metric("blockd_state_dir_refusals_total") == 3
        assert d.metric("blockd_journal_failed") == 0
        epoch = before.epoch
        kill9(d)
        # A restart on the full disk cannot write its snapshot: it refuses, keeping the state.
        with pytest.raises(RuntimeError, match="state.dir"):
            restart(d)
        assert (state / "snapshot").exists() and not list(state.glob("failed-*"))
        filler.unlink()
        d = restart(d)
        after = stats(d)
        assert after.epoch == epoch and after.num_sequences == 1
        # The refused Step was never applied: its retry applies it now, once.
        w.stub = d.stub()
        w.step_id -= 1
        out = w.step(admit(list(range(100, 108))), fence=0)
        assert out.results[0].status.code == 0
        assert out.results[0].admit.sequence_id != kept.sequence_id
        assert stats(d).num_sequences == 2
    finally:
        d.stop()


def test_a_corrupt_record_in_the_middle_starts_a_new_epoch(tmp_path: Path) -> None:
    state = tmp_path / "state"
    d = start(tmp_path, num_blocks=64, lease_ms=30_000, extra={"state": {"dir": str(state)}})
    try:
        w = Worker(d.stub(), "alice", "acme")
        for i in range(3):
            w.admit(list(range(10 * i, 10 * i + 8)))
        epoch = stats(d).epoch
        kill9(d)
        (current,) = state.glob("journal.*")
        records = journal.scan(str(current)).records
        assert [r[0] for r in records] == ["attach", "step", "step", "step"]
        data = bytearray(current.read_bytes())
        data[len(data) // 2] ^= 0x01  # one flipped bit inside the records
        current.write_bytes(bytes(data))
        d = restart(d)
        assert stats(d).epoch != epoch and stats(d).num_sequences == 0
        assert d.metric('blockd_journal_damaged_total{kind="corrupt"}') == 1
        log = d.log_text()
        assert "the journal is corrupt: starting a new epoch" in log, log
        assert "bytes lost" in log and "step" in log
        (kept,) = state.glob("failed-*")
        assert (kept / current.name).read_bytes() == bytes(data)
        with pytest.raises(grpc.RpcError) as err:
            w.stub = d.stub()
            w.step(admit([1, 2, 3]), fence=0)
        assert err.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)
    finally:
        d.stop()


def test_a_torn_final_record_is_dropped_and_the_epoch_kept(tmp_path: Path) -> None:
    state = tmp_path / "state"
    d = start(tmp_path, num_blocks=64, lease_ms=30_000, extra={"state": {"dir": str(state)}})
    try:
        w = Worker(d.stub(), "alice", "acme")
        w.admit(list(range(8)))
        epoch = stats(d).epoch
        kill9(d)
        (current,) = state.glob("journal.*")
        j = journal.Journal(str(tmp_path / "next"))
        j.append(["fence", w.sid, 1])
        j.close()
        with open(current, "ab") as f:  # a write cut short: the header and part of a payload
            f.write((tmp_path / "next").read_bytes()[:-3])
        d = restart(d)
        s = stats(d)
        assert s.epoch == epoch and s.num_sequences == 1
        assert d.metric('blockd_journal_damaged_total{kind="torn"}') == 1
        assert d.metric('blockd_journal_damaged_total{kind="corrupt"}') == 0
        assert "dropped a torn final journal record" in d.log_text()
    finally:
        d.stop()


def test_the_journal_holds_what_was_applied_not_the_request(tmp_path: Path) -> None:
    """Refused operations keep only their status; unknown fields are dropped; the replay
    rebuilds the same answer for the last Step (a retry after the restart)."""
    state = tmp_path / "state"
    d = start(tmp_path, num_blocks=64, lease_ms=30_000, extra={"state": {"dir": str(state)}})
    try:
        w = Worker(d.stub(), "alice", "acme")
        big = list(range(4 * 60))  # over acme's 40-block quota: refused
        req = pb.StepRequest(session_id=w.sid, epoch=w.epoch, step_id=1, operations=[
            admit(big), admit(list(range(8)))])
        raw = req.SerializeToString() + b"\xfa\x3f\x80\x80\x40" + b"x" * (1 << 20)  # field 1023
        call = d.channel().unary_unary("/blockd.v1.BlockdService/Step",
                                       request_serializer=lambda b: b,
                                       response_deserializer=pb.StepResponse.FromString)
        resp = call(raw, metadata=md("alice"))
        assert resp.results[0].status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert resp.results[1].status.code == 0
        (current,) = state.glob("journal.*")
        assert os.path.getsize(current) < 4096  # not the 1 MiB of unknown bytes nor `big`
        step_record = journal.scan(str(current)).records[-1]
        kept = pb.StepRequest.FromString(step_record[2])
        assert kept.operations[0].WhichOneof("op") is None
        assert list(kept.operations[1].admit.token_ids) == list(range(8))
        kill9(d)
        d = restart(d)
        call = d.channel().unary_unary("/blockd.v1.BlockdService/Step",
                                       request_serializer=lambda b: b,
                                       response_deserializer=pb.StepResponse.FromString)
        again = call(raw, metadata=md("alice"))
        assert again == resp  # the retry after the restart: the same answer, not reapplied
        assert stats(d).num_sequences == 1
    finally:
        d.stop()


def test_a_failed_journal_write_stops_the_daemon_until_restarted(tmp_path: Path) -> None:
    """EFBIG (a file-size limit set on the running daemon) after the space check passed: the
    Step is not acknowledged, its retry is not answered from memory, every call is refused,
    and the restart (same epoch) has exactly what was acknowledged."""
    import resource

    state = tmp_path / "state"
    d = start(tmp_path, num_blocks=64, lease_ms=30_000, extra={"state": {"dir": str(state)}})
    try:
        w = Worker(d.stub(), "alice", "acme")
        w.admit(list(range(8)))
        epoch = stats(d).epoch
        (current,) = state.glob("journal.*")
        limit = current.stat().st_size + 40
        resource.prlimit(d.proc.pid, resource.RLIMIT_FSIZE, (limit, limit))
        for attempt in range(2):  # the Step, then its retry (same step_id)
            if attempt:
                w.step_id -= 1
            with pytest.raises(grpc.RpcError) as err:
                w.step(admit(list(range(100, 140))), fence=0)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
            assert "journal cannot be written" in (err.value.details() or "")
        assert current.stat().st_size < limit  # the torn part was cut back
        assert d.metric("blockd_journal_failed") == 1
        with pytest.raises(grpc.RpcError) as err:
            Worker(d.stub(), "alice", "acme")
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "journal write failed" in d.log_text()
        # /healthz says so for good (a liveness probe restarts the daemon, whose replay recovers).
        health = d.metrics_url.replace("/metrics", "/healthz")
        with pytest.raises(urllib.error.HTTPError) as bad:
            urllib.request.urlopen(health, timeout=5)
        assert bad.value.code == 503 and b"journal unwritable" in bad.value.read()
        kill9(d)
        d = restart(d)
        s = stats(d)
        assert s.epoch == epoch and s.num_sequences == 1  # the unacknowledged admit is not there
        assert d.metric('blockd_journal_damaged_total{kind="torn"}') == 0
        w.stub = d.stub()
        w.step_id -= 1
        out = w.step(admit(list(range(100, 140))), fence=0)  # the worker's retry applies it once
        assert out.results[0].status.code == 0 and stats(d).num_sequences == 2
    finally:
        d.stop()
