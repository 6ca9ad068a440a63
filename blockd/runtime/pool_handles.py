"""What the handle socket sends a session's worker, and the secret it asks for in return.

``blockd.pools.handles.HandleServer`` runs on its own threads and reads daemon state only
through ``lookup``; ``secrets`` are the sessions' fetch secrets (``blockd.pools.fetch_secrets``),
which ``Daemon.attach`` returns and the server checks. With ``state.dir`` the key is the state
directory's, so a session recovered after a restart keeps its secret.
"""

from __future__ import annotations

from blockd import handle_wire
from blockd.core.coordinator import PartitionCoordinator
from blockd.pools.base import Pool
from blockd.pools.fetch_secrets import FetchSecrets
from blockd.runtime.sessions import Sessions
from blockd.runtime.state_store import StateStore

__all__ = ["PoolHandles"]


class PoolHandles:
    """The handle server's view of one epoch's sessions and pools."""

    def __init__(self, sessions: Sessions, pools: dict[str, Pool],
                 partitions: PartitionCoordinator, epoch: int, store: StateStore | None
                 ) -> None:
        self.sessions = sessions
        self.pools = pools
        self.partitions = partitions
        self.epoch = epoch
        self.secrets = (FetchSecrets(store.fetch_key(), epoch) if store is not None
                        else FetchSecrets.ephemeral(epoch))

    def secret_of(self, session_id: str) -> str:
        """What Attach returns the session's worker (and only it)."""
        return self.secrets.of(session_id)

    def lookup(self, session_id: str) -> tuple[handle_wire.HandleHeader, list[int], str] | None:
        """What the handle server sends a session's worker (called from its thread): the
        header and fds of the pool of the session's partition, and no other, then the
        session's fence page (``blockd.wire`` fd order); and the session's tenant (the
        server checks a request naming one). None for a session unknown or revoked."""
        info = self.sessions.find(session_id)
        if info is None or info.fence_page is None or info.revoked:
            return None
        pool = self.pools[self.partitions.partition_of_tenant(info.tenant_id)]
        header, fds = pool.handle(self.epoch, info.fence_page.fd)
        return header, fds, info.tenant_id
