"""The metrics endpoint of a real daemon, as an operator's tools see it.

- ``promtool check metrics`` accepts a live scrape of a daemon with every optional family on
  (KV events, crash recovery) after real traffic, and really rejects a bad exposition;
- the standard process collectors are on the daemon's private registry;
- the KV-event publisher's counters match what a real ZMQ subscriber and a replay see;
- ``/healthz`` answers 503 ``draining`` from SIGTERM until the daemon exits (kept in its grace
  period by an attached session), 200 ``ok`` before.
"""

from __future__ import annotations

import signal
import subprocess
import time
import urllib.error
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import msgpack
import pytest
import zmq
from daemon_proc import Daemon, Worker, commit, md, release, start
from deploy_support import APT_HINT, http_get, require_tool
from prometheus_client.parser import text_string_to_metric_families

from blockd.api.v1 import blockd_pb2 as pb

T = TypeVar("T")
#: Metrics of the KV-event publisher (blockd/server/metrics.py, KV_EVENT_METRICS).
KV_EVENT_SERIES = ("blockd_kv_event_batches_published_total", "blockd_kv_events_published_total",
                   "blockd_kv_event_batches_dropped_total", "blockd_kv_events_dropped_total",
                   "blockd_kv_event_replays_served_total", "blockd_kv_event_subscribers")


def until(what: str, probe: Callable[[], T | None], timeout: float = 20.0) -> T:
    """Poll ``probe`` until it returns something (a bound on waiting, never a timing assert)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = probe()
        if got is not None:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def samples(text: str) -> dict[str, float]:
    """series (name plus labels, as exposed) -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def types(text: str) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def promtool_check_metrics(text: str) -> subprocess.CompletedProcess[str]:
    exe = require_tool("promtool", APT_HINT)
    return subprocess.run([exe, "check", "metrics"], input=text, capture_output=True, text=True,
                          timeout=60, check=False)


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon with every optional metric family: KV events (with replay), crash recovery and
    the tiers below the pool (a host tier of 4 blocks over a disk tier of 64)."""
    work = tmp_path_factory.mktemp("blockd-full")
    (work / "disk").mkdir()
    d = start(work, extra={
        "events": {"zmq_endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*",
                   "topic": "kv@metrics-test@tiny", "batch_ms": 1},
        "state": {"dir": str(work / "state")},
        "tiers": {"host_bytes": 4 * 512, "disk_path": str(work / "disk"),
                  "disk_bytes": 64 * 512}})
    yield d
    assert d.stop() == 0, d.log_text()


def scrape(d: Daemon) -> str:
    return http_get(d.metrics_url).decode()


def traffic(d: Daemon, first_token: int) -> None:
    """New stored blocks (a group tenant: token ids published), hits, a failed operation."""
    w = Worker(d.stub("unix"), "carol", "initech")
    for _ in range(2):  # the second time: hits, no new blocks
        seq = w.admit(list(range(first_token, first_token + 9))).sequence_id  # 2 blocks + 1
        w.step(commit(seq))
        w.stub.Heartbeat(pb.HeartbeatRequest(session_id=w.sid, epoch=w.epoch,
                                             completed_fence=w.fence), metadata=md(w.who))
        w.step(release(seq), fence=0)
    # Past carol's quota of 40 blocks: her own cached blocks are evicted, through the host
    # tier onto the disk one (the tiers' counters and copy-time histograms).
    for i in range(12):
        start_at = 10_000 + 100 * i + first_token
        seq = w.admit(list(range(start_at, start_at + 17))).sequence_id  # 4 blocks + 1
        w.step(commit(seq))
        w.stub.Heartbeat(pb.HeartbeatRequest(session_id=w.sid, epoch=w.epoch,
                                             completed_fence=w.fence), metadata=md(w.who))
        w.step(release(seq), fence=0)
    bad = w.step(release("no-such-sequence"), fence=0).results[0]
    assert bad.status.code != 0  # counted in blockd_operation_errors_total{code}
    w.stub.Detach(pb.DetachRequest(session_id=w.sid), metadata=md(w.who))


# -- promtool ----------------------------------------------------------------------------------

def test_promtool_accepts_a_live_scrape(full: Daemon) -> None:
    traffic(full, 1)
    text = scrape(full)
    # The scrape really has the optional families promtool should look at.
    families = types(text)
    for name in ("blockd_pool_blocks", "blockd_journal_bytes", "blockd_snapshots",
                 "blockd_operation_errors", "blockd_step_duration_seconds",
                 "process_cpu_seconds", "blockd_kv_event_subscribers", "blockd_tier_slots",
                 "blockd_tier_stored_blocks", "blockd_tier_store_seconds",
                 "blockd_tenant_tier_used_slots"):
        assert name in families, name
    assert 'blockd_operation_errors_total{code="' in text
    proc = promtool_check_metrics(text)
    assert proc.returncode == 0 and not proc.stdout.strip() and not proc.stderr.strip(), (
        proc.stdout + proc.stderr)


def test_promtool_really_rejects_a_gauge_named_total() -> None:
    """A control: the exposition blockd had before the rename fails `promtool check metrics`."""
    bad = ("# HELP blockd_blocks_total KV blocks in the pool.\n"
           "# TYPE blockd_blocks_total gauge\nblockd_blocks_total 64.0\n")
    proc = promtool_check_metrics(bad)
    assert proc.returncode != 0
    assert "blockd_blocks_total" in proc.stdout + proc.stderr


# -- process metrics ---------------------------------------------------------------------------

def test_process_and_runtime_collectors_are_exported(full: Daemon) -> None:
    text = scrape(full)
    kinds = types(text)
    got = samples(text)
    assert kinds["process_cpu_seconds"] == "counter"
    for gauge in ("process_resident_memory_bytes", "process_virtual_memory_bytes",
                  "process_open_fds", "process_max_fds", "process_start_time_seconds"):
        assert kinds[gauge] == "gauge", gauge
        assert got[gauge] > 0, gauge
    assert got["process_cpu_seconds_total"] > 0
    assert got["process_open_fds"] < got["process_max_fds"]
    # The daemon process' own start, not the test's: it started before the daemon's state did
    # (the collector's clock has whole-second boot time, hence the second of slack).
    assert got["process_start_time_seconds"] <= got["blockd_start_time_seconds"] + 1
    assert any(k.startswith("python_info{") for k in got)
    assert kinds["python_gc_collections"] == "counter"


# -- KV-event publisher counters ---------------------------------------------------------------

def replay_all(endpoint: str) -> list[list[bytes]]:
    """Every batch the publisher still buffers, through its replay socket (a real DEALER).

    The reply frames end with an empty payload for END, in the old and in vLLM's current form.
    """
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.connect(endpoint)
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        out: list[list[bytes]] = []
        while True:
            assert sock.poll(10_000), "replay timed out"
            frames = sock.recv_multipart()
            if frames[-1] == b"":
                return out
            out.append(frames)
    finally:
        ctx.destroy(linger=0)


def test_kv_event_counters_match_a_real_subscriber_and_replay(full: Daemon) -> None:
    # Events are on: every publisher metric is exported, with the right type.
    kinds = types(scrape(full))
    assert kinds["blockd_kv_event_subscribers"] == "gauge"
    for counter in ("blockd_kv_event_batches_published", "blockd_kv_events_published",
                    "blockd_kv_event_batches_dropped", "blockd_kv_events_dropped",
                    "blockd_kv_event_replays_served"):
        assert kinds[counter] == "counter", counter

    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(full.endpoints["kv_events"])
        until("the subscriber to be counted",
              lambda: True if full.metric("blockd_kv_event_subscribers") >= 1 else None)
        traffic(full, 1000)  # new blocks: BlockStored batches
        assert sub.poll(10_000), "no live KV-event batch reached the subscriber"
        # The daemon is idle now: its counters stop moving once the last batch is out.
        published = until("the publisher to go quiet", lambda: _quiet(full))
        before = full.metric("blockd_kv_event_replays_served_total")
        batches = replay_all(full.endpoints["kv_replay"])
        until("the replay to be counted", lambda: True if full.metric(
            "blockd_kv_event_replays_served_total") == before + 1 else None)
        sub.close()
        until("the subscriber to be gone",
              lambda: True if full.metric("blockd_kv_event_subscribers") == 0 else None)
    finally:
        ctx.destroy(linger=0)
    # Nothing was dropped, and the replay buffer (10000 batches) holds every batch published.
    assert full.metric("blockd_kv_event_batches_dropped_total") == 0
    assert full.metric("blockd_kv_events_dropped_total") == 0
    assert published["batches"] == len(batches) > 0
    events = sum(len(msgpack.unpackb(frames[-1], raw=False)[1]) for frames in batches)
    assert published["events"] == events


def _quiet(d: Daemon) -> dict[str, float] | None:
    first = (d.metric("blockd_kv_event_batches_published_total"),
             d.metric("blockd_kv_events_published_total"))
    time.sleep(0.2)  # a batch waits at most events.batch_ms (1 ms) for company
    second = (d.metric("blockd_kv_event_batches_published_total"),
              d.metric("blockd_kv_events_published_total"))
    return {"batches": second[0], "events": second[1]} if first == second else None


def test_no_kv_event_metrics_without_events(daemon: Daemon) -> None:
    text = scrape(daemon)
    got = samples(text)
    assert "blockd_pool_blocks" in got  # the scrape itself is fine
    for name in KV_EVENT_SERIES:
        assert name not in got, name


# -- /healthz ----------------------------------------------------------------------------------

def get(url: str) -> tuple[int, bytes]:
    try:
        return 200, http_get(url)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_healthz_reports_drain_until_the_daemon_exits(tmp_path: Path) -> None:
    # A long grace period: the attached session keeps the daemon draining until it detaches.
    d = start(tmp_path, extra={"server": {"grace_seconds": 120.0}})
    try:
        health = f"http://{d.endpoints['metrics']}/healthz"
        assert get(health) == (200, b"ok\n")
        assert get(health + "?verbose=1") == (200, b"ok\n")
        w = Worker(d.stub("unix"), "alice", "acme")
        d.signal(signal.SIGTERM)
        status, body = until("/healthz to report the drain",
                             lambda: (got if (got := get(health))[0] != 200 else None))
        assert (status, body) == (503, b"draining\n")
        assert d.proc.poll() is None  # still draining: the session holds it in its grace period
        # Metrics keep being served while draining, and the session can still step.
        assert "blockd_sessions 1.0" in scrape(d)
        w.step(fence=0)
        assert get(health) == (503, b"draining\n")
        w.stub.Detach(pb.DetachRequest(session_id=w.sid), metadata=md(w.who))
        assert d.proc.wait(30) == 0, d.log_text()
    finally:
        d.stop()


def test_metrics_endpoint_errors(daemon: Daemon) -> None:
    base = f"http://{daemon.endpoints['metrics']}"
    assert get(base + "/nope") == (404, b"not found\n")
    # /healthz is not a prefix match.
    assert get(base + "/healthzz")[0] == 404
