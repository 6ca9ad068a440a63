"""Command line: ``blockd serve`` and friends (also ``python -m blockd``)."""

from __future__ import annotations

import argparse
import asyncio
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="blockd", description="blockd: KV-block manager daemon")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the daemon")
    from blockd import config

    config.add_flags(serve)
    sub.add_parser("demo-core", help="narrated in-process walk through the block manager")
    sub.add_parser("load", help="load generator: N workers streaming Steps (see --help)",
                   add_help=False)
    sub.add_parser("demo", help="embedded daemon + reference worker over a shared-prompt "
                   "workload; prints a summary, writes a plot", add_help=False)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["load"]:
        from blockd import loadgen

        return loadgen.main(argv[1:])
    if argv[:1] == ["demo"]:
        from blockd import demo

        return demo.main(argv[1:])
    args = parser.parse_args(argv)

    if args.command == "demo-core":
        from blockd import core_demo

        core_demo.run()
        return 0
    from blockd import logs
    from blockd.core.errors import BlockdError

    try:
        cfg = config.load(args)
    except BlockdError as exc:
        print(f"blockd: bad configuration: {exc.field}: {exc.message}", file=sys.stderr)
        return 2
    logs.setup(cfg.log.level, cfg.log.format)
    from blockd.server.app import serve as run_server

    try:
        asyncio.run(run_server(cfg))
    except BlockdError as exc:
        print(f"blockd: cannot start: {exc.field}: {exc.message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
