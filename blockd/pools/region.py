"""A region of shared memory the daemon maps: an anonymous memfd, or a file in its private
state directory that outlives the process (crash recovery). The host pool and the host tier's
store are each one.

Reserved with ``posix_fallocate``: a region the machine (or the tmpfs, or the memory cgroup)
cannot hold is refused when it is made, naming the configuration key, instead of a SIGBUS on
first touch.
"""

from __future__ import annotations

import contextlib
import mmap
import os

from blockd.core.errors import ResourceExhausted


def open_region(size: int, *, name: str, path: str | None, reuse: bool, field: str,
                what: str, missing_ok: bool = False) -> tuple[int, mmap.mmap]:
    """(fd, mapping) of a ``size``-byte region: a memfd named ``name`` without ``path``;
    else the file ``path``, kept when ``reuse`` (its size must be ``size``; a missing file is
    made anew with ``missing_ok``) or made anew (an old file is unlinked first: a worker still
    mapping it keeps its memory). ``what`` names the region in the refusal on ``field``."""
    if path is None:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
    elif reuse and not (missing_ok and not os.path.exists(path)):
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    else:
        reuse = False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        if reuse:
            have = os.fstat(fd).st_size
            if have != size:
                raise ValueError(f"{path} holds {have} bytes, the {what} needs {size}")
        else:
            os.ftruncate(fd, size)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise ResourceExhausted(
                    f"{field}: cannot reserve {size} bytes of shared memory for the {what}: "
                    f"{exc.strerror or exc}", reason="shm", field=field) from None
        return fd, mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise


def prefault(region: mmap.mmap, size: int) -> None:
    """Touch every page now, so that no later write pays its first fault."""
    region.madvise(mmap.MADV_WILLNEED)
    for off in range(0, size, mmap.PAGESIZE):
        region[off] = region[off]
