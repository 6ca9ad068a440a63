"""The tenants file: tenant policies and worker credentials (reloaded on SIGHUP).

```yaml
tenants:
  - id: acme                # [A-Za-z0-9][A-Za-z0-9_.-]{0,62}
    quota_blocks: 4000
    guaranteed_blocks: 500  # optional, default 0
    priority: 1             # optional, default 0
    sharing: private        # private | group | public
    group: ""               # required with sharing: group
    scrub_on_reuse: true    # optional, default true
workers:
  - name: worker-a
    token_sha256: 9f86d0...  # hex SHA-256 of the bearer token; the token itself is never stored
    tenants: [acme]
    admin: false            # admins may flush any namespace, watch events, see every tenant
```
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from blockd.core.errors import InvalidArgument, PermissionDenied, Unauthenticated
from blockd.core.tenants import Sharing, TenantPolicy

DEFAULT_TENANT = "default"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True, slots=True)
class Worker:
    """A credential: who may act for which tenants."""

    name: str
    token_sha256: bytes
    tenants: frozenset[str]
    admin: bool = False


@dataclass(frozen=True, slots=True)
class Principal:
    """The authenticated caller of one RPC."""

    name: str
    tenants: frozenset[str]
    admin: bool

    def require_tenant(self, tenant_id: str) -> None:
        if tenant_id not in self.tenants:
            raise PermissionDenied("this credential may not act for that tenant",
                                   field="tenant_id")


@dataclass(frozen=True, slots=True)
class TenantsFile:
    tenants: tuple[TenantPolicy, ...]
    workers: tuple[Worker, ...]
    #: Anonymous callers act for every tenant as non-admins (the laptop default only).
    anonymous: Principal | None = None

    def authenticate(self, token: str | None) -> Principal:
        """The principal for a bearer token; constant-time comparison of hashes."""
        if not token:
            if self.anonymous is not None:
                return self.anonymous
            raise Unauthenticated("missing credential: send 'authorization: Bearer <token>'",
                                  field="authorization")
        digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
        found = None
        for w in self.workers:
            if hmac.compare_digest(w.token_sha256, digest):
                found = w
        if found is None:
            raise Unauthenticated("unknown credential", field="authorization")
        return Principal(found.name, found.tenants, found.admin)


def default(quota_blocks: int, allow_anonymous: bool) -> TenantsFile:
    """One tenant, ``default``, with the whole pool; anonymous callers act for it if allowed."""
    policy = TenantPolicy(DEFAULT_TENANT, quota_blocks=quota_blocks, sharing=Sharing.PRIVATE,
                          scrub_on_reuse=False)
    anon = Principal("anonymous", frozenset({DEFAULT_TENANT}), False) if allow_anonymous else None
    return TenantsFile((policy,), (), anon)


def parse(data: Mapping[str, Any], source: str = "tenants file") -> TenantsFile:
    """Validate a parsed tenants file; errors name the offending entry and key."""
    if not isinstance(data, Mapping):
        raise InvalidArgument(f"{source}: the top level must be a mapping", field="tenants")
    policies = []
    for i, t in enumerate(data.get("tenants") or []):
        where = f"tenants[{i}]"
        if not isinstance(t, Mapping):
            raise InvalidArgument(f"{source}: {where} must be a mapping", field=where)
        unknown = set(t) - {"id", "quota_blocks", "guaranteed_blocks", "priority", "sharing",
                            "group", "scrub_on_reuse"}
        if unknown:
            raise InvalidArgument(f"{source}: {where} has unknown keys {sorted(unknown)}",
                                  field=where)
        try:
            sharing = Sharing(t.get("sharing", "private"))
        except ValueError:
            raise InvalidArgument(f"{source}: {where}.sharing must be private, group or public",
                                  field=f"{where}.sharing") from None
        try:
            policies.append(TenantPolicy(
                tenant_id=str(t["id"]),
                quota_blocks=int(t["quota_blocks"]),
                guaranteed_blocks=int(t.get("guaranteed_blocks", 0)),
                priority=int(t.get("priority", 0)),
                sharing=sharing,
                group=str(t.get("group", "")),
                scrub_on_reuse=bool(t.get("scrub_on_reuse", True)),
            ))
        except KeyError as exc:
            raise InvalidArgument(f"{source}: {where} needs {exc.args[0]!r}",
                                  field=f"{where}.{exc.args[0]}") from None
        except InvalidArgument as exc:
            raise InvalidArgument(f"{source}: {where}: {exc.message}",
                                  field=f"{where}.{exc.field}") from None
    names = {p.tenant_id for p in policies}
    workers = []
    for i, w in enumerate(data.get("workers") or []):
        where = f"workers[{i}]"
        if not isinstance(w, Mapping):
            raise InvalidArgument(f"{source}: {where} must be a mapping", field=where)
        digest = str(w.get("token_sha256", "")).lower()
        if not _HEX64.match(digest):
            raise InvalidArgument(f"{source}: {where}.token_sha256 must be 64 hex digits",
                                  field=f"{where}.token_sha256")
        allowed = frozenset(str(x) for x in (w.get("tenants") or []))
        if allowed - names:
            raise InvalidArgument(f"{source}: {where} names unknown tenants "
                                  f"{sorted(allowed - names)}", field=f"{where}.tenants")
        workers.append(Worker(str(w.get("name", f"worker-{i}")), bytes.fromhex(digest), allowed,
                              bool(w.get("admin", False))))
    return TenantsFile(tuple(policies), tuple(workers))


def load(path: str | Path) -> TenantsFile:
    return parse(yaml.safe_load(Path(path).read_text()) or {}, str(path))


def token_hash(token: str) -> str:
    """The hex digest to put in a tenants file for ``token``."""
    return hashlib.sha256(token.encode()).hexdigest()
