"""One trainer per run directory: a lock held on RUN_DIR/lock while the run lives.

`RunLock(run_dir).acquire()` takes an exclusive `fcntl.flock` on the file and writes
its owner (host, pid, start time) into it. The kernel drops the lock when the owner
exits, however it exits (kill -9 included), so a crashed run never blocks the next
one, and a second trainer on a live run gets one line naming the owner.

flock works on local disks and, on Linux, on NFS (emulated with NFS byte-range locks).
Run directories in buckets (gs://...), and file systems that refuse locks (ENOLCK),
are not locked: `note` says so, and keeping two trainers apart there is up to the user.
"""

import datetime
import errno
import fcntl
import json
import os
import socket

from easylm.errors import UserError

LOCK_FILE = "lock"
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)


class RunLock:

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, LOCK_FILE)
        self.note = ""  # why nothing is locked, when nothing is
        self._file = None

    def acquire(self) -> "RunLock":
        if "://" in self.run_dir:
            self.note = (f"note: {self.run_dir} is a bucket, which has no locks: make sure "
                         f"no other trainer uses it")
            return self
        try:
            os.makedirs(self.run_dir, exist_ok=True)
            file = open(self.path, "a+")
        except OSError as e:
            raise UserError(f"cannot create the run directory {self.run_dir} (from "
                            f"--logger.output_dir): {e.strerror}") from None
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in _NO_LOCKS:
                file.close()
                self.note = (f"note: the file system of {self.run_dir} refuses locks: make "
                             f"sure no other trainer uses it")
                return self
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            file.seek(0)
            owner = _describe(file.read())
            file.close()
            raise UserError(f"{self.run_dir} is in use by another trainer ({owner}); wait "
                            f"for it to end or stop it, or set another "
                            f"--logger.experiment_id") from None
        file.seek(0)
        file.truncate()
        file.write(json.dumps({
            "host": socket.gethostname(), "pid": os.getpid(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}))
        file.flush()
        self._file = file
        return self

    def release(self):
        """Unlock; the file stays (removing it would let a third trainer lock a new file
        while a second still holds the old one)."""
        if self._file is not None:
            self._file.truncate(0)
            self._file.close()  # closing drops the flock
            self._file = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def _describe(text: str) -> str:
    try:
        owner = json.loads(text)
        return f"pid {owner['pid']} on host {owner['host']}, started {owner['started']}"
    except (ValueError, KeyError, TypeError):
        return "its owner did not record itself"
