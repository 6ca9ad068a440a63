"""``python -m blockd.server``: serve the daemon (the flags of ``blockd serve``).

The daemon needs nothing of the applications package to start: this is its own entry point,
configured as ``blockd.config`` describes (defaults <- ``--config`` YAML <- ``BLOCKD_*``
environment <- flags).

Exit status: 0 after a clean stop (SIGTERM, SIGINT); 2 when the daemon refuses to start, with
one line on stderr that names the field at fault: a bad configuration (``blockd: bad
configuration: ...``, before logging exists) or an environment it cannot serve in (a port or
socket in use, no CUDA device: one ``cannot start`` log record in the configured format).
Nothing is left behind by a refused start. Anything else (a bug) is a traceback and status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

import blockd
from blockd import config, logs, options
from blockd.core.errors import BlockdError

#: The daemon refused to start (see the module docstring).
REFUSED = 2

log = logging.getLogger("blockd")


def parser(prog: str = "python -m blockd.server") -> argparse.ArgumentParser:
    p = options.Parser(prog=prog,
                                description="blockd: serve the KV-block manager daemon. Every "
                                            "field below is also a YAML key (--config) and a "
                                            "BLOCKD_<SECTION>_<FIELD> variable.")
    p.add_argument("--version", action="version", version=f"blockd {blockd.__version__}")
    config.add_flags(p)
    return p


def warn_unknown_env() -> None:
    """One warning per ``BLOCKD_*`` variable that configures nothing (a typo would otherwise
    be silently ignored)."""
    for name, close in config.unknown_env():
        log.warning("unknown environment variable ignored",
                    extra=logs.fields(variable=name, did_you_mean=close or None))


def main(argv: list[str] | None = None, prog: str = "python -m blockd.server") -> int:
    args = parser(prog).parse_args(argv)
    try:
        cfg = config.load(args)
    except BlockdError as exc:
        sys.stderr.write(f"blockd: bad configuration: {exc.message}\n")
        return REFUSED
    logs.setup(cfg.log.level, cfg.log.format)
    warn_unknown_env()
    from blockd.server.app import serve  # after the configuration is known to be good

    try:
        asyncio.run(serve(cfg))
    except BlockdError as exc:
        log.error("cannot start", extra=logs.fields(field=exc.field, error=exc.message))
        return REFUSED
    return 0


if __name__ == "__main__":
    sys.exit(main())
