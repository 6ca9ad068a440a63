"""KV-event topics at start (#28, the operator path). An endpoint alone used to refuse to start
until events.model_name or a topic was set, though vLLM itself defaults to an empty topic; and
the CPU overlay shipped ``model_name: replace-me``, which was accepted, so routers indexed every
block under "replace-me". Now an endpoint alone starts with vLLM's default (the empty topic)
and a warning naming what llm-d needs, and a placeholder model name is refused at start."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import yaml
import zmq
from daemon_proc import NS, Worker, start
from test_kv_events import decode, detach, replay, store

from blockd_apps.launch import DAEMON_COMMAND


def test_an_endpoint_alone_publishes_under_vllms_empty_topic_with_a_warning(
        tmp_path: Path) -> None:
    d = start(tmp_path, num_blocks=64, extra={
        "events": {"zmq_endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*",
                   "batch_ms": 1}})
    try:
        warnings = [line for line in d.lines if "level=warning" in line and "llm-d" in line]
        assert len(warnings) == 1 and "events.model_name" in warnings[0], d.log_text()
        w = Worker(d.stub(), "alice", "acme")
        store(w, list(range(100, 108)), NS)
        ctx = zmq.Context()
        try:
            batches: list[tuple[int, bytes]] = []
            for _ in range(400):  # until the publisher thread has sent the batch
                batches = replay(ctx, d.endpoints["kv_replay"], 0, topic=b"")
                if any(decode(p) for _, p in batches):
                    break
                time.sleep(0.01)
            assert {e["type"] for _, p in batches for e in decode(p)} == {"BlockStored"}
        finally:
            ctx.destroy(linger=0)
        detach(w)
    finally:
        assert d.stop() == 0, d.log_text()


@pytest.mark.parametrize("placeholder", ["replace-me", "REPLACE_ME", "<your model>", "changeme"])
def test_a_placeholder_model_name_is_refused_at_start(tmp_path: Path, placeholder: str) -> None:
    config = tmp_path / "blockd.yaml"
    config.write_text(yaml.safe_dump({
        "server": {"unix_socket": str(tmp_path / "b.sock"), "tcp_address": "",
                   "handle_socket": str(tmp_path / "p.sock")},
        "metrics": {"address": ""},
        "events": {"zmq_endpoint": "tcp://127.0.0.1:*", "model_name": placeholder}}))
    out = subprocess.run([*DAEMON_COMMAND, "--config", str(config)], capture_output=True,
                         text=True, timeout=60, cwd=tmp_path, check=False)
    assert out.returncode == 2, out.stdout + out.stderr
    (line,) = out.stderr.splitlines()
    assert line.startswith("blockd: bad configuration: events.model_name")
    assert "placeholder" in line and not (tmp_path / "b.sock").exists()
