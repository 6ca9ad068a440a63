"""The ``handles`` section of the configuration: who may ask the handle socket for a pool.

Its own module because ``blockd.config`` is at the size limit; ``blockd.config.Config`` holds
it as ``handles``. The handle socket hands out the memory of the pool (docs/security.md, the
trust model): besides the session id, the peer's kernel-reported credentials (SO_PEERCRED)
must be allowed here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from blockd.core.errors import InvalidArgument
from blockd.options import option


def _ids(text: str, key: str) -> frozenset[int]:
    out = set()
    for part in str(text).replace(" ", "").split(","):
        if not part:
            continue
        if not part.isdigit() or int(part) >= 2**32:
            raise InvalidArgument(f"{key}: expected comma-separated numeric ids, got {part!r}",
                                  field=key)
        out.add(int(part))
    return frozenset(out)


@dataclass(frozen=True)
class HandlesConfig:
    """The handle socket's peer-credential check."""

    allowed_uids: str = option(
        "", "Comma-separated uids whose processes may fetch a session's pool descriptors "
            "(SO_PEERCRED); \"\": the daemon's own uid only.")
    allowed_gids: str = option(
        "", "Comma-separated gids whose processes may fetch them too (a peer passes if its uid "
            "or its gid is allowed); \"\": none.")

    def __post_init__(self) -> None:
        _ids(self.allowed_uids, "handles.allowed_uids")
        _ids(self.allowed_gids, "handles.allowed_gids")

    def uids(self) -> frozenset[int]:
        """The allowed uids (the daemon's effective uid when none is configured)."""
        return _ids(self.allowed_uids, "handles.allowed_uids") or frozenset({os.geteuid()})

    def gids(self) -> frozenset[int]:
        return _ids(self.allowed_gids, "handles.allowed_gids")
