"""The ``events`` section of the configuration: block events in vLLM's KV-events format.

Its own module because ``blockd.config`` is at the size limit; ``blockd.config.Config`` holds
it as ``events`` (``blockd.runtime.kv_events`` publishes with it; docs/kv_events.md).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from blockd.core.errors import InvalidArgument
from blockd.options import option

#: ``events.model_name`` values that are a template's placeholder, not a model (refused).
PLACEHOLDER = re.compile(r"(?i)(replace|change)[-_ ]?me|todo|fixme|tbd|placeholder|<.*>")


@dataclass(frozen=True)
class EventsConfig:
    """Block events in vLLM's KV-events wire format over ZMQ (docs/kv_events.md)."""

    zmq_endpoint: str = option(
        "",
        "ZMQ PUB endpoint to bind, e.g. \"tcp://127.0.0.1:5557\" (\"\" disables publishing; "
        "a port of \"*\" picks a free one). Without CURVE it is unauthenticated: private "
        "tenants' LoRA names are withheld on it.")
    curve_secret_key_file: str = option(
        "", "File holding the publisher's Z85 CURVE secret key (40 characters): PUB and replay "
            "sockets then require CURVE (\"\": no authentication).")
    curve_client_keys: str = option(
        "", "Comma-separated Z85 public keys of the subscribers CURVE admits (\"\": none).")
    zmq_connect: bool = option(
        False,
        "Connect the PUB socket to zmq_endpoint instead of binding it: for a consumer "
        "that binds and collects many publishers (llm-d's indexer on \"tcp://*:5557\").")
    replay_endpoint: str = option(
        "",
        "ZMQ ROUTER endpoint that replays missed batches, e.g. \"tcp://*:5558\" (\"\" "
        "disables it).")
    topic: str = option(
        "",
        "First frame of every message. \"\" = llm-d's \"kv@<pod_id>@<model_name>\" (see "
        "below).")
    model_name: str = option(
        "",
        "The model the default topic names: llm-d indexes every block of this node "
        "under it, so use the model name the router scores requests for. With topic \"\" "
        "too: vLLM's default empty topic (llm-d needs the model; a warning says so).")
    pod_id: str = option(
        "",
        "The pod in the default topic; \"\" = $POD_IP, else $POD_NAME, else the host "
        "name. llm-d matches it with the pod's address: set e.g. \"$(POD_IP):8000\" if "
        "its endpoints have ports.")
    batch_ms: float = option(
        10.0,
        "Longest time an event waits for others to share its batch, milliseconds.")
    max_batch: int = option(
        512,
        "Most events in one batch.")
    replay_buffer: int = option(
        10000,
        "Batches kept for replay (the oldest are dropped first).")
    replay_max_bytes: int = option(
        1 << 20,
        "Most bytes one replay answer carries (each batch's topic, sequence number and "
        "payload; at least one batch): a longer replay ends early with the end marker and "
        "the subscriber asks again from the next sequence number.")
    replay_bytes_per_second: int = option(
        4 << 20,
        "Bytes every replay answer together may carry per second (a token bucket holding a "
        "second's worth, at least replay_max_bytes): however many peers ask, an 8-byte "
        "request no longer makes the daemon send megabytes.")
    replay_requests_per_second: float = option(
        2.0,
        "Replay requests answered per second per peer (its address: the IP over TCP); "
        "beyond, a request is answered with the end marker only.")
    replay_request_burst: int = option(
        10,
        "Replay requests a peer may make at once before replay_requests_per_second holds.")
    hwm: int = option(
        100000,
        "ZMQ send high-water mark of the PUB socket (messages queued per slow "
        "subscriber before further ones are dropped for it: it sees a gap and replays), "
        "and the most events queued for the publisher thread (beyond that they are "
        "dropped and AllBlocksCleared announced).")
    extra_keys: bool = option(
        True,
        "Publish vLLM's extra_keys (per block: the LoRA name, or nil). Off for "
        "consumers that cannot decode the field.")
    labels: bool = option(
        False,
        "Add blockd's optional blockd field to each BlockStored (the namespace label "
        "and the tenant label; vLLM's decoder ignores it). Only with wire_format "
        "\"vllm\".")
    wire_format: str = option(
        "vllm",
        "\"vllm\": vLLM's current format (events as tagged maps; replay answers carry the "
        "topic). \"legacy\": the pre-0.26 form (events as tagged arrays; replay answers "
        "without the topic).")

    def __post_init__(self) -> None:
        checks = (("batch_ms", self.batch_ms >= 0, "must be >= 0"),
                  ("max_batch", self.max_batch >= 1, "must be >= 1"),
                  ("replay_buffer", self.replay_buffer >= 1, "must be >= 1"),
                  ("replay_max_bytes", self.replay_max_bytes >= 1, "must be >= 1"),
                  ("replay_bytes_per_second", self.replay_bytes_per_second >= 1,
                   "must be >= 1"),
                  ("replay_requests_per_second", self.replay_requests_per_second > 0,
                   "must be > 0"),
                  ("replay_request_burst", self.replay_request_burst >= 1, "must be >= 1"),
                  ("hwm", self.hwm >= 1, "must be >= 1"),
                  ("wire_format", self.wire_format in ("vllm", "legacy"),
                   "must be 'vllm' or 'legacy'"),
                  ("pod_id", "@" not in self.pod_id, "may not contain '@'"),
                  ("model_name", not PLACEHOLDER.fullmatch(self.model_name.strip()),
                   "is a placeholder: set the model name your router scores requests for"))
        for name, ok, why in checks:
            if not ok:
                raise InvalidArgument(f"events.{name} {why}, got {getattr(self, name)!r}",
                                      field=f"events.{name}")

    def resolved_topic(self, environ: Mapping[str, str] | None = None) -> str:
        """The topic to publish under: ``topic``, else ``kv@<pod>@<model_name>``.

        Checked when the publisher is built (not per field: ``model_name`` and ``topic`` may
        come from different sources). The only reader of POD_IP / POD_NAME.
        """
        if self.topic or not self.model_name:
            return self.topic  # "" without a model: vLLM's own default topic
        env = os.environ if environ is None else environ
        pod = self.pod_id or env.get("POD_IP") or env.get("POD_NAME") or os.uname().nodename
        if "@" in pod:
            raise InvalidArgument(f"events.pod_id: {pod!r} contains '@'", field="events.pod_id")
        return f"kv@{pod}@{self.model_name}"

    def check(self) -> None:
        """What only holds for an enabled publisher (fields from different sources)."""
        if self.labels and self.wire_format != "vllm":
            raise InvalidArgument("events.labels needs events.wire_format 'vllm' (the legacy "
                                  "arrays have no room for an optional field)",
                                  field="events.labels")
        self.resolved_topic()
