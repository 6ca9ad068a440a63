"""The connector's settings: ``kv_connector_extra_config`` checked once, at engine start.

Every key is checked before anything connects, and a bad value raises ``ValueError`` naming the
key and the value, so a typo fails ``vllm serve`` at start instead of silently running without
the cache. ``target`` and ``tenant`` are required; ``token_file`` is optional (as for any
blockd worker: without it, ``$BLOCKD_TOKEN_FILE`` if set, else no credential, which only a
daemon that allows anonymous workers accepts).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

KNOWN_KEYS = frozenset({
    "target", "tenant", "token_file", "model_revision", "connect_timeout_s", "rpc_timeout_s",
    "retry_interval_s", "lease_ms", "worker_name", "remote_wait_s", "save_generated",
    "commit_interval_s", "admit_wait_s",
})


@dataclass(frozen=True)
class Settings:
    #: ``unix:/path/blockd.sock`` or ``host:port`` of the daemon.
    target: str
    #: The blockd tenant every request of this engine is admitted for.
    tenant: str
    #: A file holding the bearer token (re-read when the daemon rejects it).
    token_file: str | None = None
    #: Overrides the revision derived from the weights (``blockd_vllm.namespace``).
    model_revision: str | None = None
    #: How long the engine waits at start for blockd to answer before refusing to start.
    connect_timeout_s: float = 30.0
    #: Deadline of one RPC on the request path; a slower daemon counts as unreachable.
    rpc_timeout_s: float = 2.0
    #: While degraded, how often the connector tries to reach blockd again.
    retry_interval_s: float = 1.0
    #: The session's lease (0: the daemon's default).
    lease_ms: int = 0
    #: A display name for the session in blockd's logs and ListSequences.
    worker_name: str = "vllm"
    #: With a remote tier on the daemon: how long a new request may wait in vLLM's
    #: ``WAITING_FOR_REMOTE_KVS`` (an async load: the scheduler never blocks) while blockd
    #: fetches its prefix from the cluster; then it goes ahead with what arrived, the rest
    #: computed (0: never wait, admit the local hit at once).
    remote_wait_s: float = 1.0
    #: Save and commit the full blocks of generated tokens too (prompt + answer, as vLLM's
    #: own prefix cache hashes them), so the next turn of a conversation hits the previous
    #: answer; false: prompt blocks only.
    save_generated: bool = True
    #: While the engine runs work, a Step that would carry only commits and releases goes at
    #: most this often and not while another Step is in flight (seconds; an admit or an
    #: append goes at once and takes what waits with it, and so does a step that runs
    #: nothing). Fewer round trips on the engine's threads and in the daemon; a saved prefix
    #: becomes hittable at most this much later. 0: a Step from every step that has any.
    commit_interval_s: float = 0.05
    #: While the engine runs other requests, how long a new request waits for blockd's answer
    #: to its admit (seconds from its first ask; it waits whole steps: vLLM asks once per
    #: ``schedule()``). Then it is computed with the others, without the cache, and its
    #: prompt is still saved once the answer comes. A slow answer costs that request its hit,
    #: never a split batch. 0: at most one step. An idle engine keeps waiting for the answer
    #: (nothing else is held back), each ask blocking up to 0.05 s for it rather than spinning
    #: through empty steps (``blockd_vllm.asking.IDLE_WAIT_S``).
    admit_wait_s: float = 0.02

    @classmethod
    def parse(cls, extra: dict[str, Any] | None) -> Settings:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - KNOWN_KEYS)
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown key(s) {unknown}; known: "
                             f"{sorted(KNOWN_KEYS)}")
        target = extra.get("target")
        if not isinstance(target, str) or not target:
            raise ValueError("kv_connector_extra_config.target: required, e.g. "
                             f"'unix:/run/blockd/blockd.sock' (got {target!r})")
        _check_target(target)
        tenant = extra.get("tenant")
        if not isinstance(tenant, str) or not tenant.strip():
            raise ValueError(f"kv_connector_extra_config.tenant: required, a tenant id of the "
                             f"daemon's tenants file (got {tenant!r})")
        token_file = extra.get("token_file")
        if token_file is not None:
            if not isinstance(token_file, str) or not token_file:
                raise ValueError(f"kv_connector_extra_config.token_file: a path (got "
                                 f"{token_file!r})")
            if not os.access(token_file, os.R_OK):
                raise ValueError(f"kv_connector_extra_config.token_file: {token_file!r} "
                                 f"cannot be read")
        revision = extra.get("model_revision")
        if revision is not None and (not isinstance(revision, str) or not revision):
            raise ValueError(f"kv_connector_extra_config.model_revision: a non-empty string "
                             f"(got {revision!r})")
        save_generated = extra.get("save_generated", True)
        if not isinstance(save_generated, bool):
            raise ValueError(f"kv_connector_extra_config.save_generated: true or false (got "
                             f"{save_generated!r})")
        return cls(target=target, tenant=tenant, token_file=token_file,
                   model_revision=revision,
                   connect_timeout_s=_positive(extra, "connect_timeout_s", 30.0),
                   rpc_timeout_s=_positive(extra, "rpc_timeout_s", 2.0),
                   retry_interval_s=_positive(extra, "retry_interval_s", 1.0),
                   lease_ms=int(_positive(extra, "lease_ms", 0, allow_zero=True)),
                   remote_wait_s=_positive(extra, "remote_wait_s", 1.0, allow_zero=True),
                   worker_name=str(extra.get("worker_name", "vllm")),
                   save_generated=save_generated,
                   commit_interval_s=_positive(extra, "commit_interval_s", 0.05,
                                               allow_zero=True),
                   admit_wait_s=_positive(extra, "admit_wait_s", 0.02, allow_zero=True))


def _check_target(target: str) -> None:
    if target.startswith("unix:"):
        path = target[len("unix:"):]
        if path.startswith("//"):  # unix:///abs/path is gRPC's other spelling
            path = path[2:]
        if not path.startswith("/"):
            raise ValueError(f"kv_connector_extra_config.target: a unix target needs an "
                             f"absolute path, e.g. 'unix:/run/blockd/blockd.sock' (got "
                             f"{target!r})")
        return
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"kv_connector_extra_config.target: 'unix:/path' or 'host:port' "
                         f"(got {target!r})")


def _positive(extra: dict[str, Any], key: str, default: float, allow_zero: bool = False
              ) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"kv_connector_extra_config.{key}: a number (got {value!r})")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"kv_connector_extra_config.{key}: must be > 0 (got {value!r})")
    return float(value)
