"""The ``tiers`` section of the configuration: the storage below the pool (docs/tiers.md).

Its own module because ``blockd.config`` is at the size limit; ``blockd.config.Config`` holds it
as ``tiers``. The sizes are checked here against each other; against the pool (a tier smaller
than one block) by ``Config``, and against the machine (its memory, the disk's free space) by the
daemon at start, each a one-line refusal naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

from blockd.core.errors import InvalidArgument
from blockd.options import option

MIB = 1024 * 1024


@dataclass(frozen=True)
class TiersConfig:
    """Where evicted prefixes go below the pool: host memory, then a file on local disk."""

    host_bytes: int = option(
        0, "Bytes of host memory below the pool for the prefixes it evicts (0: no host tier). "
           "Reserved at start (a memfd; a file in state.dir with crash recovery); refused "
           "above the machine's memory. Off by default: it is memory taken from the node.")
    disk_path: str = option(
        "", "Directory on local disk for the disk tier's file (\"\": no disk tier). Entries "
            "the host tier evicts go there (written through the page cache, behind the "
            "Steps); every slot has a checksum, checked on each read.")
    disk_bytes: int = option(0, "Bytes of the disk tier's file, preallocated at start (a full "
                                "disk is refused then, not at run time).")
    max_spill_bytes_per_step: int = option(
        16 * MIB, "Most bytes one Step copies down the tiers (spills and demotions); beyond, "
                  "an evicted prefix is dropped (counted): a Step's copies stay bounded.")
    max_load_bytes_per_step: int = option(
        64 * MIB, "Most bytes one Step loads from the tiers into the pool; a lower hit beyond "
                  "is computed instead (counted).")
    redis_nodes: str = option(
        "", "The remote tier: startup nodes of a Redis Cluster that every node of the "
            "deployment shares, host:port,host:port,... (\"\": no remote tier). Committed "
            "prefixes are written there behind the Steps; a local miss is fetched from there "
            "ahead of the next admit, into the host tier. Needs cluster_secret_file and a "
            "host or disk tier.")
    redis_user: str = option("", "ACL user of the Redis Cluster (\"\": the default user).")
    redis_password_file: str = option(
        "", "File holding the Redis Cluster's password (its first line; \"\": none).")
    redis_tls: bool = option(False, "Talk TLS to the Redis Cluster.")
    redis_tls_ca_file: str = option(
        "", "CA bundle that signs the Redis Cluster's certificates (\"\": the system's).")
    cluster_secret_file: str = option(
        "", "File holding a secret of at least 32 bytes that every node of the deployment "
            "shares: remote keys are MACs under it, so the same prefix of the same tenant has "
            "the same key on every node and a key reveals nothing without it.")
    remote_timeout_ms: int = option(
        200, "Deadline of one Redis Cluster command (connect, read or write); beyond it the "
             "command fails (counted) and the blocks are computed.")
    remote_retry_ms: int = option(
        1000, "How often a remote tier that cannot reach its cluster tries again.")
    remote_queue_blocks: int = option(
        1024, "Blocks waiting to be written to the remote tier at most; beyond, a committed "
              "prefix is not published (counted): a Step never waits for the cluster.")
    remote_fetches_per_tenant: int = option(
        64, "Fetches one tenant may have waiting for the cluster; beyond, that tenant's local "
            "miss is not fetched (computed, counted as blockd_remote_dropped_total"
            "{reason=\"fetch_budget\"}). Tenants' fetches are served in turn, so one tenant's "
            "flood of misses never delays another's by more than one fetch.")
    remote_ttl_s: int = option(
        0, "Expiry of the values the remote tier writes, seconds (0: none; the cluster's "
           "maxmemory-policy evicts).")

    def __post_init__(self) -> None:
        for name in ("host_bytes", "disk_bytes", "max_spill_bytes_per_step",
                     "max_load_bytes_per_step"):
            value = getattr(self, name)
            if not value >= 0:
                raise InvalidArgument(f"tiers.{name}: must not be negative, got {value}",
                                      field=f"tiers.{name}")
        for name in ("remote_timeout_ms", "remote_retry_ms", "remote_queue_blocks",
                     "remote_fetches_per_tenant"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"tiers.{name}: must be positive, got "
                                      f"{getattr(self, name)}", field=f"tiers.{name}")
        if self.remote_ttl_s < 0:
            raise InvalidArgument(f"tiers.remote_ttl_s: must not be negative, got "
                                  f"{self.remote_ttl_s}", field="tiers.remote_ttl_s")
        if self.redis_nodes:
            self.redis_addresses()  # refused here if malformed
            if not self.cluster_secret_file:
                raise InvalidArgument("tiers.cluster_secret_file: a remote tier "
                                      "(tiers.redis_nodes) needs the deployment's cluster "
                                      "secret", field="tiers.cluster_secret_file")
            if not (self.host_bytes or self.disk_bytes):
                raise InvalidArgument("tiers.redis_nodes: a remote tier needs a host or disk "
                                      "tier (tiers.host_bytes) for the prefixes it fetches",
                                      field="tiers.redis_nodes")
        if bool(self.disk_path) != bool(self.disk_bytes):
            missing = "disk_bytes" if self.disk_path else "disk_path"
            raise InvalidArgument(f"tiers.{missing}: a disk tier needs both disk_path and "
                                  "disk_bytes", field=f"tiers.{missing}")

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0 or self.disk_bytes > 0

    @property
    def remote(self) -> bool:
        return bool(self.redis_nodes)

    def redis_addresses(self) -> tuple[tuple[str, int], ...]:
        """``redis_nodes`` as (host, port) pairs; refused naming the field if malformed."""
        out = []
        for item in self.redis_nodes.split(","):
            host, sep, port = item.strip().rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise InvalidArgument(f"tiers.redis_nodes: {item.strip()!r} is not host:port",
                                      field="tiers.redis_nodes")
            out.append((host.strip("[]"), int(port)))
        return tuple(out)

    def check_pool(self, slot_bytes: int) -> None:
        """Refuse tiers the pool cannot use: smaller than one of its blocks, or copy bounds
        below one block."""
        if not self.enabled:
            return
        for name in ("host_bytes", "disk_bytes", "max_spill_bytes_per_step",
                     "max_load_bytes_per_step"):
            value = getattr(self, name)
            if value < slot_bytes and (value or name.startswith("max_")):
                raise InvalidArgument(
                    f"tiers.{name}: {value} bytes is less than one block of the pool "
                    f"({slot_bytes} bytes)", field=f"tiers.{name}")

    def limits(self, slot_bytes: int) -> tuple[int, int, int, int]:
        """(host slots, disk slots, spills per Step, loads per Step), in blocks."""
        return (self.host_bytes // slot_bytes, self.disk_bytes // slot_bytes,
                self.max_spill_bytes_per_step // slot_bytes,
                self.max_load_bytes_per_step // slot_bytes)
