"""The ``blockd`` command: ``serve`` (the daemon), ``demo``, ``demo-core`` and ``load``.

Also ``python -m blockd_apps``. ``serve`` hands its arguments to the daemon's own entry point
(``blockd.server.__main__``, i.e. ``python -m blockd.server``), so the daemon starts the same
way with or without this package. The other commands are applications of the client library
and the reference engine, which the daemon package must not import. Each command parses its
own arguments (``blockd CMD --help``); imports are deferred to the command that needs them, so
``blockd serve`` loads neither torch nor the client.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import blockd
from blockd import options


def _serve(argv: list[str]) -> int:
    from blockd.server.__main__ import main as serve_main

    return serve_main(argv, prog="blockd serve")


def _demo(argv: list[str]) -> int:
    from blockd_apps import demo

    return demo.main(argv)


def _demo_core(argv: list[str]) -> int:
    from blockd_apps import core_demo

    options.Parser(prog="blockd demo-core",
                            description=(core_demo.__doc__ or "").split("\n\n")[0]
                            ).parse_args(argv)
    core_demo.run()
    return 0


def _load(argv: list[str]) -> int:
    from blockd_apps import loadgen

    return loadgen.main(argv)


#: name -> (one-line help, run(arguments after the name) -> exit status).
COMMANDS: dict[str, tuple[str, Callable[[list[str]], int]]] = {
    "serve": ("run the daemon (--help lists every config flag)", _serve),
    "demo": ("embedded daemon + reference worker over a shared-prompt workload; prints a "
             "summary, writes a plot", _demo),
    "demo-core": ("narrated in-process walk through the block manager", _demo_core),
    "load": ("load generator: N workers streaming Steps", _load),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]][1](argv[1:])
    parser = options.Parser(prog="blockd", description="blockd: KV-block manager daemon")
    parser.add_argument("--version", action="version", version=f"blockd {blockd.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (text, _) in COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    parser.parse_args(argv)  # exits: --help, --version, no command, or an unknown one
    return 2


if __name__ == "__main__":
    sys.exit(main())
