"""A worker process for the isolation tests: ``python hostile.py MODE ARGS_JSON``.

``write``: attach, admit a prompt, fill every byte of its blocks (in its own mapping) with a
16-byte marker, commit, complete the fence; print a JSON line (session id, table, pool size),
then hold the session (heartbeating) until stdin closes.
``scan``: attach, fetch its own handles, map every descriptor it received read-only and look for
the marker in every byte; then ask the handle socket for each session id in ``steal`` (with no
tenant, its own tenant and the victim's) and scan whatever it gets; admit the victim's prompt
and report the cached tokens. Prints one JSON line.
``probe``: ask the handle socket for ``steal[0]`` (with the fetch secret ``secret``, if given)
and print the refusal code (or "SERVED").
A process that only learnt a session id has no fetch secret: ``scan`` asks with the one given as
``secret`` (the victim's own, leaked with the id, in the tests that say so) or with none.

With ``uid`` the process drops to that uid (and ``gid``) after its imports, before it talks to
the daemon: the interpreter lives in a directory only root may read, so a process of another
uid must be started as root and then become that uid (``os.setuid`` in the child).
"""

import json
import mmap
import os
import select
import sys

import blockd_client.requests as rq
from blockd import handle_wire
from blockd_client import Client
from blockd_client.handles import fetch_handles

LAYOUT = {"block_size": 4, "num_layers": 2, "num_kv_heads": 2, "head_dim": 8,
          "dtype": "float16"}


def _scan_fds(fds: list[int], marker: bytes) -> dict[str, int]:
    out = {"bytes": 0, "found": 0}
    for fd in fds:
        size = os.fstat(fd).st_size
        if size:
            with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) as m:
                out["bytes"] += size
                out["found"] += m.find(marker) >= 0
        os.close(fd)
    return out


def _drop(args: dict) -> None:
    if args.get("uid") is not None:
        os.setgroups([])
        os.setgid(args["gid"])
        os.setuid(args["uid"])


def main() -> None:
    mode, args = sys.argv[1], json.loads(sys.argv[2])
    if mode == "probe":
        _drop(args)
        try:
            _h, fds = fetch_handles(args["handles"], args["steal"][0], args.get("secret", ""),
                                    timeout=5)
        except handle_wire.HandleRefused as exc:
            print(exc.code, flush=True)
            return
        for fd in fds:
            os.close(fd)
        print("SERVED", flush=True)
        return
    from blockd_gpu import KvLayout  # not for a probe: it imports torch

    layout = KvLayout(**LAYOUT)
    client = Client(args["target"], token=args["token"])
    _drop(args)
    ns = rq.namespace("tiny", model_revision="r1")
    marker = bytes.fromhex(args["marker"])
    if mode == "write":
        import torch  # as the daemon's uid (the writer is the trusted victim)

        session = client.attach(args["tenant"], layout, worker_name="writer")
        out = session.step([rq.admit(args["tokens"], ns)])
        res = out.results[0]
        assert res.status.code == 0, res.status
        seq, table = res.admit.sequence_id, list(res.admit.block_table)
        kv_pool = session.pool.kv_pool()
        for b in table:
            u8 = kv_pool[:, :, b].view(torch.uint8)
            tiled = (marker * (u8.numel() // len(marker) + 1))[:u8.numel()]
            u8.copy_(torch.frombuffer(bytearray(tiled), dtype=torch.uint8).reshape(u8.shape))
        session.complete(out.fence)
        commit = session.step([rq.commit(seq)])
        session.complete(commit.fence)
        print(json.dumps({"session": session.session_id, "secret": session.fetch_secret,
                          "table": table,
                          "cached": res.admit.num_cached_tokens,
                          "num_blocks": session.pool.num_blocks}), flush=True)
        # Hold the session (and its cached prefix) until stdin closes, heartbeating as a live
        # worker does: a loaded machine can take longer than a lease over the scans.
        while not select.select([sys.stdin], [], [], 1.0)[0]:
            session.heartbeat()
        sys.stdin.read()
        session.step([rq.release(seq)])
        session.detach()
        return
    session = client.attach(args["tenant"], layout, worker_name="scanner", map_pool=False)
    report: dict = {"uid": os.getuid()}
    header, fds = fetch_handles(args["handles"], session.session_id, session.fetch_secret,
                                tenant_id=args["tenant"])
    report["own"] = {"num_blocks": header.num_blocks, **_scan_fds(fds, marker)}
    report["steal"] = []
    for sid in args.get("steal", []):
        for tenant in ("", args["tenant"], args.get("victim_tenant", "")):
            try:
                _h, got = fetch_handles(args["handles"], sid, args.get("secret", ""),
                                        tenant_id=tenant, timeout=5)
            except handle_wire.HandleRefused as exc:
                report["steal"].append({"tenant": tenant, "refused": exc.code})
                continue
            report["steal"].append({"tenant": tenant, **_scan_fds(got, marker)})
    out = session.step([rq.admit(args["tokens"], ns)])
    res = out.results[0]
    report["cached"] = res.admit.num_cached_tokens if res.status.code == 0 else -1
    if res.status.code == 0:
        session.step([rq.release(res.admit.sequence_id)])
    session.detach()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
