"""blockctl: the operator's CLI for a running blockd.

    blockctl stats                 blocks by state, hit rate, sessions
    blockctl tenants               per-tenant usage and quota
    blockctl sequences             the live sequences of the caller's tenants (ids for inspect)
    blockctl inspect SEQ           every position's logical block, offset, physical block, slot
    blockctl watch                 stream block events (stored / removed / cleared)
    blockctl flush                 drop the caller's tenant's cached blocks (also --tenant,
                                   --model-id, --model-revision, --lora)

Readable tables by default, ``--json`` for scripts. The credential comes from, first found:
``--token-file FILE`` (``/dev/stdin`` reads it from a pipe: ``kubectl exec -i ... < token``),
``--token`` (discouraged, with a warning: every user sees it in the process list),
``$BLOCKD_TOKEN_FILE``, ``$BLOCKD_TOKEN`` (none: the anonymous caller of the laptop default, who
acts for tenant ``default``). A TCP target served with TLS needs ``--ca-file`` (and, for mTLS,
``--cert-file`` and ``--key-file``). The daemon is ``--target`` (``unix:PATH`` or
``HOST:PORT``), else ``$BLOCKD_TARGET``, else the Unix socket a daemon started with the same
environment listens on (``$BLOCKD_SERVER_UNIX_SOCKET`` or the absolute default of
``blockd.config``), so blockctl works from any directory. Exit status: 0 done, 1 the daemon
refused (its status and message on one line), 2 no daemon answering at the target or a usage
error.
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

import blockd
from blockd import config, options
from blockd.api.v1 import blockd_pb2 as pb
from blockd.api.v1 import blockd_pb2_grpc as pb_grpc
from blockd.runtime.kv_events import block_hash

#: Exit statuses (the module docstring).
REFUSED, UNREACHABLE = 1, 2


class UsageError(Exception):
    """A command that cannot be sent as given; its message is printed as is."""


def default_socket() -> str:
    """The Unix socket a daemon started in this environment listens on by default."""
    env = os.environ.get(config.ENV_PREFIX + "SERVER_UNIX_SOCKET")
    if env:
        return env
    # ``default_unix_socket`` is where the daemon's default lives; an older blockd.config
    # without it has the (relative) default in ServerConfig.
    fn = getattr(config, "default_unix_socket", None)
    return str(fn()) if callable(fn) else config.ServerConfig().unix_socket


def default_target() -> str:
    """``$BLOCKD_TARGET``, else ``unix:`` and ``default_socket()``."""
    return os.environ.get("BLOCKD_TARGET") or f"unix:{default_socket()}"


def unreachable(target: str, why: str) -> str:
    """The one line blockctl prints when no daemon answers at ``target``."""
    return (f"blockctl: no blockd is answering at {target} ({why}); start one with "
            f"`blockd serve`, or name another with --target or $BLOCKD_TARGET")


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
    if s.tiers:
        rows = [(t.tier, t.used_slots, t.num_slots, _mib(t.used_slots * t.slot_bytes),
                 _mib(t.num_slots * t.slot_bytes), t.hit_tokens_total, t.stored_blocks_total,
                 t.loaded_blocks_total, t.load_failures_total) for t in s.tiers]
        out += ["", "tiers below the pool (evicted prefixes):",
                _table(rows, ("tier", "used", "slots", "used MiB", "MiB", "hit tokens",
                              "stored", "loaded", "bad loads"))]
    return "\n".join(out)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def cmd_tenants(stub: pb_grpc.BlockdServiceStub, args: argparse.Namespace, md: Any) -> str:
    s = stub.Stats(pb.StatsRequest(), metadata=md, timeout=args.timeout)
    if args.json:
        return json.dumps([MessageToDict(t, preserving_proto_field_name=True,
                                         always_print_fields_with_no_presence=True)
                           for t in s.tenants], indent=1)
    # used_blocks counts the tenant's cached blocks too (evictable: an admit of its own evicts
    # them first), so "held of quota" leaves them out: a tenant whose blocks are all cached is
    # at 0%, not 100%.
    rows = [(t.tenant_id, t.used_blocks - t.cached_blocks, t.cached_blocks, t.quota_blocks,
             t.guaranteed_blocks,
             f"{(t.used_blocks - t.cached_blocks) / t.quota_blocks:.0%}" if t.quota_blocks
             else "-")
            for t in s.tenants]
    return _table(rows, ("tenant", "held", "cached", "quota", "guaranteed", "held of quota"))


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


def _event_dict(ev: pb.WatchEventsResponse, kind: str, hashes: list[int]) -> dict[str, Any]:
    """The event as JSON with its block hashes in the one printed form (#28 finding 10): the
    unsigned 64-bit integers the ZMQ stream sends (``blockd.runtime.kv_events.block_hash``),
    where the proto's JSON mapping would print base64 of the full keys; those stay, as hex,
    under ``block_keys``."""
    d = MessageToDict(ev, preserving_proto_field_name=True)
    body = getattr(ev, kind)
    if hashes:
        d[kind]["block_hashes"] = hashes
        d[kind]["block_keys"] = [h.hex() for h in body.block_hashes]
    parent = getattr(body, "parent_block_hash", b"")
    if parent:
        d[kind]["parent_block_hash"] = block_hash(parent)
    return d


def cmd_watch(stub: pb_grpc.BlockdServiceStub, args: argparse.Namespace, md: Any) -> str:
    stream = stub.WatchEvents(pb.WatchEventsRequest(since_sequence=args.since), metadata=md)
    try:
        for i, ev in enumerate(stream):
            kind = ev.WhichOneof("event")
            body = getattr(ev, kind)
            hashes = [block_hash(h) for h in getattr(body, "block_hashes", [])]
            if args.json:
                print(json.dumps(_event_dict(ev, kind, hashes)), flush=True)
            else:
                print(f"{ev.sequence_number:>8} {kind:<18} {','.join(map(str, hashes))}",
                      flush=True)
            if args.limit and i + 1 >= args.limit:
                break
    finally:
        stream.cancel()
    return ""


def cmd_sequences(stub: pb_grpc.BlockdServiceStub, args: argparse.Namespace, md: Any) -> str:
    found: list[pb.SequenceSummary] = []
    token = ""
    scope = None
    while True:
        want = min(10_000, args.limit - len(found)) if args.limit else 10_000
        r = stub.ListSequences(pb.ListSequencesRequest(tenant_id=args.tenant or "",
                                                       page_size=want, page_token=token),
                               metadata=md, timeout=args.timeout)
        scope = scope or r
        found.extend(r.sequences)
        token = r.next_page_token
        if not token or (args.limit and len(found) >= args.limit):
            break
    if args.json:
        return json.dumps([MessageToDict(s, preserving_proto_field_name=True,
                                         always_print_fields_with_no_presence=True)
                           for s in found], indent=1)
    rows = [(s.sequence_id, s.tenant_id, s.worker_name or "-", s.num_tokens, s.num_blocks,
             s.session_id) for s in found]
    more = "; more not shown (raise --limit)" if token else ""
    return (_table(rows, ("sequence", "tenant", "worker", "tokens", "blocks", "session"))
            + f"\n\n{len(found)} sequences of {', '.join(scope.tenant_ids) or 'no tenant'}"
            + more)


def _own_tenant(stub: pb_grpc.BlockdServiceStub, args: argparse.Namespace, md: Any) -> str:
    """The tenant a non-admin's flush names when ``--tenant`` is not given ("" for an admin:
    every tenant): the credential's one tenant, as the daemon reports it."""
    scope = stub.ListSequences(pb.ListSequencesRequest(page_size=1), metadata=md,
                               timeout=args.timeout)
    if scope.admin:
        return ""
    if len(scope.tenant_ids) != 1:
        raise UsageError("blockctl: name the tenant to flush with --tenant (this credential "
                         f"acts for {', '.join(scope.tenant_ids) or 'no tenant'})")
    return str(scope.tenant_ids[0])


def cmd_flush(stub: pb_grpc.BlockdServiceStub, args: argparse.Namespace, md: Any) -> str:
    tenant = args.tenant or _own_tenant(stub, args, md)
    r = stub.FlushNamespace(pb.FlushNamespaceRequest(
        model_id=args.model_id or "", model_revision=args.model_revision or "",
        lora_id=args.lora or "", tenant_id=tenant), metadata=md,
        timeout=args.timeout)
    if args.json:
        return _dump(r)
    return f"flushed {r.num_blocks_flushed} blocks" + (f" of tenant {tenant}" if tenant else "")


def _parser() -> argparse.ArgumentParser:
    p = options.Parser(prog="blockctl", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"blockctl {blockd.__version__}")
    p.add_argument("--target", default=None,
                   help="unix:PATH or HOST:PORT (default: $BLOCKD_TARGET, else the daemon's "
                        f"default socket, now unix:{default_socket()})")
    p.add_argument("--token-file", default=None,
                   help="file holding the bearer token, /dev/stdin to pipe it in (default: "
                        "$BLOCKD_TOKEN_FILE, else $BLOCKD_TOKEN; none: anonymous)")
    p.add_argument("--token", default=None,
                   help="bearer token; discouraged: other users see it in the process list "
                        "(use --token-file or $BLOCKD_TOKEN_FILE)")
    p.add_argument("--ca-file", default=None,
                   help="PEM CA that signed the daemon's TLS certificate (a TCP target with "
                        "server.tls_cert): TLS instead of plaintext")
    p.add_argument("--cert-file", default=None, help="PEM client certificate (mTLS)")
    p.add_argument("--key-file", default=None, help="PEM key of --cert-file (mTLS)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per call")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("stats", help="blocks by state, hit rate, sessions")
    sub.add_parser("tenants", help="per-tenant usage and quota")
    ls = sub.add_parser("sequences", help="live sequences of the caller's tenants")
    ls.add_argument("--tenant", help="only this tenant's (default: every tenant the "
                                     "credential acts for)")
    ls.add_argument("--limit", type=int, default=1000,
                    help="show at most this many (0 = all; default %(default)s)")
    ins = sub.add_parser("inspect", help="every position's block, offset and physical slot")
    ins.add_argument("sequence", help="a sequence id (blockctl sequences lists them)")
    ins.add_argument("--session", help="the sequence's session (default: found by the daemon, "
                                       "for a sequence of the caller's tenants)")
    ins.add_argument("--start", type=int, default=0)
    ins.add_argument("--count", type=int, default=0, help="positions to show (0 = all)")
    w = sub.add_parser("watch", help="stream block events")
    w.add_argument("--since", type=int, default=0, help="replay from this sequence number")
    w.add_argument("--limit", type=int, default=0, help="stop after this many events")
    f = sub.add_parser("flush", help="drop cached blocks of a namespace")
    f.add_argument("--model-id")
    f.add_argument("--model-revision")
    f.add_argument("--lora")
    f.add_argument("--tenant", help="default: the credential's own tenant (an admin's: every "
                                    "tenant)")
    return p


COMMANDS = {"stats": cmd_stats, "tenants": cmd_tenants, "sequences": cmd_sequences,
            "inspect": cmd_inspect, "watch": cmd_watch, "flush": cmd_flush}


def token(args: argparse.Namespace) -> str:
    """The bearer token (module docstring: the order); a file is read whole, stripped."""
    path = args.token_file
    if path is None and args.token is None:
        path = os.environ.get("BLOCKD_TOKEN_FILE") or None
    if path is None:
        return args.token if args.token is not None else os.environ.get("BLOCKD_TOKEN", "")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError as exc:
        raise UsageError(f"blockctl: cannot read the token file {path}: {exc.strerror}") from None


def _channel(target: str, args: argparse.Namespace) -> grpc.Channel:
    if not args.ca_file:
        return grpc.insecure_channel(target)
    pem = []
    for name in ("ca_file", "cert_file", "key_file"):
        path = getattr(args, name)
        try:
            pem.append(open(path, "rb").read() if path else None)  # noqa: SIM115
        except OSError as exc:
            raise UsageError(f"blockctl: cannot read --{name.replace('_', '-')} {path}: "
                             f"{exc.strerror}") from None
    return grpc.secure_channel(target, grpc.ssl_channel_credentials(*pem))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    target = args.target or default_target()
    if target.startswith("unix:") and not os.path.exists(target.removeprefix("unix:")):
        print(unreachable(target, "no socket there"), file=sys.stderr)
        return UNREACHABLE
    if args.token is not None:
        print("blockctl: warning: --token is visible to every user of this machine in the "
              "process list; use --token-file FILE (or /dev/stdin) or $BLOCKD_TOKEN_FILE",
              file=sys.stderr)
    try:
        tok = token(args)
        channel = _channel(target, args)
    except UsageError as err:
        print(err, file=sys.stderr)
        return UNREACHABLE
    md = (("authorization", f"Bearer {tok}"),) if tok else ()
    with channel:
        stub = pb_grpc.BlockdServiceStub(channel)
        try:
            out = COMMANDS[args.command](stub, args, md)
        except UsageError as err:
            print(err, file=sys.stderr)
            return UNREACHABLE
        except grpc.RpcError as err:
            code = err.code()
            if code == grpc.StatusCode.UNAVAILABLE:
                why = (err.details() or "unavailable").splitlines()[0]
                print(unreachable(target, why), file=sys.stderr)
                return UNREACHABLE
            print(f"blockctl: {code.name}: {err.details()}", file=sys.stderr)
            return REFUSED
        except KeyboardInterrupt:
            return 130
    if out:
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
