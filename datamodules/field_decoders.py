"""Compiled decoders from Arrow binary columns (offsets + bytes) to model-ready arrays.

One pass per column, no intermediate Python objects: the decode costs less than
pyarrow's own tokenising, so a reader worker runs at the parser's speed.
"""

from __future__ import annotations

import numba
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ctr_lightning.hashing import feature_salt, splitmix64_one

# Outside the 32-bit value range, so "missing" gets its own id in every feature.
MISSING_VALUE = np.uint64(1 << 32)
_MASK63 = np.uint64((1 << 63) - 1)


def column_buffers(column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets int32 [n + 1], bytes uint8) of a binary or string column; nulls read as empty."""
    if column.type not in (pa.binary(), pa.string()):
        column = column.cast(pa.binary())
    if column.null_count:  # Arrow does not promise that a null's bytes are empty
        column = pc.fill_null(column, pa.scalar(b"", column.type))
    n = len(column)
    _, offsets_buf, data_buf = column.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int32, count=n + 1, offset=column.offset * 4)
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, dtype=np.uint8)
    return offsets, data


def label_column(column: pa.Array, name: str) -> tuple[np.ndarray, list[tuple[np.ndarray, str]]]:
    """0/1 labels as float32, and the problem rows (if any) for a stream's bad-line policy."""
    labels = np.empty(len(column), dtype=np.float32)
    bad = np.zeros(len(column), dtype=bool)
    decode_labels(*column_buffers(column), labels, bad)
    return labels, [(bad, f"{name} is not 0 or 1")] if bad.any() else []


@numba.njit(cache=True)
def decode_labels(offsets, data, out, bad) -> None:
    """``0``/``1`` to float32; anything else is bad."""
    for i in range(len(out)):
        start = offsets[i]
        if offsets[i + 1] - start == 1 and (data[start] == 48 or data[start] == 49):
            out[i] = np.float32(data[start] - 48)
        else:
            out[i] = 0.0
            bad[i] = True


# log(1 + x) of small counts, which are most counts: a table read beats computing it.
_LOG1P = np.log1p(np.arange(1 << 14, dtype=np.float64)).astype(np.float32)


@numba.njit(cache=True, nogil=True, inline="always")
def count_value(data, start, end, negative_is_bad):
    """``(log(1 + max(x, 0)), bad)`` of the integer count in ``data[start:end]``; empty is
    missing (0); non-integers are bad, and so are negative values when ``negative_is_bad``."""
    if start == end:
        return np.float32(0.0), False
    negative = data[start] == 45  # '-'
    if negative or data[start] == 43:  # '+'
        start += 1
    if start == end or end - start > 18:
        return np.float32(0.0), True
    value = np.int64(0)
    for j in range(start, end):
        c = data[j]
        if c < 48 or c > 57:
            return np.float32(0.0), True
        value = value * 10 + np.int64(c - 48)
    if negative:
        return np.float32(0.0), negative_is_bad and value > 0
    if value == 0:
        return np.float32(0.0), False
    return (_LOG1P[value] if value < len(_LOG1P) else np.float32(np.log1p(np.float64(value)))), False


# 0-15 for hex digits, 255 for every other byte.
_HEX = np.full(256, 255, dtype=np.uint8)
_HEX[np.frombuffer(b"0123456789abcdef", dtype=np.uint8)] = np.arange(16, dtype=np.uint8)
_HEX[np.frombuffer(b"ABCDEF", dtype=np.uint8)] = np.arange(10, 16, dtype=np.uint8)


@numba.njit(cache=True, nogil=True, inline="always")
def hex8(data, i):
    """``(value, ok)`` of the 8 bytes at ``data[i]`` read as hex digits."""
    acc = np.uint64(0)
    seen = np.uint8(0)  # OR of the table entries: above 15 iff some byte was not hex
    for j in range(8):
        nibble = _HEX[data[i + j]]
        seen |= nibble
        acc = (acc << np.uint64(4)) | np.uint64(nibble & np.uint8(15))
    return acc, seen <= 15


@numba.njit(cache=True)
def hash_bytes_ids(offsets, data, salt, out) -> None:
    """Any byte string to a 63-bit id (FNV-1a, then SplitMix64 with the feature's salt)."""
    for i in range(len(out)):
        h = np.uint64(0xCBF29CE484222325)
        for j in range(offsets[i], offsets[i + 1]):
            h = (h ^ np.uint64(data[j])) * np.uint64(0x100000001B3)
        out[i] = np.int64(splitmix64_one(h ^ salt) & _MASK63)


def hash_values(values: np.ndarray, salt: np.uint64) -> np.ndarray:
    """Small non-negative integers (e.g. derived features) to 63-bit ids with the feature's salt."""
    out = np.empty(len(values), dtype=np.int64)
    _hash_values(np.ascontiguousarray(values, dtype=np.int64), salt, out)
    return out


@numba.njit(cache=True)
def _hash_values(values, salt, out) -> None:
    for i in range(len(values)):
        out[i] = np.int64(splitmix64_one(np.uint64(values[i]) ^ salt) & _MASK63)


__all__ = ["MISSING_VALUE", "column_buffers", "count_value", "decode_labels", "feature_salt", "hash_bytes_ids",
           "hash_values", "hex8", "label_column"]
