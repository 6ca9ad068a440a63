"""Command line: ``blockd serve`` and friends (also ``python -m blockd``)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="blockd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="run the daemon (until the gRPC server lands: the core demo)")
    sub.add_parser("demo-core", help="narrated in-process walk through the block manager")
    args = parser.parse_args(argv)

    from blockd import core_demo

    if args.command == "serve":
        print("blockd serve: the gRPC server is not built yet (next milestone); running the "
              "in-process core demo instead.", file=sys.stderr)
    core_demo.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
