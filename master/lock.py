"""The output folder belongs to one run: a lock file, `output.path/.streamjoin.lock`, held by rank 0.

Two clusters writing one folder deleted each other's results and both reported success.  The lock is an
flock on that file (the kernel releases it when its holder dies, however it dies), and the file says who
holds it (host, pid, start time), so a refusal can name the other run.  A lock file whose flock is free was
left by a run that died (SIGKILL, MPI_Abort): it is reported and taken over.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

NAME = ".streamjoin.lock"


class OutputBusy(Exception):
    """Another live run holds the output folder."""


def owner_text(raw: bytes) -> str:
    try:
        owner = json.loads(raw)
        return f"pid {owner['pid']} on host {owner['host']}, started {time.ctime(owner['started'])}"
    except (ValueError, KeyError, TypeError):
        return "an unreadable lock file"


class OutputLock:
    def __init__(self, out: str | Path, wait: float = 0.0, log=print):
        """Take the lock of folder `out` (creating it), waiting up to `wait` seconds for a live holder to end;
        OutputBusy if it does not.  An unwritable folder raises its OSError here, before any rank starts work."""
        self.path = Path(out) / NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + wait
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                if time.monotonic() < deadline:
                    time.sleep(0.2)
                    continue
                raise OutputBusy(
                    f"output.path {str(self.path.parent)!r} is in use by another cluster "
                    f"({owner_text(self._read())}, lock {self.path}): wait for it to end, stop it, or "
                    "choose another output.path"
                ) from None
            try:  # the holder may have released and removed the file between our open and flock: retry
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self.fd = fd
        stale = os.pread(fd, 4096, 0)
        if stale:
            log(
                f"output.path {str(self.path.parent)!r}: the run that held it ({owner_text(stale)}) ended without "
                "releasing it (killed or crashed): taking it over"
            )
        me = json.dumps(
            {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "command": sys.argv}
        ).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, me, 0)

    def _read(self) -> bytes:
        try:
            return self.path.read_bytes()
        except OSError:
            return b""

    def release(self) -> None:
        """Remove the file, then let go (in this order: a waiting run takes a fresh file, not this one)."""
        self.path.unlink(missing_ok=True)
        os.close(self.fd)
