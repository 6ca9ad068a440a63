"""blockctl: the operator's CLI for a running blockd.

    blockctl stats                 blocks by state, hit rate, sessions
    blockctl tenants               per-tenant usage and quota
    blockctl inspect SEQ           every position's logical block, offset, physical block, slot
    blockctl watch                 stream block events (stored / removed / cleared)
    blockctl flush --tenant T      drop cached blocks (also --model-id, --model-revision, --lora)

Readable tables by default, ``--json`` for scripts. The credential comes from ``--token`` or
``$BLOCKD_TOKEN``; the daemon from ``--target`` (``unix:PATH`` or ``HOST:PORT``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from blockd.api.v1 import blockd_pb2 as pb
from blockd.api.v1 import blockd_pb2_grpc as pb_grpc

DEFAULT_TARGET = "unix:run/blockd.sock"


def _table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if c.replace(".", "").isdigit() else c.ljust(w)
                       for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _dump(msg: Any) -> str:
    return json.dumps(MessageToDict(msg, preserving_proto_field_name=True), indent=1)


def cmd_stats(stub: pb_grpc.BlockdServiceStub, args: argparse.Namespace, md: Any) -> str:
    s = stub.Stats(pb.StatsRequest(), metadata=md, timeout=args.timeout)
    if args.json:
        return _dump(s)
    rate = s.prefix_hit_tokens_total / s.prefix_queried_tokens_total \
        if s.prefix_queried_tokens_total else 0.0
    rows = [("free", s.blocks_free), ("writing", s.blocks_writing),
            ("committed", s.blocks_committed), ("pending", s.blocks_pending),
            ("cached", s.blocks_cached), ("total", s.num_blocks)]
    out = [_table(rows, ("state", "blocks")), "",
           f"block size {s.block_size} tokens, epoch {s.epoch}",
           f"sessions {s.num_sessions}, sequences {s.num_sequences}",
           f"prefix cache: {s.prefix_hit_tokens_total}/{s.prefix_queried_tokens_total} tokens hit"
           f" ({rate:.1%}); evictions {s.evictions_total}; copy-on-write {s.cow_copies_total}"]
    return "\n".join(out)


def cmd_tenants(stub: pb_grpc.BlockdServiceStub, args: argparse.Namespace, md: Any) -> str:
    s = stub.Stats(pb.StatsRequest(), metadata=md, timeout=args.timeout)
    if args.json:
        return json.dumps([MessageToDict(t, preserving_proto_field_name=True,
                                         always_print_fields_with_no_presence=True)
                           for t in s.tenants], indent=1)
    rows = [(t.tenant_id, t.used_blocks, t.cached_blocks, t.quota_blocks, t.guaranteed_blocks,
             f"{t.used_blocks / t.quota_blocks:.0%}" if t.quota_blocks else "-")
            for t in s.tenants]
    return _table(rows, ("tenant", "used", "cached", "quota", "guaranteed", "of quota"))


def cmd_inspect(stub: pb_grpc.BlockdServiceStub, args: argparse.Namespace, md: Any) -> str:
    r = stub.Inspect(pb.InspectRequest(session_id=args.session or "", sequence_id=args.sequence,
                                       start_position=args.start,
                                       max_positions=args.count),
                     metadata=md, timeout=args.timeout)
    if args.json:
        return _dump(r)
    state = {v.number: v.name.removeprefix("BLOCK_STATE_").lower()
             for v in pb.BlockState.DESCRIPTOR.values}
    blocks = {b.logical_block: b for b in r.blocks}
    rows = []
    for p in r.positions:
        b = blocks.get(p.logical_block)
        rows.append((p.position, p.logical_block, p.offset, p.physical_block, p.slot,
                     state[b.state] if b else "?", b.ref_count if b else "?"))
    head = f"sequence {r.sequence_id}: {r.num_tokens} tokens, block size {r.block_size}, " \
           f"epoch {r.epoch}\n"
    return head + _table(rows, ("position", "logical", "offset", "physical", "slot", "state",
                                "refs"))


def cmd_watch(stub: pb_grpc.BlockdServiceStub, args: argparse.Namespace, md: Any) -> str:
    stream = stub.WatchEvents(pb.WatchEventsRequest(since_sequence=args.since), metadata=md)
    try:
        for i, ev in enumerate(stream):
            kind = ev.WhichOneof("event")
            if args.json:
                print(json.dumps(MessageToDict(ev, preserving_proto_field_name=True)),
                      flush=True)
            else:
                body = getattr(ev, kind)
                hashes = ",".join(h.hex()[:12] for h in getattr(body, "block_hashes", []))
                print(f"{ev.sequence_number:>8} {kind:<18} {hashes}", flush=True)
            if args.limit and i + 1 >= args.limit:
                break
    finally:
        stream.cancel()
    return ""


def cmd_flush(stub: pb_grpc.BlockdServiceStub, args: argparse.Namespace, md: Any) -> str:
    r = stub.FlushNamespace(pb.FlushNamespaceRequest(
        model_id=args.model_id or "", model_revision=args.model_revision or "",
        lora_id=args.lora or "", tenant_id=args.tenant or ""), metadata=md,
        timeout=args.timeout)
    return _dump(r) if args.json else f"flushed {r.num_blocks_flushed} blocks"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="blockctl", description=__doc__.splitlines()[0])
    p.add_argument("--target", default=os.environ.get("BLOCKD_TARGET", DEFAULT_TARGET),
                   help="unix:PATH or HOST:PORT (default: $BLOCKD_TARGET or %(default)s)")
    p.add_argument("--token", default=os.environ.get("BLOCKD_TOKEN", ""),
                   help="bearer token (default: $BLOCKD_TOKEN)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per call")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("stats", help="blocks by state, hit rate, sessions")
    sub.add_parser("tenants", help="per-tenant usage and quota")
    ins = sub.add_parser("inspect", help="every position's block, offset and physical slot")
    ins.add_argument("sequence")
    ins.add_argument("--session", help="the sequence's session (admins may omit it)")
    ins.add_argument("--start", type=int, default=0)
    ins.add_argument("--count", type=int, default=0, help="positions to show (0 = all)")
    w = sub.add_parser("watch", help="stream block events")
    w.add_argument("--since", type=int, default=0, help="replay from this sequence number")
    w.add_argument("--limit", type=int, default=0, help="stop after this many events")
    f = sub.add_parser("flush", help="drop cached blocks of a namespace")
    f.add_argument("--model-id")
    f.add_argument("--model-revision")
    f.add_argument("--lora")
    f.add_argument("--tenant")
    args = p.parse_args(argv)

    md = (("authorization", f"Bearer {args.token}"),) if args.token else ()
    commands = {"stats": cmd_stats, "tenants": cmd_tenants, "inspect": cmd_inspect,
                "watch": cmd_watch, "flush": cmd_flush}
    with grpc.insecure_channel(args.target) as channel:
        stub = pb_grpc.BlockdServiceStub(channel)
        try:
            out = commands[args.command](stub, args, md)
        except grpc.RpcError as err:
            print(f"blockctl: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
    if out:
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
