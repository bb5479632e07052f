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
def _digits(data, start, end):
    """``(value, ok)`` of ``data[start:end]`` read as 1 to 18 decimal digits (an int64)."""
    if start == end or end - start > 18:
        return np.int64(0), False
    value = np.int64(0)
    for j in range(start, end):
        c = data[j]
        if c < 48 or c > 57:
            return np.int64(0), False
        value = value * 10 + np.int64(c - 48)
    return value, True


@numba.njit(cache=True, nogil=True, inline="always")
def count_value(data, start, end, negative_is_bad):
    """``(log(1 + max(x, 0)), bad)`` of the integer count in ``data[start:end]``; empty is
    missing (0); non-integers are bad, and so are negative values when ``negative_is_bad``."""
    if start == end:
        return np.float32(0.0), False
    negative = data[start] == 45  # '-'
    if negative or data[start] == 43:  # '+'
        start += 1
    value, ok = _digits(data, start, end)
    if not ok:
        return np.float32(0.0), True
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


@numba.njit(cache=True, nogil=True, inline="always")
def _bytes_id(data, start, end, salt):
    """FNV-1a of ``data[start:end]``, then SplitMix64 with the feature's salt, to 63 bits."""
    h = np.uint64(0xCBF29CE484222325)
    for j in range(start, end):
        h = (h ^ np.uint64(data[j])) * np.uint64(0x100000001B3)
    return np.int64(splitmix64_one(h ^ salt) & _MASK63)


@numba.njit(cache=True)
def hash_bytes_ids(offsets, data, salt, out) -> None:
    """Any byte string to a 63-bit id (:func:`_bytes_id`)."""
    for i in range(len(out)):
        out[i] = _bytes_id(data, offsets[i], offsets[i + 1], salt)


@numba.njit(cache=True, nogil=True, inline="always")
def _integer(data, start, end):
    """``(value, ok)`` of ``data[start:end]`` read as a decimal integer, as pyarrow's CSV
    reader reads one (a ``-``, not a ``+``; leading zeros), of up to 18 digits."""
    # A '-', not a '+': pyarrow reads "+5" as a float, not an integer.
    digits = start + 1 if end > start and data[start] == 45 else start
    value, ok = _digits(data, digits, end)
    return (-value if digits > start else value), ok


@numba.njit(cache=True, nogil=True, inline="always")
def _text_id(data, start, end, salt):
    """The id of one text value: a decimal integer hashes as :func:`hash_values` hashes
    the number (as a Parquet integer column's value does), anything else by its bytes."""
    value, ok = _integer(data, start, end)
    if ok:
        return np.int64(splitmix64_one(np.uint64(value) ^ salt) & _MASK63)
    return _bytes_id(data, start, end, salt)


@numba.njit(cache=True)
def decode_integers(offsets, data, out, ok) -> None:
    """Decimal integer text to int64; ``ok[i]`` says whether value i was one (else 0)."""
    for i in range(len(out)):
        out[i], ok[i] = _integer(data, offsets[i], offsets[i + 1])


_POW10 = np.array([10.0**k for k in range(23)])  # exact in float64 up to 1e22


@numba.njit(cache=True)
def decode_decimals(offsets, data, out, state) -> None:
    """Decimal text (``-12.5``, ``3e-4``) to float64 where one rounding is exact: at most 15
    significant digits times a power of ten up to 22 (Clinger's fast path, so the value is
    the correctly rounded one any exact parser gives): ``state`` 0. Empty: state 1, value 0.
    Anything else (other spellings, more digits, text that is no number): state 2, for a
    parser that handles every case."""
    for i in range(len(out)):
        start, end = offsets[i], offsets[i + 1]
        out[i] = 0.0
        if start == end:
            state[i] = 1
            continue
        state[i] = 2
        j = start
        negative = data[j] == 45  # "-"
        if negative:
            j += 1
        mantissa = 0
        significant = 0
        digits = 0
        exponent = 0
        while j < end and 48 <= data[j] <= 57:
            if mantissa or data[j] != 48:
                significant += 1
            mantissa = mantissa * 10 + (data[j] - 48) if significant <= 15 else mantissa
            if significant > 15:
                exponent += 1
            digits += 1
            j += 1
        if j < end and data[j] == 46:  # "."
            j += 1
            fraction = 0
            while j < end and 48 <= data[j] <= 57:
                if mantissa or data[j] != 48:
                    significant += 1
                if significant <= 15:
                    mantissa = mantissa * 10 + (data[j] - 48)
                    exponent -= 1
                fraction += 1
                j += 1
            if fraction == 0:
                continue  # "3.": left to the full parser
            digits += fraction
        if digits == 0 or significant > 15:
            continue
        if j < end and (data[j] == 101 or data[j] == 69):  # "e" / "E"
            j += 1
            sign = 1
            if j < end and (data[j] == 45 or data[j] == 43):
                sign = -1 if data[j] == 45 else 1
                j += 1
            power = 0
            count = 0
            while j < end and 48 <= data[j] <= 57 and count < 4:
                power = power * 10 + (data[j] - 48)
                count += 1
                j += 1
            if count == 0:
                continue
            exponent += sign * power
        if j != end or exponent > 22 or exponent < -22:
            continue
        value = float(mantissa)
        value = value * _POW10[exponent] if exponent >= 0 else value / _POW10[-exponent]
        out[i] = -value if negative else value
        state[i] = 0


@numba.njit(cache=True)
def hash_text_ids(offsets, data, salt, out) -> None:
    """Text values to 63-bit ids: integers as numbers, the rest (empty included) as bytes."""
    for i in range(len(out)):
        out[i] = _text_id(data, offsets[i], offsets[i + 1], salt)


@numba.njit(cache=True)
def count_items(offsets, data, separator, lengths) -> None:
    """Items per value of a list written as text (``a|b|c``: 3; empty: none)."""
    for i in range(len(lengths)):
        start, end = offsets[i], offsets[i + 1]
        n = 1 if end > start else 0
        for j in range(start, end):
            if data[j] == separator:
                n += 1
        lengths[i] = n


@numba.njit(cache=True)
def hash_item_ids(offsets, data, separator, salt, out) -> None:
    """The ids of every item of lists written as text, in order (see :func:`count_items`)."""
    k = 0
    for i in range(len(offsets) - 1):
        start, end = offsets[i], offsets[i + 1]
        if end == start:
            continue
        item = start
        for j in range(start, end + 1):
            if j == end or data[j] == separator:
                out[k] = _text_id(data, item, j, salt)
                k += 1
                item = j + 1


def hash_values(values: np.ndarray, salt: np.uint64) -> np.ndarray:
    """Small non-negative integers (e.g. derived features) to 63-bit ids with the feature's salt."""
    out = np.empty(len(values), dtype=np.int64)
    _hash_values(np.ascontiguousarray(values, dtype=np.int64), salt, out)
    return out


@numba.njit(cache=True)
def _hash_values(values, salt, out) -> None:
    for i in range(len(values)):
        out[i] = np.int64(splitmix64_one(np.uint64(values[i]) ^ salt) & _MASK63)


__all__ = ["MISSING_VALUE", "column_buffers", "count_items", "count_value", "decode_integers", "decode_labels",
           "feature_salt", "hash_bytes_ids", "hash_item_ids", "hash_text_ids", "hash_values", "hex8", "label_column"]
