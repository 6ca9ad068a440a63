"""The remote tier on the daemon's side: publish committed prefixes, fetch a local miss ahead.

A remote tier is a store many nodes share (``blockd.tiers.redis_cluster``), keyed by MACs
under the deployment's cluster secret (``blockd.tiers.remote_format``). Nothing here waits for
it on the event loop:

* **Write-behind.** The core reports every block that joins the index (``BlockStored``, heard
  per partition through ``PartitionCoordinator.set_partition_listener``). A block of the pool
  whose chain this daemon knows (its parent's remote key, or its namespace's remote root for a
  first block: ``chains``) is copied out of the pool at once (its bytes are final: the commit's
  fence has completed) and queued for the publisher thread; a full queue drops it (counted).
* **Fetch-ahead.** An admit whose verified local prefix stops before the prompt's last full
  block asks the fetcher thread for the blocks after it (one fetch per first-missing key at a
  time; a key that missed is not asked again for ``remote_retry_ms``). The fetcher checks each
  value against what this node computed for the prompt (``check_value``) off the loop, deletes
  bad ones, and hands the good prefix of them back to the loop, where they join the tenant's
  lower tier (``KVManager.adopt_remote``, journalled) like a spill: the next admit of the prompt
  loads them. An admit with ``wait_for_remote`` is answered "pending" instead of admitted while
  such a fetch may still bring blocks (``BlockdConnector`` then tells vLLM's scheduler to ask
  again next step).

Faults are misses: a cluster down, slow, flushed, full or holding a bad value never fails a
Step nor serves a byte that did not pass its check.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from blockd.core.contract import KVManager
from blockd.core.coordinator import PartitionCoordinator
from blockd.core.errors import InvalidArgument
from blockd.core.events import POOL, BlockRemoved, BlockStored, CoreEvent
from blockd.core.namespace import PrefixScope
from blockd.core.results import AdmitResult, DoesNotFit
from blockd.core.spec import PoolSpec
from blockd.pools.base import Pool
from blockd.runtime.journal_records import AdoptRecord
from blockd.tiers.remote_format import (
    MIN_SECRET_BYTES,
    Expected,
    RemoteKeys,
    check_value,
    expectations,
    layout_digest,
    pack_value,
    redis_key,
)
from blockd.tiers.remote_jobs import FetchJob, RedisSettings
from blockd.tiers_config import TiersConfig

if TYPE_CHECKING:  # the daemon's, handed to ``start`` (recovery imports the Step path)
    from blockd.runtime.recovery import Recovery
    from blockd.runtime.storage import Storage

log = logging.getLogger("blockd.remote")

#: The tier name of the events of blocks the cluster holds (``blockd.runtime.events`` gives
#: them the medium ``REMOTE``).
REMOTE = "remote"

#: Remote keys of chains (by partition and local key) remembered to publish children.
MAX_CHAINS = 1 << 18
#: Remote keys known to be in the cluster (published or fetched): not written again.
MAX_PRESENT = 1 << 18
#: Namespaces' remote roots remembered (by partition and local root key).
MAX_ROOTS = 1 << 14


def read_secret(cfg: TiersConfig) -> bytes:
    """The cluster secret, or a one-line refusal naming ``tiers.cluster_secret_file``."""
    path = cfg.cluster_secret_file
    try:
        with open(path, "rb") as f:
            secret = f.read().strip()
    except OSError as exc:
        raise InvalidArgument(f"tiers.cluster_secret_file: cannot read {path}: "
                              f"{exc.strerror or exc}", field="tiers.cluster_secret_file"
                              ) from None
    if len(secret) < MIN_SECRET_BYTES:
        raise InvalidArgument(f"tiers.cluster_secret_file: {path} holds {len(secret)} bytes; "
                              f"a cluster secret needs at least {MIN_SECRET_BYTES}",
                              field="tiers.cluster_secret_file")
    return secret


def redis_settings(cfg: TiersConfig) -> RedisSettings:
    password = None
    if cfg.redis_password_file:
        try:
            with open(cfg.redis_password_file, encoding="utf-8") as f:
                password = f.readline().rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else "not UTF-8"
            raise InvalidArgument(f"tiers.redis_password_file: cannot read "
                                  f"{cfg.redis_password_file}: {why}",
                                  field="tiers.redis_password_file") from None
    if cfg.redis_tls_ca_file and not os.access(cfg.redis_tls_ca_file, os.R_OK):
        raise InvalidArgument(f"tiers.redis_tls_ca_file: cannot read {cfg.redis_tls_ca_file}",
                              field="tiers.redis_tls_ca_file")
    return RedisSettings(
        nodes=cfg.redis_addresses(), username=cfg.redis_user or None, password=password,
        tls=cfg.redis_tls, tls_ca_file=cfg.redis_tls_ca_file or None,
        timeout_s=cfg.remote_timeout_ms / 1000, ttl_s=cfg.remote_ttl_s,
        retry_s=cfg.remote_retry_ms / 1000, queue_values=cfg.remote_queue_blocks,
        fetches_per_tenant=cfg.remote_fetches_per_tenant)


def _bounded_put(d: OrderedDict[Any, Any], key: object, value: object, limit: int) -> None:
    d[key] = value
    if len(d) > limit:
        d.popitem(last=False)


@dataclass
class RemoteStats:
    """What the remote tier did for this daemon (the cluster client counts its commands)."""

    #: Blocks fetched that passed their check / missed / failed it (deleted).
    hit_blocks: int = 0
    miss_blocks: int = 0
    bad_values: int = 0
    #: Blocks that joined a lower tier, and prompt tokens admits then loaded... (the core
    #: counts the latter per tier as ``tier_hit_tokens``).
    adopted_blocks: int = 0
    fetches: int = 0
    #: Admits answered "pending" (``wait_for_remote``).
    pending_admits: int = 0
    #: Committed blocks queued to publish, and not published by why.
    published_blocks: int = 0
    not_published: Counter[str] = field(default_factory=Counter)


@dataclass
class _Fetch:
    partition: str
    tenant_id: str
    scope: PrefixScope
    tokens: bytes
    start: int
    expected: list[Expected]
    first: bytes
    #: ``RemoteTier._writes`` when the fetch was asked: a key announced written after that
    #: may have been written after the fetch read it, so its "no such key" says nothing.
    since: int
    #: Filled on the fetcher thread: the checked bytes of blocks start.., and the keys the
    #: cluster answered it does not hold, or held a bad value for (deleted).
    good: list[memoryview] = field(default_factory=list)
    gone: list[bytes] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Published:
    """A block handed to the cluster: its remote key, and its announcement once written."""

    key: bytes
    stored: BlockStored




class RemoteTier:
    """One daemon's remote tier: the cluster client plus the chains and fetches in flight."""

    def __init__(self, cfg: TiersConfig, parts: PartitionCoordinator, pools: dict[str, Pool],
                 spec: PoolSpec) -> None:
        # redis-py only with a remote tier configured (``blockd.tiers.remote_jobs`` says why).
        from blockd.tiers.redis_cluster import RedisRemote

        self.keys = RemoteKeys(read_secret(cfg))
        self.client = RedisRemote(redis_settings(cfg))
        self.parts = parts
        self.pools = pools
        self.block_size = spec.block_size
        # Every partition has the pool's layout (only its number of blocks differs).
        self.layout = layout_digest(
            f"block_size={spec.block_size} layers={spec.num_layers} "
            f"kv_heads={spec.num_kv_heads} head_dim={spec.head_dim} dtype={spec.dtype} "
            f"order={spec.kv_order} tp={spec.tp_size} slot_bytes={spec.slot_bytes}")
        self.slot_bytes = {name: s.slot_bytes for name, s in parts.specs.items()}
        self.retry_s = cfg.remote_retry_ms / 1000
        #: Partitions with a lower tier for fetched blocks to join (a dedicated partition has
        #: one only if its members have host or disk quotas: ``partition_tiers``).
        self._tiered = {name for name, t in parts.tiers.items() if t.enabled}
        self.stats = RemoteStats()
        self._roots: OrderedDict[tuple[str, bytes], bytes] = OrderedDict()
        self._root_memo: OrderedDict[bytes, bytes] = OrderedDict()
        self._chains: OrderedDict[tuple[str, bytes], bytes] = OrderedDict()
        #: Remote key -> the removal to announce when it is found gone, and the number of
        #: writes announced when it was (None: not announced by this daemon, e.g. fetched, or
        #: not written yet).
        self._present: OrderedDict[bytes, tuple[BlockRemoved, int] | None] = OrderedDict()
        #: Writes the cluster accepted and this daemon announced, so far.
        self._writes = 0
        self._missed: dict[bytes, float] = {}
        self._in_flight: dict[bytes, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._storage: Storage | None = None
        self._recovery: Recovery | None = None
        self._after: Callable[[], None] = lambda: None
        self._announce: Callable[[CoreEvent], None] | None = None

    def start(self, loop: asyncio.AbstractEventLoop, storage: Storage, recovery: Recovery,
              after: Callable[[], None], announce: Callable[[CoreEvent], None]) -> None:
        """Connect (a degraded start if the cluster is not reachable: logged, exported,
        retried) and listen to the core. Fetched blocks are written through ``storage``,
        journalled by ``recovery``, then ``after()`` (the daemon's compaction and checks);
        a block the cluster accepted is announced (``announce``: the event log's sink) as a
        ``BlockStored`` of the ``remote`` tier, and as its ``BlockRemoved`` once a fetch of
        this daemon finds it gone (``_gone``)."""
        self._announce = announce
        self.client.on_written = self._written
        self._loop = loop
        self._storage = storage
        self._recovery = recovery
        self._after = after
        self.client.start()
        self.parts.set_partition_listener(self.on_event)

    def close(self) -> None:
        self.parts.set_partition_listener(None)
        self.client.close()

    # -- the Step's admits ----------------------------------------------------------------------

    def admit(self, m: KVManager, session_id: str, tenant_id: str, scope: PrefixScope,
              tokens: bytes, *, cache: bool, priority: int, wait: bool
              ) -> AdmitResult | DoesNotFit | int:
        """``m.admit``, with the remote tier's part: the result, or (``wait``) the number of
        blocks a fetch is bringing, with nothing admitted."""
        partition = self.parts.partition_of_tenant(tenant_id)
        if not cache or not self.client.up or partition not in self._tiered:
            return m.admit(session_id, scope, tokens, cache=cache, priority=priority)
        want = (len(tokens) // 4 - 1) // self.block_size  # an admit's most cached blocks
        if wait:
            reach = m.lookup(session_id, scope, tokens) // self.block_size
            pending = self._fetch(partition, tenant_id, scope, tokens, reach, want)
            if pending:
                self.stats.pending_admits += 1
                return pending
        admitted = m.admit(session_id, scope, tokens, cache=cache, priority=priority)
        if isinstance(admitted, AdmitResult) and not wait:  # (with wait: tried just above)
            self._fetch(partition, tenant_id, scope, tokens,
                        admitted.num_cached_tokens // self.block_size, want)
        return admitted

    def _root(self, partition: str, tenant_id: str, scope: PrefixScope) -> bytes:
        canonical, local_root = self.parts.namespace_keys(tenant_id, scope)
        memo = partition.encode() + b"\0" + canonical
        root = self._root_memo.get(memo)
        if root is None:
            root = self.keys.root(partition, self.layout, canonical)
            _bounded_put(self._root_memo, memo, root, MAX_ROOTS)
        _bounded_put(self._roots, (partition, local_root), root, MAX_ROOTS)
        return root

    def _fetch(self, partition: str, tenant_id: str, scope: PrefixScope, tokens: bytes,
               start: int, stop: int) -> int:
        """Start fetching blocks ``start..stop-1`` (unless one fetch of them is under way:
        its size; or they missed lately: 0). Returns the blocks being fetched."""
        root = self._root(partition, tenant_id, scope)  # also what publishing chains from
        if start >= stop:
            return 0
        chain = self.keys.chain(root, tokens, self.block_size, stop)
        first = chain[start]
        if first in self._in_flight:
            return self._in_flight[first]
        missed = self._missed.get(first)
        now = time.monotonic()
        if missed is not None and now - missed < self.retry_s:
            return 0
        job = _Fetch(partition, tenant_id, scope, tokens, start,
                     expectations(self.keys, root, chain, tokens, self.block_size, start), first,
                     self._writes)
        keys = [redis_key(e.key) for e in job.expected]
        if not self.client.fetch(FetchJob(keys, lambda raw, unread: self._fetched(job, raw, unread),
                                          tenant=tenant_id)):
            return 0
        self.stats.fetches += 1
        self._in_flight[first] = stop - start
        if len(self._missed) > MAX_PRESENT:
            self._missed = {k: t for k, t in self._missed.items() if now - t < self.retry_s}
        return stop - start

    def _fetched(self, job: _Fetch, raw: list[bytes | None], unread: frozenset[int]) -> None:
        """On the fetcher thread: check the values in order, keep the good prefix; note the
        keys found gone (answered "no such key", or the bad value, deleted)."""
        bad = []
        length = self.slot_bytes[job.partition]
        for value, expected in zip(raw, job.expected, strict=True):
            out = check_value(self.keys, value, self.layout, expected, length)
            if isinstance(out, str):
                if out == "bad_value":
                    bad.append(redis_key(expected.key))
                    job.gone.append(expected.key)
                break
            job.good.append(out)
        job.gone += [e.key for i, (value, e) in enumerate(zip(raw, job.expected, strict=True))
                     if value is None and i not in unread]
        if bad:
            self.client.delete(bad)
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._landed, job, len(bad))

    def _landed(self, job: _Fetch, bad: int) -> None:
        """On the loop: the fetched blocks join the tenant's lower tier."""
        self._in_flight.pop(job.first, None)
        stats = self.stats
        stats.bad_values += bad
        stats.hit_blocks += len(job.good)
        stats.miss_blocks += len(job.expected) - len(job.good)
        joined = 0
        if job.good:
            try:
                joined = self._join(job)
            except Exception:  # a bug: a miss, never a daemon down
                log.exception("remote tier: fetched blocks could not join the lower tier")
        stats.adopted_blocks += joined
        for e in job.expected[:joined]:
            _bounded_put(self._present, e.key, self._present.get(e.key), MAX_PRESENT)
        if joined < len(job.expected) and not self._written_since(job, job.expected[joined].key):
            self._missed[job.expected[joined].key] = time.monotonic()
        for key in job.gone:
            if not self._written_since(job, key):
                self._gone(key)

    def _written_since(self, job: _Fetch, key: bytes) -> bool:
        """Whether this daemon's write of ``key`` was accepted after ``job`` was asked: the
        fetch may have read the cluster before the write, so its miss is stale (neither a
        removal nor a reason not to fetch the key again)."""
        entry = self._present.get(key)
        return entry is not None and entry[1] > job.since

    def _gone(self, key: bytes) -> None:
        """The cluster no longer holds ``key`` (flushed, evicted, expired, or its value was
        bad): published again when it is committed again, and if this daemon announced it
        on ``REMOTE``, its removal is announced (the cluster itself says nothing of what it
        drops: a removal is only ever seen by a fetch)."""
        entry = self._present.pop(key, None)
        if entry is not None and self._announce is not None:
            self._announce(entry[0])

    def _join(self, job: _Fetch) -> int:
        """The fetched blocks join the tenant's lower tier, journalled like a Step."""
        storage, recovery = self._storage, self._recovery
        if (storage is None or recovery is None or recovery.failed is not None
                or not self.parts.has_tenant(job.tenant_id)):
            return 0
        storage.stage(job.partition, job.good)
        try:
            n = self.parts.adopt_remote(job.tenant_id, job.scope, job.tokens, job.start,
                                        len(job.good))
        finally:
            storage.stage(job.partition, [])
        recovery.record(AdoptRecord(job.tenant_id, job.scope, job.tokens, job.start,
                                    len(job.good), storage.take_io_failures(job.partition)))
        self._after()
        return n

    def _written(self, tags: list[object]) -> None:
        """On the publisher thread: the cluster holds these blocks now; announce them."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._announce_all, tags)

    def _announce_all(self, tags: list[object]) -> None:
        if self._announce is None:
            return
        for tag in tags:
            if isinstance(tag, _Published):
                ev = tag.stored
                self._writes += 1
                _bounded_put(self._present, tag.key,
                             (BlockRemoved(ev.block, ev.key, ev.namespace_label,
                                           ev.sharing_domain, REMOTE), self._writes),
                             MAX_PRESENT)
                # The cluster holds it now: a miss noted before says nothing any more (an
                # admit of it right after must fetch it, and see it if it is gone again).
                self._missed.pop(tag.key, None)
                self._announce(ev)

    # -- publishing -----------------------------------------------------------------------------

    def on_event(self, partition: str, ev: CoreEvent) -> None:
        """The core's events: learn each indexed block's remote key; publish the pool's."""
        if not isinstance(ev, BlockStored):
            return
        if ev.parent_key:
            parent = self._chains.get((partition, ev.parent_key))
        elif ev.root_key:
            parent = self._roots.get((partition, ev.root_key))
        else:
            parent = None  # its parent left before it was indexed: its chain is unknown
        if parent is None:
            if ev.tier == POOL:
                self.stats.not_published["unchained"] += 1
            return
        key = self.keys.child(parent, ev.token_bytes)
        _bounded_put(self._chains, (partition, ev.key), key, MAX_CHAINS)
        if ev.tier != POOL:
            return
        if key in self._present:
            self.stats.not_published["present"] += 1
            return
        if not self.client.up:
            self.stats.not_published["down"] += 1
            return
        buf = bytearray(self.slot_bytes[partition])
        try:
            self.pools[partition].copy_out(ev.block, memoryview(buf))
        except Exception:  # a pool that cannot be read now: not published, counted
            self.stats.not_published["copy"] += 1
            return
        expected = Expected(key, parent, self.keys.token_digest(ev.token_bytes))
        announced = ev.held_by(REMOTE)
        if self.client.publish(redis_key(key), pack_value(self.keys, self.layout, expected, buf),
                               _Published(key, announced)):
            self.stats.published_blocks += 1
            _bounded_put(self._present, key, None, MAX_PRESENT)
        else:
            self.stats.not_published["queue"] += 1
