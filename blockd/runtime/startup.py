"""Starting a daemon: recovered from ``state.dir`` when there is state to recover, else a new
epoch (``start``)."""

from __future__ import annotations

import logging

from blockd import logs
from blockd.config import Config
from blockd.runtime.daemon import Daemon
from blockd.runtime.recovery import JournalCorrupt, StateDirTooSmall

log = logging.getLogger("blockd.daemon")


def start(cfg: Config) -> Daemon:
    """The daemon, recovered from ``state.dir`` when there is state to recover.

    If replaying the state fails (a corrupt journal record, a bug), the snapshot and journal
    are moved aside for a post-mortem and the daemon starts a new epoch, which workers detect:
    carrying on without the lost records would hand acknowledged blocks to others, and a crash
    loop would keep every worker waiting. A state directory that cannot be written (full) is
    an ``OSError``: the daemon refuses to start and the state is kept for when there is room.
    """
    daemon = Daemon(cfg)
    damage = None
    try:
        daemon.recover()
        return daemon
    except (OSError, StateDirTooSmall):  # the state stays for a start with room
        daemon.close()
        raise
    except JournalCorrupt as exc:
        store = daemon.recovery.store
        damage = daemon.recovery.journal_damage
        daemon.close()
        assert store is not None
        kept = store.quarantine()
        log.error("the journal is corrupt: starting a new epoch, what it held after the damage "
                  "is lost (the snapshot and journal are kept)",
                  extra=logs.fields(state_dir=store.dir, kept=kept, journal=exc.path,
                                    lost=exc.what))
    except Exception:
        store = daemon.recovery.store
        daemon.close()
        if store is None:
            raise
        kept = store.quarantine()
        log.exception("recovering failed: starting a new epoch (the snapshot and journal are "
                      "kept)", extra=logs.fields(state_dir=store.dir, kept=kept))
    daemon = Daemon(cfg)
    if damage is not None:
        daemon.recovery.journal_damage.update(damage)
    daemon.recover()
    return daemon
