"""The remote tier's store: a Redis Cluster that many nodes' daemons share (redis-py's client).

``RedisRemote`` owns one ``redis.cluster.RedisCluster`` and two threads, so that nothing the
cluster does (a slow master, a failover, a cluster that is down) ever holds the daemon's event
loop:

* the *publisher* drains a bounded queue of values to write (``publish``: never blocks; a full
  queue drops the value and counts it) and writes them in pipelines;
* the *fetcher* takes fetch jobs (``fetch``: a queue per tenant, bounded, served in turn:
  ``blockd.tiers.fair_queue``), reads their keys in one pipeline, and hands the raw values to
  the job's callback (which the runtime makes run on its loop). A key that fails to read is a
  miss.

Every command has a deadline (``timeout_s``, the socket timeout). Errors are counted by kind
(``timeout``, ``connection``, ``cluster_down``, ``full``, ``auth``, ``other``) and never escape.
The client is *down* while it cannot be built (the cluster unreachable at start, or after
``DOWN_AFTER`` consecutive failures of rounds in which no command succeeded, once every master
failed in that run: a dead master among live ones fails its own keys only, however many rounds
ask it alone): each thread then tries to build it again every
``retry_s``, and publishes and fetches meanwhile are dropped (counted); when the cluster is
back it is used again. The password is read from a file by the caller and never logged.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from redis import exceptions as rx
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from blockd.tiers.fair_queue import FairQueue
from blockd.tiers.remote_jobs import FetchJob, RedisSettings, RemoteCounters

log = logging.getLogger("blockd.remote")

#: Consecutive failed commands after which the client is rebuilt from the startup nodes (if
#: every master failed meanwhile).
DOWN_AFTER = 3
#: Failure kinds that take the tier down at once when no master answered at all (every master
#: failed since the last command that succeeded).
DOWN_AT_ONCE = frozenset({"connection", "cluster_down"})
#: Values one publisher pipeline writes at most.
PUBLISH_BATCH = 64


def error_kind(exc: BaseException) -> str:
    if isinstance(exc, rx.TimeoutError) or (isinstance(exc, rx.RedisClusterException)
                                            and "Timeout" in str(exc)):
        return "timeout"
    if isinstance(exc, rx.OutOfMemoryError):
        return "full"
    if isinstance(exc, (rx.AuthenticationError, rx.AuthorizationError, rx.NoPermissionError)):
        return "auth"
    if isinstance(exc, (rx.ClusterDownError, rx.SlotNotCoveredError, rx.MasterDownError,
                        rx.TryAgainError)):
        return "cluster_down"
    if isinstance(exc, (rx.ConnectionError, rx.RedisClusterException, OSError)):
        return "connection"
    if isinstance(exc, rx.ResponseError) and "OOM" in str(exc):
        return "full"
    return "other"


class RedisRemote:
    """A shared Redis Cluster, written behind and read ahead on threads of its own."""

    def __init__(self, settings: RedisSettings) -> None:
        self.settings = settings
        self.counters = RemoteCounters()
        self._client: RedisCluster | None = None
        self._client_lock = threading.Lock()
        self._failures = 0
        #: The masters (by name) that failed a command since the last one that succeeded.
        self._failing: set[str] = set()
        self._next_try = 0.0
        self._next_refresh = 0.0
        self._values: queue.Queue[tuple[bytes, bytes, object] | None] = queue.Queue(
            settings.queue_values)
        #: Called on the publisher thread with the tags of the values the cluster accepted.
        self.on_written: Callable[[list[object]], None] | None = None
        self._fetches: FairQueue[FetchJob] = FairQueue(settings.fetches_per_tenant)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._publisher, name="blockd-remote-pub",
                                          daemon=True),
                         threading.Thread(target=self._fetcher, name="blockd-remote-fetch",
                                          daemon=True)]

    # -- the loop's side (never blocks) ---------------------------------------------------------

    def start(self) -> bool:
        """Connect once (a failure is a degraded start, retried), then start the threads."""
        ok = self._connect() is not None
        for t in self._threads:
            t.start()
        return ok

    @property
    def up(self) -> bool:
        return self.counters.up

    def publish(self, key: bytes, value: bytes, tag: object = None) -> bool:
        """Queue ``value`` to write under ``key``; ``tag`` comes back through ``on_written``
        once the cluster accepted it. False (dropped, counted) if the queue is full or the
        cluster down."""
        if not self.counters.up:
            self.counters.dropped["down"] += 1
            return False
        try:
            self._values.put_nowait((key, value, tag))
        except queue.Full:
            self.counters.dropped["publish_queue"] += 1
            return False
        return True

    def fetch(self, job: FetchJob) -> bool:
        if not self.counters.up:
            self.counters.dropped["down"] += 1
            return False
        if not self._fetches.put(job.tenant, job):
            self.counters.dropped["fetch_budget"] += 1
            return False
        return True

    def delete(self, keys: Sequence[bytes]) -> None:
        """Drop bad values (from the fetcher thread, which found them)."""
        client = self._client
        if client is None:
            return
        for k in keys:
            try:
                client.delete(k)
            except Exception as exc:  # a failed delete only leaves a bad value (checked again)
                self._failed(exc)

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(queue.Full):
            self._values.put_nowait(None)
        self._fetches.close()
        for t in self._threads:
            if t.is_alive():
                t.join(timeout=2 * self.settings.timeout_s + 1)
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):  # a broken client must not fail the shutdown
                client.close()

    # -- the threads ----------------------------------------------------------------------------

    def _connect(self) -> RedisCluster | None:
        with self._client_lock:
            if self._client is not None:
                return self._client
            now = time.monotonic()
            if now < self._next_try:
                return None
            s = self.settings
            try:
                client = RedisCluster(
                    startup_nodes=[ClusterNode(h, p) for h, p in s.nodes],
                    username=s.username, password=s.password, ssl=s.tls,
                    ssl_ca_certs=s.tls_ca_file, socket_timeout=s.timeout_s,
                    socket_connect_timeout=s.timeout_s, require_full_coverage=False,
                    retry=Retry(NoBackoff(), retries=1))
                client.ping(target_nodes=RedisCluster.RANDOM)
            except Exception as exc:
                self._next_try = now + s.retry_s
                kind = error_kind(exc)
                self.counters.errors[kind] += 1
                if self.counters.up or not self.counters.connects:
                    log.warning("remote tier: the Redis Cluster is not reachable; retrying "
                                "every %.1f s", s.retry_s, extra={"kind": kind})
                self.counters.up = False
                return None
            self._client = client
            self._ok()
            self.counters.connects += 1
            if not self.counters.up:
                log.info("remote tier: connected to the Redis Cluster")
            self.counters.up = True
            return client

    def _ok(self) -> None:
        """A command succeeded: the cluster answers; a run of failures ends."""
        self._failures = 0
        self._failing.clear()

    def _failed(self, exc: BaseException, *, whole: bool = False) -> None:
        """One command failed (``whole``: a probe that asked every master could not reach the
        cluster: it is down at once)."""
        kind = error_kind(exc)
        self.counters.errors[kind] += 1
        self._failures += 1
        client = self._client
        if whole and client is not None:
            self._failing.update(n.name for n in client.get_primaries())
        self._down_if(whole and kind in DOWN_AT_ONCE)

    def _every_master_failed(self) -> bool:
        client = self._client
        return client is None or all(n.name in self._failing for n in client.get_primaries())

    def _down_if(self, at_once: bool) -> None:
        """Drop the client (reconnect after ``retry_s``) after ``DOWN_AFTER`` failures in a
        row, or at once, but only once every master failed since the last success: rounds
        that asked only a dead (or slow) master while the others answer are its keys' misses,
        not a cluster that is down."""
        if (self._failures >= DOWN_AFTER or at_once) and self._every_master_failed():
            with self._client_lock:
                client, self._client = self._client, None
                self._next_try = time.monotonic() + self.settings.retry_s
            if client is not None:
                log.warning("remote tier: the Redis Cluster fails; reconnecting in %.1f s",
                            self.settings.retry_s)
                self.counters.up = False
                with contextlib.suppress(Exception):  # dropped because it is broken
                    client.close()

    def _tally(self, results: list[Any], failed_nodes: set[str]) -> None:
        """Count a round's failed commands by kind, each once. A round in which some command
        succeeded is no failure of the cluster (a dead or slow master fails its own keys
        only: misses) and ends a run of failures; one in which every command failed counts
        towards ``DOWN_AFTER``, command by command, and notes the masters that failed it
        (``failed_nodes``). The tier goes down only once every master failed in the run (a
        round may ask one master only: all its keys on the dead one, while the others
        answer), at once if by a connection failure, else after ``DOWN_AFTER``."""
        failed = [r for r in results if isinstance(r, BaseException)]
        kinds = [error_kind(exc) for exc in failed]
        for kind in kinds:
            self.counters.errors[kind] += 1
        if len(failed) < len(results):
            self._ok()
            return
        self._failures += len(failed)
        self._failing |= failed_nodes
        self._down_if(bool(failed_nodes) and any(k in DOWN_AT_ONCE for k in kinds))

    def _idle(self) -> None:
        """Nothing to do for ``retry_s``: reconnect if down, else probe (so that ``up`` says
        the truth while nobody writes or reads)."""
        client = self._client
        if client is None:
            self._connect()
            return
        failure: BaseException | None = None
        for primary in client.get_primaries():  # down only if no master answers
            try:
                client.ping(target_nodes=primary)
            except Exception as exc:
                failure = exc
            else:
                self._ok()
                return
        if failure is not None:
            self._failed(failure, whole=True)

    def _publisher(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._values.get(timeout=self.settings.retry_s)
            except queue.Empty:
                self._idle()
                continue
            if item is None:
                return
            batch = [item]
            while len(batch) < PUBLISH_BATCH:
                try:
                    nxt = self._values.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._stop.set()
                    break
                batch.append(nxt)
            self._write(batch)

    def _by_node(self, client: RedisCluster, commands: list[tuple[Any, ...]]
                 ) -> list[Any]:
        """Run ``commands`` (``(name, key, *args)``) in one pipeline per master that owns
        their keys' slots, so that a master that is down or slow fails its own keys only
        (one cluster pipeline fails as a whole). Each command's reply, or the exception that
        failed it, counted (``_tally``): the cluster is down only once no master is reached.
        A stale slot map (a slot no master serves in it, or a MOVED/ASK reply: a cluster that
        was still forming when the client connected, a failover) is reloaded in the round that
        finds out, and those commands run once more on the fresh map."""
        out: list[Any] = [None] * len(commands)
        todo: list[int] = list(range(len(commands)))
        failure: BaseException | None = None
        failed_nodes: set[str] = set()
        for again in (False, True):
            groups: dict[str, tuple[Any, list[int]]] = {}
            stale = self._group(client, commands, todo, groups, out)
            for node, idx in groups.values():
                try:
                    conn = client.get_redis_connection(node)
                    pipe = conn.pipeline(transaction=False)
                    for i in idx:
                        name, key, *args = commands[i]
                        getattr(pipe, name)(key, *args)
                    replies = pipe.execute(raise_on_error=False)
                except Exception as exc:
                    failure = exc
                    failed_nodes.add(node.name)
                    for i in idx:
                        out[i] = exc
                    continue
                failed_nodes.discard(node.name)  # answered on the fresh map
                for i, r in zip(idx, replies, strict=True):
                    out[i] = r
                    if isinstance(r, rx.AskError):  # MOVED or ASK: the map is stale
                        stale.append(i)
            if again or not stale or not self._refresh(client):
                break
            todo = stale
        if failure is not None:
            self._refresh(client)
        self._tally(out, failed_nodes)
        return out

    @staticmethod
    def _group(client: RedisCluster, commands: list[tuple[Any, ...]], which: Any,
               groups: dict[str, tuple[Any, list[int]]], out: list[Any]) -> list[int]:
        """Add commands ``which`` to their master's group; those whose slot no master serves
        get the lookup's exception in ``out`` and are returned."""
        unmapped = []
        for i in which:
            try:
                node = client.nodes_manager.get_node_from_slot(client.keyslot(commands[i][1]))
            except Exception as exc:  # a slot no master serves
                out[i] = exc
                unmapped.append(i)
                continue
            groups.setdefault(node.name, (node, []))[1].append(i)
        return unmapped

    def _refresh(self, client: RedisCluster) -> bool:
        """A master failed or a slot had none: reload the slot map (a failover may have moved
        slots; a cluster may have been forming at the connect), at most once per
        ``retry_s``. True when the map was reloaded."""
        now = time.monotonic()
        if now < self._next_refresh:
            return False
        self._next_refresh = now + self.settings.retry_s
        try:
            client.nodes_manager.initialize()
        except Exception:  # the map stays as it was
            return False
        return True

    def _write(self, batch: list[tuple[bytes, bytes, object]]) -> None:
        client = self._connect()
        if client is None:
            self.counters.dropped["down"] += len(batch)
            return
        t0 = time.perf_counter()
        ttl = self.settings.ttl_s or None
        commands = [("set", k, v, ttl) for k, v, _ in batch]
        results = self._by_node(client, commands)
        written = []
        for (_, v, tag), r in zip(batch, results, strict=True):
            if not isinstance(r, BaseException):
                written.append(tag)
                self.counters.bytes_written += len(v)
        self.counters.values_written += len(written)
        self._timed("set", t0)
        if written and self.on_written is not None:
            try:
                self.on_written(written)
            except Exception:  # the runtime's callback only schedules work on its loop
                log.exception("remote tier: announcing written values failed")

    def _fetcher(self) -> None:
        while not self._stop.is_set():
            job = self._fetches.get(timeout=self.settings.retry_s)
            if job is None:
                if self._stop.is_set():
                    return
                self._connect()  # nothing to fetch: the publisher probes
                continue
            values, unread = self._read(job.keys)
            try:
                job.done(values, unread)
            except Exception:  # the runtime's callback only schedules work on its loop
                log.exception("remote tier: a fetch's callback failed")

    def _read(self, keys: list[bytes]) -> tuple[list[bytes | None], frozenset[int]]:
        """Each key's value (None: none), and the indices of the keys left unanswered."""
        out: list[bytes | None] = [None] * len(keys)
        client = self._connect()
        if client is None:
            self.counters.dropped["down"] += 1
            return out, frozenset(range(len(keys)))
        t0 = time.perf_counter()
        results = self._by_node(client, [("get", k) for k in keys])
        unread = set(range(len(results), len(keys)))
        for i, r in enumerate(results[:len(keys)]):
            if isinstance(r, bytes):
                out[i] = r
                self.counters.values_read += 1
                self.counters.bytes_read += len(r)
            elif r is not None:  # an error in place of the answer
                unread.add(i)
        self._timed("get", t0)
        return out, frozenset(unread)

    def _timed(self, op: str, t0: float) -> None:
        self.counters.seconds[op].observe(time.perf_counter() - t0)
