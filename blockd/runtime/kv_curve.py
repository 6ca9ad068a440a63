"""CURVE authentication of the KV-event sockets (``events.curve_secret_key_file``).

Without it the PUB and replay sockets are unauthenticated, so ``blockd.runtime.kv_events``
withholds private tenants' LoRA names there (docs/security.md). With it both sockets are CURVE
servers under the publisher's keypair, and pyzmq's ZAP authenticator (a thread of the same ZMQ
context) admits only the subscribers whose public keys ``events.curve_client_keys`` lists.
The secret key lives in a file (a mounted Secret), never in the configuration itself.
"""

from __future__ import annotations

import logging
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from blockd.core.errors import FailedPrecondition
from blockd.events_config import EventsConfig

Z85_KEY_CHARS = 40


def read_secret(cfg: EventsConfig) -> bytes:
    """The Z85 secret key of ``events.curve_secret_key_file`` (b"": CURVE off); a missing or
    malformed file, or a malformed client key, is refused on its field."""
    if not cfg.curve_secret_key_file:
        return b""
    where = "events.curve_secret_key_file"
    try:
        with open(cfg.curve_secret_key_file, "rb") as f:
            key = f.read().strip()
    except OSError as exc:
        raise FailedPrecondition(f"{where}: cannot read {cfg.curve_secret_key_file}: "
                                 f"{exc.strerror}", field=where) from None
    try:
        zmq.curve_public(key)
    except (ValueError, zmq.ZMQError):
        raise FailedPrecondition(f"{where}: not a Z85 CURVE secret key of {Z85_KEY_CHARS} "
                                 "characters", field=where) from None
    if any(len(k) != Z85_KEY_CHARS for k in client_keys(cfg)):
        raise FailedPrecondition(f"events.curve_client_keys: Z85 public keys of "
                                 f"{Z85_KEY_CHARS} characters, comma-separated",
                                 field="events.curve_client_keys")
    return key


def client_keys(cfg: EventsConfig) -> set[bytes]:
    """The admitted subscribers' Z85 public keys."""
    return {k.strip().encode() for k in cfg.curve_client_keys.split(",") if k.strip()}


class CurveServer:
    """The publisher's keypair and the ZAP authenticator of its context."""

    def __init__(self, secret: bytes, allowed: set[bytes]) -> None:
        self.secret = secret
        self.allowed = allowed
        self._auth: ThreadAuthenticator | None = None

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP's question: may the peer with this Z85 public key connect?"""
        return key in self.allowed

    def secure(self, ctx: zmq.Context[Any], sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` a CURVE server (before its bind); starts the authenticator once."""
        if self._auth is None:
            self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("blockd.kv_events.zap"))
            self._auth.start()
            self._auth.configure_curve_callback("*", credentials_provider=self)
        sock.curve_secretkey = self.secret
        sock.curve_publickey = zmq.curve_public(self.secret)
        sock.curve_server = True

    def stop(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
