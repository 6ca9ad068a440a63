"""The state directory: where the pool, fence pages, snapshot and journal outlive the daemon.

Layout of ``state.dir`` (created mode 0700; refused if another user owns it or others may
read or write it, since it holds every tenant's K/V and a pickle the daemon loads)::

    pool                  the host pool's memory (workers map it)
    fence-<session id>    one fence page per attached session (its worker writes it)
    snapshot              the last snapshot (written to snapshot.tmp, then renamed)
    journal.<generation>  what was applied since the snapshot of that generation
    lock                  flock-ed by the daemon using the directory (holds its pid)
    fetch-key             the key the sessions' fetch secrets are derived under (32 bytes,
                          0600, made once: ``fetch_key``; a wipe keeps it, a new epoch is enough)
    failed-<time>-<pid>/  a snapshot and journal that could not be replayed (a corrupt
                          journal, a bug), kept for a post-mortem

A snapshot names the generation of the journal that follows it; taking one writes the new
snapshot, renames it over the old one, and only then starts the next journal and deletes the
previous one. A crash at any point leaves one snapshot plus the one journal to replay after it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
import stat
import time
from pathlib import Path
from typing import Any

from blockd.core.errors import FailedPrecondition
from blockd.pools.fetch_secrets import KEY_BYTES

MAGIC = b"BLOCKD-STATE\x00\x01"


class StateStore:
    def __init__(self, directory: str) -> None:
        self.dir = Path(directory)
        try:
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = self.dir.stat(follow_symlinks=False)
        except OSError as exc:
            raise FailedPrecondition(f"state directory {directory}: {exc}",
                                     field="state.dir") from None
        if not stat.S_ISDIR(st.st_mode):
            raise FailedPrecondition(f"state directory {directory} is not a directory",
                                     field="state.dir")
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise FailedPrecondition(
                f"state directory {directory} must be owned by this user and private "
                f"(mode 0700), it is uid {st.st_uid} mode {stat.S_IMODE(st.st_mode):o}",
                field="state.dir")
        self._lock_fd: int | None = self._lock()

    def _lock(self) -> int:
        """Hold ``lock`` for this daemon's life: two daemons on one directory would both append
        to one journal and map one pool. The kernel drops the lock when its holder dies, so a
        killed daemon's successor needs no clean-up."""
        path = self.dir / "lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise FailedPrecondition(
                f"state directory {self.dir} is in use by a running blockd (pid {holder})",
                field="state.dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def close(self) -> None:
        """Release the directory (the files stay for the next daemon)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    @property
    def pool_path(self) -> str:
        return str(self.dir / "pool")

    def fence_path(self, session_id: str) -> str:
        # Session ids are URL-safe base64 (token_urlsafe): safe as a file name.
        return str(self.dir / f"fence-{session_id}")

    def journal_path(self, generation: int) -> str:
        return str(self.dir / f"journal.{generation}")

    def fetch_key(self) -> bytes:
        """The fetch-secret key (``blockd.pools.fetch_secrets``): read, or made on the first
        start (written to a temporary file, synced, then renamed: never half a key). A file of
        another size is refused naming it; the sessions it served could not fetch again."""
        path = self.dir / "fetch-key"
        try:
            key = path.read_bytes()
        except FileNotFoundError:
            key = os.urandom(KEY_BYTES)
            tmp = self.dir / "fetch-key.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
                         | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, key)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            dir_fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        if len(key) != KEY_BYTES:
            raise FailedPrecondition(f"{path}: {len(key)} bytes, expected a {KEY_BYTES}-byte "
                                     f"key (remove it to make a new one: attached workers "
                                     f"then cannot fetch their pool again)", field="state.dir")
        return key

    # -- snapshots -----------------------------------------------------------------------------

    def read_snapshot(self) -> dict[str, Any] | None:
        path = self.dir / "snapshot"
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        if not data.startswith(MAGIC):
            raise ValueError(f"{path} is not a blockd snapshot (or another version's)")
        state: dict[str, Any] = pickle.loads(data[len(MAGIC):])  # noqa: S301 (private dir)
        return state

    def write_snapshot(self, state: dict[str, Any]) -> int:
        """Write ``state`` atomically; returns its size in bytes."""
        data = MAGIC + pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
        tmp = self.dir / "snapshot.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW,
                     0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()  # give the space back: the old snapshot stays the truth
            raise
        finally:
            os.close(fd)
        os.replace(tmp, self.dir / "snapshot")
        return len(data)

    def remove_journals(self, keep: int | None = None) -> None:
        for path in self.dir.glob("journal.*"):
            if keep is None or path.name != f"journal.{keep}":
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

    def quarantine(self) -> Path:
        """Move the snapshot and journals into ``failed-<time>/`` (a state that could not be
        replayed, kept for a post-mortem) and forget the fence pages; returns the folder."""
        kept = self.dir / f"failed-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        kept.mkdir(mode=0o700)
        for path in list(self.dir.iterdir()):
            if path.name == "snapshot" or path.name.startswith("journal."):
                path.rename(kept / path.name)
        self.wipe()
        return kept

    def wipe(self) -> None:
        """Forget everything (a clean epoch): snapshot, journals and fence pages."""
        for path in self.dir.iterdir():
            if path.name in ("snapshot", "snapshot.tmp") or path.name.startswith(
                    ("journal.", "fence-")):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
