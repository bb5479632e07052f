"""Records moved by the compiled loop; a failure raises its own errno, not a generic EIO."""

import errno
import os

import numpy as np
import pytest

from ctr_lightning.embedding.tiers.ssd.record_io import move_records


def test_records_round_trip_and_a_failure_raises_its_own_errno(tmp_path):
    path = tmp_path / "records"
    rows = np.arange(12, dtype=np.float32).reshape(4, 3)
    records = np.array([0, 1, 5, 6], dtype=np.int64)  # two runs
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    read_only = os.open(path, os.O_RDONLY)
    try:
        move_records(fd, rows, records, write=True)
        back = np.empty_like(rows)
        move_records(read_only, back, records, write=False)
        np.testing.assert_array_equal(back, rows)
        with pytest.raises(OSError) as failed:
            move_records(read_only, rows, records, write=True)
        assert failed.value.errno == errno.EBADF
        with pytest.raises(OSError) as failed:  # past the end of the file
            move_records(read_only, np.empty((2, 3), dtype=np.float32), np.array([6, 7], dtype=np.int64), write=False)
        assert failed.value.errno == errno.EIO and "end of file" in str(failed.value)
    finally:
        os.close(fd)
        os.close(read_only)
