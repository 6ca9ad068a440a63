"""Prefix-cache namespaces: the root every block key chains from (design.md section 3).

A namespace is everything besides the token ids that decides whether two blocks hold the same
K/V: model id and revision, LoRA adapter, tokenizer settings, the sharing domain derived from
the tenant's policy, and an optional per-request salt. Each field is tagged and length-prefixed,
so no two fields can be confused and an empty value differs from a missing one.

Namespaces are interned: equal canonical bytes get the same small integer id, which every
indexed block stores. Verification compares ids, and ids are assigned by exact byte equality of
the canonical encoding (a dict keyed by the bytes), so a hash collision between two namespaces'
root keys can never make their blocks interchangeable. An id is recycled when nothing refers to
it any more (no indexed block, no live sequence), which keeps per-request salts bounded.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from blockd.core.errors import InvalidArgument

#: Field tags of the canonical encoding. Never renumber: they are part of every key.
_TAGS = {
    "model_id": 1,
    "model_revision": 2,
    "lora_id": 3,
    "tokenizer_digest": 4,
    "sharing_domain": 5,
    "salt": 6,
}
_MISSING = 0xFFFFFFFF
_DOMAIN_SEPARATOR = b"blockd.namespace.v1\x00"

MAX_FIELD_BYTES = 256
MAX_SALT_BYTES = 64


@dataclass(frozen=True, slots=True)
class NamespaceFields:
    """The inputs of a namespace root. ``None`` means missing, which differs from empty."""

    model_id: str
    model_revision: str | None = None
    lora_id: str | None = None
    tokenizer_digest: bytes | None = None
    sharing_domain: str = "public"
    salt: bytes | None = None

    def canonical(self) -> bytes:
        """Tagged, length-prefixed encoding of every field, in tag order."""
        out = [_DOMAIN_SEPARATOR]
        for name, tag in _TAGS.items():
            value = getattr(self, name)
            if value is None:
                out.append(struct.pack("<BI", tag, _MISSING))
                continue
            raw = value.encode("utf-8") if isinstance(value, str) else bytes(value)
            limit = MAX_SALT_BYTES if name == "salt" else MAX_FIELD_BYTES
            if len(raw) > limit:
                raise InvalidArgument(f"{name} is longer than {limit} bytes", field=name)
            out.append(struct.pack("<BI", tag, len(raw)))
            out.append(raw)
        return b"".join(out)


class Namespace:
    """An interned namespace: its id, root key and the fields flushes filter on."""

    __slots__ = ("id", "fields", "canonical", "root_key", "refs")

    def __init__(self, ns_id: int, fields: NamespaceFields, canonical: bytes,
                 root_key: bytes) -> None:
        self.id = ns_id
        self.fields = fields
        self.canonical = canonical
        #: 16-byte keyed XXH3-128 of the canonical encoding.
        self.root_key = root_key
        #: Indexed blocks plus live sequences that name this namespace.
        self.refs = 0


def namespace_label(ns: Namespace) -> str:
    """How events name a namespace: a prefix of its keyed root hash, never its fields."""
    return "ns-" + ns.root_key[:8].hex()


class NamespaceTable:
    """Interns namespaces and recycles their ids. Owned by the manager, used by caching."""

    def __init__(self, seed: int, max_namespaces: int = 2**31 - 1) -> None:
        self._seed = seed
        self._max = max_namespaces
        self._by_bytes: dict[bytes, Namespace] = {}
        self._by_id: dict[int, Namespace] = {}
        self._free_ids: list[int] = []
        # Id 0 is never assigned: a zero in the per-block array means "no namespace".
        self._next_id = 1
        #: (scope, tenant slot) -> its namespace: encoding and hashing the fields costs more
        #: than the rest of a short lookup. Cleared when tenants (sharing domains) change.
        self._requests: dict[tuple[PrefixScope, int], Namespace] = {}

    def for_request(self, scope: PrefixScope, tenant: int, sharing_domain: str) -> Namespace:
        """The interned namespace of a request: the client's scope plus the sharing domain the
        server derived from the caller's tenant (``tenant`` is its slot, the memo's key)."""
        key = (scope, tenant)
        ns = self._requests.get(key)
        if ns is not None and self.is_live(ns):
            return ns
        ns = self.intern(NamespaceFields(
            model_id=scope.model_id, model_revision=scope.model_revision,
            lora_id=scope.lora_id, tokenizer_digest=scope.tokenizer_digest,
            sharing_domain=sharing_domain, salt=scope.salt))
        if len(self._requests) >= 4096:
            self._requests.clear()
        self._requests[key] = ns
        return ns

    def matching(self, model_id: str | None, model_revision: str | None, lora_id: str | None,
                 sharing_domains: set[str] | None = None) -> set[int]:
        """Ids of the live namespaces that match every given filter (a flush)."""
        return {ns.id for ns in self._by_id.values()
                if (sharing_domains is None or ns.fields.sharing_domain in sharing_domains)
                and (model_id is None or ns.fields.model_id == model_id)
                and (model_revision is None or ns.fields.model_revision == model_revision)
                and (lora_id is None or ns.fields.lora_id == lora_id)}

    def forget_requests(self) -> None:
        """Sharing domains may have changed (a tenants reload): drop the request memo."""
        self._requests.clear()

    def intern(self, fields: NamespaceFields) -> Namespace:
        """The namespace for ``fields``, created on first use (refs start at 0)."""
        canonical = fields.canonical()
        ns = self._by_bytes.get(canonical)
        if ns is not None:
            return ns
        if self._free_ids:
            ns_id = self._free_ids.pop()
        else:
            if self._next_id > self._max:
                raise InvalidArgument("too many distinct namespaces", field="namespace")
            ns_id = self._next_id
            self._next_id += 1
        root = xxhash.xxh3_128_digest(canonical, self._seed)
        ns = Namespace(ns_id, fields, canonical, root)
        self._by_bytes[canonical] = ns
        self._by_id[ns_id] = ns
        return ns

    def get(self, ns_id: int) -> Namespace:
        return self._by_id[ns_id]

    def is_live(self, ns: Namespace) -> bool:
        """Whether ``ns`` is still interned (its id has not been recycled)."""
        return self._by_id.get(ns.id) is ns

    def incref(self, ns: Namespace, n: int = 1) -> None:
        ns.refs += n

    def decref(self, ns: Namespace, n: int = 1) -> None:
        ns.refs -= n
        if ns.refs == 0:
            del self._by_bytes[ns.canonical]
            del self._by_id[ns.id]
            self._free_ids.append(ns.id)

    def release_if_unused(self, ns: Namespace) -> None:
        """Drop a namespace interned for a lookup that left no reference behind."""
        if ns.refs == 0 and self._by_id.get(ns.id) is ns:
            del self._by_bytes[ns.canonical]
            del self._by_id[ns.id]
            self._free_ids.append(ns.id)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(self._by_id.values()))

    def __len__(self) -> int:
        return len(self._by_id)


@dataclass(frozen=True, slots=True)
class PrefixScope:
    """What a request says about its prefix key. The sharing domain is not here on purpose:
    the server derives it from the caller's tenant policy."""

    model_id: str
    model_revision: str | None = None
    lora_id: str | None = None
    tokenizer_digest: bytes | None = None
    #: Optional per-request salt (vLLM's ``cache_salt``): only requests with the same salt share.
    salt: bytes | None = None
