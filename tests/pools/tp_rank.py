"""One tensor-parallel rank's worker, in its own process: ``python tp_rank.py SPEC_JSON``.

What a vLLM worker process of rank ``rank`` does with the connector's worker side
(``blockd_vllm.worker.WorkerSide``): it maps the scheduler session's pool, saves its own KV
tensors (seeded by ``seed``, so the test can rebuild them) into its shard, and publishes fences
into its slot of the fence page. Driven over stdin, one command per line:

- ``save FENCE VLLM_IDS BLOCKD_IDS`` (ids comma-separated): one step's saves, then ``FENCE``;
- ``fence FENCE``: a step with no copies, only the fence;
- ``load VLLM_IDS BLOCKD_IDS``: load blockd blocks into (zeroed) vLLM blocks and compare them
  with the blocks saved from (answers ``same`` or ``differ``);
- ``retire``: the shutdown path (answers whether this rank was the last to retire).

Each command answers one line on stdout (``ok ...``).
"""

from __future__ import annotations

import json
import sys

import torch
from blockd_vllm.layout import KvShape
from blockd_vllm.metadata import BlockdMetadata, PoolRef
from blockd_vllm.worker import WorkerSide

B, H, D, LAYERS, VLLM_BLOCKS = 4, 2, 8, 2, 10


def caches(seed: int) -> dict[str, torch.Tensor]:
    """The CPU backend's layout (``[blocks, H, B, 2D]``), random per rank."""
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn.attn":
            torch.randn((VLLM_BLOCKS, H, B, 2 * D), generator=g).to(torch.float16)
            for i in range(LAYERS)}


def ids(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    spec = json.loads(sys.argv[1])
    shape = KvShape(num_layers=LAYERS, block_size=B, num_kv_heads=H, head_dim=D,
                    dtype="float16", tp_size=spec["tp_size"])
    ref = PoolRef(spec["session_id"], spec["epoch"], spec["handle_socket"],
                  fetch_secret=spec["fetch_secret"])
    kv = caches(spec["seed"])
    worker = WorkerSide(shape, "LBHNC")
    worker.rank = spec["rank"]
    worker.register(kv)
    for step, line in enumerate(sys.stdin, start=1):
        cmd, *args = line.split()
        if cmd == "save":
            fence, v, b = int(args[0]), ids(args[1]), ids(args[2])
            meta = BlockdMetadata(pool=ref, step=step, fence=fence, save_vllm=v, save_blockd=b)
            worker.start_load(meta)  # maps the pool (nothing to load)
            worker.save(meta)
            worker.drain()  # the copy thread ran it (CPU tensors)
            report = worker.take_report()
            print("ok", "saved" if report is not None and step in report.ok else "failed",
                  flush=True)
        elif cmd == "fence":
            worker.save(BlockdMetadata(pool=ref, step=step, fence=int(args[0])))
            worker.drain()
            print("ok", worker.pool.fences.published, flush=True)
        elif cmd == "load":
            v, b = ids(args[0]), ids(args[1])
            saved = {n: t[v].clone() for n, t in kv.items()}
            for t in kv.values():
                t[v] = 0
            worker.start_load(BlockdMetadata(pool=ref, step=step, load_vllm=v, load_blockd=b,
                                             load_session=[ref.session_id] * len(v)))
            same = all(torch.equal(kv[n][v], saved[n]) for n in kv)
            print("ok", "same" if same else "differ", flush=True)
        elif cmd == "retire":
            print("ok", "last" if worker.retire() else "not-last", flush=True)
            worker.close()
            return


if __name__ == "__main__":
    main()
