"""Request builders shared by ``Client`` and ``AsyncClient``: one place that knows the proto."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from blockd import wire
from blockd.api.v1 import blockd_pb2 as pb


def layout_proto(layout: Any, tp_size: int = 1) -> pb.KvLayout:
    """A ``blockd_gpu.KvLayout`` (or anything with its fields) as the proto KvLayout; the enum
    numbers are ``blockd.wire``'s."""
    return pb.KvLayout(block_size=layout.block_size, num_layers=layout.num_layers,
                       num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                       dtype=wire.dtype_to_proto(layout.dtype),
                       kv_order=wire.kv_order_to_proto(layout.kv_order),
                       tp_size=tp_size)


def namespace(model_id: str, model_revision: str | None = None, lora_id: str | None = None,
              tokenizer_digest: bytes | None = None, cache_salt: bytes | None = None
              ) -> pb.CacheNamespace:
    ns = pb.CacheNamespace(model_id=model_id)
    if model_revision is not None:
        ns.model_revision = model_revision
    if lora_id is not None:
        ns.lora_id = lora_id
    if tokenizer_digest is not None:
        ns.tokenizer_digest = tokenizer_digest
    if cache_salt is not None:
        ns.cache_salt = cache_salt
    return ns


def admit(tokens: Sequence[int], ns: pb.CacheNamespace, request_id: str = "",
          cache: bool = True, priority: int = 0, wait_for_remote: bool = False
          ) -> pb.Operation:
    """``wait_for_remote``: answered ``pending_remote_blocks`` > 0 (nothing admitted) while
    the daemon's remote tier fetches blocks after the local hit; ask again later."""
    return pb.Operation(admit=pb.AdmitOp(request_id=request_id, namespace=ns, token_ids=tokens,
                                         priority=priority, disable_prefix_cache=not cache,
                                         wait_for_remote=wait_for_remote))


def append(seq_id: str, tokens: Sequence[int]) -> pb.Operation:
    return pb.Operation(append=pb.AppendOp(sequence_id=seq_id, token_ids=tokens))


def append_batch(seq_ids: Sequence[str], tokens: Sequence[int],
                 counts: Sequence[int] | None = None) -> pb.Operation:
    """One packed append for many sequences: ``tokens`` concatenated in ``seq_ids`` order,
    ``counts`` per sequence (None: one token each, a decode step)."""
    return pb.Operation(append_batch=pb.AppendBatchOp(sequence_ids=seq_ids, token_ids=tokens,
                                                      num_tokens=counts or ()))


def fork(seq_id: str, num_children: int = 1) -> pb.Operation:
    return pb.Operation(fork=pb.ForkOp(sequence_id=seq_id, num_children=num_children))


def release(seq_id: str) -> pb.Operation:
    return pb.Operation(release=pb.ReleaseOp(sequence_id=seq_id))


def commit(seq_id: str) -> pb.Operation:
    return pb.Operation(commit=pb.CommitOp(sequence_id=seq_id))


class StepCounter:
    """Numbers a session's steps and fences.

    Every Step gets a new step_id (the idempotency key of retries) and a new fence: the value
    the worker publishes once that step's GPU work is done.
    """

    def __init__(self) -> None:
        self.step_id = 0
        self.fence = 0
        #: Highest fence the worker reported done.
        self.completed = 0

    def request(self, session_id: str, epoch: int, ops: Iterable[pb.Operation]
                ) -> pb.StepRequest:
        self.step_id += 1
        self.fence += 1
        return pb.StepRequest(session_id=session_id, epoch=epoch, step_id=self.step_id,
                              fence=self.fence, completed_fence=self.completed,
                              operations=list(ops))
