"""The ZMQ replay socket is no amplifier (issue 28, finding 8), against a real daemon over real
sockets (pyzmq).

Before, an 8-byte request was answered with the whole replay buffer, for each request, also
after the sender left (the audit: 3.97 MB per request, 300 requests ~6.6 CPU-seconds). Now
(``blockd.runtime.kv_replay``) an answer carries at most ``events.replay_max_bytes``, a peer
gets ``events.replay_request_burst`` requests and then ``events.replay_requests_per_second``,
and all answers together at most ``events.replay_bytes_per_second``; every request is still
answered with vLLM's end marker. A subscriber that follows the protocol (ask again from the
sequence number after the last one received) still gets every batch, in order, byte for byte.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import zmq
from cli_support import run_refused, write_config
from daemon_proc import Daemon, Worker, commit, md, release, start

from blockd.api.v1 import blockd_pb2 as pb

TOPIC = b"kv@bounds-pod@tiny"
END = [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
LIMITS = {"replay_max_bytes": 2048, "replay_bytes_per_second": 8192,
          "replay_requests_per_second": 2, "replay_request_burst": 5}
ATTACK = 300


def events_daemon(tmp: Path) -> Daemon:
    return start(tmp, num_blocks=256, extra={"events": {
        "zmq_endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*",
        "topic": TOPIC.decode(), "batch_ms": 0, **LIMITS}})


def publish(d: Daemon, ctx: zmq.Context[Any], at_least: int) -> dict[int, bytes]:
    """Commit prefixes of a group tenant (its token ids are published) until the live stream
    carried ``at_least`` bytes of payload: seq -> payload, as a subscriber saw them."""
    sub = ctx.socket(zmq.SUB)
    sub.connect(d.endpoints["kv_events"])
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
    time.sleep(0.2)  # the subscription reaches the publisher
    w = Worker(d.stub(), "carol", "initech")
    live: dict[int, bytes] = {}
    for i in range(2000):  # a bound, never reached: each cycle publishes a batch
        if sum(map(len, live.values())) >= at_least:
            break
        seq = w.admit([10_000 + 100 * i + k for k in range(17)]).sequence_id
        w.step(commit(seq))
        w.stub.Heartbeat(pb.HeartbeatRequest(session_id=w.sid, epoch=w.epoch,
                                             completed_fence=w.fence), metadata=md(w.who))
        w.step(release(seq), fence=0)
        while sub.poll(500 if not live else 50):
            _, seq_bytes, payload = sub.recv_multipart()
            live[int.from_bytes(seq_bytes, "big")] = payload
    sub.close(linger=0)
    assert sorted(live) == list(range(len(live))) and live, "the live stream has a gap"
    return live


def ask(sock: zmq.Socket[Any], start: int) -> list[list[bytes]]:
    """One replay answer: its frame lists, the end marker last."""
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    while True:
        assert sock.poll(10_000), "no end marker"
        frames = sock.recv_multipart()
        out.append(frames)
        if frames == END:
            return out


def counters(d: Daemon) -> dict[str, float]:
    return {k: d.metric(f"blockd_kv_event_{k}_total")
            for k in ("replays_served", "replays_limited", "replays_truncated", "replay_bytes")}


def test_a_replay_request_flood_is_answered_with_bounded_bytes(tmp_path: Path) -> None:
    ctx = zmq.Context()
    with events_daemon(tmp_path) as d:
        try:
            live = publish(d, ctx, at_least=8 * LIMITS["replay_max_bytes"])
            buffer_bytes = sum(len(TOPIC) + 8 + len(p) for p in live.values())
            t0 = time.monotonic()
            attacker = ctx.socket(zmq.DEALER)
            attacker.connect(d.endpoints["kv_replay"])
            for _ in range(ATTACK):  # 8 bytes each, then the sender leaves
                attacker.send_multipart([b"", (0).to_bytes(8, "big")])
            attacker.close(linger=2000)
            deadline = time.monotonic() + 60
            while True:  # a bound on waiting: the daemon answers all 300
                got = counters(d)
                if got["replays_served"] + got["replays_limited"] >= ATTACK:
                    break
                assert time.monotonic() < deadline, got
                time.sleep(0.05)
            elapsed = time.monotonic() - t0
        finally:
            ctx.destroy(linger=0)
        # Before: 300 answers of the whole buffer. Now: the byte budget's burst plus its
        # refill over the (generous) elapsed time, plus at most one batch of debt.
        largest = max(len(TOPIC) + 8 + len(p) for p in live.values())
        budget = (max(LIMITS["replay_bytes_per_second"], LIMITS["replay_max_bytes"])
                  + LIMITS["replay_bytes_per_second"] * elapsed + largest)
        assert got["replay_bytes"] <= budget, (got, elapsed)
        assert ATTACK * buffer_bytes > 20 * budget  # what the old daemon sent, for scale
        served_bound = LIMITS["replay_request_burst"] + LIMITS["replay_requests_per_second"] * (
            elapsed + 1)
        assert got["replays_served"] <= served_bound, (got, elapsed)
        assert got["replays_limited"] >= ATTACK - served_bound
        assert got["replays_truncated"] >= 1  # a whole buffer is more than one answer holds
        assert d.stub().Stats(pb.StatsRequest(), metadata=md("admin")).num_blocks == 256


def test_a_subscriber_catches_up_through_truncated_replays(tmp_path: Path) -> None:
    ctx = zmq.Context()
    with events_daemon(tmp_path) as d:
        try:
            live = publish(d, ctx, at_least=6 * LIMITS["replay_max_bytes"])
            sock = ctx.socket(zmq.DEALER)
            sock.connect(d.endpoints["kv_replay"])
            got: dict[int, bytes] = {}
            answers = 0
            deadline = time.monotonic() + 60
            while len(got) < len(live):  # the protocol: ask again from the next seq
                assert time.monotonic() < deadline, (len(got), len(live))
                answer = ask(sock, len(got))
                answers += 1
                batches = answer[:-1]
                if not batches:  # limited (the end marker only): ask again a bit later
                    time.sleep(0.25)
                    continue
                size = sum(len(TOPIC) + 8 + len(f[3]) for f in batches)
                assert len(batches) == 1 or size <= LIMITS["replay_max_bytes"]
                for empty, topic, seq_bytes, payload in batches:
                    assert (empty, topic) == (b"", TOPIC)
                    seq = int.from_bytes(seq_bytes, "big")
                    assert seq == len(got)  # in order, from where it asked, no gap
                    got[seq] = payload
            sock.close(linger=0)
        finally:
            ctx.destroy(linger=0)
        assert got == live  # every batch, byte for byte, as the live stream carried it
        assert answers >= 3  # it took several truncated answers
        c = counters(d)
        assert c["replays_truncated"] >= 2 and c["replays_served"] >= 3


@pytest.mark.parametrize(("key", "value"), [("replay_max_bytes", 0),
                                            ("replay_requests_per_second", 0),
                                            ("replay_request_burst", 0),
                                            ("replay_bytes_per_second", -1)])
def test_a_bad_replay_bound_refuses_the_start_naming_it(tmp_path: Path, key: str,
                                                       value: int) -> None:
    cfg = write_config(tmp_path, events={"zmq_endpoint": "tcp://127.0.0.1:*",
                                         "replay_endpoint": "tcp://127.0.0.1:*",
                                         "topic": "t", key: value})
    r = run_refused("--config", str(cfg), cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"events.{key}" in lines[0], r.stderr
