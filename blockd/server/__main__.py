"""``python -m blockd.server``: serve the daemon (the flags of ``blockd serve``).

The daemon needs nothing of the applications package to start: this is its own entry point,
configured as ``blockd.config`` describes (defaults <- ``--config`` YAML <- ``BLOCKD_*``
environment <- flags).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from blockd import config, logs
from blockd.core.errors import BlockdError


def main(argv: list[str] | None = None, prog: str = "python -m blockd.server") -> int:
    parser = argparse.ArgumentParser(prog=prog,
                                     description="blockd: serve the KV-block manager daemon")
    config.add_flags(parser)
    args = parser.parse_args(argv)
    try:
        cfg = config.load(args)
    except BlockdError as exc:
        sys.stderr.write(f"blockd: bad configuration: {exc.field}: {exc.message}\n")
        return 2
    logs.setup(cfg.log.level, cfg.log.format)
    from blockd.server.app import serve  # after the configuration is known to be good

    try:
        asyncio.run(serve(cfg))
    except BlockdError as exc:
        sys.stderr.write(f"blockd: cannot start: {exc.field}: {exc.message}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
