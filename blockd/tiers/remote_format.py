"""The remote tier's keys and values: what a node writes into the shared store (a durable format).

Keys. Every node of one deployment shares a *cluster secret* (``tiers.cluster_secret_file``);
nothing else about a key is secret or per node. A prefix's chain of remote keys is

    root   = MAC(secret, "root" | partition | layout digest | namespace canonical bytes)
    key[0] = MAC(secret, "block" | root   | token ids of block 0)
    key[i] = MAC(secret, "block" | key[i-1] | token ids of block i)

with MAC = keyed BLAKE2b (a PRF, one pass: ~1 us per block key) of 16 bytes, each part
length-prefixed. The namespace's canonical bytes
(``blockd.core.namespace.NamespaceFields``) hold the model id and revision, LoRA, tokenizer
digest, salt and the *sharing domain* the tenant's policy gives (``private:<tenant>``,
``group:<name>``, ``public``); the partition separates a dedicated tenant's public prefixes from
the shared region's. So the same prefix of the same tenant has the same key on every node; two
tenants that may not share never have a key in common; and without the secret a key says
nothing about the tenant or the tokens. Unlike the pool's keys (a keyed XXH3
with a per-daemon seed, which the pool backs with a token comparison), a remote key is collision
resistant on its own: a node cannot compare tokens with the node that wrote a value.

Values. ``HEADER_BYTES`` of header, then the block's bytes (every plane and shard, as the pool
lays them out: ``PoolSpec.slot_bytes``):

    magic "BLKDRMT2" | version u32 | length u32 | layout digest 16 | key 16 | parent key 16
    | token digest 16 | MAC of all the above and the bytes 16

A fetched value is served only if every field is what the fetching node computed for the
prompt it is matching (this format and layout, this key, the parent key of the previous block,
so a value is only ever the continuation it was written as, the MAC of this block's token ids)
and its MAC, under the cluster secret, matches the header and the bytes. Anything else (a torn
or hand-edited value, another layout's write, a value forged by someone who can write to the
cluster but does not hold the secret) is a *bad value*: a miss, deleted, counted, never served.
The bytes are not encrypted: whoever can read the cluster can read the K/V
(docs/security.md, "Remote tier").
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass

MAGIC = b"BLKDRMT2"
VERSION = 2
KEY_BYTES = 16
#: Shortest cluster secret accepted (bytes): a 256-bit MAC key.
MIN_SECRET_BYTES = 32
_FIELDS = struct.Struct("<8sII16s16s16s16s")
HEADER_BYTES = _FIELDS.size + KEY_BYTES
#: Prefix of every key blockd writes (so an operator can tell them apart, scan or drop them).
KEY_PREFIX = b"blockd:"


def _mac(key: bytes, *parts: bytes) -> bytes:
    h = hashlib.blake2b(key=key, digest_size=KEY_BYTES, person=b"blockd.remote.v1")
    for p in parts:
        h.update(struct.pack("<I", len(p)))
        h.update(p)
    return h.digest()


def layout_digest(layout: str) -> bytes:
    """A 16-byte digest of a pool layout's description (block size, dtype, planes, shards):
    a value written for another layout is never read as this one's."""
    return hashlib.sha256(b"blockd.layout.v1\x00" + layout.encode()).digest()[:KEY_BYTES]


class RemoteKeys:
    """Derives remote keys and token digests under one cluster secret."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"a cluster secret needs at least {MIN_SECRET_BYTES} bytes")
        # BLAKE2b takes keys of up to 64 bytes: a longer secret is hashed down to one.
        self._secret = (bytes(secret) if len(secret) <= 64
                        else hashlib.blake2b(bytes(secret), digest_size=64).digest())

    def root(self, partition: str, layout: bytes, canonical: bytes) -> bytes:
        return _mac(self._secret, b"root", partition.encode(), layout, canonical)

    def child(self, parent: bytes, chunk: bytes | memoryview) -> bytes:
        return _mac(self._secret, b"block", parent, bytes(chunk))

    def token_digest(self, chunk: bytes | memoryview) -> bytes:
        return _mac(self._secret, b"tokens", bytes(chunk))

    def value_mac(self, head: bytes, data: bytes | bytearray | memoryview) -> bytes:
        """The MAC of a value's header fields and bytes (BLAKE2b, C speed, no copy)."""
        h = hashlib.blake2b(key=self._secret, digest_size=KEY_BYTES, person=b"blockd.value.v2")
        h.update(head)
        h.update(data)
        return h.digest()

    def chain(self, root: bytes, token_bytes: bytes, block_size: int, stop: int) -> list[bytes]:
        """Keys of blocks ``0..stop-1`` of the prompt (uint32 LE token ids)."""
        step = 4 * block_size
        out: list[bytes] = []
        parent = root
        view = memoryview(token_bytes)
        for i in range(stop):
            parent = self.child(parent, view[i * step:(i + 1) * step])
            out.append(parent)
        return out


def redis_key(key: bytes) -> bytes:
    return KEY_PREFIX + key.hex().encode()


@dataclass(frozen=True, slots=True)
class Expected:
    """What a fetched value must say it is to be served."""

    key: bytes
    parent: bytes
    token_digest: bytes


def pack_value(keys: RemoteKeys, layout: bytes, expected: Expected,
               data: bytes | bytearray | memoryview) -> bytes:
    head = _FIELDS.pack(MAGIC, VERSION, len(data), layout, expected.key, expected.parent,
                        expected.token_digest)
    return b"".join((head, keys.value_mac(head, data), bytes(data)))


def check_value(keys: RemoteKeys, raw: bytes | None, layout: bytes, expected: Expected,
                length: int) -> memoryview | str:
    """The block's bytes in ``raw`` if it is the value ``expected`` describes, else why not:
    ``"miss"`` (no value) or ``"bad_value"``."""
    if raw is None:
        return "miss"
    if len(raw) != HEADER_BYTES + length:
        return "bad_value"
    head = raw[:_FIELDS.size]
    magic, version, n, lay, key, parent, tokens = _FIELDS.unpack(head)
    data = memoryview(raw)[HEADER_BYTES:]
    if (magic != MAGIC or version != VERSION or n != length or lay != layout
            or key != expected.key or parent != expected.parent
            or tokens != expected.token_digest):
        return "bad_value"
    if not hmac.compare_digest(raw[_FIELDS.size:HEADER_BYTES], keys.value_mac(head, data)):
        return "bad_value"
    return data


def expectations(keys: RemoteKeys, root: bytes, chain: Sequence[bytes], token_bytes: bytes,
                 block_size: int, start: int) -> list[Expected]:
    """What blocks ``start..len(chain)-1`` of a prompt must be (``chain`` from ``chain()``)."""
    step = 4 * block_size
    view = memoryview(token_bytes)
    return [Expected(chain[i], chain[i - 1] if i else root,
                     keys.token_digest(view[i * step:(i + 1) * step]))
            for i in range(start, len(chain))]
