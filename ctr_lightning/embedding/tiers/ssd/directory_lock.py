"""One process at a time in a directory: an exclusive ``flock`` that every user of the
directory in this process shares, and that the kernel drops when the process dies."""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

# In the directory it locks; it stays there after the lock is released: removing it would
# let a process that opened the old file and one that creates a new one both hold "the" lock.
LOCK_FILE = ".ctr-lightning.lock"
# What flock(2) answers on a file system without locks (some network and parallel ones).
_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


class DirectoryInUseError(RuntimeError):
    """Another live process holds the directory: using it would delete or overwrite its files."""

    def __init__(self, message: str, directory: Path, pid: int | None) -> None:
        super().__init__(message)
        self.directory = directory
        self.pid = pid  # as the holder recorded it; None if it could not be read


@dataclass
class _Hold:
    fd: int  # the locked lock file, open while any user of this process holds it
    users: int


# Keyed by the directory's (device, inode): two paths of one directory are one lock.
_holds: dict[tuple[int, int], _Hold] = {}
# Reentrant: a claim collected by the garbage collector releases itself, and a collection
# can run in the middle of a claim being made in the same thread.
_holds_lock = threading.RLock()
_generation = 0  # changes in a forked child, whose inherited holds are not its own


def _forget_after_fork() -> None:
    """A forked child (a data loader worker) holds nothing: its copies of the locked files
    are closed, so the lock goes with the parent's death, not with the last child's."""
    global _holds_lock, _generation
    _holds_lock = threading.RLock()  # another thread may have held it at the fork
    for hold in _holds.values():
        try:
            os.close(hold.fd)  # not LOCK_UN: that would unlock the parent's lock too
        except OSError:
            pass
    _holds.clear()
    _generation += 1


os.register_at_fork(after_in_child=_forget_after_fork)


class DirectoryLock:
    """This process's exclusive claim on a directory, held until :meth:`release` (or until
    the object is collected, or the process dies). Claims of one process on one directory
    share one lock, so the tiers of one run never shut each other out; another process's
    claim raises :class:`DirectoryInUseError`, naming the holder's PID. A copy (deepcopy,
    pickle) claims the directory anew.

    Example::

        claim = DirectoryLock("/nvme/run1", "SSD tier of tables ['t0']", "StorageConfig.ssd_dir")
        ...                      # no other process can claim /nvme/run1 meanwhile
        claim.release()
    """

    def __init__(self, directory: str | os.PathLike, owner: str, setting: str) -> None:
        self._key: tuple[tuple[int, int], int] | None = None
        self.directory = Path(directory)
        self.owner = owner  # who claims it, for error messages
        self.setting = setting  # the option that chooses the directory, for error messages
        with _holds_lock:
            try:
                stat = os.stat(self.directory)
            except OSError as e:
                raise OSError(e.errno, f"{owner}: cannot use {self.directory}: {e.strerror}") from e
            key = (stat.st_dev, stat.st_ino)
            hold = _holds.get(key)
            if hold is None:
                hold = _holds[key] = _Hold(self._lock(), 0)
            hold.users += 1
            self._key = (key, _generation)

    def _lock(self) -> int:
        """The lock file, opened and locked, with this process's PID written in it."""
        path = self.directory / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise OSError(e.errno, f"{self.owner}: cannot create files in {self.directory}: {e.strerror}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _recorded_pid(fd)
            os.close(fd)
            raise DirectoryInUseError(
                f"{self.owner}: {self.directory} is in use by another process "
                f"(PID {pid if pid is not None else 'unknown'}), whose files there would be destroyed; "
                f"choose another directory ({self.setting}) or stop that run", self.directory, pid) from None
        except OSError as e:
            if e.errno not in _NO_LOCKS:
                os.close(fd)
                raise OSError(e.errno, f"{self.owner}: cannot lock {path}: {e.strerror}") from e
            warnings.warn(f"{self.owner}: the file system of {self.directory} has no locks, so another run "
                          f"using it would not be refused; give each run its own directory ({self.setting})",
                          stacklevel=3)
            return fd
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass  # only names this process in another's refusal (a full disk: "PID unknown")
        return fd

    def release(self) -> None:
        """Give up this claim; the lock goes when the last claim of this process does."""
        claim, self._key = self._key, None
        if claim is None:
            return
        key, generation = claim
        with _holds_lock:
            if generation != _generation:
                return  # made before a fork: the hold belongs to the parent
            hold = _holds[key]
            hold.users -= 1
            if hold.users == 0:
                del _holds[key]
                os.close(hold.fd)

    def __reduce__(self):
        return type(self), (self.directory, self.owner, self.setting)

    def __del__(self) -> None:
        self.release()


def _recorded_pid(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).decode().strip())
    except (OSError, ValueError):
        return None  # the holder is between locking and writing its PID, or could not write it
