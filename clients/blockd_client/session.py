"""What a worker keeps per session, shared by the sync and asyncio clients.

``SessionState`` applies each Step's results locally: block-table deltas into the int32 tensor,
copy-on-write copies into the mapped pool (``blockd_gpu.copy_blocks``, before the step's
kernels), sequences the daemon preempted (dropped from the tables: their blocks go to a
higher-priority request once this session's fences complete, so no kernel may touch them any
more), and it publishes the fence once the caller says the step's GPU work is done
(``complete``) or enqueues it on the worker's CUDA stream (``complete_on_stream``, see
``blockd_client.fences``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from blockd.api.v1 import blockd_pb2 as pb
from blockd_client import fences
from blockd_client.errors import UNANSWERED, BlockdError
from blockd_client.requests import StepCounter
from blockd_client.tables import BlockTables


def left_in_doubt(req: pb.StepRequest, err: BlockdError) -> pb.StepRequest | None:
    """What a Step call ``req`` that failed with ``err`` leaves in doubt: ``req`` itself when
    the daemon may have applied it (a status of ``UNANSWERED``: ``settle`` sends it again),
    else nothing (refused: not applied, and never will be)."""
    return req if err.status in UNANSWERED else None


@dataclass
class StepOutcome:
    """A Step's response plus the fence to publish once its GPU work is done."""

    response: pb.StepResponse
    fence: int

    @property
    def results(self) -> Any:
        return self.response.results

    def ok(self) -> bool:
        return all(r.status.code == 0 for r in self.response.results)

    @property
    def preempted(self) -> list[str]:
        """Sequences the daemon preempted for higher-priority requests since the previous
        Step: gone (already dropped from the block tables); re-admit them to recompute."""
        return [p.sequence_id for p in self.response.preempted]


def _of_state(name: str, doc: str) -> Any:
    """A read-only property reading ``self.state.<name>``."""
    return property(lambda self: getattr(self.state, name), doc=doc)


class SessionViews:
    """Read-only views of a session's ``state`` that ``Session`` and ``AsyncSession`` share."""

    state: SessionState
    session_id: str = _of_state("session_id", "The daemon's id of this session.")
    epoch: int = _of_state("epoch", "The pool's epoch this session was attached in.")
    fetch_secret: str = _of_state("fetch_secret", "What the handle socket asks for with the "
                                  "session id (``AttachResponse.fetch_secret``): pass it only "
                                  "to this session's own workers, never log it.")
    pool: Any = _of_state("pool", "The mapped pool (``PoolView`` or ``CudaPoolView``); None "
                          "with ``map_pool=False``.")
    tables: Any = _of_state("tables", "The local block tables (``BlockTables``); None with "
                            "``tables=False``.")


class SessionState:
    def __init__(self, attach: pb.AttachResponse, pool: Any | None, max_seqs: int,
                 max_blocks: int, device: Any, tables: bool = True) -> None:
        self.attach = attach
        self.session_id = attach.session_id
        self.epoch = attach.epoch
        self.fetch_secret = attach.fetch_secret
        self.block_size = attach.pool.layout.block_size
        self.pool = pool
        self.counter = StepCounter()
        #: None with ``tables=False`` (``Client.attach``).
        self.tables: BlockTables | None = (
            BlockTables(max_seqs, max_blocks, self.block_size, device) if tables else None)

    def request(self, ops: list[pb.Operation]) -> pb.StepRequest:
        self.completed_fence()
        return self.counter.request(self.session_id, self.epoch, ops)

    def completed_fence(self) -> int:
        """The highest fence known done, reported over RPC: what the host completed, or what a
        stream has written into the fence page since (it only ever holds fences it was handed,
        so it is never beyond those the Steps announced)."""
        if self.pool is not None:
            self.counter.completed = max(self.counter.completed, self.pool.fences.published)
        return self.counter.completed

    def apply(self, ops: list[pb.Operation], resp: pb.StepResponse,
              fence: int | None = None) -> StepOutcome:
        """Bring the local tables and pool up to date with a Step's results (``fence``: the
        Step's, when it is not the last one made: a late answer)."""
        if self.tables is not None:
            self._update_tables(self.tables, ops, resp)
        if resp.copies and self.pool is not None:
            self.copy_blocks([(c.src_block, c.dst_block) for c in resp.copies])
        return StepOutcome(resp, self.counter.fence if fence is None else fence)

    @staticmethod
    def _update_tables(tables: BlockTables, ops: list[pb.Operation],
                       resp: pb.StepResponse) -> None:
        for op, res in zip(ops, resp.results, strict=True):
            if res.status.code:
                continue
            kind = op.WhichOneof("op")
            if kind == "admit":
                a = res.admit
                tables.add(a.sequence_id, list(a.block_table), a.num_tokens)
            elif kind == "append":
                d = res.append.delta
                tables.apply(op.append.sequence_id, d.start_index, list(d.block_ids),
                             res.append.num_tokens)
            elif kind == "append_batch":
                ids = op.append_batch.sequence_ids
                ab = res.append_batch
                changed = {e.index: e.delta for e in ab.deltas}
                failed = {e.index for e in ab.errors}
                for i, n in enumerate(ab.num_tokens):
                    if i in failed:
                        continue
                    d = changed.get(i)
                    if d is None:
                        tables.set_len(ids[i], n)
                    else:
                        tables.apply(ids[i], d.start_index, list(d.block_ids), n)
            elif kind == "fork":
                parent = op.fork.sequence_id
                blocks = tables.blocks(parent)
                n = int(tables.lens[tables.row(parent)])
                for child in res.fork.child_sequence_ids:
                    tables.add(child, blocks, n)
            elif kind == "release":
                tables.remove(op.release.sequence_id)
        # After the results: a sequence admitted, forked or appended to earlier in this very
        # Step may have been preempted by a later operation of it.
        for p in resp.preempted:
            if tables.has(p.sequence_id):
                tables.remove(p.sequence_id)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Run the copy-on-write copies in every shard (all layers, K and V, one launch)."""
        import torch

        from blockd_gpu import copy_blocks

        for shard in range(self.pool.tp_size):
            kv_pool = self.pool.kv_pool(shard)
            mapping = torch.tensor(pairs, dtype=torch.int64, device=kv_pool.device)
            copy_blocks(kv_pool, mapping)

    def complete(self, fence: int) -> None:
        """The step's GPU work is done: publish its fence (read by the daemon's poller)."""
        if fence > self.counter.completed:
            if self.pool is not None:
                self.pool.publish_fence(fence)
            self.counter.completed = fence

    def complete_on_stream(self, fence: int, stream: Any = None) -> str:
        """Publish ``fence`` when ``stream`` passes this point; the caller never waits.

        With CUDA tensors (``stream`` None: the current torch stream of the pool's device) the
        write is enqueued on the stream (``blockd_client.fences``); on CPU tensors the work it
        orders already ran, so it is published at once, like ``complete``. A fence not above
        the highest handed over is ignored; one no Step announced is refused (ValueError).
        Returns what was done: ``fences.HOST``, ``STREAM_WRITE``, ``HOST_FUNCTION``,
        ``IGNORED``."""
        if fence > self.counter.fence:
            raise fences.FenceOrderError(
                f"fence {fence} was never announced: the last Step named {self.counter.fence}")
        if self.pool is None:
            if stream is not None:
                raise ValueError("complete_on_stream: no fence page (attached with "
                                 "map_pool=False); synchronize the stream, then complete()")
            self.complete(fence)
            return fences.HOST
        how: str = self.pool.publish_fence_on_stream(fence, stream)
        if how == fences.HOST:
            self.counter.completed = max(self.counter.completed, fence)
        return how
