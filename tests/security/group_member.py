"""A sharing-group member's worker for ``test_group_charging.py``: ``python group_member.py
ARGS_JSON`` (target, token, tenant).

It attaches as its tenant, maps the pool, and answers one JSON line on stdout for each JSON
command line on stdin, heartbeating while it waits (a live worker):

* ``{"op": "admit", "tokens": [...]}``: ``{"code", "reason", "seq", "table", "cached"}``
  (``reason``: the status' field, e.g. ``quota`` for RESOURCE_EXHAUSTED); the step's fence is
  completed (the prefill ran).
* ``{"op": "write", "seq": id, "marker": hex}``: fill every byte of the sequence's blocks with
  the marker, as its kernels would write K/V.
* ``{"op": "commit", "seq": id}``: commit its full blocks; the fence is completed and
  reported (a heartbeat) before the reply.
* ``{"op": "release", "seq": id, "report": bool}``: release it; the fence is completed and
  reported (a heartbeat) before the reply, or, with ``report`` false, never reported (a worker
  that stops reporting, still heartbeating).
* ``{"op": "read", "blocks": [...], "marker": hex}``: ``{"marked": n}``, the blocks whose
  every byte is the marker.
* ``{"op": "exit"}``: detach.
"""

import json
import os
import select
import sys
from collections.abc import Callable

import torch

import blockd_client.requests as rq
from blockd_client import Client
from blockd_gpu import KvLayout

LAYOUT = {"block_size": 4, "num_layers": 2, "num_kv_heads": 2, "head_dim": 8,
          "dtype": "float16"}


class Lines:
    """Lines of stdin, read unbuffered so that ``select`` tells whether one is waiting."""

    def __init__(self) -> None:
        self.buf = b""

    def next(self, idle: Callable[[], object]) -> str:
        while b"\n" not in self.buf:
            if not select.select([0], [], [], 1.0)[0]:
                idle()
                continue
            chunk = os.read(0, 65536)
            if not chunk:
                return ""
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()


def _tiled(marker: bytes, n: int) -> torch.Tensor:
    return torch.frombuffer(bytearray((marker * (n // len(marker) + 1))[:n]), dtype=torch.uint8)


def main() -> None:
    args = json.loads(sys.argv[1])
    client = Client(args["target"], token=args["token"])
    session = client.attach(args["tenant"], KvLayout(**LAYOUT), worker_name=args["tenant"])
    ns = rq.namespace("tiny", model_revision="r1")
    kv_pool = session.pool.kv_pool()
    tables: dict[str, list[int]] = {}
    lines = Lines()
    print(json.dumps({"session": session.session_id}), flush=True)
    while line := lines.next(session.heartbeat):
        cmd = json.loads(line)
        op = cmd["op"]
        reply: dict = {}
        if op == "admit":
            out = session.step([rq.admit(cmd["tokens"], ns)])
            res = out.results[0]
            reply = {"code": res.status.code, "reason": res.status.field}
            if res.status.code == 0:
                seq = res.admit.sequence_id
                tables[seq] = list(res.admit.block_table)
                reply.update(seq=seq, table=tables[seq], cached=res.admit.num_cached_tokens)
            session.complete(out.fence)
        elif op == "write":
            marker = bytes.fromhex(cmd["marker"])
            for b in tables[cmd["seq"]]:
                u8 = kv_pool[:, :, b].view(torch.uint8)
                u8.copy_(_tiled(marker, u8.numel()).reshape(u8.shape))
        elif op == "commit":
            out = session.step([rq.commit(cmd["seq"])])
            reply = {"code": out.results[0].status.code}
            session.complete(out.fence)
            # Reported before the reply, so the committed blocks are in the index when the
            # test's next command (another member's admit) runs: otherwise the completion
            # rode on the next heartbeat and such a hit depended on timing.
            session.heartbeat()
        elif op == "release":
            out = session.step([rq.release(cmd["seq"])])
            reply = {"code": out.results[0].status.code}
            if cmd.get("report", True):
                session.complete(out.fence)
                session.heartbeat()  # reported before the reply, as a commit's fence is
        elif op == "read":
            marker = bytes.fromhex(cmd["marker"])
            marked = 0
            for b in cmd["blocks"]:
                u8 = kv_pool[:, :, b].view(torch.uint8)
                marked += bool(torch.equal(u8.flatten(), _tiled(marker, u8.numel())))
            reply = {"marked": marked}
        elif op == "exit":
            break
        print(json.dumps(reply), flush=True)
    session.detach()
    print(json.dumps({"detached": True}), flush=True)


if __name__ == "__main__":
    main()
