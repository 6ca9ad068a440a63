"""A worker process for the cross-process pool tests: ``python kvworker.py MODE ARGS_JSON``.

``write``: attach, admit a prompt, write a deterministic K/V pattern for every prompt position
into its own mapping of the pool (``reshape_and_cache``), commit, publish the fence, detach.
``read``: attach, admit the same prompt, and report what its own mapping holds in the hit blocks.
``hold``: attach, admit, print the table and sleep (to be killed with SIGKILL).
Prints one JSON line with the results. ``write`` with ``prompts`` (a list of prompts) in place
of ``tokens`` writes each prompt in turn, each its own attach, admit, write, commit, release
and detach as a separate ``write`` worker would, and prints one JSON list of their results:
one process (one import of torch) where a test only pushes blocks through the pool.

``python kvworker.py serve``: a fork server for the tests (``test_shared_pool.run_worker``).
It imports what a worker needs once, then for each request line on stdin (JSON: ``mode``,
``args``, ``timeout``) forks a worker process that runs that mode exactly as
``python kvworker.py MODE ARGS_JSON`` would (its own attach, its own mapping of the pool, its
stdout and stderr captured), waits for it (killed past ``timeout``), and answers one JSON line:
``returncode``, ``stdout``, ``stderr``. Each worker is still a process of its own; only the
seconds of importing torch are not paid again by every one. The server itself never attaches
or maps anything, and it exits when its stdin closes.
"""

import hashlib
import json
import os
import select
import signal
import sys
import tempfile
import time
import traceback

import torch

import blockd_client.requests as rq
from blockd_client import Client
from blockd_gpu import KvLayout, reshape_and_cache


def pattern(layout: KvLayout, tokens: list[int], layer: int, kv: int) -> torch.Tensor:
    """K (kv=0) or V (kv=1) of each token: a function of token id, position, layer and head."""
    t = torch.tensor(tokens, dtype=torch.float32)[:, None, None]
    pos = torch.arange(len(tokens), dtype=torch.float32)[:, None, None]
    h = torch.arange(layout.num_kv_heads, dtype=torch.float32)[None, :, None]
    d = torch.arange(layout.head_dim, dtype=torch.float32)[None, None, :]
    x = torch.sin(t * 0.01 + pos * 0.1 + h * 0.37 + d * 0.05 + layer * 1.3 + kv * 2.1)
    return x.to(layout.torch_dtype)


def block_bytes(kv_pool: torch.Tensor, block: int) -> bytes:
    return b"".join(kv_pool[layer, kv, block].contiguous().numpy().tobytes()
                    for layer in range(kv_pool.shape[0]) for kv in range(2))


def main() -> None:
    if sys.argv[1] == "serve":
        serve()
        return
    run(sys.argv[1], json.loads(sys.argv[2]))


def serve() -> None:
    for line in sys.stdin:
        req = json.loads(line)
        print(json.dumps(fork_one(req["mode"], req["args"], req["timeout"])), flush=True)


def fork_one(mode: str, args: dict, timeout: float) -> dict:
    """One worker in a forked process, as ``python kvworker.py MODE ARGS_JSON`` runs it."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:  # the worker
            code = 1
            try:
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                run(mode, args)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pidfd = os.pidfd_open(pid)
        try:
            if not select.select([pidfd], [], [], timeout)[0]:
                os.kill(pid, signal.SIGKILL)
                err.write(f"kvworker serve: the worker ran past {timeout} s, killed\n".encode())
        finally:
            os.close(pidfd)
        status = os.waitpid(pid, 0)[1]
        out.seek(0)
        err.seek(0)
        return {"returncode": os.waitstatus_to_exitcode(status),
                "stdout": out.read().decode(errors="replace"),
                "stderr": err.read().decode(errors="replace")}


def run(mode: str, args: dict) -> None:
    if mode == "write" and "prompts" in args:
        reports = [work(mode, {**args, "tokens": tokens}) for tokens in args["prompts"]]
        print(json.dumps(reports), flush=True)
    else:
        print(json.dumps(work(mode, args)), flush=True)


def work(mode: str, args: dict) -> dict:
    layout = KvLayout(**args["layout"])
    client = Client(args["target"], token=args["token"])
    session = client.attach(args["tenant"], layout, worker_name=f"kvworker-{mode}",
                            lease_ms=args.get("lease_ms", 0))
    ns = rq.namespace("tiny", model_revision="r1")
    tokens = args["tokens"]
    wait = bool(args.get("wait_for_remote"))
    out = session.step([rq.admit(tokens, ns, wait_for_remote=wait)])
    res = out.results[0]
    pending = 0
    while wait and res.admit.pending_remote_blocks:  # a scheduler's "ask again next step"
        pending += 1
        time.sleep(0.02)
        out = session.step([rq.admit(tokens, ns, wait_for_remote=wait)])
        res = out.results[0]
    assert res.status.code == 0, res.status
    seq = res.admit.sequence_id
    table = list(res.admit.block_table)
    kv_pool = session.pool.kv_pool()
    report = {"epoch": session.epoch, "table": table, "cached": res.admit.num_cached_tokens,
              "session": session.session_id, "pending_answers": pending}
    if mode == "write":
        slots = session.tables.slots(seq, 0, len(tokens))
        for layer, (k_cache, v_cache) in enumerate(session.pool.kv_caches()):
            reshape_and_cache(pattern(layout, tokens, layer, 0), pattern(layout, tokens, layer, 1),
                              k_cache, v_cache, slots)
        session.complete(out.fence)  # prompt K/V written: step 1's work is done
        commit = session.step([rq.commit(seq)])
        session.complete(commit.fence)
        report["committed"] = commit.results[0].commit.num_blocks_committed
        report["digests"] = [hashlib.sha256(block_bytes(kv_pool, b)).hexdigest()
                             for b in table]
        session.step([rq.release(seq)])
        session.detach()
    elif mode == "read":
        hits = res.admit.num_cached_tokens // layout.block_size
        report["digests"] = [hashlib.sha256(block_bytes(kv_pool, b)).hexdigest()
                             for b in table[:hits]]
        # Independently of the writer: the hit blocks hold exactly the pattern for these tokens.
        ok = True
        B = layout.block_size
        for layer in range(layout.num_layers):
            for kv in range(2):
                want = pattern(layout, tokens[:hits * B], layer, kv)
                got = kv_pool[layer, kv, table[:hits]].reshape(hits * B, layout.num_kv_heads,
                                                               layout.head_dim)
                ok = ok and torch.equal(got, want)
        report["pattern_ok"] = ok
        session.detach()
    elif mode == "hold":
        print(json.dumps(report), flush=True)
        time.sleep(3600)
    return report


if __name__ == "__main__":
    main()
