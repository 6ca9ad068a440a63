"""A session's fetch secret: what its worker shows the handle socket besides the session id.

The session id alone is a weak capability for the pool's descriptors: it is passed around (the
worker's logs, the vLLM connector's metadata, ``blockctl sessions``), and the handle socket
cannot know which process attached, since grpcio gives no peer credentials of a Unix gRPC
connection. The secret closes that gap (issue 28, finding 5): the daemon returns it only in the
AttachResponse, over the authenticated gRPC call, and the handle socket sends the pool only to a
request carrying it (``blockd.pools.handles``). Whoever merely learnt the session id gets the
answer an unknown session gets, before or after the owner's fetch.

It is derived, not stored: HMAC-SHA256 under a daemon key, of the epoch and the session id.
With ``state.dir`` the key is a file there (``StateStore.fetch_key``), so a session that
survives a restart (same epoch, same id) has the same secret and its worker can fetch again;
without it the key is random per process, and so are the epoch and every session. Nothing is
journalled, and no snapshot or journal of an older daemon lacks anything it needs. A new epoch
(a wiped or quarantined state) makes every earlier secret worthless.

256 bits, as 64 hex digits; compared in constant time (``hmac.compare_digest``). The key and
the secrets never reach a log, a metric, an event, Stats, Inspect or blockctl: this object's
``repr`` shows neither.
"""

from __future__ import annotations

import hashlib
import hmac
import os

#: Bytes of the daemon key (and of each secret: SHA-256).
KEY_BYTES = 32
#: What the MAC covers besides the epoch and the session id: another use of the key could
#: never produce a fetch secret.
_DOMAIN = b"blockd fetch secret v1\x00"


class FetchSecrets:
    """The secrets of one epoch's sessions, under one key."""

    __slots__ = ("_key", "_prefix")

    def __init__(self, key: bytes, epoch: int) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"fetch secret key: {len(key)} bytes, expected {KEY_BYTES}")
        self._key = key
        self._prefix = _DOMAIN + epoch.to_bytes(8, "little")

    @classmethod
    def ephemeral(cls, epoch: int) -> FetchSecrets:
        """Under a random key of this process (no ``state.dir``: no session outlives it)."""
        return cls(os.urandom(KEY_BYTES), epoch)

    def of(self, session_id: str) -> str:
        """The session's secret (what Attach returns)."""
        data = self._prefix + session_id.encode("utf-8", "surrogatepass")  # any str a JSON has
        return hmac.new(self._key, data, hashlib.sha256).hexdigest()

    def matches(self, session_id: str, given: str) -> bool:
        """Whether ``given`` is the session's secret, in time independent of how much of it
        is right (a missing secret is "")."""
        return hmac.compare_digest(self.of(session_id).encode(),
                                   given.encode("utf-8", "surrogatepass"))

    def __repr__(self) -> str:
        return "FetchSecrets(<key hidden>)"
