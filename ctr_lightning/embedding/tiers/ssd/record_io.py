"""Fixed-size float32 records moved between arrays and files by compiled pread/pwrite loops."""

from __future__ import annotations

import ctypes
import errno
import os

import numba
import numpy as np

_libc = ctypes.CDLL(None, use_errno=True)
_pread = _libc.pread
_pread.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64]
_pread.restype = ctypes.c_ssize_t
_pwrite = _libc.pwrite
_pwrite.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64]
_pwrite.restype = ctypes.c_ssize_t


@numba.njit(cache=True, nogil=True)
def _runs(records):
    """Start indices of the runs of adjacent records (ascending input), plus the end."""
    starts = [0]
    for i in range(1, len(records)):
        if records[i] != records[i - 1] + 1:
            starts.append(i)
    starts.append(len(records))
    return np.array(starts, dtype=np.int64)


# Not cached on disk: numba cannot cache functions that call through ctypes pointers.
# nogil: a prefetch thread reads while the training thread computes.
@numba.njit(nogil=True)
def transfer_records(fd, rows, records, write) -> int:
    """pwrite ``rows`` to (or pread them from) ``records`` (ascending), one call per run of
    adjacent records; returns the first row of a failed run, or -1."""
    nbytes = rows.shape[1] * 4
    base = rows.ctypes.data
    runs = _runs(records)
    for r in range(len(runs) - 1):
        i, j = runs[r], runs[r + 1]
        size = (j - i) * nbytes
        if write:
            done = _pwrite(fd, base + i * nbytes, size, records[i] * nbytes)
        else:
            done = _pread(fd, base + i * nbytes, size, records[i] * nbytes)
        if done != size:
            return i
    return -1


def move_records(fd: int, rows: np.ndarray, records: np.ndarray, write: bool) -> None:
    """:func:`transfer_records`, raising the OSError that stopped it, with its errno.

    The compiled loop cannot see errno, so the run it stopped at is moved again here, and
    a short transfer is continued where it ended: the call that fails, with the cause, is
    the next one (a disk that filled up mid-run took the run's first bytes, and writing
    those again would succeed). The runs after it go back to the compiled loop. End of
    file on a read is EIO. ``rows`` must be C-contiguous."""
    start = transfer_records(fd, rows, records, write)
    if start < 0:
        return
    nbytes = rows.shape[1] * 4
    data = memoryview(rows).cast("B")
    while start >= 0:
        stop = start + 1
        while stop < len(records) and records[stop] == records[stop - 1] + 1:
            stop += 1
        view, offset = data[start * nbytes : stop * nbytes], int(records[start]) * nbytes
        while len(view):
            done = os.pwrite(fd, view, offset) if write else os.preadv(fd, [view], offset)
            if done == 0:
                raise OSError(errno.EIO, f"{'writing' if write else 'reading'} {len(view)} bytes at {offset}: "
                                         f"{'nothing written' if write else 'end of file'}")
            view, offset = view[done:], offset + done
        rest = transfer_records(fd, rows[stop:], records[stop:], write)
        start = stop + rest if rest >= 0 else -1
