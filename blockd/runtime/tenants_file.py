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
    isolation: shared       # shared (default) | dedicated: a partition of its own (or of its
                            # group), sized from quota_blocks; not with sharing: public
    # Optional per-tenant limits (docs/security.md lists defaults and what each protects):
    max_sequences: 65536    # live sequences, fork children included
    max_sessions: 256       # attached sessions
    max_pending_fences: 8192  # releases/commits one session has waiting for fences
    max_metadata_bytes: 268435456  # default: 256 MiB + 128 bytes per quota block
    max_request_priority: 0  # AdmitOp.priority counts at most this against other tenants
    host_quota_bytes: 1073741824  # optional: most bytes of the host tier (default: all of it;
    disk_quota_bytes: 8589934592  # for a dedicated tenant also its own tier's size, default 0)
    # Optional: this tenant's own work budget (default: tenants.work_units_per_second and
    # tenants.work_units_burst of the daemon's config; 0 units per second: no budget)
    work_units_per_second: 1000000
    work_units_burst: 200000
workers:
  - name: worker-a          # required, unique: the credential's identity (owns its sessions)
    token_sha256: 9f86d0...  # hex SHA-256 of the bearer token (unique); never the token itself
    tenants: [acme]
    admin: false            # admins may flush any namespace, watch events, see every tenant
```
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from blockd.core.errors import InvalidArgument, PermissionDenied, Unauthenticated
from blockd.core.tenants import Isolation, Sharing, TenantPolicy, partition_layout

DEFAULT_TENANT = "default"
#: The name of the laptop default's anonymous caller (reserved: no credential may take it).
ANONYMOUS = "anonymous"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


@dataclass(frozen=True, slots=True)
class Worker:
    """A credential: who may act for which tenants."""

    name: str
    token_sha256: bytes
    tenants: frozenset[str]
    admin: bool = False


@dataclass(frozen=True, slots=True)
class Principal:
    """The authenticated caller of one RPC.

    ``name`` is the credential's identity: unique in the tenants file (refused otherwise), what
    a session's owner is, and kept by a token rotation (same name, new ``token_sha256``).
    """

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
    #: Tenants' own work budgets, (units per second, burst), None where the tenant keeps the
    #: daemon-wide setting (``blockd.runtime.budgets``).
    budgets: Mapping[str, tuple[float | None, float | None]] = field(default_factory=dict)

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
    anon = Principal(ANONYMOUS, frozenset({DEFAULT_TENANT}), False) if allow_anonymous else None
    return TenantsFile((policy,), (), anon)


def parse(data: Mapping[str, Any], source: str = "tenants file") -> TenantsFile:
    """Validate a parsed tenants file; errors name the offending entry and key."""
    if not isinstance(data, Mapping):
        raise InvalidArgument(f"{source}: the top level must be a mapping", field="tenants")
    policies = []
    budgets: dict[str, tuple[float | None, float | None]] = {}
    for i, t in enumerate(data.get("tenants") or []):
        where = f"tenants[{i}]"
        if not isinstance(t, Mapping):
            raise InvalidArgument(f"{source}: {where} must be a mapping", field=where)
        unknown = set(t) - {"id", "quota_blocks", "guaranteed_blocks", "priority", "sharing",
                            "group", "scrub_on_reuse", "isolation", *_LIMITS, *_BUDGET}
        if unknown:
            raise InvalidArgument(f"{source}: {where} has unknown keys {sorted(unknown)}",
                                  field=where)
        try:
            sharing = Sharing(t.get("sharing", "private"))
        except ValueError:
            raise InvalidArgument(f"{source}: {where}.sharing must be private, group or public",
                                  field=f"{where}.sharing") from None
        try:
            isolation = Isolation(t.get("isolation", "shared"))
        except ValueError:
            raise InvalidArgument(f"{source}: {where}.isolation must be shared or dedicated",
                                  field=f"{where}.isolation") from None
        try:
            policies.append(TenantPolicy(
                tenant_id=str(t["id"]),
                quota_blocks=int(t["quota_blocks"]),
                guaranteed_blocks=int(t.get("guaranteed_blocks", 0)),
                priority=int(t.get("priority", 0)),
                sharing=sharing,
                group=str(t.get("group", "")),
                scrub_on_reuse=bool(t.get("scrub_on_reuse", True)),
                isolation=isolation,
                **{k: _limit(t[k], k) for k in _LIMITS if k in t},
            ))
        except KeyError as exc:
            raise InvalidArgument(f"{source}: {where} needs {exc.args[0]!r}",
                                  field=f"{where}.{exc.args[0]}") from None
        except InvalidArgument as exc:
            raise InvalidArgument(f"{source}: {where}: {exc.message}",
                                  field=f"{where}.{exc.field}") from None
        if any(k in t for k in _BUDGET):
            budgets[policies[-1].tenant_id] = _budget(t, f"{source}: {where}")
    try:
        partition_layout(policies, 1)  # a group mixing isolations, named here
    except InvalidArgument as exc:
        raise InvalidArgument(f"{source}: {exc.message}", field="tenants.isolation") from None
    names = {p.tenant_id for p in policies}
    workers: list[Worker] = []
    for i, w in enumerate(data.get("workers") or []):
        where = f"workers[{i}]"
        if not isinstance(w, Mapping):
            raise InvalidArgument(f"{source}: {where} must be a mapping", field=where)
        name = w.get("name")
        if not isinstance(name, str) or not _NAME.match(name) or name == ANONYMOUS:
            raise InvalidArgument(f"{source}: {where}.name must be a name like a tenant id "
                                  f"(not {ANONYMOUS!r}): it is the credential's identity",
                                  field=f"{where}.name")
        digest = str(w.get("token_sha256", "")).lower()
        if not _HEX64.match(digest):
            raise InvalidArgument(f"{source}: {where}.token_sha256 must be 64 hex digits",
                                  field=f"{where}.token_sha256")
        allowed = frozenset(str(x) for x in (w.get("tenants") or []))
        if allowed - names:
            raise InvalidArgument(f"{source}: {where} names unknown tenants "
                                  f"{sorted(allowed - names)}", field=f"{where}.tenants")
        for other, o in enumerate(workers):
            # Sessions belong to the credential's name: two entries sharing a name (or a token,
            # which would authenticate as either) would act on each other's sessions.
            if o.name == name:
                raise InvalidArgument(f"{source}: {where}.name {name!r} is also workers[{other}]"
                                      f"'s: credential names must be unique",
                                      field=f"{where}.name")
            if hmac.compare_digest(o.token_sha256, bytes.fromhex(digest)):
                raise InvalidArgument(f"{source}: {where}.token_sha256 is also workers[{other}]"
                                      f"'s: every credential needs its own token",
                                      field=f"{where}.token_sha256")
        workers.append(Worker(name, bytes.fromhex(digest), allowed, bool(w.get("admin", False))))
    return TenantsFile(tuple(policies), tuple(workers), budgets=budgets)


#: The optional limit keys of a tenant (``TenantPolicy`` fields of the same names).
_LIMITS = ("max_sequences", "max_sessions", "max_pending_fences", "max_metadata_bytes",
           "max_request_priority", "host_quota_bytes", "disk_quota_bytes")


#: A tenant's own work budget keys (``blockd.runtime.budgets``).
_BUDGET = ("work_units_per_second", "work_units_burst")


def _budget(t: Mapping[str, Any], where: str) -> tuple[float | None, float | None]:
    """A tenant's (rate, burst): numbers (never a bool or a string), the rate >= 0 (0: no
    budget for this tenant), the burst > 0; an absent key keeps the daemon-wide value."""
    out: list[float | None] = []
    for key in _BUDGET:
        value = t.get(key)
        if value is None and key not in t:
            out.append(None)
            continue
        field_ = f"{where.rsplit(': ', 1)[-1]}.{key}"
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value \
                or value in (float("inf"), float("-inf")):
            raise InvalidArgument(f"{where}.{key} must be a number, got {value!r}",
                                  field=field_)
        if value < 0 or (key == "work_units_burst" and value == 0):
            bound = "> 0" if key == "work_units_burst" else ">= 0 (0: no budget)"
            raise InvalidArgument(f"{where}.{key} must be {bound}, got {value!r}",
                                  field=field_)
        out.append(float(value))
    return out[0], out[1]


def _limit(value: object, key: str) -> int:
    """A limit's value: an integer (never a bool, a float or a string)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{key} must be an integer, got {value!r}", field=key)
    return value


def load(path: str | Path) -> TenantsFile:
    return parse(yaml.safe_load(Path(path).read_text()) or {}, str(path))


def token_hash(token: str) -> str:
    """The hex digest to put in a tenants file for ``token``."""
    return hashlib.sha256(token.encode()).hexdigest()
