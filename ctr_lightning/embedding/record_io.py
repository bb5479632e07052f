"""Fixed-size float32 records moved between arrays and files by compiled pread/pwrite loops."""

from __future__ import annotations

import ctypes

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
