"""TLS material a configuration section names: which files go together, and reading them.

Two listeners take PEM files (``server.tls_*`` for gRPC, ``metrics.tls_*`` for Prometheus);
the rules are the same for both and live here once: a key needs its certificate and a
certificate its key, a client CA (mTLS) needs a certificate; each file is read at start, before
anything is bound, and refused in one line naming the field when it cannot be read or is not PEM.
"""

from __future__ import annotations

from pathlib import Path

from blockd.core.errors import FailedPrecondition

#: ``(name, needs)``: a section setting ``name`` must set ``needs`` too.
PAIRS = (("tls_key", "tls_cert"), ("tls_cert", "tls_key"), ("tls_client_ca", "tls_cert"))
#: The settings that name PEM files, in the order they are read.
NAMES = ("tls_cert", "tls_key", "tls_client_ca")


def missing(section: object) -> tuple[str, str] | None:
    """The first ``(name, needs)`` pair where ``section`` sets ``name`` but not ``needs``."""
    for name, needs in PAIRS:
        if getattr(section, name) and not getattr(section, needs):
            return name, needs
    return None


def read(path: str, field: str) -> bytes:
    """The bytes of ``path``; a file that cannot be read is refused naming ``field``."""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise FailedPrecondition(f"{field}: cannot read {path}: {exc.strerror}",
                                 field=field) from None


def read_pems(section: object, prefix: str) -> dict[str, bytes]:
    """Every PEM file ``section`` names (``tls_cert``, ``tls_key``, ``tls_client_ca``), by
    setting name; a file without a PEM block is refused naming ``<prefix>.<name>``."""
    pem: dict[str, bytes] = {}
    for name in NAMES:
        path = getattr(section, name)
        if not path:
            continue
        field = f"{prefix}.{name}"
        pem[name] = read(path, field)
        if b"-----BEGIN" not in pem[name]:
            raise FailedPrecondition(f"{field}: {path} is not a PEM file", field=field)
    return pem
