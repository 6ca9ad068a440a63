"""The remote tier's durable format: keys every node derives alike and no one else can, values
that are served only if everything in them is what the reader computed and their MAC holds."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from blockd.tiers.remote_format import (
    HEADER_BYTES,
    Expected,
    RemoteKeys,
    check_value,
    expectations,
    layout_digest,
    pack_value,
)

SECRET = b"a" * 32
LAYOUT = layout_digest("block_size=4 layers=2")
TOKENS = struct.pack("<12I", *range(100, 112))


def chain(keys: RemoteKeys, partition: str = "shared", canonical: bytes = b"ns-acme"
          ) -> tuple[bytes, list[bytes]]:
    root = keys.root(partition, LAYOUT, canonical)
    return root, keys.chain(root, TOKENS, 4, 3)


def test_keys_are_the_same_on_every_node_and_differ_across_tenants_secrets_partitions() -> None:
    _, a = chain(RemoteKeys(SECRET))
    _, b = chain(RemoteKeys(bytes(SECRET)))  # another node, the same deployment
    assert a == b and len(set(a)) == 3
    assert chain(RemoteKeys(b"b" * 32))[1][0] != a[0]          # another deployment
    assert chain(RemoteKeys(SECRET), canonical=b"ns-globex")[1][0] != a[0]  # another domain
    assert chain(RemoteKeys(SECRET), partition="group-lab")[1][0] != a[0]
    # A key is the chain's: the same block after another prefix has another key.
    other = RemoteKeys(SECRET).chain(chain(RemoteKeys(SECRET))[0], TOKENS[16:] + TOKENS[:16],
                                     4, 3)
    assert other[1] != a[1]


def test_a_short_secret_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 32"):
        RemoteKeys(b"x" * 31)


def test_a_value_round_trips_and_is_checked_against_what_the_reader_expects() -> None:
    keys = RemoteKeys(SECRET)
    root, ks = chain(keys)
    exp = expectations(keys, root, ks, TOKENS, 4, 0)
    data = bytes(range(256)) * 4
    raw = pack_value(keys, LAYOUT, exp[1], data)
    assert bytes(check_value(keys, raw, LAYOUT, exp[1], len(data))) == data  # type: ignore[arg-type]
    assert check_value(keys, None, LAYOUT, exp[1], len(data)) == "miss"
    # The right bytes under the wrong expectation: another block, layout, length.
    assert check_value(keys, raw, LAYOUT, exp[2], len(data)) == "bad_value"
    assert check_value(keys, raw, layout_digest("other"), exp[1], len(data)) == "bad_value"
    assert check_value(keys, raw, LAYOUT, exp[1], len(data) - 1) == "bad_value"
    # Written by another deployment (its own secret): never this one's.
    assert check_value(RemoteKeys(b"b" * 32), raw, LAYOUT, exp[1], len(data)) == "bad_value"


@given(st.integers(min_value=0, max_value=HEADER_BYTES + 1023), st.integers(1, 255))
def test_any_changed_byte_is_a_bad_value(pos: int, flip: int) -> None:
    keys = RemoteKeys(SECRET)
    e = Expected(b"k" * 16, b"p" * 16, b"t" * 16)
    raw = bytearray(pack_value(keys, LAYOUT, e, bytes(1024)))
    raw[pos] ^= flip
    assert check_value(keys, bytes(raw), LAYOUT, e, 1024) == "bad_value"


def test_a_forger_with_cluster_access_but_no_secret_cannot_make_a_value_pass() -> None:
    """Copying a real value's header onto other bytes (what a checksum would let anyone redo)
    fails: the MAC covers the header and the bytes, under the secret."""
    keys = RemoteKeys(SECRET)
    e = Expected(b"k" * 16, b"p" * 16, b"t" * 16)
    real = pack_value(keys, LAYOUT, e, b"\x01" * 1024)
    forged = real[:HEADER_BYTES] + b"\x02" * 1024
    assert check_value(keys, forged, LAYOUT, e, 1024) == "bad_value"
    guess = pack_value(RemoteKeys(b"z" * 32), LAYOUT, e, b"\x02" * 1024)
    assert check_value(keys, guess, LAYOUT, e, 1024) == "bad_value"
