"""The default socket paths, shared by the daemon's configuration and blockctl."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def runtime_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``${XDG_RUNTIME_DIR:-/tmp}/blockd-<uid>``: where the default sockets live.

    Absolute, so a daemon and a ``blockctl`` started in different directories meet; per user,
    so two users' daemons do not collide. The daemon creates it 0700 and refuses one owned by
    another user or open to others (``blockd.server.endpoints``). Only computed here.
    """
    env = os.environ if environ is None else environ
    base = env.get("XDG_RUNTIME_DIR", "")
    if not os.path.isabs(base):
        base = "/tmp"
    return Path(base) / f"blockd-{os.getuid()}"


def default_unix_socket() -> str:
    """The gRPC Unix socket a daemon listens on and blockctl dials by default."""
    return str(runtime_dir() / "blockd.sock")


def default_handle_socket() -> str:
    """The handle socket (pool file descriptors) a daemon serves by default."""
    return str(runtime_dir() / "blockd-pool.sock")
