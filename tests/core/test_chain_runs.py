"""The prefix index's chain verification walks runs of consecutive block ids (issue 17).

``PrefixIndex._verify_chain`` finds where a run starts with one ``rfind`` in a per-block
"linked to the id below" byte and checks each run's serials and token ids with one
comparison each. These tests hold it to the plain definition (walk every parent pointer, compare
every block) on random indexes whose chains are scattered, contiguous or mixed, including a
stale incarnation inside a run or at a run's edge, a wrong token anywhere, a chain longer or
shorter than asked, and a snapshot (pickle) round trip.
"""

import pickle
import random
from array import array

import pytest

from blockd.core.prefix_index import NO_PARENT, PrefixIndex

B = 4
ROOT = b"r" * 16
NS = 3


def reference(ix: PrefixIndex, ns_id: int, last: int, n: int, token_bytes: bytes
              ) -> list[int] | None:
    """The definition: every link, every serial, every block's token ids."""
    blocks = []
    b = last
    while b >= 0 and len(blocks) < n:
        blocks.append(b)
        b = ix.parent[b]
    if b != NO_PARENT or len(blocks) != n:
        return None
    blocks.reverse()
    for child, par in zip(blocks[1:], blocks, strict=False):
        if ix.parent_serial[child] != ix.serial[par]:
            return None
    if ix.ns[blocks[0]] != ns_id:
        return None
    step = ix.chunk_bytes
    for i, b in enumerate(blocks):
        if ix.tokens_of(b) != token_bytes[i * step:(i + 1) * step]:
            return None
    return blocks


def _chain_ids(rng: random.Random, free: list[int], n: int) -> list[int]:
    """``n`` free block ids: consecutive runs of random lengths, in random places."""
    out: list[int] = []
    while len(out) < n:
        start = rng.choice(free)
        run = [b for b in range(start, start + rng.randint(1, 6)) if b in free][:n - len(out)]
        run = run or [start]
        for b in run:
            free.remove(b)
        out.extend(run)
    return out


def _build(seed: int, num_blocks: int = 120):  # type: ignore[no-untyped-def]
    rng = random.Random(seed)
    ix = PrefixIndex(num_blocks, B, seed=9)
    free = list(range(num_blocks))
    chains: list[tuple[list[int], bytes]] = []
    for c in range(8):
        n = rng.randint(1, 10)
        if len(free) < n:
            break
        ids = _chain_ids(rng, free, n)
        toks = array("I", [rng.randrange(1000) for _ in range(n * B)]).tobytes()
        h = ix.new_stream(ROOT)
        keys: list[bytes] = []
        ix.extend_keys(h, toks, 0, n, keys)
        parent = NO_PARENT
        for i, b in enumerate(ids):
            assert ix.insert(b, keys[i], toks[i * 16:(i + 1) * 16], parent, NS + c % 2)
            parent = b
        chains.append((ids, toks))
    return rng, ix, chains


@pytest.mark.parametrize("seed", range(40))
def test_matches_the_definition_on_random_indexes(seed: int) -> None:
    rng, ix, chains = _build(seed)
    # Stale incarnations: remove and re-insert some blocks (same tokens, a new serial).
    for ids, toks in chains:
        if rng.random() < 0.4:
            i = rng.randrange(len(ids))
            b = ids[i]
            key = ix.key_of(b)
            ns = ix.remove(b)
            assert ix.insert(b, key, toks[i * 16:(i + 1) * 16],
                             ids[i - 1] if i else NO_PARENT, ns)
    for c, (ids, toks) in enumerate(chains):
        ns_id = NS + c % 2
        candidates = [toks, bytearray(toks)]
        bad = bytearray(toks)
        bad[rng.randrange(len(bad))] ^= 1
        candidates.append(bytes(bad))
        for tb in candidates:
            for n in {len(ids), len(ids) - 1, len(ids) + 1, 1}:
                for ns in (ns_id, ns_id + 1):
                    for last in {ids[min(n, len(ids)) - 1], ids[-1]}:
                        if n <= 0:
                            continue
                        want = reference(ix, ns, last, n, bytes(tb))
                        assert ix._verify_chain(ns, last, n, tb) == want, (seed, c, n, last)
        # A full-hit match is the whole chain exactly when nothing in it is stale.
        if reference(ix, ns_id, ids[-1], len(ids), toks) is not None:
            assert ix.match(ns_id, ROOT, toks + bytes(4), len(ids)) == ids


def test_one_run_and_a_run_per_block_agree() -> None:
    """The same prompt indexed on consecutive ids and on ids that are never consecutive."""
    toks = array("I", range(40 * B)).tobytes()
    for ids in (list(range(10, 50)), list(range(100, 20, -2))):
        ix = PrefixIndex(128, B, seed=9)
        keys: list[bytes] = []
        ix.extend_keys(ix.new_stream(ROOT), toks, 0, 40, keys)
        parent = NO_PARENT
        for i, b in enumerate(ids):
            ix.insert(b, keys[i], toks[i * 16:(i + 1) * 16], parent, NS)
            parent = b
        assert ix.match(NS, ROOT, toks + bytes(4), 40) == ids
        # A stale block in the middle (its parent re-indexed): only the prefix before it hits.
        mid = ids[20]
        key = ix.key_of(mid)
        ix.remove(mid)
        ix.insert(mid, key, toks[20 * 16:21 * 16], ids[19], NS)
        assert ix._verify_chain(NS, ids[-1], 40, toks) is None
        assert ix.match(NS, ROOT, toks + bytes(4), 40) == ids[:21]


def test_runs_survive_a_snapshot_round_trip() -> None:
    _, ix, chains = _build(7)
    again = pickle.loads(pickle.dumps(ix))
    assert again._linked == ix._linked
    assert again.serial == ix.serial and again.next_serial == ix.next_serial
    for c, (ids, toks) in enumerate(chains):
        assert again._verify_chain(NS + c % 2, ids[-1], len(ids), toks) == \
            reference(ix, NS + c % 2, ids[-1], len(ids), toks)
